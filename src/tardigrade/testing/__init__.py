"""Fault injection for your own tests: ``FaultyStorage`` fails chosen storage operations.

Wrap any backend (a local directory, ``memory://``) and make its Nth operation of a kind fail
the way storage fails in production: a full disk, an I/O error, a permission error, a transient
error, or a write that silently keeps only part of its bytes. Every operation is logged, so a
test can run once, count the operations, then fail each one in turn::

    import tardigrade as tg
    from tardigrade.testing import FaultyStorage

    faulty = FaultyStorage("memory://bucket/ckpt")
    faulty.fail("write", nth=2, error="ENOSPC")      # the second write fails
    try:
        tg.save(faulty.url("step-1"), state)         # raises SaveError; nothing is committed
    except tg.SaveError:
        pass
    assert not faulty.inner.exists("step-1/manifest.json")

Locations under ``faulty.url(...)`` go to the wrapped backend, and work wherever Tardigrade
takes a path.
"""

from __future__ import annotations

import errno
import itertools
import threading
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgumentError, StorageError
from ..format.checksum import Hasher
from ..storage import Reader, Stat, Storage, Writer, open_root, register_scheme
from ..storage.base import PutMode
from ._kill import KillResult, kill_during
from ._resume import ResumeReport, assert_resumes_exactly, checkpoint_dir, log_loss, save_final
from ._s3server import S3Server

__all__ = [
    "ERRORS",
    "OPERATIONS",
    "FaultyStorage",
    "KillResult",
    "ResumeReport",
    "S3Server",
    "assert_resumes_exactly",
    "checkpoint_dir",
    "kill_during",
    "log_loss",
    "save_final",
]

SCHEME = "faulty"
OPERATIONS = (
    "open_writer", "write", "close", "open_reader", "read", "put", "stat", "list", "delete",
    "move", "begin", "commit", "abort",
)  # fmt: skip
# What each injected error raises (short_write raises nothing: it keeps half the bytes).
ERRORS = {
    "ENOSPC": errno.ENOSPC,
    "EIO": errno.EIO,
    "EACCES": errno.EACCES,
    "transient": errno.EAGAIN,
    "short_write": None,
}

_instances: weakref.WeakValueDictionary[str, FaultyStorage] = weakref.WeakValueDictionary()
_ids = itertools.count(1)


@dataclass
class _Fault:
    op: str
    nth: int  # the operation of this kind that fails first (1 = the first)
    error: str
    times: int  # how many consecutive operations of this kind fail


