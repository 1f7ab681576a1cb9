"""The save pipeline: plan -> stage -> write -> commit.

``plan`` flattens the state and decides the file layout (in the caller, cheap). ``stage`` makes
the bytes safe to write while training goes on: a synchronous save borrows the live tensors
(the caller is blocked anyway), an asynchronous one copies them into pooled host buffers.
``write`` streams every file in parallel threads, hashing as it goes, and fsyncs it. ``commit``
writes the manifest last and makes the checkpoint visible atomically.
"""

from __future__ import annotations

import os
import platform
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from . import __version__
from ._plan import DEFAULT_WORKERS, FilePlan, SavePlan, plan_files
from ._tree import Flat, flatten
from .errors import (
    CheckpointExistsError,
    InvalidArgumentError,
    SaveError,
    StorageError,
    TardigradeError,
)
from .format import safetensors as st
from .format.checksum import ALGORITHM
from .format.jsonio import dumps
from .format.manifest import FORMAT_NAME, FORMAT_VERSION, MANIFEST
from .storage import Storage, storage_for


@dataclass(frozen=True)
class SaveResult:
    """What a committed save did: where, how many bytes, how long the caller was blocked."""

    path: str
    step: int | None
    nbytes: int
    files: int
    blocking_seconds: float
    total_seconds: float

    @property
    def throughput_gbps(self) -> float:
        return self.nbytes / self.total_seconds / 1e9 if self.total_seconds > 0 else float("inf")


@dataclass
class SaveJob:
    """Everything the write and commit phases need; owns no live state once staged."""

    storage: Storage
    name: str
    flat: Flat
    plan: SavePlan
    header: dict[str, Any]
    overwrite: bool
    started: float
    buffers: list[torch.Tensor] | None = None  # contiguous CPU bytes per entry, after staging
    blocking_seconds: float = 0.0
    release: Callable[[], None] | None = None  # returns staging buffers to their pool


def _check_metadata(metadata: Any) -> dict[str, Any]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping) or not all(isinstance(k, str) for k in metadata):
        raise InvalidArgumentError("metadata must be a dict with str keys of JSON values")
    try:
        dumps(dict(metadata))
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(
            f"metadata must hold only JSON values (str, finite numbers, bool, None, lists, "
            f"dicts): {e}"
        ) from None
    return dict(metadata)


def _check_counter(name: str, v: Any) -> int | None:
    if v is not None and (type(v) is not int or v < 0):
        raise InvalidArgumentError(f"{name} must be a non-negative int or None, got {v!r}")
    return v


def plan(
    path: str | os.PathLike[str],
    state: Any,
    *,
    overwrite: bool = False,
    metadata: Mapping[str, Any] | None = None,
    step: int | None = None,
    epoch: int | None = None,
    metrics: Mapping[str, float] | None = None,
    workers: int = DEFAULT_WORKERS,
) -> SaveJob:
    started = time.perf_counter()
    storage, name = storage_for(path)
    if not isinstance(overwrite, bool):
        raise InvalidArgumentError(f"overwrite must be a bool, got {overwrite!r}")
    if storage.exists(name) and not overwrite:
        raise CheckpointExistsError(
            f"{storage.url(name)}: a checkpoint already exists here; pass overwrite=True to "
            "replace it, or save under another name."
        )
    header = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "save_id": uuid.uuid4().hex,
        "step": _check_counter("step", step),
        "epoch": _check_counter("epoch", epoch),
        "world_size": 1,
        "created_unix": time.time(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": {
            "tardigrade": __version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "checksum_algorithm": ALGORITHM,
        "metrics": _check_metrics(metrics),
        "metadata": _check_metadata(metadata),
    }
    flat = flatten(state)
    return SaveJob(
        storage, name, flat, plan_files(flat.entries, workers=workers), header, overwrite, started
    )


def _check_metrics(metrics: Any) -> dict[str, float]:
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise InvalidArgumentError(f"metrics must be a dict of str -> number, got {metrics!r}")
    out = {}
    for k, v in metrics.items():
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)):
            raise InvalidArgumentError(f"metric {k!r}={v!r}: metrics map str names to numbers")
        out[k] = float(v)
    return out


