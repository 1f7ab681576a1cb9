"""The RAM tier: the newest checkpoint kept in host shared memory for a restart on this node.

``CheckpointManager(dir, state, ram_tier=True)`` keeps a copy of its newest committed
checkpoint in a directory on a memory filesystem (``/dev/shm`` by default, or the directory
``ram_tier`` names). It is a tier like any other: a checkpoint committed there by the local
directory protocol (staging directory, manifest, rename), the same manifest and the same
checksums as the checkpoint on disk. A process that is killed keeps it (tmpfs outlives the
process, not the node); its restart on the same node restores from it at memory speed instead
of reading the disk. ``close()`` removes it: a job that ended normally leaves nothing in memory.

Where the bytes come from: an async save has already copied the state into its staging slabs;
``RamMirror`` tees those slabs to a writer into the RAM tier, which runs beside the disk writers
in the save's background thread. The training thread copies nothing more, and the slabs go back
to the pool once both writers are done with them. The RAM copy is committed only after the disk
checkpoint is (with the manifest the disk save committed), so the RAM tier never holds a step
the directory does not. A synchronous save has no staging copy; its RAM copy is read back from
the committed checkpoint (``copy_in``).

In a distributed job each rank keeps its own share: the data files it wrote (and the
manifest), in a namespace of its own (the rank is part of its name). An async collective save
staged every local tensor before the ranks agreed who writes what; once they have, the RAM
writer takes this rank's files from the same staged copy as its disk writers
(``RamMirror.feed``), and commits after the collective commit. A synchronous save's share is
copied from the committed checkpoint in the directory by a background thread
(``copy_in_background``). A restart restores from the RAM tier only when every rank holds the
same save there (the manager agrees on it); each rank then reads its own files from memory and
the others' from the directory (``overlay``).

Namespaced per checkpoint directory and user: ``<base>/tardigrade-<uid>-<hash of the directory's
absolute path or URL>``, so two jobs on one node never share one, and a restart of the same job
(same directory) finds its own. Bounded: the newest checkpoint only (the previous one is removed
once a new one commits there; when the memory filesystem cannot hold both, the previous one is
removed first). A failure (a full ``/dev/shm``) is logged with what to do, counted in
``RamTierStats``, and never fails the save or training: the disk checkpoint is there anyway.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import queue
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from ._catalog import STEP_NAMES, Catalog
from ._commit import committed
from ._load import load, load_from
from ._open import save_id_at
from ._plan import is_candidate
from ._save_job import SaveJob, SaveResult, file_header
from ._shared import Held, SharedIndex
from ._sinks import Sink
from ._tiers import CopyPlan, copy_file
from ._write import ABORT, END, Segment, write_file
from .errors import (
    CorruptCheckpointError,
    InvalidArgumentError,
    SaveError,
    StorageError,
    TardigradeError,
)
from .format import limits
from .format.manifest import MANIFEST, Manifest, is_shared, parse
from .storage import LocalStorage, PreconditionFailed, Storage
from .storage.local import free_bytes, private_directory

log = logging.getLogger("tardigrade")

DEFAULT_BASE = "/dev/shm"
# Room left free on the memory filesystem beyond the checkpoint itself: other users of
# /dev/shm (NCCL, DataLoader workers) must not find it full because of us.
HEADROOM_BYTES = 64 * 1024 * 1024
_SOURCE = ".source"  # the checkpoint directory this namespace belongs to (for people, and checked)


@dataclass
class RamTierStats:
    """What the RAM tier did: its ``root``, the checkpoints ``stored`` there in order, copies
    that ``failed`` (``last_error``), how many restores read from it (``restored``), and with
    ``peer_replicas`` the replicas it keeps for other ranks and the bytes it sent to its own."""

    root: str
    stored: list[str] = field(default_factory=list)
    failed: int = 0
    last_error: str | None = None
    restored: int = 0
    replicas: list[str] = field(default_factory=list)
    """The replicas of other ranks' shares this rank keeps for them (``peer_replicas=``)."""
    sent_bytes: int = 0
    """Bytes of this rank's shares sent to the peers that keep its replicas."""


