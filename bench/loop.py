"""What checkpointing costs a training loop: the throughput of a loop that saves every k steps.

Each step runs a fixed compute step (matrix products whose size does not depend on the state)
and then nudges the head and tail of every state tensor in place, as an optimizer step would, so
an asynchronous save that has not snapshotted the state before returning saves a mix of steps.
Every ``every`` steps the loop saves with the mode under test and trains on:

- ``none``: no checkpointing; the baseline every other mode is compared with.
- ``tardigrade_async``: the process's one ``tg.AsyncCheckpointer`` (its staging buffers are
  reused); ``save`` returns once the state is copied to host memory.
- ``tardigrade_overlap``: the same checkpointer with ``overlap=True``: ``save`` returns before
  the copy, which runs beside the next step's compute; the step's update (the nudge, standing
  for ``optimizer.step()``) first waits for it (``wait_staged()``, the fence), and that wait
  counts as blocking.
- ``dcp_async``: ``torch.distributed.checkpoint.async_save``, waiting for the previous save's
  future before starting the next one, as DCP's documentation asks.

The loop's wall time includes the wait for the last save to be durable, as a training run ends.
Overhead is that time over the ``none`` loop's of the same round, minus one. Each save goes to a
new directory; the oldest is deleted before a third would start, so at most two are on disk.
After the loop (untimed) the checkpoints still on disk are read back: each must hold the first
and last state tensor as they were when its save was called, or the run fails.
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import tardigrade as tg

from .raw import remove
from .state import TrainState
from .tools import async_checkpointer

MODES = ("none", "tardigrade_async", "tardigrade_overlap", "dcp_async")
BASELINE = "none"
KEEP = 2  # checkpoints on disk per mode, at most
EDGE = 1024  # elements nudged at each end of every tensor per step (4 KiB each in fp32)
NUDGE = 1e-3

Paths = dict[str, tuple[tuple[Any, ...], torch.Tensor]]


@dataclass(frozen=True, kw_only=True)
class LoopSpec:
    """The training loop: ``saves`` saves, one every ``every`` steps, of a fixed compute step."""

    every: int  # steps between two saves
    saves: int
    matrix: int  # side of the square fp32 matrices of the compute step
    products: int  # matrix products per step

    @property
    def steps(self) -> int:
        return self.every * self.saves

    def to_json(self) -> dict[str, int]:
        return {**asdict(self), "steps": self.steps}


# ~65 ms a step on an otherwise idle 2-core VM (a 1024-square fp32 product takes ~13 ms), so the
# 40 steps between saves are ~2.5 s: a realistic interval next to the ~2 s background write of
# the 3 GB state.
FULL = LoopSpec(every=40, saves=3, matrix=1024, products=5)
QUICK = LoopSpec(every=10, saves=3, matrix=512, products=1)


class ComputeStep:
    """The fixed work of one step: ``products`` products of two ``matrix``-square matrices."""

    def __init__(self, matrix: int, products: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.a = torch.randn(matrix, matrix, generator=g)
        self.b = torch.randn(matrix, matrix, generator=g)
        self.out = torch.empty(matrix, matrix)
        self.products = products
        for _ in range(3):  # faults in the output, starts the intra-op threads
            self()

    def __call__(self) -> None:
        for _ in range(self.products):
            torch.mm(self.a, self.b, out=self.out)


class Nudge:
    """Mutates both ends of every state tensor in place each step; ``restore`` undoes it exactly.

    The rounds after a loop save and load the state again and check it against the fingerprint
    taken before the first round, so the loop must leave the state bit for bit as it found it.
    """

    def __init__(self, state: TrainState) -> None:
        self.flats = [t.detach().view(-1) for t in state.tensors().values()]
        self.original = [(f[:EDGE].clone(), f[-EDGE:].clone()) for f in self.flats]

    def __call__(self) -> None:
        with torch.no_grad():
            for f in self.flats:
                f[:EDGE].add_(NUDGE)
                f[-EDGE:].add_(NUDGE)

    def restore(self) -> None:
        # The two ends overlap in tensors shorter than 2 * EDGE; both copies hold originals.
        with torch.no_grad():
            for f, (head, tail) in zip(self.flats, self.original, strict=True):
                f[-EDGE:].copy_(tail)
                f[:EDGE].copy_(head)


# --- the modes --------------------------------------------------------------------------------


class Saver(ABC):
    """One way of saving from a training loop: start a save, wait for the last, read back."""

    @abstractmethod
    def save(self, state: TrainState, path: Path) -> None:
        """Start a save of ``state`` to ``path``; return once training may mutate the state."""

    def fence(self) -> None:  # noqa: B027  (most modes have nothing to wait for)
        """Before the step's update: wait for a copy still running beside training."""

    @abstractmethod
    def wait(self) -> None:
        """Block until the last save started is durable; raise its error."""

    @abstractmethod
    def read(self, path: Path, paths: Paths) -> dict[str, torch.Tensor]:
        """The tensors named in ``paths`` (flat name -> key path, live tensor) from ``path``."""


