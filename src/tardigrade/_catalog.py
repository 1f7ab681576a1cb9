"""The catalog: what the checkpoints of one directory (or store prefix) are, in one place.

It alone knows a root's checkpoint names: ``step-NNNNNNNNN`` for a manager's checkpoints (or the
format it is given), the names a checkpoint is set aside under (``step-N.incomplete-<time>``,
``step-N.abandoned-<time>``), the records beside them (abandoned checkpoints, lease fences).
How a checkpoint commits, leaves, and what a dead writer left is its backend's commit
strategy (``_commit``: a rename on POSIX, the manifest last on a store), which it holds.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, TypeAlias

from ._commit import LOCK, TMP_PREFIX, commit_for, committed, due, size_of
from ._open import manifest_at, save_id_at
from ._shared import abandon, abandoned, forget_abandoned, shared_root, sweeping
from .errors import CorruptCheckpointError, InvalidArgumentError, TardigradeError
from .format.jsonio import dumps, loads_strict
from .format.manifest import LEASE_GENERATION, MANIFEST, SHARED_DIR, Manifest, data_path, is_shared
from .storage import Storage, open_root, storage_for
from .storage.base import Tidied, grace_cutoff

__all__ = [
    "ABANDONED",
    "ABANDONED_NAME",
    "ABANDONED_RECORD",
    "COMMITTED",
    "FENCED",
    "FENCES",
    "INCOMPLETE",
    "INCOMPLETE_TMP",
    "NO_MANIFEST",
    "STEP_NAMES",
    "UNREADABLE",
    "Catalog",
    "Listed",
    "Tidied",
    "step_name",
]

log = logging.getLogger("tardigrade")

# A committed checkpoint of a timeline that restore(step) abandoned, moved aside by the manager;
# a step directory without a manifest, moved aside so the step can be saved again.
ABANDONED = "abandoned"
INCOMPLETE = "incomplete"
ABANDONED_NAME = re.compile(rf"^step-(\d{{9,}})\.{ABANDONED}-[0-9T]+(-\d+)?$")
# Where a store, which cannot rename checkpoints aside, records those restore(step) abandoned:
# each name with the save id it held then (a step saved again holds another). Hidden: listings
# of checkpoints pass over it.
ABANDONED_RECORD = ".abandoned.json"
# Where the lease holders that took the lease from a writer that may still live (a stalled
# process, a partitioned machine) record their fences: [[generation, step], ...], oldest first.
# A checkpoint committed under an older lease generation than a fence's, for a step past the
# fence's (the newest step in view when that holder took over), was committed after its writer
# lost the lease: a zombie's commit, never a checkpoint of the run (see Catalog.fence).
FENCES = ".fences.json"
_MAX_FENCES = 64  # a writer superseded that many times over is long gone


_RECORD_BYTES = 1 << 20  # a record of abandoned checkpoints is a few bytes per checkpoint


@dataclass(frozen=True)
class StepNames:
    """How the checkpoints of a root are named by step: ``template`` holds one ``{step}``
    field (``"step-{step:09d}"``, a manager's; ``"checkpoint-{step}"``, the HF Trainer's)."""

    template: str = "step-{step:09d}"

    def __post_init__(self) -> None:
        m = re.fullmatch(r"(.*?)\{step(?::0(\d+)d)?\}(.*)", self.template)
        if m is None or "{" in m.group(1) + m.group(3) or "/" in self.template:
            raise InvalidArgumentError(
                f"names={self.template!r}: a name format takes one {{step}} field (optionally "
                "zero-padded, {step:09d}) and no '/', e.g. 'checkpoint-{step}'"
            )
        digits = f"\\d{{{m.group(2)},}}" if m.group(2) else "\\d+"
        pattern = f"{re.escape(m.group(1))}({digits}){re.escape(m.group(3))}"
        object.__setattr__(self, "_pattern", re.compile(pattern))

    def name(self, step: int) -> str:
        return self.template.format(step=step)

    def step(self, name: str) -> int | None:
        """The step ``name`` is named after, or None when the format does not name it."""
        m = self._pattern.fullmatch(name)  # type: ignore[attr-defined]  # set in __post_init__
        return int(m.group(1)) if m else None


STEP_NAMES = StepNames()  # a manager's


def step_name(step: int) -> str:
    return STEP_NAMES.name(step)


# What an entry of a checkpoint directory is, as listings show it.
COMMITTED = "committed"
INCOMPLETE_TMP = "incomplete-tmp"  # a save in flight or killed: never visible to load
NO_MANIFEST = "no-manifest"  # a directory that never committed (or lost its manifest)
UNREADABLE = "unreadable"  # has a manifest that fails validation
FENCED = "fenced"  # committed by a writer that had lost the lease: not a checkpoint of the run

_STEP_IN_NAME = re.compile(r"step-(\d+)")


def step_in_name(name: str) -> int | None:
    """The step a name mentions (``step-N`` and anything derived from it), or None."""
    m = _STEP_IN_NAME.search(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Listed:
    """One entry of a checkpoint directory, as ``tardigrade ls`` shows it."""

    name: str
    path: str
    status: str
    step: int | None
    epoch: int | None
    created: str | None
    nbytes: int  # bytes of every file under it, as they are in storage
    error: str | None = None
    # With shared data (format 7): the bytes of the shared objects it references, and of
    # those no other checkpoint listed references (what deleting it alone would free).
    shared_bytes: int = 0
    unique_shared_bytes: int = 0
    shared: tuple[tuple[str, int], ...] = ()  # the shared objects it references, and sizes

    @property
    def logical_bytes(self) -> int:
        """Everything a load of it reads from storage: its own files and its shared data."""
        return self.nbytes + self.shared_bytes

    @property
    def unique_bytes(self) -> int:
        """What deleting it alone frees: its own files and the shared data only it holds."""
        return self.nbytes + self.unique_shared_bytes


class Scan(NamedTuple):
    """One listing of a root: its committed steps (ascending), its ``step-N`` entries without
    a manifest, whether it holds a record of abandoned checkpoints, and the committed names
    that fences hide (zombie commits: ``Catalog.fence``)."""

    committed: list[int]
    uncommitted: list[str]
    recorded: bool
    fenced: list[str]


@dataclass
class _Marks:
    """What the committed manifests of a root reference: each file they list (by its name
    under the root), each name's committing save (its data objects' prefix: a save's own
    objects stay with it), and the names whose manifest did not read (kept whole)."""

    files: set[str] = field(default_factory=set)
    owners: dict[str, str] = field(default_factory=dict)
    kept: set[str] = field(default_factory=set)

    def reachable(self, name: str, data: str) -> bool:
        """Whether data object ``data`` under ``name`` is referenced (kept by the sweep)."""
        owner = self.owners.get(name)
        return (
            name in self.kept
            or f"{name}/{data}" in self.files
            or (owner is not None and data.startswith(owner))
        )


class Catalog:
    """List, describe and clean up the checkpoints under one directory or URL prefix.

    ``location`` is a path or URL (``memory://``); ``storage_options`` go to its backend.
    ``listing()`` classifies every entry (``Listed.status``: one of the constants below),
    ``steps()`` gives the committed ``step-N`` checkpoints a ``CheckpointManager`` wrote,
    ``tidy()`` removes what dead writers left (take ``lease()`` first, as ``tardigrade gc``
    does).

    >>> [e.name for e in tg.Catalog("ckpt").listing() if e.status == tg.Catalog.COMMITTED]  # doctest: +SKIP
    """

    # What ``describe`` finds an entry to be (``Listed.status``), and the names it reads.
    COMMITTED = COMMITTED
    FENCED = FENCED
    INCOMPLETE_TMP = INCOMPLETE_TMP
    NO_MANIFEST = NO_MANIFEST
    UNREADABLE = UNREADABLE
    Listed: TypeAlias = Listed  # one entry of listing(), for the CLI
    LOCK = LOCK  # the object the lease of a root lives in
    step_in_name = staticmethod(step_in_name)
    step_name = staticmethod(step_name)  # a manager's checkpoint of a step: step-NNNNNNNNN

    def __init__(
        self,
        location: Any,
        storage_options: Mapping[str, Any] | None = None,
        *,
        names: str = STEP_NAMES.template,
    ) -> None:
        self.naming = StepNames(names)
        self.storage: Storage = (
            location if isinstance(location, Storage) else open_root(location, storage_options)
        )
        self.commit = commit_for(self.storage)  # how saves commit here, checkpoints leave
        self._fences: list[tuple[int, int]] | None = None  # read once (see fences())
        self._generations: dict[tuple[str, str], int | None] = {}  # (name, version) -> gen

    @property
    def root(self) -> str:
        return self.storage.root

    def path(self, name: str) -> str:
        """The location of ``name`` (a path or URL), as ``tg.load`` takes it."""
        return self.storage.url(name)

    def committed(self, name: str) -> bool:
        """Whether ``name`` is a committed checkpoint: a directory holding a manifest file."""
        return committed(self.storage, name)

    def lease(self, *, lease_seconds: float = 30.0) -> Any:
        """The one-writer lease of this root (a ``storage.lease.Lease``; not yet taken)."""
        return self.storage.lease(LOCK, lease_seconds=lease_seconds)

    @classmethod
    def is_checkpoint(cls, location: Any, storage_options: Mapping[str, Any] | None = None) -> bool:
        """Whether ``location`` (a path or URL) is a committed checkpoint (see ``committed``)."""
        try:
            storage, name = storage_for(location, storage_options)
        except TardigradeError:  # not a location at all (a bad URL): not a checkpoint either
            return False
        return cls(storage).committed(name)

    def names(self) -> list[str]:
        return self.storage.list()

    def numbered(self) -> list[tuple[int, str]]:
        """(step, name) of each entry named by this catalog's format (``names=``), committed
        or not, by step."""
        found = [(s, n) for n in self.names() if (s := self.naming.step(n)) is not None]
        return sorted(found)

    def step_path(self, step: int) -> str:
        """The location of the checkpoint of ``step``."""
        return self.path(self.naming.name(step))

    def steps(self) -> list[int]:
        """The steps of the committed ``step-N`` checkpoints, ascending."""
        return self.scan()[0]

    def uncommitted_steps(self) -> list[str]:
        """``step-N`` entries without a manifest: saves that never committed, or copies."""
        return self.scan()[1]

    def scan(self) -> Scan:
        """``steps()`` and ``uncommitted_steps()`` from one listing (a restore needs both, and
        on a store each listing and each step's stat is a request), and whether a record of
        abandoned checkpoints is there."""
        committed, uncommitted, fenced = [], [], []
        names = self.names()
        fences = self.fences() if FENCES in names else []
        for n in names:
            step = self.naming.step(n)
            if step is None:
                continue
            if not self.committed(n):
                uncommitted.append(n)
            elif fences and self.fenced(n, fences):
                fenced.append(n)
            else:
                committed.append(step)
        return Scan(sorted(committed), uncommitted, ABANDONED_RECORD in names, sorted(fenced))

    # -- fencing ---------------------------------------------------------------------------

    def fences(self) -> list[tuple[int, int]]:
        """The fences recorded here: (generation, step) pairs (see ``FENCES``); read once per
        catalog (only the lease holder adds one, as it takes the lease). A record that is not
        one raises CorruptCheckpointError naming it."""
        if self._fences is None:
            self._fences = self._read_fences()
        return self._fences

    def _read_fences(self) -> list[tuple[int, int]]:
        if self.storage.stat(FENCES) is None:
            return []
        where = self.path(FENCES)
        doc = loads_strict(self.storage.read_bytes(FENCES, _RECORD_BYTES), where)
        pairs = doc.get("fences") if isinstance(doc, dict) else None
        if not isinstance(pairs, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(type(x) is int and x >= 0 for x in p)
            for p in pairs
        ):
            raise CorruptCheckpointError(
                f"{where}: not a record of lease fences ({{'fences': [[generation, step], "
                "...]}}); delete it (with no job writing here) to see every checkpoint again"
            )
        return [(g, st) for g, st in pairs]

    def fence(self, generation: int) -> None:
        """Record, as the lease holder of ``generation`` that took the lease over from a
        writer that may still live, that no checkpoint of an older generation past the newest
        step now in view belongs to the run: that writer can only have committed it after it
        lost the lease (it stalled inside a save, then woke up).

        Called right after taking the lease, so every commit made before the takeover is in
        view. A commit the old writer makes between the takeover and this listing is in view
        too and counts as the run's, which is consistent: this holder has restored nothing yet.
        """
        step = max(self.steps(), default=0)
        fences = [*self.fences(), (generation, step)][-_MAX_FENCES:]
        body = dumps({"fences": [list(f) for f in fences]})
        self.storage.put(FENCES, body, mode="overwrite")
        self._fences = fences

    def generation(self, name: str) -> int | None:
        """The lease generation committed checkpoint ``name`` was saved under (None: saved
        without a manager's lease, or before manifests recorded it). Cached per manifest
        version: a committed manifest does not change, it is only deleted or replaced."""
        st = self.storage.stat(f"{name}/{MANIFEST}")
        key = (name, st.version if st is not None else "")
        if key[1] and key in self._generations:
            return self._generations[key]
        g = manifest_at(self.storage, name).raw.get(LEASE_GENERATION)
        found = g if type(g) is int and g >= 0 else None
        if key[1]:
            self._generations[key] = found
        return found

    def fenced(self, name: str, fences: list[tuple[int, int]] | None = None) -> bool:
        """Whether committed checkpoint ``name`` was committed by a writer after it lost the
        lease (see ``FENCES``). An unreadable manifest is not fenced: restore skips it anyway."""
        fences = self.fences() if fences is None else fences
        step = step_in_name(name)
        if not fences or step is None or step <= min(s for _, s in fences):
            return False
        try:
            g = self.generation(name)
        except TardigradeError:
            return False
        return g is not None and any(g < fg and step > fs for fg, fs in fences)

    def occupant(self, name: str) -> str:
        """Who holds ``name``: "run" (a checkpoint of the run), "fenced" (a commit made after
        its writer lost the lease, which a save replaces), or "" (nobody)."""
        if not self.committed(name):
            return ""
        return "fenced" if self.fenced(name) else "run"

    def visible(self, name: str) -> bool:
        """Whether ``name`` is a committed checkpoint of the run: committed, and not fenced."""
        return self.committed(name) and not self.fenced(name)

    def size(self, name: str) -> int:
        """Bytes of every object under ``name``, recursively (one definition for ls and gc)."""
        return size_of(self.storage, name)

    def describe(self, name: str) -> Listed:
        """Classify ``name``: committed checkpoint, a save's staging, or neither (reads only
        its manifest, never tensor bytes)."""
        path, size, step = self.path(name), self.size(name), step_in_name(name)
        if name.startswith(TMP_PREFIX):
            return Listed(name, path, INCOMPLETE_TMP, step, None, None, size)
        if self.storage.stat(f"{name}/{MANIFEST}") is None:
            return Listed(name, path, NO_MANIFEST, step, None, None, size)
        try:
            # Through this catalog's storage: a path would reopen it without its options.
            m = manifest_at(self.storage, name).raw
        except TardigradeError as e:
            return Listed(name, path, UNREADABLE, step, None, None, size, str(e))
        created = m.get("created")
        shared = {f["name"]: f["size"] for f in m["files"] if is_shared(f["name"])}
        status = COMMITTED
        try:
            if self.fenced(name):
                status = FENCED
        except TardigradeError as e:  # a damaged record of fences: say so, list the rest
            status, error = UNREADABLE, str(e)
            return Listed(name, path, status, m.get("step"), m.get("epoch"), None, size, error)
        return Listed(
            name,
            path,
            status,
            m.get("step"),
            m.get("epoch"),
            created if isinstance(created, str) else None,
            size,
            shared_bytes=sum(shared.values()),
            shared=tuple(sorted(shared.items())),
        )

    def listing(self) -> list[Listed]:
        """Every checkpoint-like entry, sorted by step, then name: directories (prefixes) but
        hidden ones other than a save's staging (``.tmp-*``); files (a lock) are left out."""
        out = []
        for n in self.names():
            if n.startswith(".") and not n.startswith(TMP_PREFIX):
                continue
            st = self.storage.stat(n)
            if st is None or not st.is_dir or st.is_link:
                continue
            out.append(self.describe(n))
        out.sort(key=lambda x: (math.inf if x.step is None else x.step, x.name))
        # The shared data each holds alone (an object referenced by no other listed one).
        held = Counter(o for x in out for o, _ in x.shared)
        return [
            replace(x, unique_shared_bytes=sum(n for o, n in x.shared if held[o] == 1))
            if x.shared else x
            for x in out
        ]  # fmt: skip

    def set_aside(self, name: str, why: str) -> str:
        """Rename ``name`` to a free ``name.<why>-<time>`` (which listings of steps ignore).

        Raises StorageError where the storage cannot rename (object stores).
        """
        aside = f"{name}.{why}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}"
        stem, n = aside, 1
        while self.commit.renames and self.storage.exists(aside):
            n += 1
            aside = f"{stem}-{n}"
        self.commit.set_aside(name, aside)
        return aside

    def manifest(self, name: str) -> Manifest:
        """The parsed, validated manifest of committed checkpoint ``name`` (read through this
        catalog's storage: a path would reopen it without its options)."""
        return manifest_at(self.storage, name)

    def save_id(self, name: str) -> str | None:
        """The save id of committed checkpoint ``name`` (None for a manifest without one)."""
        return save_id_at(self.storage, name)

    def abandoned(self) -> dict[str, str]:
        """The checkpoints recorded as abandoned here (``ABANDONED_RECORD``): name -> save id.
        Raises CorruptCheckpointError for a record that is not one."""
        if self.storage.stat(ABANDONED_RECORD) is None:
            return {}
        where = self.path(ABANDONED_RECORD)
        doc = loads_strict(self.storage.read_bytes(ABANDONED_RECORD, _RECORD_BYTES), where)
        saves = doc.get("abandoned") if isinstance(doc, dict) else None
        if not isinstance(saves, dict) or not all(
            STEP_NAMES.step(k) is not None and isinstance(v, str) for k, v in saves.items()
        ):
            raise CorruptCheckpointError(
                f"{where}: not a record of abandoned checkpoints ({{'abandoned': {{step name: "
                "save id}}); delete it to restore the newest checkpoint again"
            )
        return dict(saves)

    def record_abandoned(self, saves: Mapping[str, str]) -> None:
        """Replace the record of abandoned checkpoints (removed when ``saves`` is empty)."""
        if saves:
            body = dumps({"abandoned": dict(sorted(saves.items()))})
            self.storage.put(ABANDONED_RECORD, body, mode="overwrite")
        elif self.storage.stat(ABANDONED_RECORD) is not None:
            self.storage.delete(ABANDONED_RECORD)

    def retire(self, name: str) -> None:
        """Delete checkpoint ``name``, so that no crash leaves it half-deleted in view: out of
        view first (renamed to ``.tmp-deleting-*``; on a store, its manifest deleted), then
        its data. The shared objects it referenced are recorded (``_shared.abandon``): once
        no other checkpoint references them, a sweep need not wait out the grace period."""
        try:
            refs = [f for f in self.manifest(name).files if is_shared(f)]
        except (OSError, TardigradeError) as e:
            refs = []
            log.warning(
                "tardigrade: removing %s: its manifest does not read (%s); the shared data only "
                "it referenced goes once past the grace period",
                self.path(name),
                e,
            )
        abandon(shared_root(self.storage.url, name), refs)
        self.commit.retire(name)

    def remove(self, name: str, why: str) -> bool:
        """``retire(name)``, logged with ``why``; False (logged) if storage failed to."""
        try:
            self.retire(name)
        except OSError as e:
            log.warning("tardigrade: could not remove %s: %s", self.path(name), e)
            return False
        log.info("tardigrade: removed %s (%s)", name, why)
        return True

    def retire_fenced(
        self,
        names: list[str],
        *,
        dry_run: bool = False,
        progress: Callable[[Tidied], None] | None = None,
    ) -> list[Tidied]:
        """Retire checkpoints ``names`` (``scan().fenced``): committed by a writer after it lost
        the lease, they are no checkpoints of the run. The caller holds the lease."""
        done = []
        for name in names:
            log.warning(
                "tardigrade: removing %s: it was committed by a writer after it lost the lease "
                "of %s (a stalled process that woke up); it is no checkpoint of the run",
                self.path(name),
                self.root,
            )
            why = f"{name} (committed after its writer lost the lease)"
            done.append(Tidied(why, "removed", self.size(name)))
            if not dry_run:
                self.retire(name)
            if progress is not None:
                progress(done[-1])
        return done

    def collect(
        self, *, dry_run: bool = False, progress: Callable[[Tidied], None] | None = None
    ) -> list[Tidied]:
        """Garbage collection by reachability, on a store (a POSIX root's saves stage apart,
        and its commit strategy's ``leftovers`` removes what dies there): delete each data object no committed
        manifest references, once it is older than the grace period (``gc_grace_seconds``)
        or, written by a save this process saw fail, at once. The caller holds the lease.

        Mark, then sweep: when some object is old enough and not plainly its committed
        save's, every committed manifest under the root is read and what each references is
        kept; the rest goes. A store cannot tell a dead save from a live one, so the grace
        period is what spares a zombie writer's objects (its commit would otherwise be
        unloadable). Today's rule is the special case that costs no read: a committed name
        whose objects all belong to one save holds that save's, which committed it. A
        manifest that does not read keeps everything under its name (evidence). One item per
        name dealt with, to ``progress`` too.
        """
        storage, commit = self.storage, self.commit
        listed = list(commit.candidates())
        if not listed:
            return []
        cutoff = grace_cutoff(storage.gc_grace_seconds)
        gone = commit.abandoned_saves()
        marks: _Marks | None = None
        done: list[Tidied] = []
        for name, objects, has_manifest in listed:
            if not name:  # the root's probes: a preflight whose delete failed; no save's
                done += self._remove_probes(objects, dry_run=dry_run, progress=progress)
                continue
            if has_manifest and len({commit.save_of(n) for n, _ in objects}) == 1:
                continue  # the one save found under a manifest is the save that committed it
            abandoned = gone.get(name)
            if all(st is not None for _, st in objects):  # ages known: no manifest read
                objects = [
                    (n, st) for n, st in objects if st is not None and due(st, cutoff, abandoned)
                ]
                if not objects:
                    continue
            if marks is None:
                marks = self._mark([n for n, _, c in listed if n and c])
            dead: list[tuple[str, int]] = []
            for n, st in objects:
                if marks.reachable(name, n):
                    continue
                st = st or storage.stat(f"{name}/{n}")
                if st is not None and not st.is_dir and due(st, cutoff, abandoned):
                    dead.append((f"{name}/{n}", st.size))
            if not dead:
                continue
            if not dry_run:
                storage.delete_many([n for n, _ in dead])
            done.append(Tidied(name, "removed", sum(size for _, size in dead)))
            if progress is not None:
                progress(done[-1])
        return done

    def _remove_probes(
        self,
        probes: list[tuple[str, Any]],
        *,
        dry_run: bool,
        progress: Callable[[Tidied], None] | None,
    ) -> list[Tidied]:
        done = []
        for probe, st in probes:
            st = st or self.storage.stat(probe)
            if st is None or st.is_dir:
                continue
            if not dry_run:
                self.storage.delete(probe)
            done.append(Tidied(probe, "removed", st.size))
            if progress is not None:
                progress(done[-1])
        return done

    def sweep_shared(
        self,
        *,
        dry_run: bool = False,
        progress: Callable[[Tidied], None] | None = None,
        grace: bool = True,
    ) -> list[Tidied]:
        """Delete each shared object (``.shared/``) no committed checkpoint here references,
        never one a save of this process has in flight; with ``grace``, only those older
        than the grace period (another process's save may have just written one). The
        caller holds the lease; a manager sweeps without ``grace`` once retention removed
        checkpoints (its own saves are the only ones in flight, and they pin theirs).

        A manifest that does not read stops the sweep (what it references cannot be told):
        nothing is deleted, and the log says which."""
        storage = self.storage
        objects = self.shared_objects()
        if not objects:
            return []
        cutoff = grace_cutoff(storage.gc_grace_seconds)
        root = shared_root(storage.url, "")
        # What failed saves of this process published need not wait out the grace period.
        failed = abandoned(root)
        with sweeping(root) as pinned:
            candidates = [n for n in objects if n not in pinned]
            # Ages only where the grace period asks (on a store, a stat is a request each).
            stats = {n: storage.stat(n) for n in candidates if n not in failed} if grace else {}
            if grace:
                candidates = [n for n in candidates if n in failed or ((st := stats[n]) is not None and due(st, cutoff, None))]  # fmt: skip
            if not candidates:
                return []
            marks = self._mark([n for n in self.names() if self.committed(n)])
            if marks.kept:
                log.warning(
                    "tardigrade: not removing unreferenced shared data under %s: the manifest "
                    "of %s does not read, so what it references cannot be told",
                    self.path(SHARED_DIR),
                    ", ".join(sorted(marks.kept)),
                )
                return []
            dead = [n for n in candidates if n not in marks.files]
            stats.update({n: storage.stat(n) for n in dead if n not in stats})  # their sizes
            if dead and not dry_run:
                storage.delete_many(dead)
        if dead and not dry_run:
            forget_abandoned(root, dead)
        if not dead:
            return []
        nbytes = sum(st.size for n in dead if (st := stats[n]) is not None)
        done = [Tidied(f"{SHARED_DIR} ({len(dead)} unreferenced objects)", "removed", nbytes)]
        if progress is not None:
            progress(done[0])
        return done

    def shared_objects(self) -> list[str]:
        """Every shared object here (``.shared/ab/<hash>.safetensors``); a link in place of
        ``.shared`` or of one of its directories is not followed (what it points at is not
        this root's to delete)."""
        storage = self.storage
        links = storage.can_move  # a POSIX directory (a store has no links, and a stat costs)

        def linked(name: str) -> bool:
            st = storage.stat(name) if links else None
            return st is not None and (st.is_link or not st.is_dir)

        out: list[str] = []
        if linked(SHARED_DIR):
            return out
        for d in storage.list(SHARED_DIR):
            if linked(f"{SHARED_DIR}/{d}"):
                continue
            for f in storage.list(f"{SHARED_DIR}/{d}"):
                name = f"{SHARED_DIR}/{d}/{f}"
                if is_shared(name):
                    out.append(name)
        return out

    def _mark(self, committed: list[str]) -> _Marks:
        """What the committed manifests at ``committed`` reference (the mark of ``collect``)."""
        marks = _Marks()
        for name in committed:
            try:
                m = self.manifest(name)
            except TardigradeError as e:
                if self.storage.stat(f"{name}/{MANIFEST}") is None:
                    continue  # retired since it was listed: no checkpoint any more
                log.warning("tardigrade: leaving %s as it is: %s", self.path(name), e)
                marks.kept.add(name)
                continue
            marks.files.update(data_path(name, f) for f in m.files)
            save_id = m.raw.get("save_id")
            if isinstance(save_id, str) and save_id:
                marks.owners[name] = self.commit.data_name("", save_id)
        return marks

    def tidy(
        self,
        *,
        dry_run: bool = False,
        progress: Callable[[Tidied], None] | None = None,
        fenced: bool = True,
    ) -> list[Tidied]:
        """Clean up what dead writers left here (``collect``, the commit strategy's
        ``leftovers``, the backend's own ``Storage.tidy``), and, with ``fenced``,
        the checkpoints a writer committed after it lost the lease (``fence``; a caller that
        lists the root next retires those from its own listing: ``retire_fenced``).
        ``progress`` is called with each leftover once it is dealt with. The caller holds the
        lease."""
        done = self.collect(dry_run=dry_run, progress=progress)
        done += self.commit.leftovers(dry_run=dry_run, progress=progress)
        done += self.storage.tidy(dry_run=dry_run, progress=progress)
        if fenced and self.fences():  # one stat, once per catalog
            done += self.retire_fenced(self.scan().fenced, dry_run=dry_run, progress=progress)
        # Last: what the steps above removed (a dead save's staging, a half-deleted checkpoint)
        # no longer holds its shared objects.
        done += self.sweep_shared(dry_run=dry_run, progress=progress)
        return done