def namespace(directory: str, run: str | None = None) -> str:
    """The RAM tier's directory name for checkpoint directory ``directory`` (a root URL, or
    one rank's share of it) in run ``run`` (None: the directory alone names the run). Every
    run of one directory shares the name's stem: what another run left is found by it."""
    digest = hashlib.sha256(directory.encode()).hexdigest()[:16]
    stem = f"tardigrade-{os.geteuid()}-{digest}"
    if run is None:
        return stem
    return f"{stem}-run-{hashlib.sha256(run.encode()).hexdigest()[:12]}"


# In the manifest's metadata of a save written into the RAM tier alone (``persist_every``, a
# preemption's first save): only such a copy restores without the directory holding the step.
SAVED_ALONE = "tardigrade.saved_to_memory_alone"


def saved_alone(m: Manifest) -> bool:
    """Whether checkpoint manifest ``m`` is of a save into the RAM tier alone."""
    metadata = m.raw.get("metadata")
    return isinstance(metadata, dict) and metadata.get(SAVED_ALONE) is True


def family_of(directory: str, rank: int | None = None, replica_of: int | None = None) -> str:
    """What a RAM tier's namespace holds, without the run: the checkpoints of ``directory``
    (a single process's), rank ``rank``'s share of them, or the replica of rank
    ``replica_of``'s share that a peer keeps (``_peers``)."""
    if replica_of is not None:
        return f"{directory} (replica of rank {replica_of})"
    return directory if rank is None else f"{directory} (rank {rank})"


def source_of(family: str, run: str | None) -> str:
    """What a namespace's ``.source`` says it holds: the family, in run ``run``."""
    return family if run is None else f"{family} (run {run})"


def _image_bytes(job: SaveJob) -> int:
    return sum(len(file_header(fp)) + fp.nbytes for fp in job.plan.files)


