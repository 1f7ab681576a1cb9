"""The backend contract: a handful of byte primitives over names relative to a root.

Names use '/' and are relative to the root (a directory, or a URL prefix on a store). The byte
primitives know nothing of checkpoints (what a manifest is, which names a save stages under,
what is committed: ``tardigrade._commit`` and the catalog know that):

- ``open_writer(name)`` -> ``write``... -> ``close()``: the bytes are durable (fsynced, or the
  object is complete); ``abort()`` leaves nothing visible under ``name``;
- ``open_reader(name)`` -> ``readinto(offset, buf)``: ranged reads into the caller's buffer;
- ``put(name, data, mode=...)``: a small object, ``"create"`` (only if nothing is there),
  ``"if_match"`` (only if it is still the version ``expect``) or ``"overwrite"``; returns the
  new version, raising :class:`PreconditionFailed` when the condition does not hold;
- ``stat(name)``, ``list(name)`` (the entries directly under a prefix), ``walk()`` (every
  object with its Stat, where one listing gives them), ``delete(name)`` (an object, or
  everything under a prefix), ``delete_many(names)``;
- ``lease(name)``: the one-writer lease kept in the object ``name``.

A backend with real directories (POSIX) is a :class:`Directories`: it can also make, lock,
rename and swap them, which is what a commit by rename needs. Which commit strategy a backend
gets is chosen from that capability (``can_move``), above this layer.
"""

from __future__ import annotations

import abc
import builtins
import errno
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

from ..errors import CorruptCheckpointError, StorageError

__all__ = [
    "CLOCK_SKEW_SECONDS",
    "GRACE_SECONDS",
    "PROBE_PREFIX",
    "Directories",
    "Hashes",
    "PreconditionFailed",
    "PutMode",
    "Reader",
    "Stat",
    "Storage",
    "Tidied",
    "Writer",
    "grace_cutoff",
    "now",
]

log = logging.getLogger("tardigrade")

# A backend's own scratch objects (the empty object a preflight writes and deletes, a probe of
# what the server enforces) start with this; cleanup removes one whose delete failed.
PROBE_PREFIX = ".probe-"
# Errors no amount of waiting fixes: a location that gives them can never hold a checkpoint.
# A full store or disk, an I/O error or a transient one is not among them.
PERMANENT_ERRNOS = frozenset(
    {
        errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST, errno.ELOOP,
        errno.ENAMETOOLONG,
    }
)  # fmt: skip

PutMode = Literal["create", "if_match", "overwrite"]
_C = TypeVar("_C")

# The age below which cleanup leaves a store's objects alone (see Catalog.collect): a save may
# upload for a long time, and a zombie's may still commit.
GRACE_SECONDS = 3600.0
# How far a store's clock (its objects' modification times) may run ahead of this machine's.
CLOCK_SKEW_SECONDS = 5.0


def _clock() -> float:
    """Now, as a POSIX timestamp (tests move it on instead of sleeping)."""
    return time.time()


def now() -> float:
    """Now, as the clock that ages leftovers reads it."""
    return _clock()


def grace_cutoff(grace_seconds: float) -> float:
    """The POSIX time before which a leftover is past a grace period of ``grace_seconds``."""
    return _clock() - grace_seconds


class Hashes(Protocol):
    """What a writer feeds the bytes it writes to (a checksum, computed on the way)."""

    def update(self, data: memoryview | bytes | bytearray, /) -> None: ...


class PreconditionFailed(StorageError):
    """A conditional put found another version (or, creating, an object) in place."""


@dataclass(frozen=True)
class Tidied:
    """One leftover of a dead writer that cleanup dealt with (``Catalog.tidy``)."""

    name: str
    action: str  # "removed" or "recovered"
    nbytes: int


@dataclass(frozen=True)
class Stat:
    """What is at a name: an object of ``size`` bytes in its ``version``, or a directory."""

    size: int
    version: str
    is_dir: bool = False
    is_link: bool = False  # a symbolic link (POSIX), never followed: not a checkpoint's file
    # When it was last written (POSIX timestamp), where the backend knows; None if it does not.
    modified: float | None = None