class TardigradeAsync(Saver):
    def __init__(self) -> None:
        self.ckpt = async_checkpointer()
        self.last: tg.SaveFuture | None = None

    def save(self, state: TrainState, path: Path) -> None:
        # Waits for the save in flight, if any, then stages; raises an earlier save's error.
        self.last = self.ckpt.save(path, state.live)

    def wait(self) -> None:
        if self.last is not None:
            self.last.result()
            self.last = None

    def read(self, path: Path, paths: Paths) -> dict[str, torch.Tensor]:
        tree = tg.load(path, keys=[key for key, _ in paths.values()])
        return {name: _get(tree, key) for name, (key, _) in paths.items()}


class TardigradeOverlap(TardigradeAsync):
    def save(self, state: TrainState, path: Path) -> None:
        self.last = self.ckpt.save(path, state.live, overlap=True)

    def fence(self) -> None:
        if self.last is not None:
            self.last.wait_staged()


class DcpAsync(Saver):
    def __init__(self) -> None:
        self.pending: Any = None

    def save(self, state: TrainState, path: Path) -> None:
        self.wait()  # DCP's docs: one async_save in flight at a time
        writer = dcp.FileSystemWriter(path, thread_count=2, sync_files=True)
        self.pending = dcp.async_save(state.state_dicts(), storage_writer=writer)

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.result()
            self.pending = None

    def read(self, path: Path, paths: Paths) -> dict[str, torch.Tensor]:
        # DCP loads in place into the tensors of the (partial) state dict it is given.
        sd: dict[Any, Any] = {}
        out = {}
        for name, (key, live) in paths.items():
            node = sd
            for k in key[:-1]:
                node = node.setdefault(k, {})
            node[key[-1]] = out[name] = torch.empty_like(live)
        dcp.load(sd, storage_reader=dcp.FileSystemReader(path))
        return out


SAVERS: dict[str, Callable[[], Saver]] = {
    "tardigrade_async": TardigradeAsync,
    "tardigrade_overlap": TardigradeOverlap,
    "dcp_async": DcpAsync,
}


def _get(tree: Any, key: tuple[Any, ...]) -> torch.Tensor:
    for k in key:
        tree = tree[k]
    assert isinstance(tree, torch.Tensor), key
    return tree