class RamTier:
    """The RAM tier of the checkpoint directory ``directory``, under ``base``; ``rank``: the
    rank of a distributed job whose share this is (None in a single process); ``run``: the
    run id of the job (``run_id=``; None: the directory alone names the run); ``replica_of``:
    the rank whose share a peer keeps here instead (the peer tier's, ``_peers``).

    The caller holds ``directory``'s lock: one job per directory, so one writer here too, and
    what another run of the directory left on this node is a dead job's: it is removed (never
    restored from).
    Raises StorageError when ``base`` cannot hold it (missing, not writable, not ours).
    """

    def __init__(
        self,
        directory: str,
        base: str | os.PathLike[str] | None = None,
        rank: int | None = None,
        run: str | None = None,
        replica_of: int | None = None,
    ) -> None:
        base = os.path.abspath(os.fspath(DEFAULT_BASE if base is None else base))
        self.base = base
        # What the namespace belongs to: the directory, or one rank's share of it, in a run.
        family = family_of(directory, rank, replica_of)
        self.directory = source_of(family, run)
        self.job_directory = directory
        self.rank = rank
        self.root = os.path.join(base, namespace(family, run))
        self._make_root(base)
        self._remove_other_runs(base, family)
        self.storage = LocalStorage(self.root)
        self.catalog = Catalog(self.storage)
        self.stats = RamTierStats(self.root)
        self._lock = threading.Lock()  # stats and retention: the save thread and the caller's
        self._retiring = threading.Lock()  # one thread at a time removes older copies
        self._copying: threading.Thread | None = None  # copy_in_background's
        # A killed writer's staging directory: ours to remove (the directory's lock is ours).
        self.catalog.tidy()

    def _make_root(self, base: str) -> None:
        what = f"ram_tier={base!r}"
        try:
            # In an existing directory only: a mistyped path is not silently made on disk.
            try:
                private_directory(self.root)
            except StorageError as e:
                if e.errno != errno.EPERM:
                    raise
                self.root = self._alternative(base, e)
            storage = LocalStorage(self.root)
            try:
                storage.put(_SOURCE, self.directory.encode(), mode="create")
            except PreconditionFailed:
                there = storage.read_bytes(_SOURCE, 64 * 1024).decode(errors="replace")
                if there != self.directory:
                    raise StorageError(
                        errno.EEXIST,
                        f"{self.root} belongs to checkpoint directory {there!r}, not "
                        f"{self.directory!r}",
                    ) from None
        except StorageError as e:
            raise StorageError(
                e.errno,
                f"{what}: cannot keep checkpoints there: {e.strerror or e}. Pass ram_tier= a "
                "writable directory on a memory filesystem (tmpfs) that you own, or "
                "ram_tier=False",
            ) from e

    def _alternative(self, base: str, squatted: StorageError) -> str:
        """A private root in place of the predictable one, which another user holds (a link,
        a file, a directory not ours: anyone can plant one at that name in /dev/shm).

        Named ``<namespace>.<random>``, so that nobody can plant it beforehand; a restart finds
        it again as the one such directory that is ours, private, and names this checkpoint
        directory in its ``.source``.
        """
        stem = os.path.basename(self.root) + "."
        found = None
        with contextlib.suppress(OSError):
            for entry in LocalStorage(base).list():
                path = os.path.join(base, entry)
                if entry.startswith(stem) and self._ours(path):
                    found = path
                    break
        if found is None:
            found = os.path.join(base, stem + uuid.uuid4().hex[:16])
            private_directory(found)
        log.warning(
            "tardigrade: the RAM tier's usual directory is taken by someone else (%s); using "
            "the private directory %s instead",
            squatted.strerror or squatted,
            found,
        )
        return found

    def _ours(self, path: str) -> bool:
        """Whether ``path`` is a private directory of this user holding this tier's copies."""
        return self._source(path) == self.directory

    @staticmethod
    def _source(path: str) -> str | None:
        """What ``path`` says it holds (its ``.source``), if it is a private directory of this
        user; else None."""
        try:
            private_directory(path)
            there = LocalStorage(path).read_bytes(_SOURCE, 64 * 1024)
        except (StorageError, CorruptCheckpointError, OSError):
            return None
        return there.decode(errors="replace")

    def _remove_other_runs(self, base: str, family: str) -> None:
        """Remove what other runs of this directory (other run ids, or none) left on this node:
        their copies are never restored (a copy counts only in the run that made it), and they
        hold memory. The directory's lock is ours: none of them is live."""
        stem, mine = namespace(family), os.path.basename(self.root)
        listed = LocalStorage(base)
        try:
            entries = [e for e in listed.list() if e.startswith(stem) and e != mine]
        except OSError:
            return
        for entry in entries:
            source = self._source(os.path.join(base, entry))
            if source is None or (source != family and not source.startswith(f"{family} (run ")):
                continue
            try:
                listed.delete(entry)
            except OSError as e:
                log.warning("tardigrade: could not remove %s: %s", os.path.join(base, entry), e)
                continue
            log.info(
                "tardigrade: removed the RAM tier %s of another run of %s (%s)",
                os.path.join(base, entry),
                family,
                source,
            )

    # -- writing ---------------------------------------------------------------------------

    def retirer(self) -> Sink:
        """What a save into this tier alone (``persist_every``) runs once committed here: the
        older copies go in its own background thread, not the training thread's."""
        return _Retire(self)

    def mirror(self, files: Callable[[str], bool] | None = None) -> RamMirror:
        """A copy of the next async save into this tier, written from its staged copy (in a
        distributed job, this rank's files of it: those ``files`` accepts)."""
        return RamMirror(self, files)

    def saved(
        self, src: Storage, name: str, *, files: Callable[[str], bool] | None, teed: bool
    ) -> None:
        """Checkpoint ``name`` was just committed in ``src``: keep it here. When ``teed`` (an
        async save) its mirror already did, from the staged copy. A synchronous save is copied
        now in a single process (a preemption's is not copied either: the job stops next), and
        a rank's share (``files``) in the background, on every rank."""
        if teed:
            self._recorded(name)
            return
        if self.rank is not None:
            self.copy_in_background(src, name, files=files)
        else:
            self.copy_in(src, name)

    def copy_in(self, src: Storage, name: str, files: Callable[[str], bool] | None = None) -> None:
        """Copy checkpoint ``name``, just committed in ``src``, here (a synchronous save's);
        ``files``: only the data files it accepts (a rank's share), with the whole manifest."""
        try:
            copy = CopyPlan.of(src, name, self.storage, replace=True)
            if copy is not None:
                need = sum(n for f, n in copy.sizes.items() if files is None or files(f))
                self._make_room(need, keep=None)
                staging = self.catalog.commit.begin(name, copy.save_id)
                try:
                    copy.copy_files(staging, files)
                    copy.commit(staging)
                except BaseException:
                    if copy.end(staging) is not True:  # True: committed all the same
                        raise
        except Exception as e:
            self._failed(name, e)
            return
        self._stored(name)

    def copy_in_background(
        self, src: Storage, name: str, files: Callable[[str], bool] | None = None
    ) -> None:
        """``copy_in`` in a thread of its own, after the previous one finished."""
        self.wait()
        self._copying = threading.Thread(
            target=self.copy_in, args=(src, name, files), name="tardigrade-ram-tier", daemon=True
        )
        self._copying.start()

    def wait(self) -> None:
        """Wait for ``copy_in_background``'s copy, if one runs."""
        copying = self._copying  # kept: the peer tier's thread waits for it too
        if copying is not None:
            copying.join()

    def _free_bytes(self) -> int:
        return free_bytes(self.root)

    def _make_room(self, need: int, keep: str | None) -> None:
        """Raise StorageError (ENOSPC) unless ``need`` more bytes fit with headroom left;
        removes the older checkpoints here first when that makes them fit."""
        free = self._free_bytes()
        if free >= need + HEADROOM_BYTES:
            return
        older = [n for n in self.catalog.names() if STEP_NAMES.step(n) is not None and n != keep]
        held = sum(self.catalog.size(n) for n in older)
        if free + held >= need + HEADROOM_BYTES:
            for n in older:
                log.info("tardigrade: removing %s from the RAM tier to make room", n)
                self.catalog.retire(n)
            return
        raise StorageError(
            errno.ENOSPC,
            f"{self.root}: the RAM tier needs {need / 1e6:.1f} MB (+{HEADROOM_BYTES >> 20} MiB "
            f"left free), but its memory filesystem has {free / 1e6:.1f} MB free. The "
            "checkpoint on disk is not affected. Free space there (`df -h "
            f"{os.path.dirname(self.root)}`), enlarge it (`mount -o remount,size=... "
            f"{os.path.dirname(self.root)}`), or pass ram_tier= a larger tmpfs, or "
            "ram_tier=False",
        )

    def _commit(self, staging: str, name: str, manifest: bytes, save_id: str) -> None:
        self.catalog.commit.commit(
            staging, name, manifest, save_id=save_id, replace=self.catalog.committed(name)
        )
        self._stored(name)

    def _stored(self, name: str) -> None:
        """``name`` is committed here: the older checkpoints go (newest only). Only older
        ones: an async save's outcome is recorded after the next saves may have committed
        here already (saved into this tier alone, ``persist_every``)."""
        with self._lock:
            self.stats.stored.append(name)
        step = STEP_NAMES.step(name)
        with self._retiring:  # two saves' threads may both get here (two in flight)
            self._retire_before(name, step)
        self.sweep()

    def _retire_before(self, name: str, step: int | None) -> None:
        """Keep the newest copy only: the older ones go, and ``name`` itself when a newer one
        committed here first (two saves in flight: a directory's save, copied here once it
        committed there, ends after the next save into this tier alone)."""
        held = {n: s for n in self.catalog.names() if (s := STEP_NAMES.step(n)) is not None}
        if step is None:
            doomed = [n for n in held if n != name]
        else:
            newest = max(step, *held.values())
            doomed = [n for n, s in held.items() if s < newest]
        for n in doomed:
            try:
                self.catalog.retire(n)
            except OSError as e:
                log.warning("tardigrade: removing %s from the RAM tier: %s", n, e)

    def sweep(self) -> None:
        """Remove the shared objects no checkpoint here references (the newest only is kept:
        those of the ones it replaced go), never one a copy in flight pinned."""
        try:
            self.catalog.sweep_shared(grace=False)
        except (OSError, TardigradeError) as e:
            log.warning("tardigrade: removing unreferenced shared data from the RAM tier: %s", e)

    def shared_index(self) -> SharedIndex:
        """The shared objects the checkpoints here reference and this tier holds (a save need
        not write them), read when a save first asks. In a distributed job a rank's copy
        holds the objects of its own chunks alone, of all those its manifest references."""

        def load() -> dict[str, Held]:
            manifests = []
            for n in self.catalog.names():
                if STEP_NAMES.step(n) is not None and self.catalog.committed(n):
                    with contextlib.suppress(OSError, TardigradeError):  # unreadable: rewritten
                        manifests.append(self.catalog.manifest(n))
            held = SharedIndex.held_by(manifests)
            try:
                here = set(self.catalog.shared_objects()) if held else set()
            except OSError:
                return {}
            return {k: v for k, v in held.items() if k in here}

        return SharedIndex(load=load)

    def forget_after(self, step: int) -> None:
        """Remove the checkpoints here of steps after ``step`` (a timeline abandoned)."""
        self.wait()
        for n in self.catalog.names():
            s = STEP_NAMES.step(n)
            if s is not None and s > step:
                try:
                    self.catalog.retire(n)
                except OSError as e:
                    log.warning("tardigrade: removing %s from the RAM tier: %s", n, e)

    def _recorded(self, name: str) -> None:
        """A save committed straight into this tier (``persist_every``), or a copy its mirror
        committed already: counted and retained once."""
        with self._lock:
            known = name in self.stats.stored
        if not known and self.catalog.committed(name):
            self._stored(name)

    def _failed(self, name: str, e: BaseException) -> None:
        error = str(e)
        if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) and "ram_tier=" not in error:
            # Out of space while writing (the check before it passed: another user of the
            # memory filesystem took the room meanwhile).
            base = os.path.dirname(self.root)
            error += (
                f". The RAM tier's memory filesystem ({base}) is full: free space there, "
                "enlarge it, or pass ram_tier= a larger tmpfs, or ram_tier=False"
            )
        with self._lock:
            self.stats.failed += 1
            self.stats.last_error = error
            failed = self.stats.failed
        log.error(
            "tardigrade: RAM TIER COPY FAILED for %s in %s (%d failed so far); the other tiers' "
            "copies are not affected and training continues. Cause: %s",
            name,
            self.root,
            failed,
            error,
        )

    # -- reading ---------------------------------------------------------------------------

    def copy_of(self, name: str, disk: Storage) -> str | None:
        """The path of this tier's copy of ``disk``'s committed checkpoint ``name``, or None.

        A copy counts only when it is the same save (the same ``save_id``) as the checkpoint in
        the directory: the RAM tier never restores a step the directory does not hold (say,
        after someone emptied the directory to start afresh).
        """
        self.wait()  # a copy still being made counts once it is committed
        try:
            if not self.catalog.committed(name):
                return None
            ours = save_id_at(self.storage, name)
            # A step the directory does not hold was saved here alone (persist_every): the
            # manager asks only of those it takes as candidates.
            theirs = save_id_at(disk, name) if committed(disk, name) else ours
            if ours is None or ours != theirs:
                return None
        except Exception as e:  # unreadable on either side: the directory's copy is restored
            log.warning("tardigrade: not restoring %s from the RAM tier: %s", name, e)
            return None
        return self.storage.url(name)

    def restore(self, name: str, disk: Storage, state: Any, collective: dict[str, Any]) -> str:
        """Restore ``name`` from this tier into ``state``, every byte verified: this process's
        whole copy, or each rank's share over the directory's other files (``collective``:
        ``tg.load``'s arguments that make it collective). Returns where it was read."""
        if self.rank is None:
            load(self.storage.url(name), into=state, verify="all")
        else:
            load_from(
                lambda: self.overlay(name, disk), name, into=state, verify="all", **collective
            )
        self.restored()
        return self.storage.url(name)

    def overlay(self, name: str, disk: Storage) -> Storage:
        """A read-only view of checkpoint ``name``: each file from this tier where it holds
        it (this rank's share), else from ``disk`` under the name it has there."""
        ours, there = (
            list(
                parse(
                    storage.read_bytes(f"{name}/{MANIFEST}", limits.MAX_MANIFEST_BYTES),
                    storage.url(f"{name}/{MANIFEST}"),
                ).files
            )
            for storage in (self.storage, disk)
        )
        # The same files in the same order in both manifests: only their names may differ (a
        # store's are prefixed by the save's id).
        renames = {f"{name}/{a}": f"{name}/{b}" for a, b in zip(ours, there, strict=True)}
        return _Overlay(self.storage, disk, renames)

    def restored(self) -> None:
        with self._lock:
            self.stats.restored += 1

    def count_sent(self, nbytes: int) -> None:
        with self._lock:
            self.stats.sent_bytes += nbytes

    def count_replica(self, what: str) -> None:
        with self._lock:
            self.stats.replicas.append(what)

    def close(self, *, clean: bool) -> None:
        """``clean``: remove everything here (the job ended normally)."""
        self.wait()
        if clean:
            try:
                self.storage.delete("")
            except OSError as e:
                log.warning("tardigrade: could not remove the RAM tier %s: %s", self.root, e)
                return
            log.info("tardigrade: removed the RAM tier %s", self.root)


