"""The backend contract: a handful of byte primitives over names relative to a root, and the
commit strategy the backend chooses.

Names use '/' and are relative to the root (a directory, or a URL prefix on a store). The byte
primitives know nothing of checkpoints:

- ``open_writer(name)`` -> ``write``... -> ``close()``: the bytes are durable (fsynced, or the
  object is complete); ``abort()`` leaves nothing visible under ``name``;
- ``open_reader(name)`` -> ``readinto(offset, buf)``: ranged reads into the caller's buffer;
- ``put(name, data, mode=...)``: a small object, ``"create"`` (only if nothing is there),
  ``"if_match"`` (only if it is still the version ``expect``) or ``"overwrite"``; returns the
  new version, raising :class:`PreconditionFailed` when the condition does not hold;
- ``stat(name)``, ``list(name)`` (the entries directly under a prefix), ``delete(name)`` (an
  object, or everything under a prefix), ``delete_many(names)``.

Call order for a save (the commit order is the design), through the backend's strategy:
``begin(name, save_id)`` -> a staging location; each data file ``open_writer(staging/
data_name(file, save_id))``, ``write``..., ``close`` (durable) -> ``commit(staging, name,
manifest)``. After ``commit`` returns the checkpoint exists and survives power loss; before,
it does not. On failure ``abort(staging, name, save_id)`` removes what the save wrote; where
that fails (or the outcome is unknown) ``abandon(staging)`` leaves it to ``tidy``. Two
strategies: :class:`RenameCommit` (POSIX: a staging directory renamed into place, see
``local.py``) and :class:`ManifestLastCommit` (stores, which cannot rename: data objects under
names unique to the save, then the manifest created only if none exists).
"""

from __future__ import annotations

import abc
import builtins
import errno
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import CheckpointExistsError, CorruptCheckpointError, StorageError, TardigradeError
from ..format.checksum import Hasher
from ..format.manifest import MANIFEST, MANIFEST_START

__all__ = [
    "GRACE_SECONDS",
    "MANIFEST",
    "PROBE_PREFIX",
    "TMP_PREFIX",
    "Candidate",
    "ManifestLastCommit",
    "PreconditionFailed",
    "PutMode",
    "Reader",
    "Stat",
    "Storage",
    "Tidied",
    "Writer",
    "due",
    "grace_cutoff",
    "replaced_name",
    "staging_name",
]

log = logging.getLogger("tardigrade")

# Everything in flight or left behind starts with this; readers never read it.
TMP_PREFIX = ".tmp-"
# The empty object a preflight writes and deletes (``tidy`` removes one whose delete failed).
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

# The age below which a store's tidy leaves a save's data objects alone (see
# Catalog.collect): a save may upload for a long time, and a zombie's may still commit.
GRACE_SECONDS = 3600.0
# How far a store's clock (its objects' modification times) may run ahead of this machine's.
CLOCK_SKEW_SECONDS = 5.0


def _clock() -> float:
    """Now, as a POSIX timestamp (tests move it on instead of sleeping)."""
    return time.time()


def grace_cutoff(grace_seconds: float) -> float:
    """The POSIX time before which a leftover is past a grace period of ``grace_seconds``."""
    return _clock() - grace_seconds


# Saves this process saw end without committing and without cleaning up (``abandon``):
# (the root's tidy scope, staging) -> when.
_abandoned: dict[tuple[str, str], float] = {}
_abandoned_lock = threading.Lock()


class PreconditionFailed(StorageError):
    """A conditional put found another version (or, creating, an object) in place."""


@dataclass(frozen=True)
class Tidied:
    """One leftover of a dead writer that :meth:`Storage.tidy` dealt with."""

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


def staging_name(name: str, save_id: str) -> str:
    """Where a save of checkpoint ``name`` writes before it commits."""
    return f"{TMP_PREFIX}{name}-{save_id}"


def replaced_name(name: str, tag: str) -> str:
    """Where a replace without atomic swap moves the old checkpoint ``name`` meanwhile."""
    return f"{TMP_PREFIX}{name}-replaced-{tag}"


class Writer(abc.ABC):
    """A file being written. ``close()`` makes its bytes durable."""

    @abc.abstractmethod
    def write(self, data: memoryview | bytes, *, hasher: Hasher | None = None) -> None:
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