class FaultyStorage(Storage):
    """A backend that fails chosen operations of the backend it wraps.

    ``inner`` is a Storage or a location (a directory or URL) whose checkpoints it serves.
    ``fail(op, nth=..., error=..., times=...)`` arms a fault; ``ops`` lists every operation
    performed, in order; ``count`` counts them by kind; ``injected`` lists the faults that
    fired. Thread-safe: saves write files in parallel.
    """

    def __init__(self, inner: Storage | str) -> None:
        self.inner = inner if isinstance(inner, Storage) else open_root(inner)
        self.id = str(next(_ids))
        self.root = f"{SCHEME}://{self.id}"
        self.ops: list[str] = []
        self.count: Counter[str] = Counter()
        self.injected: list[str] = []
        self._faults: list[_Fault] = []
        self._lock = threading.Lock()
        _instances[self.id] = self

    def fail(self, op: str, *, nth: int = 1, error: str = "EIO", times: int = 1) -> None:
        """Make the ``nth`` next operation ``op`` (counted from now) fail with ``error``."""
        if op not in OPERATIONS:
            raise InvalidArgumentError(f"op must be one of {list(OPERATIONS)}, got {op!r}")
        if error not in ERRORS:
            raise InvalidArgumentError(f"error must be one of {list(ERRORS)}, got {error!r}")
        if error == "short_write" and op != "write":
            raise InvalidArgumentError("error='short_write' applies to op='write' only")
        if nth < 1 or times < 1:
            raise InvalidArgumentError(f"nth and times must be >= 1, got {nth} and {times}")
        with self._lock:
            self._faults.append(_Fault(op, self.count[op] + nth, error, times))

    def heal(self) -> None:
        """Disarm every fault not yet fired."""
        with self._lock:
            self._faults.clear()

    def _op(self, op: str, what: str) -> str | None:
        """Log ``op``; raise (or, for a short write, return the error) if a fault fires."""
        with self._lock:
            self.count[op] += 1
            self.ops.append(op)
            k = self.count[op]
            fault = next((f for f in self._faults if f.op == op and f.nth <= k), None)
            if fault is None:
                return None
            fault.times -= 1
            fault.nth += 1
            if fault.times == 0:
                self._faults.remove(fault)
            self.injected.append(f"{op} #{k}: {fault.error}")
        if fault.error == "short_write":
            return fault.error
        code = ERRORS[fault.error]
        raise StorageError(code, f"{what}: injected {fault.error} ({op} #{k}, FaultyStorage)")

    # -- the contract, each call logged and possibly failed -------------------------------

    def url(self, name: str) -> str:
        return f"{self.root}/{name}"

    def open_writer(self, name: str, *, size_hint: int | None = None) -> Writer:
        self._op("open_writer", self.url(name))
        return _FaultyWriter(self, name, self.inner.open_writer(name, size_hint=size_hint))

    def open_reader(self, name: str) -> Reader:
        self._op("open_reader", self.url(name))
        return _FaultyReader(self, self.inner.open_reader(name))

    def put(
        self, name: str, data: bytes, *, mode: PutMode = "create", expect: str | None = None
    ) -> str:
        self._op("put", self.url(name))
        return self.inner.put(name, data, mode=mode, expect=expect)

    def stat(self, name: str) -> Stat | None:
        self._op("stat", self.url(name))
        return self.inner.stat(name)

    def list(self, name: str = "") -> list[str]:
        self._op("list", self.url(name))
        return self.inner.list(name)

    def delete(self, name: str) -> None:
        self._op("delete", self.url(name))
        self.inner.delete(name)

    def begin(self, name: str, save_id: str) -> str:
        self._op("begin", self.url(name))
        return self.inner.begin(name, save_id)

    def data_name(self, file: str, save_id: str) -> str:
        return self.inner.data_name(file, save_id)

    def commit(
        self, staging: str, name: str, manifest: bytes, *, save_id: str, replace: bool
    ) -> None:
        self._op("commit", self.url(name))
        self.inner.commit(staging, name, manifest, save_id=save_id, replace=replace)

    def abort(self, staging: str, name: str, save_id: str) -> None:
        self._op("abort", self.url(name))
        self.inner.abort(staging, name, save_id)

    def describe(self, name: str) -> str | None:
        return self.inner.describe(name)

    def lease(self, *, lease_seconds: float = 30.0) -> Any:
        return self.inner.lease(lease_seconds=lease_seconds)

    @property  # type: ignore[override]
    def can_move(self) -> bool:  # a class attribute on backends
        return self.inner.can_move

    def move(self, src: str, dst: str) -> None:
        self._op("move", self.url(src))
        self.inner.move(src, dst)

    def tidy(self, *, dry_run: bool = False) -> Any:
        return self.inner.tidy(dry_run=dry_run)

    def preflight(self) -> None:
        self.inner.preflight()


class _FaultyWriter(Writer):
    def __init__(self, storage: FaultyStorage, name: str, inner: Writer) -> None:
        self._storage = storage
        self._name = name
        self._inner = inner

    def write(self, data: memoryview | bytes, *, hasher: Hasher | None = None) -> None:
        if self._storage._op("write", self._storage.url(self._name)) == "short_write":
            # The storage keeps half and says nothing: the hasher sees what was asked, as a
            # writer that believes the write succeeded would.
            view = memoryview(data).cast("B")
            if hasher is not None:
                hasher.update(view)
            self._inner.write(view[: view.nbytes // 2])
            return
        self._inner.write(data, hasher=hasher)

    def close(self) -> None:
        try:
            self._storage._op("close", self._storage.url(self._name))
        except BaseException:
            self._inner.abort()
            raise
        self._inner.close()

    def abort(self) -> None:
        self._inner.abort()


class _FaultyReader(Reader):
    def __init__(self, storage: FaultyStorage, inner: Reader) -> None:
        self._storage = storage
        self._inner = inner
        self.name = inner.name
        self.size = inner.size

    def readinto(self, offset: int, buf: memoryview) -> None:
        self._storage._op("read", self.name)
        self._inner.readinto(offset, buf)

    def close(self) -> None:
        self._inner.close()


def _open(root: str, options: Any) -> Storage:
    ident = root.removeprefix(f"{SCHEME}://").split("/", 1)[0]
    storage = _instances.get(ident)
    if storage is None or root.rstrip("/") != storage.root:
        raise InvalidArgumentError(
            f"{root}: no FaultyStorage of this process has this URL (it was garbage collected, "
            "or the URL names a path below its root); use FaultyStorage.url(name)."
        )
    return storage


register_scheme(SCHEME, _open)