class Writer(abc.ABC):
    """A file being written. ``close()`` makes its bytes durable."""

    @abc.abstractmethod
    def write(self, data: memoryview | bytes, *, hasher: Hashes | None = None) -> None:
        """Append ``data``.

        With ``hasher``, the writer updates it with exactly the bytes it writes, taken from its
        own copy of ``data``: the caller's memory may change during the call (a synchronous
        save of live tensors) and the checksum still describes the file.
        """

    @abc.abstractmethod
    def close(self) -> None: ...

    @abc.abstractmethod
    def abort(self) -> None:
        """Release resources without making anything durable (used on failure)."""


class Reader(abc.ABC):
    """A file opened for random-access reads."""

    name: str
    size: int

    @abc.abstractmethod
    def readinto(self, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` completely from ``offset``; a short file raises CorruptCheckpointError."""

    @abc.abstractmethod
    def close(self) -> None: ...

    def byte_span(self, offset: int, buf: memoryview) -> tuple[memoryview, int]:
        """``buf`` as flat bytes and the end of the range it covers from ``offset``; a range
        past the object's known size is refused before anything is fetched."""
        view = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
        end = offset + view.nbytes
        if end > self.size:
            raise CorruptCheckpointError(
                f"{self.name}: object ended early at byte {self.size} (wanted bytes {offset} to "
                f"{end}); delete this checkpoint or restore it from a backup."
            )
        return view, end

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Storage(abc.ABC):
    """A root under which checkpoints live. Names use '/' and are relative to the root."""

    root: str
    # Whether a name is a directory exactly when objects lie under it (an object store's
    # prefixes), so that finding an object under a name says it is a directory.
    implicit_directories = False

    # -- the byte primitives -------------------------------------------------------------

    @abc.abstractmethod
    def open_writer(self, name: str, *, size_hint: int | None = None) -> Writer:
        """Create the object ``name``; ``size_hint`` (its expected size) may pick a faster path."""

    @abc.abstractmethod
    def open_reader(self, name: str) -> Reader: ...

    @abc.abstractmethod
    def put(
        self, name: str, data: bytes, *, mode: PutMode = "create", expect: str | None = None
    ) -> str:
        """Write the small object ``name`` whole and durably under a condition; return its
        new version. ``"create"``: only if nothing is at ``name``; ``"if_match"``: only if it
        is still version ``expect``; ``"overwrite"``: unconditionally. A condition that does
        not hold raises :class:`PreconditionFailed` and changes nothing."""

    @abc.abstractmethod
    def stat(self, name: str) -> Stat | None:
        """The object (or directory / prefix) at ``name``, or None."""

    @abc.abstractmethod
    def list(self, name: str = "") -> list[str]:
        """Entries directly under ``name`` (a directory or prefix), sorted; empty if none."""

    @abc.abstractmethod
    def delete(self, name: str) -> None:
        """Remove an object, or everything under a directory/prefix; missing is not an error."""

    def delete_many(self, names: builtins.list[str]) -> None:
        """Remove several objects (stores batch this)."""
        for name in names:
            self.delete(name)

    def exists(self, name: str) -> bool:
        return self.stat(name) is not None

    def is_dir(self, name: str) -> bool:
        """Whether ``name`` is a directory (object stores: a prefix with entries)."""
        st = self.stat(name)
        return st is not None and st.is_dir

    # Whether this is a :class:`Directories` (POSIX directories rename; stores cannot).
    can_move = False

    def preflight(self) -> None:
        """Raise StorageError if checkpoints can never be written here (read-only, denied, a
        file in the way); create the root if missing. A transient failure only warns: the
        saves report it, and may succeed once it is gone."""
        probe = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
        try:
            self.put(probe, b"", mode="create")
        except StorageError as e:
            if e.errno in PERMANENT_ERRNOS:
                raise StorageError(
                    e.errno,
                    f"{self.root}: cannot be used as a checkpoint location, no save could ever "
                    f"succeed there: {e}. Fix its permissions or pass another location.",
                ) from e
            log.warning(
                "tardigrade: checkpoint location %s: %s; saves will fail until this is fixed "
                "(training is not stopped for it)",
                self.root,
                e,
            )
            return
        try:
            self.delete(probe)
        except StorageError as e:
            log.warning(
                "tardigrade: could not delete the probe %s: %s (`tardigrade gc` removes it)",
                self.url(probe),
                e,
            )

    def tidy(
        self, *, dry_run: bool = False, progress: Callable[[Tidied], None] | None = None
    ) -> builtins.list[Tidied]:
        """Remove what this backend's own machinery left behind when a writer died (a store's
        incomplete multipart uploads, past the grace period); what saves left is the commit
        strategy's and the catalog's to find. ``progress`` is called with each leftover once
        it is dealt with."""
        return []

    gc_grace_seconds: float = GRACE_SECONDS
    """Age (seconds) below which cleanup leaves this root's objects alone (a storage option
    on stores: a save may upload for long, a zombie writer's may still commit)."""

    @property
    def tidy_scope(self) -> str:
        """What tells this root from every other (its URL; with its endpoint, for a store)."""
        return self.root

    def walk(self) -> Iterator[tuple[str, Stat]] | None:
        """Every object under the root, recursively, with its Stat, from one listing; None
        where the backend has no such listing (the caller then lists name by name)."""
        return None

    @abc.abstractmethod
    def lease(self, name: str, *, lease_seconds: float = 30.0) -> Any:
        """The one-writer lease of this root, kept in the object ``name`` (a ``lease.Lease``;
        not yet taken)."""

    def wrap_commit(self, commit: _C) -> _C:
        """The commit strategy chosen for this backend, as a wrapping backend (fault
        injection, kill points) wants it observed: unchanged here."""
        return commit

    # -- derived helpers ------------------------------------------------------------------

    def read_bytes(self, name: str, limit: int) -> bytes:
        """Read a whole small file, refusing ones larger than ``limit``."""
        with self.open_reader(name) as r:
            if r.size > limit:
                raise CorruptCheckpointError(
                    f"{r.name}: {r.size} bytes exceeds the cap of {limit} bytes for this file"
                )
            buf = bytearray(r.size)
            r.readinto(0, memoryview(buf))
            return bytes(buf)

    def url(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"


class Directories(Storage):
    """A backend with real directories (POSIX): besides the byte primitives, it makes, locks,
    renames and swaps them, durably. This is what a commit by rename needs (a staging
    directory renamed into place; a lock that tells a live save's staging from a dead one's)."""

    can_move = True

    @abc.abstractmethod
    def make_dir(self, name: str) -> bool:
        """Create directory ``name`` (its parents too); False if something is already there."""

    @abc.abstractmethod
    def hold(self, name: str, *, wait: bool) -> bool:
        """Take an exclusive lock on directory ``name`` for this process (the kernel drops it
        when the process dies) until ``release(name)`` or ``delete(name)``. False when
        ``name`` is gone or was replaced meanwhile, is held here already, or (``wait=False``)
        another process holds it."""

    @abc.abstractmethod
    def release(self, name: str) -> None:
        """Drop the lock ``hold`` took on ``name`` (nothing if none)."""

    @abc.abstractmethod
    def move(self, src: str, dst: str) -> None:
        """Rename ``src`` to ``dst`` durably, never replacing anything at ``dst`` (a
        StorageError with EEXIST, or ENOTEMPTY, when something is there)."""

    @abc.abstractmethod
    def exchange(self, a: str, b: str) -> bool:
        """Swap ``a`` and ``b`` atomically; False where the filesystem cannot (nothing done)."""

    @abc.abstractmethod
    def sync(self, name: str = "") -> None:
        """Make the entries of directory ``name`` durable (renames into or out of it)."""
