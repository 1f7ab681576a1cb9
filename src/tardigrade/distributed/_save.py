"""A collective save: every rank writes its own files into one staging location, rank 0 commits.

The phases, each one exchange through :class:`Ranks` (an error on any rank raises the same
error on every rank, and nothing is committed):

1. **begin**: every rank flattens its state and describes it (its target: path, overwrite,
   step, epoch and metadata; the local plan's signature and a digest of its state tree); the
   coordinator checks that the ranks agree on the target and the tree and what is at the path,
   and, when every rank's tensors are laid out as at the previous save, reuses that save's
   plan and opens the staging location at once;
2. **plan** (only when the layout changed): local plans are gathered, the coordinator builds
   the global plan (who writes which chunk, which files) and hands each rank its own;
3. **write + commit**: every rank writes its files into the staging location and sends back
   their sizes and checksums and its per-rank subtrees; the coordinator builds the manifest,
   checks it as a reader would, and commits. A failure anywhere removes the staging location.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from .. import _sinks
from .._async import stage_entries
from .._commit import commit_for
from .._plan import (
    GlobalPlan,
    LocalPlan,
    SavePlan,
    global_plan_from_wire,
    local_plan,
    plan_from_wire,
)
from .._save_job import SaveJob, SaveOptions, SaveResult, check_target, make_header
from .._sinks import Sink
from .._staging import SlabPool
from .._tiers import copy_file
from .._tree import Flat, flatten, path_str
from .._write import (
    WrittenFile,
    commit_staging,
    committed_here,
    end_staging,
    manifest_doc,
    per_rank_trees,
    raise_save_error,
    save_result,
    seal_checked,
    stream_borrowed,
    write_files,
)
from ..errors import DistributedError, InvalidArgumentError
from ..format.jsonio import dumps
from ..format.manifest import data_path
from ..storage import Storage, storage_for
from ._collectives import Ranks


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


@dataclass
class _Cached:
    """The last plan of this process's group: reused while no rank's layout changes."""

    plan_id: str
    signature: str
    plan: SavePlan
    gplan: GlobalPlan | None  # on the coordinator


# Keyed by the group itself, held weakly: a group destroyed and made again (perhaps at the same
# address) starts without a plan, and the cache never keeps a group alive.
_cache: weakref.WeakKeyDictionary[Any, _Cached] = weakref.WeakKeyDictionary()


def _cache_key(ranks: Ranks) -> Any:
    return ranks.group


def first_difference(a: Any, b: Any, path: tuple[Any, ...] = ()) -> tuple[Any, ...]:
    """The path of the first node where two state skeletons differ (for error messages)."""
    if isinstance(a, dict) and isinstance(b, dict) and a.get("t") == b.get("t"):
        va, vb = a.get("v"), b.get("v")
        if a.get("t") in ("dict", "odict", "counter") and isinstance(va, list):
            if isinstance(vb, list) and len(va) == len(vb):
                for (ka, xa), (kb, xb) in zip(va, vb, strict=True):
                    key = ka.get("v") if isinstance(ka, dict) else ka
                    if ka != kb:
                        return (*path, key)
                    if xa != xb:
                        return first_difference(xa, xb, (*path, key))
            return path
        if isinstance(va, list) and isinstance(vb, list) and len(va) == len(vb):
            for i, (xa, xb) in enumerate(zip(va, vb, strict=True)):
                if xa != xb:
                    return first_difference(xa, xb, (*path, i))
        if isinstance(va, dict) and isinstance(vb, dict):
            return first_difference(va, vb, path)
    return path


def _raise_diverged(trees: list[bytes]) -> bytes:
    docs = [json.loads(t) for t in trees]
    bad = [r for r, d in enumerate(docs) if d != docs[0]]
    a, b = docs[0], docs[bad[0]]
    if a["tree"] == b["tree"]:
        # Same values; a tensor differs in dtype, global shape or being sharded.
        for x, y in zip(a["tensors"], b["tensors"], strict=False):
            if x != y:
                kind = lambda t: f"{t[1]}{t[2]}" + ("" if t[3] else " sharded")  # noqa: E731
                raise InvalidArgumentError(
                    f"state[{x[0]!r}] differs between rank 0 ({kind(x)}) and rank(s) {bad} "
                    f"(rank {bad[0]}: {kind(y)}): every rank must save tensors of the same "
                    "dtype and global shape; wrap pieces of one tensor in tg.Sharded (or use "
                    "DTensor) and each rank's own tensors in tg.PerRank."
                )
    where = path_str(first_difference(a["tree"], b["tree"]))
    raise InvalidArgumentError(
        f"{where} differs between rank 0 and rank(s) {bad}: outside tg.PerRank every rank "
        "must save the same values. Wrap what is each rank's own (RNG state, data position, "
        "counters) in tg.PerRank, or make the ranks agree."
    )


def _outcome(job: SaveJob, ranks: Ranks, e: BaseException) -> bool | None:
    """Whether a collective save that failed in its write-and-commit exchange committed.

    Rank 0 commits inside that exchange, and a rank may fail after it did (a peer died while
    the result was being sent; a rank gave up waiting just as rank 0 finished): every rank
    reads the outcome from storage. A rank other than rank 0 that lost it without a report
    (a transport error, no ``causes``) and finds nothing cannot rule out that rank 0 is still
    about to commit: unknown. Once rank 0 reported a failure, or on rank 0, it is settled.
    """
    committed = committed_here(job)
    lost = isinstance(e, DistributedError) and not getattr(e, "causes", None)
    if committed is False and lost and not ranks.coordinator:
        return None
    return committed


def _check_same_target(targets: list[dict[str, Any]]) -> None:
    """Raise, naming each argument and the ranks that differ from rank 0, unless all agree."""
    differ = []
    for arg, mine in targets[0].items():
        bad = [r for r, t in enumerate(targets) if t[arg] != mine]
        if not bad:
            continue
        if arg == "metadata":  # compared by digest: say only that it differs
            differ.append(f"metadata differs between rank 0 and rank(s) {bad}")
        else:
            theirs = targets[bad[0]][arg]
            differ.append(f"{arg}={mine!r} on rank 0 but {theirs!r} on rank(s) {bad}")
    if differ:
        raise InvalidArgumentError(
            f"tg.save {targets[0]['path']}: the ranks disagree on what to save: "
            + "; ".join(differ)
            + ". A collective save commits one checkpoint, so every rank must pass the same "
            "path, overwrite, step, epoch and metadata (metrics may differ: rank 0's are "
            "recorded). Nothing was written."
        )


class _Save:
    """One collective save, as seen by one rank."""

    def __init__(self, ranks: Ranks, path: Any, state: Any, options: SaveOptions) -> None:
        self.ranks = ranks
        self.path = path
        self.state = state
        self.options = options
        self.started = time.perf_counter()
        self.storage: Storage | None = None
        self.name = ""
        self.flat: Flat | None = None
        self.lp: LocalPlan | None = None
        self.header: dict[str, Any] = {}
        self.staging: str | None = None
        self.cached = _cache.get(_cache_key(ranks))
        # What rank sends at "begin" and how the writers get their bytes. An async save
        # describes and stages in the caller's thread and runs the rest in the background:
        # it replaces both (a failure while staging is then raised, on every rank, at begin).
        # None means ``describe``: a bound method stored here would make a reference cycle
        # keeping the state's tensors alive until the next garbage collection.
        self.begin_payload: Callable[[], bytes] | None = None
        self.make_streams: Callable[[SaveJob], list[Any]] = stream_borrowed

    # -- phase 1 -----------------------------------------------------------------------------

    def describe(self) -> bytes:
        overwrite = self.options.overwrite
        if not isinstance(overwrite, bool):
            raise InvalidArgumentError(f"overwrite must be a bool, got {overwrite!r}")
        self.storage, self.name = storage_for(self.path, self.options.storage_options)
        self.header = make_header(self.options, world_size=self.ranks.size)
        self.flat = flatten(self.state)
        self.lp = local_plan(self.flat)
        sig = self.signature()
        c = self.cached
        return _json(
            {
                "target": self.target(),
                # The tree and the tensors' dtypes and global shapes: what ranks must agree on.
                "tree": hashlib.blake2b(
                    dumps(self.flat.tree) + self.lp.meta().encode(), digest_size=16
                ).hexdigest(),
                "plan": c.plan_id if c is not None and c.signature == sig else None,
            }
        )

    def signature(self) -> str:
        """What a cached plan is valid for: this rank's layout, and whether (and how finely)
        the save shares data (a shared save plans a file per large chunk)."""
        assert self.lp is not None
        return f"{self.lp.signature()}/share={self.share}"

    @property
    def share(self) -> int:
        """The largest chunk of a shared object; 0: the save shares no data."""
        return self.options.share_chunk_bytes if self.options.shared is not None else 0

    def target(self) -> dict[str, Any]:
        """What decides what is committed, and where: every rank must pass the same.

        The coordinator alone commits, with its own path and header; a rank that meant
        another path, another step or no overwrite would otherwise be told its save
        succeeded. Metrics are not compared: they are often each rank's own (a local loss),
        and rank 0's are recorded.
        """
        assert self.storage is not None
        # Where every rank commits in its own storage, the paths differ by design.
        own = self.options.each_rank_commits
        return {
            "path": self.name if own else self.storage.url(self.name),
            "overwrite": self.options.overwrite,
            "step": self.header["step"],
            "epoch": self.header["epoch"],
            # A digest: metadata may be large, and only its equality matters here.
            "metadata": hashlib.blake2b(dumps(self.header["metadata"]), digest_size=16).hexdigest(),
            # Sharing data (a base, or a manager's dedup) lays out other files: all or none.
            "share": self.share,
        }

    def unstaged(self) -> tuple[int, ...]:
        """The replicated tensors an async save need not stage: when this rank's layout is
        the previous save's, those that plan gave to other ranks (each rank then stages about
        its share of a DDP model, not all of it). Recorded in the local plan, so that a new
        plan (another rank's layout changed) gives their chunks only to ranks that have them.
        """
        c, lp = self.cached, self.lp
        if c is None or lp is None or c.signature != self.signature():
            return ()
        mine = {it.entry for fp in c.plan.files for it in fp.items}
        skip = tuple(i for i, e in enumerate(lp.shared) if e.box is None and i not in mine)
        self.lp = replace(lp, unstaged=skip)
        return skip

    def open(self, payloads: list[bytes]) -> bytes:
        """Coordinator: check agreement and the target; reuse the plan if nobody's changed."""
        docs = [json.loads(p) for p in payloads]
        _check_same_target([d["target"] for d in docs])
        if any(d["tree"] != docs[0]["tree"] for d in docs):
            return _json({"diverged": True})
        assert self.storage is not None
        check_target(self.storage, self.name, self.options.overwrite)
        c = self.cached
        if c is not None and c.gplan is not None and all(d["plan"] == c.plan_id for d in docs):
            return _json({"plan_id": c.plan_id, **self._begin()})
        return _json({"plan_id": None})

    def _begin(self) -> dict[str, Any]:
        assert self.storage is not None
        save_id = self.header["save_id"]
        self.staging = commit_for(self.storage).begin(self.name, save_id)
        return {"save_id": save_id, "staging": self.staging}

    def tree_bytes(self) -> bytes:
        assert self.flat is not None and self.lp is not None
        tensors = [
            [e.name, e.dtype, list(e.shape if e.box is None else e.box.global_shape), e.box is None]
            for e in self.lp.shared
        ]
        return _json({"tree": json.loads(dumps(self.flat.tree)), "tensors": tensors})

    # -- phase 2 -----------------------------------------------------------------------------

    def plan(self, payloads: list[bytes]) -> bytes:
        """Coordinator: the global plan, cached, and every rank's own part of it."""
        gplan = global_plan_from_wire(payloads, max_files=self.options.max_files, share=self.share)
        plan_id = uuid.uuid4().hex
        _cache[_cache_key(self.ranks)] = _Cached(
            plan_id, self.signature(), gplan.rank_plan(0), gplan
        )
        # Every rank cuts its own plan from the chunk table (packed integers, not JSON).
        return _json({"plan_id": plan_id, **self._begin()}) + b"\0" + gplan.to_wire()

    # -- the whole save ----------------------------------------------------------------------

    def run(self) -> SaveResult:
        ranks = self.ranks
        verdict = json.loads(
            ranks.reduce("tg.save (begin)", self.begin_payload or self.describe, self.open)
        )
        if verdict.get("diverged"):
            # A second exchange, on this error path only, to name what differs.
            ranks.reduce("tg.save (comparing state trees)", self.tree_bytes, _raise_diverged)
            raise AssertionError("unreachable: the comparison always raises")
        assert self.lp is not None and self.flat is not None and self.storage is not None
        if verdict["plan_id"] is None:
            try:
                raw = ranks.reduce("tg.save (planning)", self.lp.to_bytes, self.plan)
            except BaseException:
                # Plan afresh next time: a stale plan would make the next async save stage
                # the same subset again.
                _cache.pop(_cache_key(ranks), None)
                raise
            cut = raw.index(b"\0")
            verdict = json.loads(raw[:cut])
            if not ranks.coordinator:
                plan = plan_from_wire(raw[cut + 1 :], ranks.rank, self.lp)
                _cache[_cache_key(ranks)] = _Cached(
                    verdict["plan_id"], self.signature(), plan, None
                )
        c = _cache[_cache_key(ranks)]
        self.header["save_id"] = verdict["save_id"]
        flat = self.flat
        assert flat is not None  # described before the ranks agreed on the plan
        job = SaveJob(
            self.storage, self.name, self.flat, c.plan, self.header, self.options.overwrite,
            self.started, c.gplan, shared=self.options.shared,
        )  # fmt: skip
        own = self.options.each_rank_commits
        staging: str | None = verdict["staging"]
        if own and not ranks.coordinator:
            staging = None  # begun here, inside the exchange: a failure reaches every rank

        def write() -> bytes:
            nonlocal staging
            try:
                if staging is None:
                    check_target(job.storage, job.name, job.overwrite)
                    staging = job.commit.begin(job.name, job.header["save_id"])
                written = write_files(job, staging, self.make_streams(job))
            except Exception as e:  # reaches every rank as the SaveError a save raises
                raise_save_error(job, e)
            return _json(
                {
                    "files": {
                        n: [w.size, w.header_checksum, w.checksums, w.shared, w.written]
                        for n, w in written.items()
                    },
                    "per_rank": [sub.tree for sub in flat.per_rank],
                    "own": [len(sub.entries) for sub in flat.per_rank],
                    "packed": flat.uses_packed,
                }
            )

        def commit(payloads: list[bytes]) -> bytes:
            assert c.gplan is not None
            written: dict[str, WrittenFile] = {}
            trees = []
            packed = False
            for r, p in enumerate(payloads):
                d = json.loads(p)
                packed = packed or d["packed"]
                for n, (size, head, sums, shared, wrote) in d["files"].items():
                    written[n] = WrittenFile(size, head, sums, shared, wrote)
                trees.append(per_rank_trees(d["per_rank"], d["own"], c.gplan.own_base[r]))
            assert staging is not None
            one_reference_each(job, staging, c.gplan.files, written)
            doc = manifest_doc(
                self.header,
                flat.tree,
                trees,
                c.gplan,
                written,
                packed=packed,
                stored_name=job.stored_name,
            )
            manifest = seal_checked(doc, job.storage.url(job.name))
            commit_staging(job, staging, manifest)
            mine = [w for w in written.values() if w.written]
            done = _json({"nbytes": sum(w.size for w in mine) + len(manifest),
                          "files": len(mine)})  # fmt: skip
            return done + b"\0" + manifest if own else done

        try:
            raw = ranks.reduce("tg.save (write and commit)", write, commit)
            done = json.loads(raw.split(b"\0", 1)[0])
            if own and not ranks.coordinator:
                # Every rank commits its own copy, with the manifest rank 0 built and committed.
                assert staging is not None
                commit_staging(job, staging, raw.split(b"\0", 1)[1])
        except BaseException as e:
            # The outcome first: past the commit point, aborting would delete the data of a
            # committed checkpoint (an object store's data objects are not in a staging dir).
            committed = _outcome(job, ranks, e)
            if staging is not None and (ranks.coordinator or own):
                end_staging(job, staging, committed)
            job.abandon_published()  # swept unless a committed checkpoint references them
            raise_save_error(job, e, committed)
        finally:
            job.unpin()  # committed, or failed on every rank: no sweep need spare them now
        return save_result(job, done["nbytes"], done["files"])


def one_reference_each(
    job: SaveJob, staging: str, files: Sequence[str], written: dict[str, WrittenFile]
) -> None:
    """Coordinator: a shared object two ranks both hold in this save (equal chunks: rows of
    zeros, say) stays the first file's; each later one becomes a plain data file of the save,
    a copy of the object made here, so every (file, key) of the manifest is referenced once,
    as in a single process (``SaveJob.claim``). Rare: ranks decide apart, each for its own
    chunks, and compare only here."""
    seen: set[str] = set()
    for n in files:
        w = written[n]
        if w.shared is None:
            continue
        if w.shared not in seen:
            seen.add(w.shared)
            continue
        copy_file(job.storage, data_path(job.name, w.shared), job.storage,
                  f"{staging}/{job.stored_name(n)}", w.size)  # fmt: skip
        written[n] = replace(w, shared=None, written=True)


def save_collective(ranks: Ranks, path: Any, state: Any, options: SaveOptions) -> SaveResult:
    """Save ``state`` collectively: every rank of ``ranks`` calls this with its own state."""
    return _Save(ranks, path, state, options).run()


def stage_collective(
    ranks: Ranks,
    pool: SlabPool,
    *,
    path: Any,
    state: Any,
    options: SaveOptions,
    sinks: Sequence[Sink] = (),
) -> Callable[[], SaveResult]:
    """The caller's half of an async collective save; returns the half to run in the background.

    Here, in the caller's thread: flatten the state (``state_dict()`` calls), describe it, and
    copy every local tensor into ``pool`` slabs, so training may mutate the state once this
    returns. The returned callable runs the whole protocol on ``ranks`` (a fork, so it never
    meets the training's collectives) from the staged copy, and gives the slabs back. A
    failure here is not raised here: it is raised at "begin" on every rank alike, as the
    synchronous save raises it, so no rank is left waiting for a peer that gave up.
    ``options`` are the save's knobs (``tg.save``'s). ``sinks``: the manager's other copies
    (its RAM tier's ``_ramtier.RamMirror``), fed this rank's files from the same staged copy.
    """
    save = _Save(ranks, path, state, options)
    staged = None
    try:
        payload = save.describe()
        assert save.flat is not None
        entries = [*save.flat.entries, *save.flat.own_entries()]
        skip = save.unstaged()
        staged = stage_entries(entries, pool, skip)
    except Exception as exc:
        failure = exc

        def fail() -> bytes:
            raise failure

        save.begin_payload = fail
    else:
        save.begin_payload = lambda: payload
        save.make_streams = _sinks.feed(sinks, staged.streams)
        # Only shapes are needed from here on: holding no live tensor means the background
        # cannot read memory that training mutates, nor keep freed tensors alive.
        for e in entries:
            e.tensor = torch.empty(e.tensor.shape, dtype=e.tensor.dtype, device="meta")
    save.state = None

    def background() -> SaveResult:
        try:
            return _sinks.after(sinks, save.run)
        finally:
            if staged is not None:
                staged.release()

    return background
