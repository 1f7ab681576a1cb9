"""Chunk checksums: xxh3-64, fast enough (>20 GB/s/core) to compute while writing and reading;
and the identity of a shared object: xxh3-128 of its whole file, as fast."""

from __future__ import annotations

import xxhash

__all__ = [
    "ALGORITHM",
    "Hasher",
    "Identity",
    "checksum",
]

ALGORITHM = "xxh3-64"


class Hasher:
    """An incremental checksum over the bytes of one chunk."""

    __slots__ = ("_h",)

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()

    def update(self, data: memoryview | bytes | bytearray) -> None:
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def checksum(data: memoryview | bytes) -> str:
    """The checksum of one buffer, as stored in the manifest."""
    return xxhash.xxh3_64_hexdigest(data)


class Identity:
    """The 128-bit content hash naming a shared object (``format.manifest.shared_name``): equal
    bytes of equal dtype and shape have one name. Strong for data that is not adversarial (not
    a cryptographic hash: an object forged to collide must also match the chunk checksum every
    manifest referencing it records, and a load checks it)."""

    __slots__ = ("_h",)

    def __init__(self) -> None:
        self._h = xxhash.xxh3_128()

    def update(self, data: memoryview | bytes | bytearray) -> None:
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()
