"""The registry of tools: a name and a callable per save, and per load.

Every save takes ``(state, path)`` and must leave the checkpoint durable (fsynced) at ``path``
(a file or a directory, the tool's choice; ``path`` does not exist beforehand). Every load takes
``(state, path)`` and must restore ``path`` into the live model and optimizer of ``state``. Either
may return a dict of extra numbers (e.g. ``{"blocking_s": ...}`` for an asynchronous save, which
should wait for durability before returning so the wall time stays comparable); the harness
records them next to the wall time and peak RSS.

Adding a tool is one function plus its decorator; e.g. Tardigrade's async save (the
checkpointer lives as long as the process, so its staging buffers are reused from save to save)::

    _async = tg.AsyncCheckpointer()

    @save_tool("tardigrade_async")
    def save_tardigrade_async(state: TrainState, path: Path) -> dict[str, float]:
        t0 = time.perf_counter()
        future = _async.save(path, state.live)
        blocking = time.perf_counter() - t0
        future.result()
        return {"blocking_s": blocking}

Tools run in registration order within a round; ``tardigrade`` first, then the baselines.
"""

from __future__ import annotations

import os
import resource
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp

import tardigrade as tg

from .raw import fsync_dir
from .state import TrainState

Op = Callable[[TrainState, Path], "dict[str, float] | None"]

SAVES: dict[str, Op] = {}
LOADS: dict[str, Op] = {}

# DCP warns on every call without a process group; a single process is what we mean.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def save_tool(name: str) -> Callable[[Op], Op]:
    """Register a save under ``name`` (also its output's file or directory name)."""

    def register(fn: Op) -> Op:
        if name in SAVES:
            raise ValueError(f"a save named {name!r} is already registered")
        SAVES[name] = fn
        return fn

    return register


def load_tool(name: str) -> Callable[[Op], Op]:
    """Register a load of what the save of the same ``name`` wrote."""

    def register(fn: Op) -> Op:
        if name in LOADS:
            raise ValueError(f"a load named {name!r} is already registered")
        LOADS[name] = fn
        return fn

    return register


# --- tardigrade -----------------------------------------------------------------------------


@save_tool("tardigrade")
def save_tardigrade(state: TrainState, path: Path) -> None:
    tg.save(path, state.live)  # fsyncs its files and commits atomically


@load_tool("tardigrade")
def load_tardigrade(state: TrainState, path: Path) -> None:
    tg.load(path, into=state.live)


# --- torch.save -----------------------------------------------------------------------------


@save_tool("torch")
def save_torch(state: TrainState, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(state.state_dicts(), f)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(path.parent)


@load_tool("torch")
def load_torch(state: TrainState, path: Path) -> None:
    sd = torch.load(path, weights_only=True)
    state.model.load_state_dict(sd["model"])
    state.optim.load_state_dict(sd["optim"])


# --- safetensors ----------------------------------------------------------------------------


@save_tool("safetensors")
def save_safetensors(state: TrainState, path: Path) -> None:
    safetensors.torch.save_file(state.tensors(), str(path))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(path.parent)


@load_tool("safetensors")
def load_safetensors(state: TrainState, path: Path) -> None:
    loaded = safetensors.torch.load_file(str(path))
    live = state.tensors()
    if loaded.keys() != live.keys():
        raise RuntimeError(f"{path}: holds other tensors than the live state")
    with torch.no_grad():
        for k, t in live.items():
            t.copy_(loaded[k])


# --- torch.distributed.checkpoint -----------------------------------------------------------


@save_tool("dcp")
def save_dcp(state: TrainState, path: Path) -> None:
    writer = dcp.FileSystemWriter(path, thread_count=2, sync_files=True)
    dcp.save(state.state_dicts(), storage_writer=writer)


@load_tool("dcp")
def load_dcp(state: TrainState, path: Path) -> None:
    # DCP loads in place into the tensors of the state dict it is given: the live ones.
    sd = state.state_dicts()
    dcp.load(sd, storage_reader=dcp.FileSystemReader(path))
    state.model.load_state_dict(sd["model"])
    state.optim.load_state_dict(sd["optim"])


# --- asynchronous saves: time the caller is blocked, then wait for durability -----------------

_async: tg.AsyncCheckpointer | None = None


def async_checkpointer(state: TrainState | None = None) -> tg.AsyncCheckpointer:
    """The process's one checkpointer, as in training: its staging buffers are reused.

    The saves here and the training loop (``loop``) share it, so the state is staged into one
    set of buffers, not two. Set up as a training script would: the first call with the state
    reserves its staging memory in the background (``tg.AsyncCheckpointer.reserve``).
    """
    global _async
    if _async is None:
        _async = tg.AsyncCheckpointer()
        if state is not None:
            _async.reserve(state.live)
    return _async


@save_tool("tardigrade_async")
def save_tardigrade_async(state: TrainState, path: Path) -> dict[str, float]:
    ckpt = async_checkpointer(state)
    faults, cpu = _minor_faults(), time.process_time()
    t0 = time.perf_counter()
    future = ckpt.save(path, state.live)
    blocking = time.perf_counter() - t0
    # What the blocking phase did: page faults (staging memory not faulted in beforehand)
    # and CPU seconds (about 2x the wall time when both copy threads had a core each).
    faults, cpu = _minor_faults() - faults, time.process_time() - cpu
    assert future is not None
    future.result()
    # The background phase: from the staged copy to the commit (serialisation, hashing, I/O).
    return {
        "blocking_s": blocking,
        "background_s": time.perf_counter() - t0 - blocking,
        "blocking_faults": float(faults),
        "blocking_cpu_s": cpu,
    }


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@save_tool("dcp_async")
def save_dcp_async(state: TrainState, path: Path) -> dict[str, float]:
    writer = dcp.FileSystemWriter(path, thread_count=2, sync_files=True)
    t0 = time.perf_counter()
    future = dcp.async_save(state.state_dicts(), storage_writer=writer)
    blocking = time.perf_counter() - t0
    future.result()
    return {"blocking_s": blocking}


def verify_tardigrade(path: Path) -> dict[str, float]:
    """Checksum every byte of a tardigrade checkpoint; return the bytes it hashed."""
    report = tg.verify(path)
    return {"verified_bytes": float(report.nbytes)}