class _Overlay(Storage):
    """Reads from ``top`` where it holds a name, else from ``base`` (``renames``: the names
    that differ there). Read-only: a view to restore from, never saved into."""

    def __init__(self, top: Storage, base: Storage, renames: dict[str, str]) -> None:
        self.top, self.base, self.renames = top, base, renames
        self.root = top.root

    def _where(self, name: str) -> tuple[Storage, str]:
        if self.top.exists(name):
            return self.top, name
        return self.base, self.renames.get(name, name)

    def open_reader(self, name: str) -> Any:
        storage, there = self._where(name)
        return storage.open_reader(there)

    def stat(self, name: str) -> Any:
        storage, there = self._where(name)
        return storage.stat(there)

    def list(self, name: str = "") -> list[str]:
        return self.top.list(name)

    def url(self, name: str) -> str:
        storage, there = self._where(name)
        return storage.url(there)

    def _read_only(self, *args: Any, **kwargs: Any) -> Any:
        raise StorageError(errno.EROFS, f"{self.root}: a read-only view of the RAM tier")

    open_writer = put = delete = begin = commit = abort = lease = _read_only


def _shared(done: Callable[[], None] | None) -> Callable[[], None] | None:
    """``done`` called once both the disk writer and the RAM writer called theirs."""
    if done is None:
        return None
    left = [2]
    lock = threading.Lock()

    def one() -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            done()

    return one


