"""Reading data files: given the chunks to read and where each lands, read and check the bytes.

This step decides nothing about *where*: each ``_ReadTask`` (built by ``_match._plan_reads``)
names one stored chunk and the tensor its bytes go into. Here those byte ranges are read, files
side by side, and checked against the manifest (file sizes, header checksums and keys, chunk
checksums). ``_verify_file`` is the same checks without a destination, for ``verify`` and for
``load(verify="all")``'s files that hold nothing to load.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ._tree import as_bytes
from .errors import ChecksumMismatchError, CorruptCheckpointError, InsufficientMemoryError
from .format import safetensors as st
from .format.checksum import Hasher
from .format.manifest import Chunk, Manifest, data_path
from .storage import Storage

# Data files read side by side by a load or a verify.
DEFAULT_READ_THREADS = max(2, min(8, os.cpu_count() or 2))


def _empty(shape: Sequence[int], dtype: torch.dtype, what: str) -> torch.Tensor:
    """torch.empty, with running out of memory as a TardigradeError (torch raises RuntimeError)."""
    try:
        return torch.empty(shape, dtype=dtype)
    except (RuntimeError, MemoryError) as e:
        if isinstance(e, RuntimeError) and "can't allocate memory" not in str(e):
            raise
        nbytes = math.prod(shape) * dtype.itemsize
        raise InsufficientMemoryError(
            f"{what}: cannot allocate {nbytes} bytes for a tensor of shape {list(shape)} "
            f"{dtype}. Free memory, load fewer keys at once (keys=...), or load into "
            "preallocated live tensors (into=...)."
        ) from None


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(as_bytes(t).numpy())  # type: ignore[arg-type]  # numpy arrays are buffers; its stubs say so from Python 3.12


@dataclass(frozen=True)
class _ReadTask:
    """Read one stored chunk, whole, into ``target``."""

    entry: int  # the manifest's tensor the chunk belongs to (its dtype is checked in the header)
    chunk: Chunk  # which bytes: data file, key in its header, checksum
    target: torch.Tensor  # where they land: a tensor, or a view of one, of the chunk's shape
    path: str  # display path of the leaf, for messages
    # Only this part of the chunk lands in ``target`` (a live piece of a resharded tensor);
    # the whole chunk is still read, since its checksum covers all of it.
    part: tuple[slice, ...] | None = None


def _check_sizes(storage: Storage, name: str, m: Manifest, files: set[str]) -> None:
    """Data files must be as large as the manifest says before anything is allocated for them."""
    for file in sorted(files):
        with storage.open_reader(data_path(name, file)) as src:
            _check_size(src, m.files[file])


def _check_size(src: Any, recorded: int) -> None:
    """A data file must be exactly as large as the manifest recorded."""
    if src.size != recorded:
        raise CorruptCheckpointError(
            f"{src.name}: file is {src.size} bytes but the manifest recorded {recorded} "
            "(truncated or modified after commit). Delete this checkpoint or restore it from "
            "a backup."
        )


def _check_sum(src: Any, key: str, what: str, expected: str, hasher: Hasher) -> None:
    if hasher.hexdigest() != expected:
        raise ChecksumMismatchError(
            f"{src.name}: tensor {key!r}{what} fails its checksum (expected {expected}, got "
            f"{hasher.hexdigest()}); its bytes were damaged after the save. Delete this "
            "checkpoint or restore it from a backup."
        )


def _read_file(
    storage: Storage,
    ckpt: str,
    file: str,
    size: int,
    tasks: list[_ReadTask],
    m: Manifest,
    verify: bool,
    unread: list[tuple[int, Chunk]] | None = None,
) -> int:
    """Read ``tasks`` into their targets; with ``unread`` (verify="all"), also check what a full
    ``verify`` checks in this file: its header lists exactly the manifest's chunks, and the
    chunks not read here (``unread``) match their checksums. Each byte is read once."""
    with storage.open_reader(data_path(ckpt, file)) as src:
        _check_size(src, size)
        header = st.read_header(
            src, m.header_checksums.get(file) if verify else None, unsealed=not m.sealed
        )
        if unread is not None:
            _check_listed(src, header, [c for _, c in unread] + [t.chunk for t in tasks])
        nbytes = 0
        for task in tasks:
            c, info = task.chunk, m.tensors[task.entry]
            h = header.get(c.key)
            if h is None or h.dtype != info.dtype or h.shape != c.shape:
                raise CorruptCheckpointError(
                    f"{src.name}: tensor {c.key!r} (for {task.path}) is missing from the file or "
                    "has another dtype/shape than the manifest records. Delete this checkpoint "
                    "or restore it from a backup."
                )
            region = task.target
            direct = region.is_contiguous() and task.part is None
            target = region if direct else _empty(c.shape, region.dtype, f"{src.name}: {c.key!r}")
            hasher = Hasher() if verify else None
            if target.numel():
                st.read_range(src, h.begin, _bytes_of(target), hasher)
            if hasher is not None:
                _check_sum(src, c.key, f" (for {task.path})", c.checksum, hasher)
            if not direct:
                region.copy_(target if task.part is None else target[task.part])
            nbytes += h.end - h.begin
        if unread:
            _check_chunks(src, header, m, unread)
        return nbytes


def _check_listed(src: Any, header: dict[str, Any], chunks: list[Chunk]) -> None:
    listed = {c.key for c in chunks}
    if set(header) != listed:
        raise CorruptCheckpointError(
            f"{src.name}: holds tensors {sorted(set(header) - listed)[:5]} the manifest "
            f"does not list, or lacks {sorted(listed - set(header))[:5]}."
        )


def _check_chunks(src: Any, header: dict[str, Any], m: Manifest, chunks: Any) -> None:
    """Hash each chunk's bytes (read once, through a small buffer) against the manifest."""
    # A store reads in larger windows (each read is a request; see st.read_range).
    window = max(st.SLICE_BYTES, int(getattr(src, "read_window", st.SLICE_BYTES)))
    buf = memoryview(bytearray(min(window, max(1, src.size))))
    for i, c in chunks:
        h = header[c.key]
        if h.dtype != m.tensors[i].dtype or h.shape != c.shape:
            raise CorruptCheckpointError(
                f"{src.name}: tensor {c.key!r} has dtype/shape {h.dtype}{list(h.shape)} "
                f"but the manifest records {m.tensors[i].dtype}{list(c.shape)}."
            )
        hasher = Hasher()
        pos = h.begin
        while pos < h.end:
            n = min(buf.nbytes, h.end - pos)
            src.readinto(pos, buf[:n])
            hasher.update(buf[:n])
            pos += n
        _check_sum(src, c.key, "", c.checksum, hasher)


