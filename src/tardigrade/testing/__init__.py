"""Fault injection for your own tests: ``FaultyStorage`` fails chosen storage operations.

Wrap any backend (a local directory, ``memory://``) and make its Nth operation of a kind fail
the way storage fails in production: a full disk, an I/O error, a permission error, a transient
error, a write that silently keeps only part of its bytes, or an operation that took effect but
whose reply was lost (a store's request that timed out after it was applied). Every operation is logged, so a
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

import builtins
import errno
import itertools
import threading
import weakref
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .._commit import Candidate, Commit, commit_for
from ..errors import InvalidArgumentError, StorageError
from ..format.manifest import check_name
from ..storage import Directories, Reader, Stat, Storage, Writer, open_root, register_scheme
from ..storage.base import Hashes, PutMode, Tidied
from ..storage.lease import ObjectLease
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
# What each injected error raises (short_write raises nothing: it keeps half the bytes;
# lost_reply raises after the operation was done, as a store's request that timed out after
# it took effect, or a rename whose fsync failed).
ERRORS = {
    "ENOSPC": errno.ENOSPC,
    "EIO": errno.EIO,
    "EACCES": errno.EACCES,
    "transient": errno.EAGAIN,
    "short_write": None,
    "lost_reply": errno.ETIMEDOUT,
}

_instances: weakref.WeakValueDictionary[str, FaultyStorage] = weakref.WeakValueDictionary()
_ids = itertools.count(1)


@dataclass
class _Fault:
    op: str
    nth: int  # the matching operation that fails first (1 = the first after fail())
    error: str
    times: int  # how many consecutive matching operations fail
    outage: bool  # once it fires, every operation fails until heal()
    where: str | None  # only operations on a location containing this text match
    seen: int = 0  # matching operations so far


class FaultyStorage(Directories):
    """A backend that fails chosen operations of the backend it wraps.

    ``inner`` is a Storage or a location (a directory or URL) whose checkpoints it serves,
    with ``storage_options`` for a URL's backend (as ``tg.save`` takes them).
    ``fail(op, nth=..., error=..., times=...)`` arms a fault; ``ops`` lists every operation
    performed, in order, and ``log`` the same as (operation, location) pairs; ``count``
    counts them by kind; ``injected`` lists the faults that fired. Thread-safe: saves write
    files in parallel.

    Around an object store (a backend that commits manifest-last), the commit strategy and
    the lease run over this wrapper's own primitives, as they do over a store's requests: a
    commit is a ``commit`` operation, then the ``stat``, ``put``, ``list`` and ``delete`` it
    is made of, each of which can fail on its own (a store's requests fail one by one). Around
    a POSIX directory the rename strategy and the ``flock`` lease are the backend's own
    system calls, one ``begin``/``commit``/``abort`` operation each.
    """

    def __init__(
        self, inner: Storage | str, storage_options: Mapping[str, Any] | None = None
    ) -> None:
        self.inner = inner if isinstance(inner, Storage) else open_root(inner, storage_options)
        self._options = storage_options  # to open the inner backend below its root (below())
        self.id = str(next(_ids))
        self.root = f"{SCHEME}://{self.id}"
        self.ops: list[str] = []
        self.log: list[tuple[str, str]] = []
        self.count: Counter[str] = Counter()
        self.injected: list[str] = []
        self._faults: list[_Fault] = []
        # The error every operation fails with, in an outage (a dict: shared with below()).
        self._shared: dict[str, str | None] = {"outage": None}
        self._lock = threading.Lock()
        _instances[self.id] = self

    def fail(
        self,
        op: str,
        *,
        nth: int = 1,
        error: str = "EIO",
        times: int = 1,
        outage: bool = False,
        where: str | None = None,
    ) -> None:
        """Make the ``nth`` next operation ``op`` (counted from now) fail with ``error``.

        ``times``: how many consecutive operations ``op`` fail. ``where``: only operations on
        a location (URL or path) containing this text count, e.g. ``where="data-r00001"`` for
        one rank's data file. ``outage=True``: from that operation on, every operation of every
        kind fails with ``error`` until :meth:`heal` (a disk that stays full, a store that
        stays down), so what a failed run does to clean up fails too."""
        if op not in OPERATIONS:
            raise InvalidArgumentError(f"op must be one of {list(OPERATIONS)}, got {op!r}")
        if error not in ERRORS:
            raise InvalidArgumentError(f"error must be one of {list(ERRORS)}, got {error!r}")
        if error == "short_write" and (op != "write" or outage):
            raise InvalidArgumentError(
                "error='short_write' applies to op='write' only, and not to an outage"
            )
        if error == "lost_reply" and outage:
            raise InvalidArgumentError("error='lost_reply' does not apply to an outage")
        if nth < 1 or times < 1:
            raise InvalidArgumentError(f"nth and times must be >= 1, got {nth} and {times}")
        with self._lock:
            self._faults.append(_Fault(op, nth, error, times, outage, where))

    def below(self, path: str) -> FaultyStorage:
        """This storage rooted at ``path`` under its root (what ``url("run")`` names when a
        manager or ``tg.save`` opens it), sharing its faults and its log."""
        for part in path.split("/"):
            check_name(part, f"{self.root}/{path}")
        view = FaultyStorage.__new__(FaultyStorage)
        view.__dict__.update(self.__dict__)  # the same faults, log, counts and lock
        view.inner = open_root(self.inner.url(path), self._options)
        view.root = f"{self.root}/{path}"
        return view

    def heal(self) -> None:
        """Disarm every fault not yet fired."""
        with self._lock:
            self._faults.clear()
            self._shared["outage"] = None

    def _op(self, op: str, what: str) -> str | StorageError | None:
        """Log ``op``; raise if a fault fires. A short write returns ``"short_write"``; a lost
        reply returns the error to raise once the operation is done (:meth:`_after`)."""
        with self._lock:
            self.count[op] += 1
            self.ops.append(op)
            self.log.append((op, what))
            k = self.count[op]
            error = self._shared["outage"]
            if error is None:
                fault = None
                for f in self._faults:
                    if f.op == op and (f.where is None or f.where in what):
                        f.seen += 1
                        if fault is None and f.nth <= f.seen:
                            fault = f
                if fault is None:
                    return None
                fault.times -= 1
                fault.nth += 1
                if fault.times == 0 or fault.outage:
                    self._faults.remove(fault)
                if fault.outage:
                    self._shared["outage"] = fault.error
                error = fault.error
                self.injected.append(f"{op} #{k}: {error}")
        if error == "short_write":
            return error
        err = StorageError(ERRORS[error], f"{what}: injected {error} ({op} #{k}, FaultyStorage)")
        if error == "lost_reply":
            return err
        raise err

    @staticmethod
    def _after(late: str | StorageError | None) -> None:
        """Raise a lost reply's error, now that its operation is done."""
        if isinstance(late, StorageError):
            raise late

    # -- the contract, each call logged and possibly failed -------------------------------

    def url(self, name: str) -> str:
        return f"{self.root}/{name}"

    def open_writer(self, name: str, *, size_hint: int | None = None) -> Writer:
        late = self._op("open_writer", self.url(name))
        writer = _FaultyWriter(self, name, self.inner.open_writer(name, size_hint=size_hint))
        if late is not None:
            writer.abort()
        self._after(late)
        return writer

    def open_reader(self, name: str) -> Reader:
        late = self._op("open_reader", self.url(name))
        reader = _FaultyReader(self, self.inner.open_reader(name))
        if late is not None:
            reader.close()
        self._after(late)
        return reader

    def put(
        self, name: str, data: bytes, *, mode: PutMode = "create", expect: str | None = None
    ) -> str:
        late = self._op("put", self.url(name))
        version = self.inner.put(name, data, mode=mode, expect=expect)
        self._after(late)
        return version

    def stat(self, name: str) -> Stat | None:
        late = self._op("stat", self.url(name))
        st = self.inner.stat(name)
        self._after(late)
        return st

    def list(self, name: str = "") -> list[str]:
        late = self._op("list", self.url(name))
        names = self.inner.list(name)
        self._after(late)
        return names

    def delete(self, name: str) -> None:
        late = self._op("delete", self.url(name))
        self.inner.delete(name)
        self._after(late)

    @property
    def _store(self) -> bool:
        """Whether the inner backend commits manifest-last (an object store)."""
        return not self.inner.can_move

    @property
    def implicit_directories(self) -> bool:  # type: ignore[override]  # the wrapped backend's class attribute
        return self.inner.implicit_directories

    @property
    def can_move(self) -> bool:  # type: ignore[override]  # a class attribute on backends
        return self.inner.can_move

    def wrap_commit(self, commit: Any) -> Any:
        return _FaultyCommit(self, commit)

    def lease(self, name: str, *, lease_seconds: float = 30.0) -> Any:
        lease = self.inner.lease(name, lease_seconds=lease_seconds)
        if isinstance(lease, ObjectLease):
            # The record is read and written with this wrapper's conditional puts.
            return ObjectLease(self, name, lease_seconds=lease_seconds)
        return lease

    # What only a POSIX directory does: a rename is an operation of its own; making, locking,
    # swapping and syncing directories are the rename commit's system calls (its ``begin``
    # and ``commit``), never failed on their own.

    def move(self, src: str, dst: str) -> None:
        late = self._op("move", self.url(src))
        self._directories.move(src, dst)
        self._after(late)

    def make_dir(self, name: str) -> bool:
        return self._directories.make_dir(name)

    def hold(self, name: str, *, wait: bool) -> bool:
        return self._directories.hold(name, wait=wait)

    def release(self, name: str) -> None:
        if isinstance(self.inner, Directories):
            self.inner.release(name)

    def exchange(self, a: str, b: str) -> bool:
        return self._directories.exchange(a, b)

    def sync(self, name: str = "") -> None:
        self._directories.sync(name)

    @property
    def _directories(self) -> Directories:
        if not isinstance(self.inner, Directories):
            raise StorageError(errno.EOPNOTSUPP, f"{self.inner.root}: cannot rename (a store)")
        return self.inner

    @property
    def gc_grace_seconds(self) -> float:  # type: ignore[override]  # the inner store's, read-only
        return float(getattr(self.inner, "gc_grace_seconds", 0.0))

    @property
    def tidy_scope(self) -> str:
        return self.inner.tidy_scope

    def preflight(self) -> None:
        if self._store:
            Storage.preflight(self)  # a store's probe: this wrapper's put and delete
        else:
            self.inner.preflight()


class _FaultyCommit(Commit):
    """The commit strategy chosen for a ``FaultyStorage``, with ``begin``, ``commit`` and
    ``abort`` logged (and failed) as operations of their own.

    Around an object store the strategy runs over the wrapper's primitives (each request of a
    commit fails on its own, as a store's do). Around a POSIX directory a save's ``begin``,
    ``commit`` and ``abort`` (and cleanup's ``leftovers``) are the backend's own system calls,
    one operation each; retiring or setting aside a checkpoint is a ``move`` and a ``delete``
    of the wrapper's.
    """

    def __init__(self, faulty: FaultyStorage, outer: Commit) -> None:
        super().__init__(faulty)
        self.faulty = faulty
        self.outer = outer  # over the wrapper's primitives
        self.own = commit_for(faulty.inner) if outer.renames else outer
        self.renames = outer.renames

    def begin(self, name: str, save_id: str) -> str:
        late = self.faulty._op("begin", self.faulty.url(name))
        staging = self.own.begin(name, save_id)
        if late is not None:
            # The caller never learns the staging name: let go of what this process holds of
            # it (a local staging's flock), so it is a dead writer's leftover that gc removes.
            self.own.abandon(staging)
        self.faulty._after(late)
        return staging

    def data_name(self, file: str, save_id: str) -> str:
        return self.own.data_name(file, save_id)

    def commit(
        self, staging: str, name: str, manifest: bytes, *, save_id: str, replace: bool
    ) -> None:
        late = self.faulty._op("commit", self.faulty.url(name))
        self.own.commit(staging, name, manifest, save_id=save_id, replace=replace)
        self.faulty._after(late)

    def abort(self, staging: str, name: str, save_id: str) -> None:
        late = self.faulty._op("abort", self.faulty.url(name))
        self.own.abort(staging, name, save_id)
        self.faulty._after(late)

    def abandon(self, staging: str) -> None:
        self.own.abandon(staging)  # lets go of a resource here; no storage request

    def retire(self, name: str) -> None:
        self.outer.retire(name)

    def set_aside(self, name: str, aside: str) -> None:
        self.outer.set_aside(name, aside)

    def leftovers(self, *, dry_run: bool = False, progress: Any = None) -> builtins.list[Tidied]:
        return self.own.leftovers(dry_run=dry_run, progress=progress)

    def candidates(self) -> Iterator[Candidate]:
        return self.outer.candidates()

    def abandoned_saves(self) -> dict[str, float]:
        return self.outer.abandoned_saves()

    def save_of(self, data: str) -> str:
        return self.outer.save_of(data)


class _FaultyWriter(Writer):
    def __init__(self, storage: FaultyStorage, name: str, inner: Writer) -> None:
        self._storage = storage
        self._name = name
        self._inner = inner

    def write(self, data: memoryview | bytes, *, hasher: Hashes | None = None) -> None:
        late = self._storage._op("write", self._storage.url(self._name))
        if late == "short_write":
            # The storage keeps half and says nothing: the hasher sees what was asked, as a
            # writer that believes the write succeeded would.
            view = memoryview(data).cast("B")
            if hasher is not None:
                hasher.update(view)
            self._inner.write(view[: view.nbytes // 2])
            return
        self._inner.write(data, hasher=hasher)
        self._storage._after(late)

    def close(self) -> None:
        try:
            late = self._storage._op("close", self._storage.url(self._name))
        except BaseException:
            self._inner.abort()
            raise
        self._inner.close()
        self._storage._after(late)

    def abort(self) -> None:
        self._inner.abort()


class _FaultyReader(Reader):
    def __init__(self, storage: FaultyStorage, inner: Reader) -> None:
        self._storage = storage
        self._inner = inner
        self.name = inner.name
        self.size = inner.size

    def readinto(self, offset: int, buf: memoryview) -> None:
        late = self._storage._op("read", self.name)
        self._inner.readinto(offset, buf)
        self._storage._after(late)

    def close(self) -> None:
        self._inner.close()


def _open(root: str, options: Any) -> Storage:
    ident, _, below = root.removeprefix(f"{SCHEME}://").partition("/")
    storage = _instances.get(ident)
    if storage is None:
        raise InvalidArgumentError(
            f"{root}: no FaultyStorage of this process has this URL (it was garbage "
            "collected); use FaultyStorage.url(name) of a live one."
        )
    below = below.strip("/")
    return storage.below(below) if below else storage


register_scheme(SCHEME, _open)