class _Tee:
    """What the stager puts a file's blocks into: the disk writer's queue and the RAM
    writer's, the same slab memory in both (no copy); the slab is freed when both are done."""

    def __init__(self, disk: queue.SimpleQueue[Any], ram: queue.SimpleQueue[Any]) -> None:
        self.disk, self.ram = disk, ram

    def put(self, block: Any) -> None:
        if block is END or block is ABORT:
            self.disk.put(block)
            self.ram.put(block)
            return
        block = replace(block, done=_shared(block.done))
        self.ram.put(block)
        self.disk.put(block)


class _Retire:
    """A :class:`~tardigrade._sinks.Sink` of a save committed straight into the RAM tier
    (``persist_every``): it copies nothing; once the save committed, it records the copy and
    removes the older ones, in the save's background thread. Unlinking a memory filesystem's
    pages takes time (about 50 ms a 0.38 GB copy), which recording the save on the training
    thread would cost each step that saves. Whatever fails here is logged, never raised."""

    def __init__(self, tier: RamTier) -> None:
        self.tier = tier
        self._name: str | None = None

    def tee(self, streams: list[Any]) -> list[Any]:
        return streams

    def around(self, job: SaveJob, save: Callable[[], SaveResult]) -> SaveResult:
        self._name = job.name
        return self.after(save)

    def feed(self, make: Callable[[SaveJob], list[list[Any]]]) -> Callable[[SaveJob], Any]:
        def streams(job: SaveJob) -> list[list[Any]]:
            self._name = job.name
            return make(job)

        return streams

    def after(self, save: Callable[[], SaveResult]) -> SaveResult:
        result = save()
        if self._name is not None:
            try:
                self.tier._recorded(self._name)
            except Exception as e:
                log.warning("tardigrade: removing older copies from the RAM tier: %s", e)
        return result