def _verify_file(
    storage: Storage, ckpt: str, file: str, m: Manifest, chunks: list[tuple[int, Chunk]]
) -> int:
    """Check one data file entirely: size, header checksum and keys, every chunk's checksum."""
    with storage.open_reader(data_path(ckpt, file)) as src:
        _check_size(src, m.files[file])
        header = st.read_header(src, m.header_checksums.get(file), unsealed=not m.sealed)
        _check_listed(src, header, [c for _, c in chunks])
        _check_chunks(src, header, m, chunks)
        return int(src.size)


def _read_chunks(
    storage: Storage,
    name: str,
    m: Manifest,
    tasks: list[_ReadTask],
    verify: bool,
    workers: int,
    full: bool = False,
) -> int:
    """Carry out ``tasks``, ``workers`` data files side by side; returns the bytes read.

    ``verify``: check each chunk read (and each header) against its checksum. ``full``
    (``load(verify="all")``): also check everything else a full ``verify`` checks.
    """
    by_file: dict[str, list[_ReadTask]] = {}
    for task in tasks:
        by_file.setdefault(task.chunk.file, []).append(task)
    for file_tasks in by_file.values():
        file_tasks.sort(key=lambda t: t.chunk.key)
    # With ``full``, every file is checked as ``verify`` would, each byte read once: the
    # chunks not needed here are hashed by the same pass, and files holding none are verified.
    # A chunk is its (file, key): the manifest parser refuses two chunks naming the same one.
    unread: dict[str, list[tuple[int, Chunk]]] = {}
    if full:
        read = {(t.chunk.file, t.chunk.key) for t in tasks}
        unread = {f: [] for f in m.files}
        for i, info in enumerate(m.tensors):
            for c in info.chunks:
                if (c.file, c.key) not in read:
                    unread[c.file].append((i, c))

    def one(file: str) -> int:
        if file not in by_file:
            return _verify_file(storage, name, file, m, unread[file])
        return _read_file(
            storage, name, file, m.files[file], by_file[file], m, verify, unread.get(file)
        )

    files = sorted(set(by_file) | set(unread))
    if len(files) <= 1 or workers <= 1:
        return sum(one(f) for f in files)
    with ThreadPoolExecutor(min(workers, len(files)), thread_name_prefix="tardigrade-read") as pool:
        return sum(pool.map(one, files))
