"""How a save becomes a checkpoint on a backend: the names of a root's layout, what committed
means, and the two commit strategies, chosen from a backend capability.

The byte layer (``tardigrade.storage``) moves bytes under names; this module gives the names
their meaning. A checkpoint is a name holding a manifest (``manifest.json``), written last.
Everything a save has in flight, and what cleanup may remove, starts with ``.tmp-``; the
one-writer lease lives in ``.lock``.

Call order for a save: ``begin(name, save_id)`` -> a staging location; each data file
``open_writer(staging/data_name(file, save_id))``, ``write``..., ``close`` (durable) ->
``commit(staging, name, manifest)``. After ``commit`` returns the checkpoint exists and
survives power loss; before, it does not. On failure ``abort(staging, name, save_id)``
removes what the save wrote; where that fails (or the outcome is unknown) ``abandon(staging)``
leaves it to cleanup. The strategies:

- :class:`RenameCommit` (a :class:`~tardigrade.storage.base.Directories` backend: POSIX): a
  locked staging directory renamed (or atomically swapped) into place;
- :class:`ManifestLastCommit` (object stores, which cannot rename): data objects under names
  unique to the save, then the manifest created only if none exists.

Each also says how a checkpoint leaves (``retire``: out of view first), whether one can be set
aside under another name, and what a dead writer left (``leftovers``; a store's is swept by
reachability in ``Catalog.collect`` from ``candidates``).
"""

from __future__ import annotations

import abc
import errno
import logging
import re
import threading
import uuid
from collections.abc import Callable, Iterator

from .errors import CheckpointExistsError, StorageError
from .format.manifest import MANIFEST, MANIFEST_START
from .storage import base as _base
from .storage.base import PROBE_PREFIX, Directories, Stat, Storage, Tidied

__all__ = [
    "LOCK",
    "MANIFEST",
    "TMP_PREFIX",
    "Candidate",
    "Commit",
    "ManifestLastCommit",
    "RenameCommit",
    "commit_for",
    "committed",
    "deleting_name",
    "due",
    "replaced_name",
    "size_of",
    "staging_name",
    "what_is_at",
]

log = logging.getLogger("tardigrade")

# Everything in flight or left behind starts with this; readers never read it.
TMP_PREFIX = ".tmp-"
# The object a root's one-writer lease lives in.
LOCK = ".lock"
# The probes of conditional writes of Tardigrade 0.3 and earlier on S3 (now PROBE_PREFIX).
_OLD_PROBE = f"{TMP_PREFIX}probe-"
# A store's data object: the save's id (16 hex digits), a dot, the file's name in the plan.
_SAVE_DATA = re.compile(r"^[0-9a-f]{16}\.")
_SAVE_ID_CHARS = 17  # what of a data object's name names its save: ``<16 hex digits>.``
# A committed checkpoint a replace without atomic swap moved aside (``replaced_name``). Any id
# is accepted: a checkpoint is put back, never deleted, whoever named it.
_REPLACED = re.compile(rf"^{re.escape(TMP_PREFIX)}(.+)-replaced-[^-]+$")


def staging_name(name: str, save_id: str) -> str:
    """Where a save of checkpoint ``name`` writes before it commits (a rename commit)."""
    return f"{TMP_PREFIX}{name}-{save_id}"


def replaced_name(name: str, tag: str) -> str:
    """Where a replace without atomic swap moves the old checkpoint ``name`` meanwhile."""
    return f"{TMP_PREFIX}{name}-replaced-{tag}"


def deleting_name(name: str) -> str:
    """Where a retire moves a checkpoint before deleting it (never half-deleted in view)."""
    return f"{TMP_PREFIX}deleting-{name}"


def committed(storage: Storage, name: str) -> bool:
    """Whether ``name`` is a committed checkpoint: a directory (not a link) holding a manifest
    file (the one definition: the catalog, listings, tiers and the commit itself ask here; a
    reader opens whatever is named like a manifest, to say what is wrong with it).

    The manifest is asked for first: on a store, where a name is a directory exactly when
    objects lie under it, that one request answers (listing a store's steps costs one request
    per step, not three), and a name without one costs one request anywhere.
    """
    st = storage.stat(f"{name}/{MANIFEST}")
    if st is None or st.is_dir or st.is_link:
        return False
    if storage.implicit_directories:
        return True
    here = storage.stat(name)  # not a link to a directory elsewhere
    return here is not None and here.is_dir and not here.is_link


