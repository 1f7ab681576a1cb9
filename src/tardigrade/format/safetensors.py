"""Safetensors headers for streaming writes, and a validating reader.

Files are plain safetensors (8-byte little-endian header length, JSON header, raw bytes), so
``safetensors.safe_open`` reads them. The header depends only on shapes and dtypes, so a writer
emits it first and then streams each tensor's bytes from wherever they live. The reader trusts
nothing: every rule below is checked before a byte of tensor data is touched.
"""

from __future__ import annotations

import collections
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ..errors import (
    ChecksumMismatchError,
    CorruptCheckpointError,
    InsufficientMemoryError,
    UnsupportedFormatError,
)
from . import limits
from .checksum import Hasher
from .dtypes import ITEMSIZE
from .jsonio import dumps, loads_strict

__all__ = [
    "HEADER_ALIGN",
    "SEALED_MARK",
    "SLICE_BYTES",
    "ByteSource",
    "HeaderEntry",
    "Spec",
    "TensorSpec",
    "encode_header",
    "read_header",
    "read_range",
]

# Bytes hashed and handed to the OS per call: large enough to amortise syscalls, small enough
# that the hash reads from cache-warm memory right before the write.
SLICE_BYTES = 1024 * 1024
HEADER_ALIGN = 8


class ByteSource(Protocol):
    size: int
    name: str

    def readinto(self, offset: int, buf: memoryview) -> None: ...


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a file to write: its key, safetensors dtype, shape and byte count."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class HeaderEntry:
    key: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute offset in the file
    end: int