class RamMirror:
    """One async save's copy into the RAM tier, written from the save's staged copy.

    In a single process, ``tee(streams)`` (in the caller, before staging) gives the stager
    queues that feed both writers, and ``around(job, save)`` (in the save's background thread)
    writes the RAM copy beside ``save()``, the disk write and commit. In a distributed job,
    ``feed(make)`` wraps the collective save's stream maker: once the ranks agreed on the plan,
    this rank's file streams (segments of the staged copy) go to its disk writers and to the
    RAM writer alike, and ``after(run)`` runs the collective save. Either way the RAM copy is
    committed once the disk checkpoint is. Whatever fails here is logged and counted, never
    raised: the disk save's outcome is the save's outcome.
    """

    def __init__(self, tier: RamTier, files: Callable[[str], bool] | None = None) -> None:
        self.tier = tier
        self.files = files  # a rank's share of the save's data files (None: all)
        self.sources: list[Callable[[], Any]] = []  # per file: its next block or segment
        self._reading = 0  # the source the writer reads now: the ones from here are not drained
        self._job: SaveJob | None = None
        self._thread: threading.Thread | None = None
        self._out: list[Any] = [None, None]  # staging, failure
        self._copy: SaveJob | None = None  # the job writing here (its pins: until committed)
        self._aborted = False

    def tee(self, streams: list[queue.SimpleQueue[Any]]) -> list[Any]:
        queues: list[queue.SimpleQueue[Any]] = [queue.SimpleQueue() for _ in streams]
        self.sources = [q.get for q in queues]
        return [_Tee(s, q) for s, q in zip(streams, queues, strict=True)]

    def around(self, job: SaveJob, save: Callable[[], SaveResult]) -> SaveResult:
        self._start(job)
        return self.after(save)

    def feed(self, make: Callable[[SaveJob], list[list[Any]]]) -> Callable[[SaveJob], Any]:
        """``make`` (a collective save's streams for a job) that also starts this mirror's
        writer on the same streams: lists of segments of the staged copy, read twice."""

        def streams(job: SaveJob) -> list[list[Any]]:
            out = make(job)
            self.sources = [iter(s).__next__ for s in out]
            self._start(job)
            return out

        return streams

    def after(self, save: Callable[[], SaveResult]) -> SaveResult:
        """Run ``save`` (whose streams feed this mirror); then commit the RAM copy."""
        try:
            return self._after(save)
        finally:
            if self._copy is not None:
                published = bool(self._copy.pins)
                self._copy.unpin()
                if published and self._aborted:
                    self.tier.sweep()  # the shared objects it published for nothing

    def _after(self, save: Callable[[], SaveResult]) -> SaveResult:
        try:
            result = save()
        except BaseException:
            self._join()
            self._abort()
            raise
        self._join()
        job = self._job
        if job is None:  # nothing was written (a save that wrote no file of this rank's)
            return result
        staging, failure = self._out
        if failure is None:
            try:
                manifest = job.storage.read_bytes(
                    f"{job.name}/{MANIFEST}", limits.MAX_MANIFEST_BYTES
                )
                save_id = job.header["save_id"]
                if save_id_at(job.storage, job.name) != save_id:
                    raise SaveError(f"{job.storage.url(job.name)}: replaced meanwhile")
                self._fill(job, staging, manifest)
                self.tier._commit(staging, job.name, manifest, save_id)
                return result
            except Exception as e:
                failure = e
        self._abort()
        self.tier._failed(job.name, failure)
        return result

    def _fill(self, job: SaveJob, staging: str, manifest: bytes) -> None:
        """Copy from the committed checkpoint the files of this rank's share its streams did
        not carry: a chunk another rank held too, written here as its shared object, which
        rank 0 made a plain data file of this rank's in the checkpoint."""
        if self.files is None:
            return
        storage = self.tier.storage
        m = parse(manifest, job.storage.url(f"{job.name}/{MANIFEST}"))
        for f, size in m.files.items():
            if is_shared(f) or not self.files(f) or storage.exists(f"{staging}/{f}"):
                continue
            copy_file(job.storage, f"{job.name}/{f}", storage, f"{staging}/{f}", size)

    def _start(self, job: SaveJob) -> None:
        self._job = job

        def write() -> None:
            try:
                self._out[:] = self._write(job)
            except BaseException as e:  # never lost: reported as this copy's failure
                self._out[:] = [None, e]
                # Every slab must still come back to the pool (a staging budget waits for it).
                for get in self.sources[self._reading :]:
                    _drain(get)

        self._thread = threading.Thread(target=write, name="tardigrade-ram-tier", daemon=True)
        self._thread.start()

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def _abort(self) -> None:
        self._aborted = True
        staging = self._out[0]
        if self._job is not None and staging is not None:
            try:
                self.tier.catalog.commit.abort(staging, self._job.name, self._job.header["save_id"])
            except OSError as e:
                log.warning("tardigrade: cleaning up the RAM tier's %s: %s", staging, e)

    def _write(self, job: SaveJob) -> tuple[str | None, BaseException | None]:
        """Write every file from its source (each drained to its end, whatever fails, so every
        slab is released); return the staging directory and the first failure."""
        storage = self.tier.storage
        failure: BaseException | None = None
        staging = None
        # A shared object: as the disk writer writes it, into this tier's own .shared/
        # (which holds the ones its newest checkpoint references: those are not rewritten).
        mine = replace(job, storage=storage, shared=SharedIndex(), pins=[], published=[])
        self._copy = mine
        try:
            self.tier._make_room(_image_bytes(job), keep=job.name)
            staging = self.tier.catalog.commit.begin(job.name, job.header["save_id"])
            if job.shared is not None:
                mine.shared = self.tier.shared_index()
        except BaseException as e:
            failure = e
        for i, (fp, get) in enumerate(zip(job.plan.files, self.sources, strict=True)):
            self._reading = i
            if job.shared is not None and is_candidate(fp.name):
                if failure is None and staging is not None:
                    try:
                        write_file(mine, fp, staging, _blocks(get))  # drains it, whatever fails
                    except BaseException as e:
                        failure = e
                else:
                    _drain(get)
                self._reading = i + 1
                continue
            writer = None
            if failure is None:
                try:
                    # No size hint: buffered writes (a memory filesystem has no direct I/O),
                    # under the disk's name for the file, so the disk's manifest fits as it is.
                    writer = storage.open_writer(f"{staging}/{job.stored_name(fp.name)}")
                except BaseException as e:
                    failure = e
            first = True
            while True:
                block = get()
                if block is END or block is ABORT:
                    if block is ABORT and failure is None:
                        failure = SaveError(f"{job.storage.url(job.name)}: staging failed")
                    break
                try:
                    if failure is None and writer is not None:
                        if first and isinstance(block, Segment):
                            # Segments are items' bytes alone (a collective save's): the
                            # header first, as the disk writer writes it.
                            writer.write(file_header(fp))
                        writer.write(block.data)
                except BaseException as e:
                    failure = e
                finally:
                    first = False
                    if block.done is not None:
                        block.done()
            self._reading = i + 1
            if writer is not None:
                try:
                    if failure is None:
                        writer.close()
                    else:
                        writer.abort()
                except BaseException as e:
                    failure = failure or e
        return staging, failure


