"""Tiers: a committed checkpoint copied from one storage to another (a local directory to a
store, and back), committed there by that storage's own protocol.

``copy_checkpoint(src, name, dst)`` streams each data file through the contract (a ranged
reader on ``src``, a writer on ``dst``), stores it under ``dst``'s name for the save's data
(``<save id>.<file>`` on a store: a retry or a zombie copy never overwrites bytes a committed
manifest points at), then commits the manifest with the file names rewritten and its checksum
resealed, exactly as a save would (a conditional create on a store, a rename on a directory).
Nothing else of the checkpoint changes: the tensors' checksums and the save id travel as they
are, so the copy verifies like the original. A copy that fails removes what it wrote.

``Uploader`` runs such copies in a background thread for ``CheckpointManager(upload_to=...)``:
a checkpoint counts as uploaded once its remote manifest is committed; a failed copy is logged,
counted and retried with backoff, never raised into training. In a distributed job every rank
runs one, over a fork of the job's group (its own gloo group: the upload threads' collectives
never interleave with training's): rank 0 begins each copy, every rank copies the data files it
wrote (``CopyPlan.copy_files``), and rank 0 commits the manifest only once every rank reported
its files copied; a failure on any rank fails the copy on every rank, and rank 0 removes what
was written.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ._catalog import Catalog, step_name
from ._commit import Commit, commit_for, committed
from ._open import holds_save
from ._shared import pin, shared_root, unpin
from .errors import CheckpointExistsError, CorruptCheckpointError, TardigradeError
from .format import limits
from .format.jsonio import dumps, loads_strict
from .format.manifest import MANIFEST, data_path, is_shared, parse, seal
from .storage import Storage

log = logging.getLogger("tardigrade")

COPY_BYTES = 8 * 1024 * 1024  # read and written at a time (the reader splits larger GETs)
# Parts of a manifest that hold the user's own strings (keys, values, metadata): never
# rewritten, even where one equals a data file's name.
_USER_PARTS = frozenset({"tree", "metadata", "metrics"})


def _renamed(doc: Any, names: dict[str, str], depth: int = 0) -> Any:
    """``doc`` with every string equal to an old file name replaced by its new name."""
    if isinstance(doc, str):
        return names.get(doc, doc)
    if isinstance(doc, list):
        return [_renamed(v, names, depth + 1) for v in doc]
    if isinstance(doc, dict):
        return {
            k: v if depth == 0 and k in _USER_PARTS else _renamed(v, names, depth + 1)
            for k, v in doc.items()
        }
    return doc


def copy_checkpoint(
    src: Storage,
    name: str,
    dst: Storage,
    *,
    replace: bool = False,
    files: Callable[[str], bool] | None = None,
    go: threading.Event | None = None,
    to: str | None = None,
    standalone: bool = False,
) -> str:
    """Copy the committed checkpoint ``name`` of ``src`` to ``dst`` under the same name (or
    ``to``).

    Returns ``"copied"``, or ``"present"`` when ``dst`` already holds this very save (same
    save id). A different checkpoint already committed there raises CheckpointExistsError
    unless ``replace``. The source must verify its manifest; the bytes of its data files are
    copied as they are (their checksums are checked by whoever loads or verifies the copy).
    ``files``: copy only the data files it accepts (one rank's share), and commit the whole
    manifest all the same: a partial copy, for a tier that reads the rest elsewhere.
    ``go``: when given, the copy waits for it to be set before each chunk (``Uploader.held``).
    The shared objects it references go to ``dst``'s own ``.shared/`` (those there already
    are not copied); ``standalone``: into the copy itself, which then shares nothing.
    """
    copy = CopyPlan.of(src, name, dst, replace=replace, to=to, standalone=standalone)
    if copy is None:
        return "present"
    staging = copy.into.begin(copy.to, copy.save_id)
    try:
        copy.copy_files(staging, files, go)
        copy.commit(staging)
    except BaseException as e:
        if copy.end(staging) is True:
            log.warning(
                "tardigrade: the copy of %s to %s was committed, though its commit failed: %s",
                src.url(name),
                dst.url(copy.to),
                e,
            )
            return "copied"
        raise
    finally:
        copy.unpin()
    return "copied"


@dataclass
class CopyPlan:
    """One copy of checkpoint ``name`` from ``src`` to ``dst``, in the phases that ranks split
    between them: every rank copies its own files (``copy_files``), one commits (``commit``).
    ``names`` maps each data file to its name in ``dst``."""

    src: Storage
    name: str
    dst: Storage
    replace: bool
    raw: bytes
    doc: dict[str, Any]
    save_id: str
    sizes: dict[str, int]
    names: dict[str, str]
    into: Commit  # how copies commit in ``dst``
    to: str = ""  # the copy's name in ``dst`` (``name``: the same)
    standalone: bool = False  # shared objects copied into the copy itself
    pinned: list[str] = field(default_factory=list)  # shared objects pinned in ``dst``

    def __post_init__(self) -> None:
        self.to = self.to or self.name

    @classmethod
    def of(
        cls, src: Storage, name: str, dst: Storage, *, replace: bool, to: str | None = None,
        standalone: bool = False,
    ) -> CopyPlan | None:  # fmt: skip
        """The copy of ``name`` (to ``to``); None when ``dst`` already holds this very save."""
        to = to or name
        where = src.url(f"{name}/{MANIFEST}")
        raw = src.read_bytes(f"{name}/{MANIFEST}", limits.MAX_MANIFEST_BYTES)
        manifest = parse(raw, where)
        doc = loads_strict(raw, where)
        save_id = doc.get("save_id")
        if not isinstance(save_id, str) or not save_id:
            raise CorruptCheckpointError(f"{where}: the manifest has no save_id; cannot copy it")
        into = commit_for(dst)
        if committed(dst, to):
            there_at = dst.url(f"{to}/{MANIFEST}")
            there = loads_strict(
                dst.read_bytes(f"{to}/{MANIFEST}", limits.MAX_MANIFEST_BYTES), there_at
            )
            if isinstance(there, dict) and there.get("save_id") == save_id:
                return None
            if not replace:
                raise CheckpointExistsError(
                    f"{dst.url(to)}: another checkpoint (save {there.get('save_id')!r}) is "
                    f"committed there; not replacing it with {src.url(name)}."
                )
        # A shared object keeps its name (its content's) on every tier, or (``standalone``)
        # becomes a data file of the copy.
        names = {}
        for file in manifest.files:
            if is_shared(file):
                names[file] = f"shared-{file.rpartition('/')[2]}" if standalone else file
            else:
                plain = file.split(".", 1)[1] if _stored(file, save_id) else file
                names[file] = into.data_name(plain, save_id)
        return cls(src, name, dst, replace, raw, doc, save_id, dict(manifest.files), names, into,
                   to, standalone)  # fmt: skip

    def copy_files(
        self,
        staging: str,
        files: Callable[[str], bool] | None = None,
        go: threading.Event | None = None,
    ) -> None:
        """Copy the data files (those ``files`` accepts) into ``staging`` (``dst.begin``'s),
        waiting for ``go`` before each chunk when given. A shared object ``dst`` holds
        already is not copied (it is pinned there until the copy ended: ``unpin``); one it
        lacks is published under its ``.shared/`` before the commit."""
        for file, size in self.sizes.items():
            if files is not None and not files(file):
                continue
            if not is_shared(file) or self.standalone:
                src_name, dst_name = data_path(self.name, file), f"{staging}/{self.names[file]}"
                copy_file(self.src, src_name, self.dst, dst_name, size, go)
                continue
            where = data_path(self.to, file)
            pin(shared_root(self.dst.url, self.to), file)
            self.pinned.append(file)
            there = self.dst.stat(where)
            if there is not None and there.size == size:
                continue
            target = self.into.shared_target(staging, where, where.rpartition("/")[2])
            copy_file(self.src, data_path(self.name, file), self.dst, target, size, go)
            self.into.publish_shared(target, where)

    def unpin(self) -> None:
        """The copy ended: ``dst``'s sweep may take the shared objects it pinned."""
        unpin(shared_root(self.dst.url, self.to), self.pinned)
        self.pinned.clear()

    def commit(self, staging: str) -> None:
        """Commit the manifest, its file names rewritten for ``dst`` and its checksum resealed."""
        doc = dict(self.doc)
        doc.pop("manifest_checksum", None)
        body = dumps(_renamed(doc, self.names))
        new = seal(body) if b'"manifest_checksum"' in self.raw[-200:] else body
        parse(new, self.dst.url(f"{self.to}/{MANIFEST}"))  # what is committed loads
        self.into.commit(staging, self.to, new, save_id=self.save_id, replace=self.replace)

    def end(self, staging: str) -> bool | None:
        """After a copy failed: whether it committed nonetheless (a commit whose reply was
        lost, or that failed after its manifest was written), None when that cannot be told.
        What the copy wrote (every rank's, on a store) is removed only when it did not commit:
        on a store the data objects of a committed copy are its checkpoint's. Never raises."""
        committed = self.committed()
        if committed is False:
            try:
                self.into.abort(staging, self.to, self.save_id)
                return False
            except Exception as e:
                log.warning(
                    "tardigrade: cleaning up a failed copy to %s: %s", self.dst.url(self.to), e
                )
        self.into.abandon(staging)  # for tidy (gc, the next manager) to remove, if uncommitted
        return committed

    def committed(self) -> bool | None:
        """Whether ``dst`` holds this copy's manifest (None: it could not be read)."""
        return holds_save(self.dst, self.to, self.save_id)


class Gate(threading.Event):
    """Set while no one holds it: a background copy waits on it between pieces, and
    ``held()`` blocks close it while they run (the training thread waiting on a save)."""

    def __init__(self) -> None:
        super().__init__()
        self._holds = 0
        self._holding = threading.Lock()
        self.set()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self._holding:
            self._holds += 1
            self.clear()
        try:
            yield
        finally:
            with self._holding:
                self._holds -= 1
                if not self._holds:
                    self.set()


_RANK_FILE = re.compile(r"(?:^|\.)data-r(\d+)-")


def file_rank(file: str) -> int:
    """The rank that wrote data file ``file`` of a collective save (0 for a single process's);
    for a shared object, which any rank may have written, a number of its name (its hash),
    so that the ranks copying a checkpoint split its shared objects evenly."""
    if is_shared(file):
        return int(file.rpartition("/")[2][:8], 16)
    m = _RANK_FILE.search(file)
    return int(m.group(1)) if m else 0


def copy_on_ranks(
    ranks: Any,
    src: Storage,
    name: str,
    dst: Storage,
    *,
    gone: Callable[[], bool] | None = None,
    go: threading.Event | None = None,
) -> str:
    """``copy_checkpoint`` shared by the ranks of ``ranks`` (a ``Ranks``; every rank calls
    it): rank 0 reads the manifest and begins, every rank copies its share of the data files
    (those its rank wrote, by their names), and rank 0 commits once every rank's are in place.

    Returns ``"copied"``, ``"present"`` (``dst`` holds this save already) or ``"gone"``
    (rank 0's ``gone()`` said ``src`` no longer holds it). An error on any rank is raised on
    every rank, and nothing is committed: rank 0 removes what every rank wrote.
    """
    # Not naming ``src``: each rank may copy from a storage of its own (its RAM tier's).
    what = f"copy of {name} to {dst.url(name)}"
    plan: list[CopyPlan | None] = [None]
    made: list[str] = []  # on rank 0: the staging it began

    def begin() -> bytes:
        # Rank 0 decides and prepares; every rank goes by its answer.
        if gone is not None and gone():
            return json.dumps({"gone": True}).encode()
        plan[0] = CopyPlan.of(src, name, dst, replace=False)
        if plan[0] is None:
            return json.dumps({"present": True}).encode()
        made.append(plan[0].into.begin(name, plan[0].save_id))
        return json.dumps({"staging": made[0]}).encode()

    def mine() -> bytes:
        if plan[0] is None:
            plan[0] = CopyPlan.of(src, name, dst, replace=False)
        if plan[0] is None:
            raise CheckpointExistsError(f"{dst.url(name)}: committed meanwhile")
        plan[0].copy_files(staging, lambda f: file_rank(f) % ranks.size == ranks.rank, go)
        return b""

    def commit() -> bytes:
        assert plan[0] is not None
        plan[0].commit(staging)
        return b""

    try:
        agreed = json.loads(ranks.broadcast(what + ": begin", begin))
        if "gone" in agreed or "present" in agreed:
            return "gone" if "gone" in agreed else "present"
        staging = agreed["staging"]
        # Every rank's files are in place (or its error is raised on every rank) before rank
        # 0 commits the manifest.
        ranks.all_gather(what + ": copying each rank's files", mine)
        ranks.broadcast(what + ": commit", commit)
    except BaseException:
        # Rank 0 began a staging (whether or not the others ever heard of it: the begin
        # exchange itself may be what failed) and every rank is done writing there: removed
        # unless it committed. The error is raised on every rank all the same; a retry
        # finds a committed copy present.
        if made:
            assert plan[0] is not None
            plan[0].end(made[0])
        raise
    finally:
        if plan[0] is not None:
            plan[0].unpin()
    return "copied"


def _stored(file: str, save_id: str) -> bool:
    """Whether ``file`` is already a store's save-unique name (``<save id>.<file>``)."""
    return file.startswith(f"{save_id[:16]}.")


def copy_file(
    src: Storage,
    src_name: str,
    dst: Storage,
    dst_name: str,
    size: int,
    go: threading.Event | None = None,
) -> None:
    buf = memoryview(bytearray(min(COPY_BYTES, max(1, size))))
    with src.open_reader(src_name) as r:
        if r.size != size:
            raise CorruptCheckpointError(
                f"{r.name}: file is {r.size} bytes but the manifest recorded {size}; not "
                "copying a damaged checkpoint."
            )
        w = dst.open_writer(dst_name, size_hint=size)
        try:
            pos = 0
            while pos < size:
                if go is not None:
                    go.wait()
                n = min(buf.nbytes, size - pos)
                r.readinto(pos, buf[:n])
                w.write(buf[:n])
                pos += n
        except BaseException:
            w.abort()
            raise
        w.close()
    kept = dst.stat(dst_name)
    if kept is None or kept.size != size:
        raise CorruptCheckpointError(
            f"{dst.url(dst_name)}: holds {None if kept is None else kept.size} bytes after "
            f"copying {size}; nothing was committed."
        )


def _permanent(e: BaseException) -> bool:
    """Whether an upload's failure cannot go away by retrying: the remote name holds another
    save's committed checkpoint (on a rank, or as every cause of a collective copy's error)."""
    causes = getattr(e, "causes", None)
    if isinstance(causes, (list, tuple, dict)) and causes:
        found = causes.values() if isinstance(causes, dict) else causes
        return all(isinstance(c, CheckpointExistsError) for c in found)
    return isinstance(e, CheckpointExistsError)


def warn_of_another_run(local: Catalog, remote: Catalog) -> None:
    """Warn when ``remote`` holds checkpoints of another run than ``local``'s: its newest step
    is also in ``local``, as another save (two runs saved the same steps there), so uploads of
    the steps it holds will fail. Never raises: the uploads say what fails, and why."""
    try:
        steps = remote.steps()
        name = step_name(steps[-1]) if steps else ""
        if not name or not local.committed(name) or local.save_id(name) == remote.save_id(name):
            return
    except TardigradeError as e:
        log.debug("tardigrade: could not compare %s with %s: %s", remote.root, local.root, e)
        return
    log.warning(
        "tardigrade: %s already holds checkpoints of another run (steps %d..%d; its %s is another "
        "save than %s): uploads of steps it holds will fail. Resume from it (restore() downloads "
        "the newest checkpoint of either tier), or give upload_to another prefix.",
        remote.root,
        steps[0],
        steps[-1],
        name,
        local.path(name),
    )


@dataclass
class UploadStats:
    """What the background uploads did: ``uploaded`` steps' names in order, ``failed``
    attempts, ``last_error``, and how many are ``pending``."""

    uploaded: list[str] = field(default_factory=list)
    failed: int = 0
    last_error: str | None = None
    pending: int = 0


class Uploader:
    """Copies committed checkpoints of ``local`` to ``remote`` in a background thread.

    ``submit(name)`` after each commit; ``close(timeout)`` waits for what is pending. A failed
    copy is retried ``retries`` times with backoff, then given up (logged, counted); an upload
    never raises into the caller. ``keep_last_remote`` retires older remote checkpoints after
    each upload (manifest first, then data, as everywhere), while ``lease`` (the remote root's,
    held by the caller) is still held. With ``ranks`` (a fork of a job's group, owned by this
    uploader) every rank's uploader is submitted the same names in the same order and copies
    its own share of each (see the module docstring); rank 0 retires.
    """

    def __init__(
        self,
        local: Storage,
        remote: Storage,
        *,
        keep_last_remote: int | None = None,
        retries: int = 3,
        backoff_seconds: float = 2.0,
        lease: Any = None,
        ranks: Any = None,
    ) -> None:
        self.local = local
        # A forked ``Ranks`` (this thread's own group) in a distributed job, else None.
        self.ranks = ranks
        self.remote = remote
        self.lease = lease  # the remote root's one-writer lease, checked before deleting
        self.keep_last_remote = keep_last_remote
        self.retries = retries
        self.backoff = backoff_seconds
        self.stats = UploadStats()
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._idle = threading.Condition()
        self._busy = 0
        self._pinned: list[str] = []  # submitted, not finished: the fast tier must keep them
        self._go = Gate()  # the copies wait on it between chunks
        self._thread = threading.Thread(target=self._run, name="tardigrade-upload", daemon=True)
        self._thread.start()

    def submit(self, name: str) -> None:
        with self._idle:
            self._busy += 1
            self._pinned.append(name)
            self.stats.pending = self._busy
        self._queue.put(name)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Pause the copies (between chunks) while the block runs: the manager holds them
        while the training thread waits on a save. On a few cores an upload's reads and
        writes (and a local store server) slow the staging copy: a tiered save blocked
        training ~1.6x as long as a local one with the upload running beside it."""
        with self._go.held():
            yield

    def pinned(self) -> set[str]:
        """Checkpoints submitted and not uploaded (or given up) yet: not to be retired."""
        with self._idle:
            return set(self._pinned)

    def _run(self) -> None:
        while True:
            name = self._queue.get()
            if name is None:
                return
            try:
                self._upload(name)
            finally:
                with self._idle:
                    self._busy -= 1
                    self._pinned.remove(name)
                    self.stats.pending = self._busy
                    self._idle.notify_all()

    def _upload(self, name: str) -> None:
        for attempt in range(self.retries + 1):
            try:
                copied = self._copy(name)
            except Exception as e:  # whatever it is, the uploads go on (and training too)
                self.stats.failed += 1
                self.stats.last_error = str(e)
                if _permanent(e):
                    # Another run's checkpoint holds the name: no retry can change that.
                    log.error(
                        "tardigrade: UPLOAD FAILED for %s to %s (not retried): %s The remote "
                        "tier holds checkpoints of another run: resume from them "
                        "(CheckpointManager(...).restore() downloads the newest), or give "
                        "upload_to another prefix.",
                        name,
                        self.remote.root,
                        e,
                    )
                    return
                last = attempt == self.retries
                log.error(
                    "tardigrade: UPLOAD FAILED for %s to %s (attempt %d of %d%s): %s",
                    name,
                    self.remote.root,
                    attempt + 1,
                    self.retries + 1,
                    "; giving up on it" if last else "; retrying",
                    e,
                )
                if last:
                    return
                time.sleep(self.backoff * 2**attempt)
                continue
            if not copied:
                log.warning(
                    "tardigrade: not uploading %s: it is gone from %s (retired meanwhile)",
                    name,
                    self.local.root,
                )
                return
            self.stats.uploaded.append(name)
            if self.ranks is None or self.ranks.coordinator:
                try:
                    self._retain()
                except Exception as e:
                    log.warning("tardigrade: retention in %s: %s", self.remote.root, e)
            return

    def _copy(self, name: str) -> bool:
        """One attempt at uploading ``name``; False when it is gone from the local tier."""
        if self.ranks is None:
            if not self._exists(name):
                return False
            copy_checkpoint(self.local, name, self.remote, go=self._go)
            return True
        outcome = copy_on_ranks(
            self.ranks,
            self.local,
            name,
            self.remote,
            gone=lambda: not self._exists(name),
            go=self._go,
        )
        return outcome != "gone"

    def _exists(self, name: str) -> bool:
        try:
            return Catalog(self.local).committed(name)
        except Exception:
            return True  # let the copy try, and report what fails

    def _retain(self) -> None:
        if self.keep_last_remote is None:
            return
        if self.lease is not None:
            try:
                self.lease.check()  # fencing: delete nothing once another job took over
            except TardigradeError as e:
                log.error("tardigrade: not retiring anything in %s: %s", self.remote.root, e)
                return
        catalog = Catalog(self.remote)
        steps = catalog.steps()
        for step in steps[: max(0, len(steps) - self.keep_last_remote)]:
            try:
                catalog.retire(step_name(step))
            except TardigradeError as e:
                log.warning("tardigrade: retiring step %d on %s: %s", step, self.remote.root, e)
        try:  # the shared data only the retired checkpoints referenced (its own reachability)
            catalog.sweep_shared(grace=False)
        except (OSError, TardigradeError) as e:
            log.warning(
                "tardigrade: removing unreferenced shared data on %s: %s", self.remote.root, e
            )

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until nothing is pending; False if ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Wait for pending uploads (at most ``timeout`` s), then stop; False if some were
        still pending (they are abandoned: nothing half-uploaded is ever visible)."""
        done = self.wait(timeout)
        self._queue.put(None)
        if done:
            self._thread.join()
            self.ranks = None  # frees the forked group
        return done