# What the catalog's sweep looks at under one name: (name, [(data object, its Stat or None)], whether a
# manifest was listed there).
Candidate = tuple[str, list[tuple[str, Stat | None]], bool]


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

    # -- the commit strategy (see the module docstring) -----------------------------------

    @abc.abstractmethod
    def begin(self, name: str, save_id: str) -> str:
        """Prepare where the data files of a save of checkpoint ``name`` go; return it."""

    def data_name(self, file: str, save_id: str) -> str:
        """The name a save stores its data file ``file`` under (in the manifest too)."""
        return file

    @abc.abstractmethod
    def commit(
        self, staging: str, name: str, manifest: bytes, *, save_id: str, replace: bool
    ) -> None:
        """Write ``manifest`` and make save ``save_id`` in ``staging`` visible as ``name``.
        ``replace`` replaces an existing checkpoint; without it, one that appeared meanwhile
        raises CheckpointExistsError and nothing is committed."""

    @abc.abstractmethod
    def abort(self, staging: str, name: str, save_id: str) -> None:
        """Remove what a save that will not commit wrote (it never became visible)."""

    def abandon(self, staging: str) -> None:
        """Let go of ``staging`` without removing it: its save ended without committing and
        its ``abort`` failed, or its outcome is unknown. Whatever marks it as a live save's
        (a POSIX staging directory's flock) is dropped, or (a store) it is recorded in this
        process, so ``tidy`` takes it for a dead writer's leftover. Never raises."""
        return None

    # Whether move() works: POSIX directories rename; object stores cannot.
    can_move = False

    def move(self, src: str, dst: str) -> None:
        """Rename ``src`` to ``dst`` durably, never replacing anything at ``dst``."""
        raise StorageError(
            errno.EOPNOTSUPP, f"{self.url(src)}: this storage cannot rename (an object store)"
        )

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
        """Clean up after writers that died: their staging, half-done replaces and deletes.

        Only what no live writer holds, and never a committed checkpoint (a store, which
        cannot tell, waits out a grace period: the catalog's sweep, ``Catalog.collect``).
        ``progress`` is called with each leftover once it is dealt with (``tardigrade gc``
        draws its bar)."""
        return []

    # -- what saves that never committed left where they write (a store's data objects), for
    # the catalog's sweep by reachability (``Catalog.collect``); nothing on a POSIX root,
    # whose saves stage apart and whose ``tidy`` removes what dies there.

    gc_grace_seconds: float = 0.0
    """Age (seconds) below which the sweep leaves a save's data objects alone."""

    def tidy_candidates(self) -> Iterator[Candidate]:
        """(name, [(data object, its Stat or None)], whether a manifest is there) for each
        name holding a save's data objects, and ("", [(probe, Stat)], False) for the root's
        probes."""
        return iter(())

    def abandoned_saves(self) -> dict[str, float]:
        """The names under which this process saw a save fail, each with the time before
        which what that save wrote may go at once."""
        return {}

    def save_of(self, data: str) -> str:
        """Which save wrote data object ``data``."""
        return data

    @abc.abstractmethod
    def lease(self, *, lease_seconds: float = 30.0) -> Any:
        """The one-writer lease of this root (a ``lease.Lease``; not yet taken)."""

    # -- derived helpers ------------------------------------------------------------------

    def describe(self, name: str) -> str | None:
        """What is at ``name``: None (nothing), ``"checkpoint"`` (a directory whose commit
        record is a Tardigrade manifest), ``"directory"`` or ``"file"`` (anything else)."""
        if not self.exists(name):
            return None
        try:
            with self.open_reader(f"{name}/{MANIFEST}") as r:
                head = bytearray(min(r.size, len(MANIFEST_START)))
                r.readinto(0, memoryview(head))
            if bytes(head) == MANIFEST_START:
                return "checkpoint"
        except (OSError, TardigradeError):
            pass
        return "directory" if self.list(name) or self.is_dir(name) else "file"

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


# A store's data object: the save's id (16 hex digits), a dot, the file's name in the plan.
_SAVE_DATA = re.compile(r"^[0-9a-f]{16}\.")
_SAVE_ID_CHARS = 17  # what of a data object's name names its save: ``<16 hex digits>.``


def due(st: Stat, cutoff: float, abandoned: float | None) -> bool:
    """Whether ``tidy`` may remove a save's data object: written before ``cutoff`` (past the
    grace period), or before ``abandoned`` (when this process abandoned its save, plus clock
    skew). One of unknown age counts as young unless abandoned."""
    if st.modified is not None and st.modified <= cutoff:
        return True
    return abandoned is not None and (st.modified is None or st.modified <= abandoned)