def size_of(storage: Storage, name: str) -> int:
    """Bytes of every object under ``name``, recursively (one definition for ls and gc)."""
    total, todo = 0, [name]
    while todo:
        here = todo.pop()
        for child in storage.list(here):
            st = storage.stat(f"{here}/{child}")
            if st is None or st.is_link:
                continue
            if st.is_dir:
                todo.append(f"{here}/{child}")
            else:
                total += st.size
    return total


def what_is_at(storage: Storage, name: str) -> str | None:
    """What is at ``name``: None (nothing, or on a store only what a save left without
    committing), ``"checkpoint"`` (its commit record is a Tardigrade manifest),
    ``"directory"`` or ``"file"`` (anything else). A storage error raises: what cannot be
    read is not taken for something else."""
    if not storage.exists(name):
        return None
    st = storage.stat(f"{name}/{MANIFEST}")
    if st is not None and not st.is_dir and not st.is_link:
        with storage.open_reader(f"{name}/{MANIFEST}") as r:
            head = bytearray(min(r.size, len(MANIFEST_START)))
            r.readinto(0, memoryview(head))
        if bytes(head) == MANIFEST_START:
            return "checkpoint"
    inside = storage.list(name)
    if storage.implicit_directories and inside and all(_SAVE_DATA.match(n) for n in inside):
        return None
    return "directory" if inside or storage.is_dir(name) else "file"


def due(st: Stat, cutoff: float, abandoned: float | None) -> bool:
    """Whether cleanup may remove a save's data object: written before ``cutoff`` (past the
    grace period), or before ``abandoned`` (when this process abandoned its save, plus clock
    skew). One of unknown age counts as young unless abandoned."""
    if st.modified is not None and st.modified <= cutoff:
        return True
    return abandoned is not None and (st.modified is None or st.modified <= abandoned)


# What the catalog's sweep looks at under one name: (name, [(data object, its Stat or None)],
# whether a manifest was listed there).
Candidate = tuple[str, list[tuple[str, Stat | None]], bool]


class Commit(abc.ABC):
    """How saves become checkpoints on one backend, and how checkpoints leave."""

    # Whether a checkpoint can be renamed aside (``set_aside``): the timeline of abandoned
    # checkpoints renames them where it can and records them where it cannot.
    renames = False

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    @abc.abstractmethod
    def begin(self, name: str, save_id: str) -> str:
        """Prepare where the data files of a save of checkpoint ``name`` go; return it."""

    def data_name(self, file: str, save_id: str) -> str:
        """The name a save stores its data file ``file`` under (in the manifest too)."""
        return file

    def shared_target(self, staging: str, where: str, file: str) -> str:
        """Where a save writes the shared object that goes to ``where`` (``publish_shared``
        puts it there before the save commits); ``file``: a name for it unique among the
        writers of ``staging`` (the ranks of a collective save may write equal objects). On a
        store, at ``where`` at once (an object under its content's name holds those bytes
        whoever wrote it)."""
        return where

    def publish_shared(self, written: str, where: str) -> None:
        """Make the shared object written at ``written`` (``shared_target``) durable at
        ``where``; the same bytes there already (an earlier save's) are kept."""
        return None  # a store's writer made it durable there (``shared_target``)

    def unnamed_object(self, staging: str, file: str) -> str | None:
        """Where a save may write a shared object before it knows its name (hashing it as it
        writes; ``publish_shared`` then moves it), ``file`` as in ``shared_target``; None
        where nothing can be renamed (a store: an object is written under its name)."""
        return None

    def keep_unnamed(self, written: str, file: str) -> None:
        """Make the object written at ``written`` (``unnamed_object``) the save's own data
        file ``file`` (in its staging): another chunk of the save holds the same bytes."""
        raise NotImplementedError("only where unnamed_object gives a place")

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

    @abc.abstractmethod
    def abandon(self, staging: str) -> None:
        """Let go of ``staging`` without removing it: its save ended without committing and
        its ``abort`` failed, or its outcome is unknown. Whatever marks it as a live save's is
        dropped (a staging directory's lock), or it is recorded in this process (a store), so
        cleanup takes it for a dead writer's leftover. Never raises."""

    @abc.abstractmethod
    def retire(self, name: str) -> None:
        """Delete checkpoint ``name`` so that no crash leaves it half-deleted in view."""

    def set_aside(self, name: str, aside: str) -> None:
        """Move checkpoint ``name`` to the free name ``aside``; StorageError where the
        backend cannot rename (``renames`` is False)."""
        raise StorageError(
            errno.EOPNOTSUPP,
            f"{self.storage.url(name)}: cannot be set aside here (the storage cannot rename)",
        )

    def leftovers(
        self, *, dry_run: bool = False, progress: Callable[[Tidied], None] | None = None
    ) -> list[Tidied]:
        """Deal with what dead writers' saves left that needs no manifest read (a rename
        commit's staging); never a live save's, never a committed checkpoint."""
        return []

    # -- for the catalog's sweep by reachability (``Catalog.collect``): a store's saves
    # write where their checkpoint stays, so what one that never committed wrote is only
    # told from a live one's by age and by the committed manifests. Nothing on a POSIX root.

    def candidates(self) -> Iterator[Candidate]:
        """(name, [(data object, its Stat or None)], whether a manifest is there) for each
        name holding a save's data objects, and ("", [(probe, Stat)], False) for the root's
        probes."""
        return iter(())

    def abandoned_saves(self) -> dict[str, float]:
        """The names under which this process saw a save fail, each with the time before
        which what that save wrote may go at once."""
        return {}

    def save_of(self, data: str) -> str:
        """Which save wrote data object ``data`` (a name ``candidates`` gave)."""
        return data


