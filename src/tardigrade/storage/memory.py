"""``memory://``: an object store in this process, for fast tests and for trying the store path.

A real backend, not a mock: objects appear whole when their writer closes (never partly
written), conditional puts (create-only, if-match) hold under concurrent writers, and it
commits as object stores do (manifest last, created only if none exists). Buckets live as long
as the process: ``memory://bucket/a`` names the same objects wherever it is opened.

Its ``tidy`` has no grace period by default (``gc_grace_seconds=0``): an in-process store
holds no other process's saves, no zombie writer can reach it, and users' fast unit tests
expect what a failed save left to go at the next cleanup. Pass ``gc_grace_seconds`` (the only
storage option it takes) to try the grace period of a real store.
"""

from __future__ import annotations

import errno
import itertools
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import CorruptCheckpointError, InvalidArgumentError
from ._options import grace_seconds
from .base import Hashes, PreconditionFailed, PutMode, Reader, Stat, Storage, Writer
from .lease import ObjectLease

__all__ = [
    "MemoryReader",
    "MemoryStorage",
]

SCHEME = "memory://"


@dataclass(frozen=True)
class _Object:
    data: bytes
    version: str
    modified: float  # when it was put (POSIX timestamp)


class _Bucket:
    def __init__(self) -> None:
        self.objects: dict[str, _Object] = {}
        self.lock = threading.Lock()


_buckets: dict[str, _Bucket] = {}
_buckets_lock = threading.Lock()
_versions = itertools.count(1)


def _bucket(name: str) -> _Bucket:
    with _buckets_lock:
        return _buckets.setdefault(name, _Bucket())


def clear() -> None:
    """Forget every ``memory://`` bucket of this process (tests start from nothing)."""
    with _buckets_lock:
        _buckets.clear()


class MemoryWriter(Writer):
    def __init__(self, storage: MemoryStorage, key: str) -> None:
        self._storage = storage
        self._key = key
        self._parts: list[bytes] = []
        self._open = True

    def write(self, data: memoryview | bytes, *, hasher: Hashes | None = None) -> None:
        # A private copy: the caller's memory may change after the call (live tensors).
        part = bytes(memoryview(data).cast("B"))
        if hasher is not None:
            hasher.update(memoryview(part))
        self._parts.append(part)

    def close(self) -> None:
        if self._open:
            self._open = False
            self._storage._store(self._key, b"".join(self._parts))
            self._parts = []

    def abort(self) -> None:
        self._open = False
        self._parts = []


class MemoryReader(Reader):
    def __init__(self, url: str, data: bytes) -> None:
        self.name = url
        self.size = len(data)
        self._data = memoryview(data)

    def readinto(self, offset: int, buf: memoryview) -> None:
        view, end = self.byte_span(offset, buf)
        view[:] = self._data[offset:end]

    def close(self) -> None:
        self._data.release()


class MemoryStorage(Storage):
    implicit_directories = True  # a name is a directory exactly when objects lie under it

    """Objects of a ``memory://bucket/prefix`` root, keyed by their names under it.

    ``options`` may hold ``gc_grace_seconds`` (default 0: see the module docstring), e.g.
    ``MemoryStorage("memory://bucket/ckpts", {"gc_grace_seconds": 3600})``.
    """

    def __init__(self, root: str, options: Mapping[str, Any] | None = None) -> None:
        options = dict(options or {})
        self.gc_grace_seconds = grace_seconds(root, options.pop("gc_grace_seconds", 0.0))
        if options:
            raise InvalidArgumentError(
                f"{root}: storage options {sorted(options)} were given, but memory:// takes "
                "none but gc_grace_seconds; they are for URLs of stores such as s3://. Pass "
                "them with the location they belong to (e.g. upload_storage_options= for "
                "CheckpointManager's upload_to)."
            )
        if not root.startswith(SCHEME):
            raise InvalidArgumentError(f"{root}: a memory:// URL is expected")
        bucket, _, prefix = root[len(SCHEME) :].partition("/")
        if not bucket:
            raise InvalidArgumentError(f"{root}: name a bucket, e.g. memory://bucket/checkpoints")
        self.root = root.rstrip("/")
        self._bucket = _bucket(bucket)
        self._prefix = prefix.strip("/")

    def _key(self, name: str) -> str:
        name = name.strip("/")
        return f"{self._prefix}/{name}" if self._prefix and name else self._prefix or name

    def _store(self, key: str, data: bytes) -> str:
        version = str(next(_versions))
        with self._bucket.lock:
            self._bucket.objects[key] = _Object(data, version, time.time())
        return version

    def open_writer(self, name: str, *, size_hint: int | None = None) -> Writer:
        return MemoryWriter(self, self._key(name))

    def open_reader(self, name: str) -> Reader:
        with self._bucket.lock:
            obj = self._bucket.objects.get(self._key(name))
        if obj is None:
            raise CorruptCheckpointError(
                f"{self.url(name)}: object listed in the manifest is missing; the checkpoint is "
                "incomplete. Delete it or restore it from a backup."
            )
        return MemoryReader(self.url(name), obj.data)

    def put(
        self, name: str, data: bytes, *, mode: PutMode = "create", expect: str | None = None
    ) -> str:
        key = self._key(name)
        version = str(next(_versions))
        with self._bucket.lock:  # check and write as one step, as a store's conditional PUT
            now = self._bucket.objects.get(key)
            if mode == "create" and now is not None:
                raise PreconditionFailed(
                    errno.EEXIST, f"{self.url(name)}: exists already; nothing was written"
                )
            if mode == "if_match" and (now is None or now.version != expect):
                raise PreconditionFailed(
                    errno.ESTALE, f"{self.url(name)}: changed since it was read; nothing written"
                )
            self._bucket.objects[key] = _Object(bytes(data), version, time.time())
        return version

    def stat(self, name: str) -> Stat | None:
        key = self._key(name)
        with self._bucket.lock:
            obj = self._bucket.objects.get(key)
            if obj is not None:
                return Stat(len(obj.data), obj.version, modified=obj.modified)
            under = f"{key}/" if key else ""
            if any(k.startswith(under) for k in self._bucket.objects):
                return Stat(0, "", is_dir=True)
        return None

    def list(self, name: str = "") -> list[str]:
        key = self._key(name)
        under = f"{key}/" if key else ""
        with self._bucket.lock:
            keys = [k[len(under) :] for k in self._bucket.objects if k.startswith(under)]
        return sorted({k.split("/", 1)[0] for k in keys})

    def lease(self, name: str, *, lease_seconds: float = 30.0) -> ObjectLease:
        return ObjectLease(self, name, lease_seconds=lease_seconds)

    def delete(self, name: str) -> None:
        key = self._key(name)
        with self._bucket.lock:
            self._bucket.objects.pop(key, None)
            under = f"{key}/" if key else ""
            for k in [k for k in self._bucket.objects if k.startswith(under)]:
                del self._bucket.objects[k]