class ManifestLastCommit(Storage):
    """The commit strategy of object stores, which cannot rename (and copy is not atomic).

    Data objects are written straight under the checkpoint's prefix, under names unique to the
    save (``<save id>.data-...``), so a retry, a zombie writer or ``overwrite=True`` never
    overwrites bytes a committed manifest points at. The manifest is written last, with one
    conditional create: of two writers, exactly one commits. A prefix without a manifest holds
    no checkpoint; ``abort`` deletes the save's own objects. Replacing puts the new manifest
    only if the old one is still the version read (if-match), then deletes the old data.
    What saves that never committed left is swept by the catalog, which reads manifests
    (``Catalog.collect``: by reachability), once older than a grace period
    (``gc_grace_seconds``), or at once where this process saw the save fail (``abandon``);
    this class lists it (``tidy_candidates``) and says which save wrote an object
    (``save_of``).
    """

    implicit_directories = True

    def begin(self, name: str, save_id: str) -> str:
        return name  # nothing to prepare: the data go where they stay

    def data_name(self, file: str, save_id: str) -> str:
        return f"{save_id[:16]}.{file}"

    def commit(
        self, staging: str, name: str, manifest: bytes, *, save_id: str, replace: bool
    ) -> None:
        key = f"{name}/{MANIFEST}"
        old = self.stat(key) if replace else None
        try:
            if old is None:
                self.put(key, manifest, mode="create")
            else:
                self.put(key, manifest, mode="if_match", expect=old.version)
        except PreconditionFailed:
            raise CheckpointExistsError(
                f"{self.url(name)}: another writer committed a checkpoint here while this save "
                "was running; nothing was overwritten and this save did not commit."
            ) from None
        if old is not None:
            mine = self.data_name("", save_id)
            self.delete_many(
                [
                    f"{name}/{n}"
                    for n in self.list(name)
                    if _SAVE_DATA.match(n) and not n.startswith(mine)
                ]
            )

    def abort(self, staging: str, name: str, save_id: str) -> None:
        mine = self.data_name("", save_id)
        self.delete_many([f"{name}/{n}" for n in self.list(name) if n.startswith(mine)])

    # -- cleanup: what saves that never committed left -------------------------------------

    # Age (seconds) below which tidy leaves a save's data objects alone; a backend sets it from
    # its ``gc_grace_seconds`` storage option.
    gc_grace_seconds: float = GRACE_SECONDS

    @property
    def tidy_scope(self) -> str:
        """What tells this root from others in the record of abandoned saves (its URL)."""
        return self.root

    def abandon(self, staging: str) -> None:
        """A save into ``staging`` ended without committing and did not clean up: ``tidy``
        in this process removes what it wrote so far without waiting for the grace period."""
        with _abandoned_lock:
            _abandoned[(self.tidy_scope, staging)] = _clock()

    def tidy_candidates(self) -> Iterator[Candidate]:
        """What ``tidy`` looks at: (name, [(object, its Stat or None)], whether a manifest is
        there) for each name that holds a save's data objects (named ``<save id>.<file>``),
        and ("", [(probe, Stat)], False) for the probes at the root. A Stat of None is read
        only if needed. This lists the root and each name in it; a store with a recursive
        listing overrides it."""
        probes: list[tuple[str, Stat | None]] = []
        for name in self.list():
            if name.startswith(PROBE_PREFIX):
                probes.append((name, None))
                continue
            if name.startswith("."):
                continue
            names = self.list(name)
            data: list[tuple[str, Stat | None]] = [(n, None) for n in names if _SAVE_DATA.match(n)]
            if data:
                yield name, data, MANIFEST in names
        if probes:
            yield "", probes, False

    def abandoned_saves(self) -> dict[str, float]:
        """The names under which this process saw a save fail (``abandon``), each with the
        time (plus clock skew) before which what that save wrote may go at once."""
        with _abandoned_lock:
            return {
                staging: when + CLOCK_SKEW_SECONDS
                for (scope, staging), when in _abandoned.items()
                if scope == self.tidy_scope
            }

    def save_of(self, data: str) -> str:
        """Which save wrote data object ``data`` (a name ``tidy_candidates`` gave): the
        prefix ``data_name`` put before the file's name."""
        return data[:_SAVE_ID_CHARS]

    def describe(self, name: str) -> str | None:
        """As :meth:`Storage.describe`; data a save left without committing is nothing."""
        kind = super().describe(name)
        if kind == "directory" and all(_SAVE_DATA.match(n) for n in self.list(name)):
            return None
        return kind