def commit_for(storage: Storage) -> Commit:
    """The commit strategy of ``storage``, chosen from what it can do (rename or not)."""
    made: Commit = (
        RenameCommit(storage)
        if isinstance(storage, Directories) and storage.can_move
        else ManifestLastCommit(storage)
    )
    return storage.wrap_commit(made)


class RenameCommit(Commit):
    """The commit of a POSIX directory: a save writes into a staging directory (``.tmp-*``)
    that it holds locked, fsyncs it, writes the manifest, and renames it into place (or, to
    replace, atomically swaps it with the old checkpoint).

    A save needs no lease (``tg.save`` takes none), so cleanup (``tardigrade gc``, a manager's
    tidy-up) tells a live save's staging from a dead one's by that lock: the kernel drops it
    when the saving process dies, whatever killed it.
    """

    renames = True
    storage: Directories

    def __init__(self, storage: Directories) -> None:
        super().__init__(storage)

    def begin(self, name: str, save_id: str) -> str:
        for attempt in range(8):
            staging = staging_name(name, save_id if attempt == 0 else uuid.uuid4().hex)
            if not self.storage.make_dir(staging):
                continue
            if self.storage.hold(staging, wait=True):
                return staging
            # A cleanup judged the fresh, not yet locked directory dead and removed it.
        raise StorageError(errno.EAGAIN, f"cannot create a staging directory for {name}")

    def commit(
        self, staging: str, name: str, manifest: bytes, *, save_id: str, replace: bool
    ) -> None:
        storage = self.storage
        try:
            w = storage.open_writer(f"{staging}/{MANIFEST}")
            try:
                w.write(manifest)
            except BaseException:
                w.abort()
                raise
            w.close()
            storage.sync(staging)
            if replace and storage.exists(name):
                self._replace(staging, name)
            else:
                try:
                    storage.move(staging, name)
                except StorageError as e:
                    if e.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR, errno.ENOTDIR):
                        raise
                    raise CheckpointExistsError(
                        f"{storage.url(name)}: something appeared here during the save; it was "
                        "left in place and nothing was committed."
                    ) from None
        finally:
            storage.release(staging)

    def _replace(self, staging: str, name: str) -> None:
        """Replace checkpoint ``name`` by ``staging`` so that at every instant the name holds
        a complete checkpoint (old, then new): one atomic swap where the filesystem has it."""
        storage = self.storage
        if storage.exchange(staging, name):
            if not committed(storage, staging):
                # Something else took the name since the caller checked: put it back.
                storage.exchange(staging, name)
                raise CheckpointExistsError(
                    f"{storage.url(name)}: something that is not a checkpoint appeared here "
                    "during the save; it was left in place and nothing was committed."
                )
            storage.sync()
            storage.delete(staging)
            return
        # No swap: move the old checkpoint aside, then rename. A crash in between leaves it as
        # ``.tmp-NAME-replaced-ID``, which ``leftovers`` puts back; it is locked while aside,
        # so a concurrent cleanup does not "recover" it mid-replace.
        if not committed(storage, name):
            raise CheckpointExistsError(
                f"{storage.url(name)}: something that is not a checkpoint appeared here during "
                "the save; it was left in place and nothing was committed."
            )
        held = storage.hold(name, wait=True)
        old = replaced_name(name, uuid.uuid4().hex)
        try:
            storage.move(name, old)
            storage.move(staging, name)
            storage.delete(old)
        finally:
            if held:
                storage.release(name)

    def abort(self, staging: str, name: str, save_id: str) -> None:
        self.storage.delete(staging)

    def abandon(self, staging: str) -> None:
        self.storage.release(staging)

    def shared_target(self, staging: str, where: str, file: str) -> str:
        """In the save's staging directory (its lock covers it), moved into ``.shared/``
        once written and fsynced."""
        return f"{staging}/{file}.object"

    def unnamed_object(self, staging: str, file: str) -> str | None:
        return f"{staging}/{file}.object"

    def keep_unnamed(self, written: str, file: str) -> None:
        self.storage.move(written, file)

    def publish_shared(self, written: str, where: str) -> None:
        storage = self.storage
        parent = where.rpartition("/")[0]
        if storage.make_dir(parent):  # new (with .shared/, maybe): their entries made durable
            above = parent
            while above:
                above = above.rpartition("/")[0]
                storage.sync(above)
        try:
            storage.move(written, where)  # fsyncs the directory it lands in
        except StorageError as e:
            if e.errno != errno.EEXIST:
                raise
            # An earlier save's object, the same bytes: swapped in where the filesystem can
            # (a fresh copy then, whose age restarts the grace period), else kept.
            if storage.exchange(written, where):
                storage.sync(parent)
            storage.delete(written)

    def retire(self, name: str) -> None:
        """Out of view first (renamed to ``.tmp-deleting-*``), then deleted."""
        doomed = deleting_name(name)
        self.storage.move(name, doomed)
        self.storage.delete(doomed)

    def set_aside(self, name: str, aside: str) -> None:
        self.storage.move(name, aside)

    def leftovers(
        self, *, dry_run: bool = False, progress: Callable[[Tidied], None] | None = None
    ) -> list[Tidied]:
        """Only ``.tmp-*`` directories (and a preflight's probe) are considered, and only
        those no live process holds: every save holds a lock on its staging directory (and on
        a checkpoint it moves aside) until it commits or gives up, so a save in flight, by
        this process or any other, is skipped. A dead save's staging directory (or an
        interrupted retire) is removed. A committed checkpoint that a crashed replace had moved
        aside (``.tmp-NAME-replaced-*``) is put back under its name when that name is free,
        whatever the name; if a committed checkpoint holds the name, the replace had finished
        and the old copy is removed. Committed checkpoints are never touched."""
        storage, done = self.storage, []
        for n in storage.list():
            if not n.startswith((TMP_PREFIX, PROBE_PREFIX)):
                continue
            st = storage.stat(n)
            if st is None or st.is_link or not st.is_dir or not storage.hold(n, wait=False):
                continue  # not a directory, a live save holds it, or it is already gone
            try:
                now = self._leftover(n, dry_run)
            finally:
                storage.release(n)
            done.extend(now)
            if progress is not None:
                for t in now:
                    progress(t)
        return done

    def _leftover(self, n: str, dry_run: bool) -> list[Tidied]:
        storage = self.storage
        m = _REPLACED.match(n)
        if m and committed(storage, n):
            name = m.group(1)
            if not storage.exists(name):
                if not dry_run:
                    storage.move(n, name)
                    log.warning("tardigrade: recovered %s from an interrupted replace", name)
                return [Tidied(name, "recovered", size_of(storage, n if dry_run else name))]
            if not committed(storage, name):
                log.warning(
                    "tardigrade: %s holds the checkpoint an interrupted replace moved aside, "
                    "but %s is taken by something that is not a checkpoint; leaving both",
                    storage.url(n),
                    storage.url(name),
                )
                return []
        nbytes = size_of(storage, n)
        if not dry_run:
            log.info("tardigrade: removing leftover %s from an interrupted save", n)
            storage.delete(n)
        return [Tidied(n, "removed", nbytes)]