def _blocks(get: Callable[[], Any]) -> Iterator[Any]:
    """A source's blocks up to its end (an ABORT too: the writer raises on it)."""
    while True:
        block = get()
        if block is END:
            return
        yield block
        if block is ABORT:
            return


def _drain(get: Callable[[], Any]) -> None:
    """Release every block left in a source, up to its end."""
    while True:
        block = get()
        if block is END or block is ABORT:
            return
        if block.done is not None:
            block.done()


def open_ram_tier(
    directory: str, ram_tier: Any, rank: int | None = None, run: str | None = None
) -> RamTier | None:
    """The manager's ``ram_tier=`` argument: False/None (off), True (``/dev/shm``) or a path;
    ``rank``: this process's rank in a distributed job; ``run``: the job's run id."""
    if ram_tier is None or ram_tier is False:
        return None
    if ram_tier is True:
        return RamTier(directory, rank=rank, run=run)
    if isinstance(ram_tier, (str, os.PathLike)):
        base = os.path.abspath(os.fspath(ram_tier))
        if base == directory or base.startswith(directory.rstrip(os.sep) + os.sep):
            raise InvalidArgumentError(
                f"ram_tier={os.fspath(ram_tier)!r} is inside the checkpoint directory "
                f"{directory}; pass a directory on a memory filesystem elsewhere (such as "
                "/dev/shm, the default with ram_tier=True)"
            )
        return RamTier(directory, ram_tier, rank=rank, run=run)
    raise InvalidArgumentError(
        f"ram_tier must be True, False or a directory on a memory filesystem, got {ram_tier!r}"
    )