def _ends(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    flat = t.detach().reshape(-1)
    return flat[:EDGE].clone(), flat[-EDGE:].clone()


# --- the loop ---------------------------------------------------------------------------------


def train(
    mode: str,
    state: TrainState,
    spec: LoopSpec,
    compute: ComputeStep,
    root: Path,
    *,
    keep_files: bool = False,
) -> dict[str, Any]:
    """Run ``spec.steps`` steps, saving every ``spec.every`` with ``mode``; return the timings.

    ``seconds`` is the whole loop, the wait for the last save included; ``blocking_s`` the time
    the loop spent inside the save calls (an earlier save still in flight included);
    ``final_wait_s`` the wait for the last save; ``cleanup_s`` deleting old checkpoints;
    ``cpu_s`` the CPU time of this process (all threads) over the loop, which other processes
    on the machine disturb less than they do the wall time.
    """
    saver = SAVERS[mode]() if mode != BASELINE else None
    root.mkdir(parents=True, exist_ok=True)
    nudge = Nudge(state)
    tensors = state.tensor_paths()
    names = list(tensors)
    checked = {n: tensors[n] for n in (names[0], names[-1])}
    on_disk: list[Path] = []
    expected: dict[Path, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    blocking: list[float] = []
    cleanup = final_wait = 0.0
    try:
        start, cpu_start = time.perf_counter(), time.process_time()
        fenced = 0.0
        for step in range(1, spec.steps + 1):
            compute()
            if saver is not None:
                t = time.perf_counter()
                saver.fence()
                fenced += time.perf_counter() - t
            nudge()
            if saver is None or step % spec.every:
                continue
            if len(on_disk) == KEEP:
                t = time.perf_counter()
                remove(on_disk.pop(0))  # done: a save starts only after the previous one ended
                cleanup += time.perf_counter() - t
            path = root / f"step-{step:06d}"
            expected[path] = {n: _ends(live) for n, (_, live) in checked.items()}
            t = time.perf_counter()
            saver.save(state, path)
            blocking.append(time.perf_counter() - t)
            on_disk.append(path)
        if saver is not None:
            t = time.perf_counter()
            saver.wait()
            final_wait = time.perf_counter() - t
        seconds = time.perf_counter() - start
        cpu = time.process_time() - cpu_start
        if saver is not None:
            for path in on_disk:
                _check_snapshot(mode, path, saver.read(path, checked), expected[path])
    finally:
        if saver is not None:
            # Never leave a save writing into files about to be removed; on the way out of a
            # failure, keep that failure rather than this wait's.
            with contextlib.suppress(Exception):
                saver.wait()
        nudge.restore()
        if not keep_files:
            for path in on_disk:
                remove(path)
    return {
        "seconds": seconds,
        "steps": spec.steps,
        "steps_per_s": spec.steps / seconds,
        "cpu_s": cpu,
        "saves": len(blocking),
        "blocking_s": sum(blocking) + fenced,
        "fence_s": fenced,
        "save_blocking_s": blocking,
        "final_wait_s": final_wait,
        "cleanup_s": cleanup,
    }


def _check_snapshot(
    mode: str,
    path: Path,
    got: dict[str, torch.Tensor],
    expected: dict[str, tuple[torch.Tensor, torch.Tensor]],
) -> None:
    for name, (head, tail) in expected.items():
        saved_head, saved_tail = _ends(got[name])
        if not (torch.equal(saved_head, head) and torch.equal(saved_tail, tail)):
            raise RuntimeError(
                f"{mode}: {path} does not hold {name} as it was when the save was called; "
                "the save returned before snapshotting the state, so training's later updates "
                "leaked into the checkpoint"
            )


def train_all(
    state: TrainState,
    spec: LoopSpec,
    compute: ComputeStep,
    root: Path,
    settle: Callable[[], None],
    *,
    keep_files: bool = False,
) -> dict[str, dict[str, Any]]:
    """Every mode once, baseline first, each after ``settle()``; overhead % vs the baseline.

    ``overhead_pct`` compares wall times, ``cpu_overhead_pct`` this process's CPU times.
    """
    out = {}
    for mode in MODES:
        settle()
        out[mode] = train(mode, state, spec, compute, root / mode, keep_files=keep_files)
    base = out[BASELINE]
    for r in out.values():
        r["overhead_pct"] = (r["seconds"] / base["seconds"] - 1.0) * 100.0
        r["cpu_overhead_pct"] = (r["cpu_s"] / base["cpu_s"] - 1.0) * 100.0
    return out