def contiguous_cpu(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a dense CPU tensor, borrowing when it already is one."""
    t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if t.device.type != "cpu":
        return t.to("cpu")
    return t if t.is_contiguous() else t.contiguous()


def stage_borrowed(job: SaveJob) -> None:
    """Synchronous staging: write straight from the live tensors (the caller waits)."""
    job.buffers = [contiguous_cpu(e.tensor) for e in job.flat.entries]


def as_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy uint8 view of a dense CPU tensor's bytes."""
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _write_file(job: SaveJob, fp: FilePlan, staging: str) -> tuple[int, dict[str, str]]:
    assert job.buffers is not None
    tensors = []
    for item in fp.items:
        buf = job.buffers[item.entry]
        part = buf[item.start : item.stop] if buf.dim() else buf
        shape = tuple(part.shape)
        tensors.append(
            st.TensorBytes(item.key, job.flat.entries[item.entry].dtype, shape, as_bytes(part))
        )
    writer = job.storage.open_writer(f"{staging}/{fp.name}")
    try:
        size, sums = st.write_file(writer, st.file_order(tensors), {"format": "pt"})
    except BaseException:
        writer.abort()
        raise
    writer.close()
    return size, sums


def _manifest(job: SaveJob, sizes: dict[str, int], sums: dict[str, str]) -> dict[str, Any]:
    tensors: list[dict[str, Any]] = [
        {"dtype": e.dtype, "shape": list(e.tensor.shape), "numpy": e.numpy, "chunks": []}
        for e in job.flat.entries
    ]
    for fp in job.plan.files:
        for item in fp.items:
            t = job.flat.entries[item.entry].tensor
            shape = list(t.shape)
            offsets = [0] * len(shape)
            if shape:
                offsets[0] = item.start
                shape[0] = item.stop - item.start
            tensors[item.entry]["chunks"].append(
                {
                    "file": fp.name,
                    "key": item.key,
                    "offsets": offsets,
                    "shape": shape,
                    "checksum": sums[item.key],
                }
            )
    return {
        **job.header,
        "files": [{"name": n, "size": s} for n, s in sorted(sizes.items())],
        "tensors": tensors,
        "tree": job.flat.tree,
    }


def write_and_commit(job: SaveJob) -> SaveResult:
    """Write every file, then the manifest, then make the checkpoint visible. Cleans up on failure."""
    storage = job.storage
    staging = storage.begin(job.name, job.header["save_id"])
    try:
        files = job.plan.files
        sizes: dict[str, int] = {}
        sums: dict[str, str] = {}
        if len(files) == 1:
            results = [_write_file(job, files[0], staging)]
        else:
            with ThreadPoolExecutor(len(files), thread_name_prefix="tardigrade-write") as pool:
                results = list(pool.map(lambda fp: _write_file(job, fp, staging), files))
        for fp, (size, file_sums) in zip(files, results, strict=True):
            sizes[fp.name] = size
            sums.update(file_sums)
        manifest = dumps(_manifest(job, sizes, sums))
        w = storage.open_writer(f"{staging}/{MANIFEST}")
        try:
            w.write(manifest)
        except BaseException:
            w.abort()
            raise
        w.close()
        if not job.overwrite and storage.exists(job.name):
            raise CheckpointExistsError(
                f"{storage.url(job.name)}: another writer committed a checkpoint here while this "
                "save was running; nothing was overwritten."
            )
        storage.commit(staging, job.name, replace=job.overwrite)
    except BaseException as e:
        storage.delete(staging)
        if isinstance(e, TardigradeError) and not isinstance(e, StorageError):
            raise
        if isinstance(e, Exception):
            raise SaveError(
                f"{storage.url(job.name)}: save failed and nothing was committed: {e}"
            ) from e
        raise
    finally:
        job.buffers = None
        if job.release is not None:
            job.release()
    total = time.perf_counter() - job.started
    return SaveResult(
        storage.url(job.name),
        job.header["step"],
        sum(sizes.values()) + len(manifest),
        len(files),
        job.blocking_seconds or total,
        total,
    )


def save(
    path: str | os.PathLike[str],
    state: Any,
    *,
    overwrite: bool = False,
    metadata: Mapping[str, Any] | None = None,
    step: int | None = None,
    epoch: int | None = None,
    metrics: Mapping[str, float] | None = None,
) -> SaveResult:
    """Save ``state`` atomically to the directory ``path``; return what was committed.

    The checkpoint appears only once complete and fsynced; a crash at any instant leaves
    either nothing or the whole checkpoint. Raises ``CheckpointExistsError`` if ``path`` exists
    (pass ``overwrite=True``) and ``UnsupportedTypeError`` naming the path of any leaf the format
    cannot store.

    >>> tg.save("ckpt/step-100", {"model": model, "optim": opt, "step": 100})  # doctest: +SKIP
    """
    job = plan(
        path, state, overwrite=overwrite, metadata=metadata, step=step, epoch=epoch, metrics=metrics
    )
    stage_borrowed(job)
    job.blocking_seconds = 0.0
    return write_and_commit(job)