# Saves this process saw end without committing and without cleaning up (``abandon``) on a
# store: (the root's tidy scope, staging) -> when.
_abandoned: dict[tuple[str, str], float] = {}
_abandoned_lock = threading.Lock()


class ManifestLastCommit(Commit):
    """The commit of object stores, which cannot rename (and copy is not atomic).

    Data objects are written straight under the checkpoint's prefix, under names unique to the
    save (``<save id>.data-...``), so a retry, a zombie writer or ``overwrite=True`` never
    overwrites bytes a committed manifest points at. The manifest is written last, with one
    conditional create: of two writers, exactly one commits. A prefix without a manifest holds
    no checkpoint; ``abort`` deletes the save's own objects. Replacing puts the new manifest
    only if the old one is still the version read (if-match), then deletes the old data.
    What saves that never committed left is swept by the catalog, which reads manifests
    (``Catalog.collect``: by reachability), once older than a grace period
    (``gc_grace_seconds``), or at once where this process saw the save fail (``abandon``);
    this class lists it (``candidates``) and says which save wrote an object (``save_of``).
    """

    def begin(self, name: str, save_id: str) -> str:
        return name  # nothing to prepare: the data go where they stay

    def data_name(self, file: str, save_id: str) -> str:
        return f"{save_id[:16]}.{file}"

    def commit(
        self, staging: str, name: str, manifest: bytes, *, save_id: str, replace: bool
    ) -> None:
        storage, key = self.storage, f"{name}/{MANIFEST}"
        old = storage.stat(key) if replace else None
        try:
            if old is None:
                storage.put(key, manifest, mode="create")
            else:
                storage.put(key, manifest, mode="if_match", expect=old.version)
        except _base.PreconditionFailed:
            raise CheckpointExistsError(
                f"{storage.url(name)}: another writer committed a checkpoint here while this "
                "save was running; nothing was overwritten and this save did not commit."
            ) from None
        if old is not None:
            mine = self.data_name("", save_id)
            storage.delete_many(
                [
                    f"{name}/{n}"
                    for n in storage.list(name)
                    if _SAVE_DATA.match(n) and not n.startswith(mine)
                ]
            )

    def abort(self, staging: str, name: str, save_id: str) -> None:
        mine = self.data_name("", save_id)
        self.storage.delete_many(
            [f"{name}/{n}" for n in self.storage.list(name) if n.startswith(mine)]
        )

    def abandon(self, staging: str) -> None:
        """Cleanup in this process removes what the save wrote so far without waiting for the
        grace period."""
        with _abandoned_lock:
            _abandoned[(self.storage.tidy_scope, staging)] = _base.now()

    def retire(self, name: str) -> None:
        """Out of view first (its manifest deleted), then its data."""
        try:
            self.storage.delete(f"{name}/{MANIFEST}")
            self.storage.delete(name)
        except BaseException:
            # No live save's data: the next cleanup in this process removes what is left,
            # without the grace period, once the manifest is gone (never before).
            self.abandon(name)
            raise

    def candidates(self) -> Iterator[Candidate]:
        """What the sweep looks at: (name, [(object, its Stat or None)], whether a manifest is
        there) for each name that holds a save's data objects (named ``<save id>.<file>``),
        and ("", [(probe, Stat)], False) for the probes at the root. A Stat of None is read
        only if needed. From one recursive listing where the backend has one (which also
        gives each object's size and age, and sees checkpoints at any depth), else by listing
        the root and each name in it."""
        walked = self.storage.walk()
        if walked is None:
            yield from self._listed()
            return
        found: dict[str, list[tuple[str, Stat | None]]] = {}
        manifests: set[str] = set()
        for path, st in walked:
            ckpt, _, base = path.rpartition("/")
            if ckpt:
                if base == MANIFEST:
                    manifests.add(ckpt)
                if not _SAVE_DATA.match(base):
                    continue
            elif not base.startswith((PROBE_PREFIX, _OLD_PROBE)):
                continue
            found.setdefault(ckpt, []).append((base, st))
        for ckpt, objects in found.items():
            yield ckpt, objects, ckpt in manifests

    def _listed(self) -> Iterator[Candidate]:
        probes: list[tuple[str, Stat | None]] = []
        for name in self.storage.list():
            if name.startswith((PROBE_PREFIX, _OLD_PROBE)):
                probes.append((name, None))
                continue
            if name.startswith("."):
                continue
            names = self.storage.list(name)
            data: list[tuple[str, Stat | None]] = [(n, None) for n in names if _SAVE_DATA.match(n)]
            if data:
                yield name, data, MANIFEST in names
        if probes:
            yield "", probes, False

    def abandoned_saves(self) -> dict[str, float]:
        """The names under which this process saw a save fail (``abandon``), each with the
        time (plus clock skew) before which what that save wrote may go at once."""
        scope = self.storage.tidy_scope
        with _abandoned_lock:
            return {
                staging: when + _base.CLOCK_SKEW_SECONDS
                for (where, staging), when in _abandoned.items()
                if where == scope
            }

    def save_of(self, data: str) -> str:
        """The prefix ``data_name`` put before the file's name."""
        return data[:_SAVE_ID_CHARS]