class Spec(Protocol):
    """What a header needs of a tensor (a ``TensorSpec``, or a plan's write item)."""

    @property
    def key(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def nbytes(self) -> int: ...


def encode_header(specs: Sequence[Spec], metadata: dict[str, str] | None) -> bytes:
    """The header for ``specs`` laid out back to back in the given order."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for t in specs:
        end = offset + t.nbytes
        header[t.key] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, end]}
        offset = end
    if len(header) != len(specs) + bool(metadata):
        # A JSON object keeps only the last of two equal keys: the file would be corrupt.
        counts = collections.Counter(t.key for t in specs)
        twice = next(k for k, n in counts.items() if n > 1)
        raise ValueError(f"safetensors key {twice!r} appears twice in one file")
    raw = dumps(header)
    raw += b" " * ((-(8 + len(raw))) % HEADER_ALIGN)
    return struct.pack("<Q", len(raw)) + raw


def _corrupt(src: ByteSource, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{src.name}: {what}. The data file is damaged or was not written by a safetensors "
        "writer; delete this checkpoint or restore it from a backup."
    )


# Header metadata of every data file a writer of sealed manifests (format 2 on) writes: a
# file that carries it belongs to a checkpoint whose manifest must carry checksums.
SEALED_MARK = {"tardigrade_manifest": "sealed"}


def read_header(
    src: ByteSource, expected_checksum: str | None = None, *, unsealed: bool = False
) -> dict[str, HeaderEntry]:
    """Read and validate a data file's header; return its entries by key.

    With ``expected_checksum`` (what the manifest recorded), the header's bytes, length prefix
    and padding included, must match it: a damaged header can otherwise still parse (a space
    in the padding, an edited metadata value) or point keys at other bytes. ``unsealed``: the
    manifest carries no checksums (format 1), so a header marked ``SEALED_MARK`` is refused.
    """
    if src.size < 8:
        raise _corrupt(src, f"file is {src.size} bytes, too short to hold a safetensors header")
    buf = bytearray(8)
    src.readinto(0, memoryview(buf))
    (n,) = struct.unpack("<Q", buf)
    if n > limits.MAX_HEADER_BYTES:
        raise _corrupt(src, f"header length {n} exceeds the cap of {limits.MAX_HEADER_BYTES} bytes")
    if 8 + n > src.size:
        raise _corrupt(src, f"header length {n} runs past the end of the {src.size}-byte file")
    try:
        raw = bytearray(n)
    except MemoryError:
        raise InsufficientMemoryError(
            f"{src.name}: cannot allocate {n} bytes for the safetensors header. Free memory "
            "(or raise this process's memory limit) and load again."
        ) from None
    src.readinto(8, memoryview(raw))
    if expected_checksum is not None:
        h = Hasher()
        h.update(buf)
        h.update(raw)
        if h.hexdigest() != expected_checksum:
            raise ChecksumMismatchError(
                f"{src.name}: safetensors header fails its checksum (expected "
                f"{expected_checksum}, got {h.hexdigest()}); it was damaged after the save. "
                "Delete this checkpoint or restore it from a backup."
            )
    header = loads_strict(bytes(raw), src.name)
    if not isinstance(header, dict):
        raise _corrupt(src, "header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if (
        unsealed
        and isinstance(meta, dict)
        and all(meta.get(k) == v for k, v in SEALED_MARK.items())
    ):
        raise _corrupt(
            src, "it was written with a checksummed (format 2 or newer) manifest, and the "
            "manifest now claims format 1, which has no checksums: it was edited and relabelled"
        )  # fmt: skip
    if len(header) > limits.MAX_TENSORS_PER_FILE:
        raise _corrupt(
            src,
            f"header lists {len(header)} tensors, over the cap of {limits.MAX_TENSORS_PER_FILE}",
        )
    data_start = 8 + n
    entries: dict[str, HeaderEntry] = {}
    for key, info in header.items():
        entries[key] = _entry(src, key, info, data_start)
    _check_layout(src, entries, data_start)
    return entries


def _entry(src: ByteSource, key: str, info: object, data_start: int) -> HeaderEntry:
    # Plain loops and lookups, no sets or generators: this runs for every tensor of a file,
    # and a file may hold a few hundred thousand small ones.
    if (
        type(info) is not dict
        or len(info) != 3
        or "dtype" not in info
        or "shape" not in info
        or "data_offsets" not in info
    ):
        raise _corrupt(src, f"tensor {key!r} must have exactly dtype, shape and data_offsets")
    dtype, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
    if type(dtype) is not str or dtype not in ITEMSIZE:
        raise UnsupportedFormatError(
            f"{src.name}: tensor {key!r} has unknown dtype {dtype!r}; this version of Tardigrade "
            f"reads {sorted(ITEMSIZE)}. Upgrade Tardigrade or re-save the checkpoint."
        )
    if type(shape) is not list or len(shape) > limits.MAX_DIMS:
        raise _corrupt(src, f"tensor {key!r} has an invalid shape {shape!r}")
    for d in shape:
        if type(d) is not int or not 0 <= d <= limits.MAX_TORCH_EXTENT:
            raise _corrupt(src, f"tensor {key!r} has an invalid shape {shape!r}")
    if (
        type(offs) is not list
        or len(offs) != 2
        or type(offs[0]) is not int
        or type(offs[1]) is not int
        or offs[0] < 0
        or offs[1] < 0
    ):
        raise _corrupt(src, f"tensor {key!r} has invalid data_offsets {offs!r}")
    begin, end = offs
    if end < begin:
        raise _corrupt(src, f"tensor {key!r} has data_offsets {offs} that end before they begin")
    # Python ints do not overflow, but a hostile shape could be astronomically large: compare
    # against the byte range, which is itself bounded by the file size below.
    nbytes = math.prod(shape) * ITEMSIZE[dtype]
    if nbytes != end - begin:
        raise _corrupt(
            src,
            f"tensor {key!r}: shape {shape} of {dtype} needs {nbytes} bytes but data_offsets "
            f"{offs} span {end - begin}",
        )
    # A zero-size shape passes the byte count whatever its other dims; torch still refuses
    # one whose strides overflow int64.
    if not limits.fits_torch(shape, ITEMSIZE[dtype]):
        raise _corrupt(src, f"tensor {key!r}: shape {shape} is too large for any tensor")
    if data_start + end > src.size:
        raise _corrupt(src, f"tensor {key!r}: data_offsets {offs} run past the end of the file")
    return HeaderEntry(key, dtype, tuple(shape), data_start + begin, data_start + end)


def _check_layout(src: ByteSource, entries: dict[str, HeaderEntry], data_start: int) -> None:
    """Tensors must tile the data region exactly: no overlap, no gap, no trailing bytes."""
    pos = data_start
    for e in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if e.begin < pos:
            raise _corrupt(src, f"tensor {e.key!r} overlaps the tensor before it")
        if e.begin > pos:
            raise _corrupt(src, f"there is a gap of {e.begin - pos} bytes before tensor {e.key!r}")
        pos = e.end
    if pos != src.size:
        raise _corrupt(src, f"{src.size - pos} trailing bytes after the last tensor")


def read_range(src: ByteSource, begin: int, dest: memoryview, hasher: Hasher | None) -> None:
    """Read ``dest.nbytes`` bytes at ``begin`` into ``dest``, hashing them when asked.

    A source with a ``read_hashed(begin, dest, hasher)`` method (an object store, where each
    read is a request) is handed the whole range: it fetches pieces in parallel and hashes
    them in order as they arrive."""
    read_hashed = getattr(src, "read_hashed", None)
    if read_hashed is not None:
        read_hashed(begin, dest, hasher)
        return
    step = SLICE_BYTES
    for start in range(0, dest.nbytes, step):
        piece = dest[start : start + step]
        src.readinto(begin + start, piece)
        if hasher is not None:
            hasher.update(piece)
