"""The save planner: which bytes go into which file, on which rank. Plain frozen data, no I/O.

A save has three planning steps, in one process as across a ``torch.distributed`` job (PyTorch
DCP's local -> global -> final plans): each rank describes the tensors it holds
(:func:`local_plan`); a coordinator merges every rank's description into the checkpoint's
tensor table and decides who writes which chunk (:func:`global_plan`): replicated tensors
once in total, balanced across ranks by bytes, each distinct piece of a sharded tensor once,
per-rank tensors by their rank; each rank then writes the files of its own final plan. A
write item names a global tensor, the box of it the chunk covers, and the rows of the rank's
local tensor that hold those bytes; writers only move those bytes.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np

from ._sharding import Box
from ._shared import SHARE_CHUNK_BYTES, SHARE_HEADER_BYTES, SHARE_MIN_BYTES
from ._tree import Entry, Flat
from .errors import InvalidArgumentError
from .format.dtypes import ITEMSIZE
from .format.jsonio import gc_paused
from .format.manifest import CANDIDATE, SHARED_KEY
from .format.tiling import TilingError, check_exact_tiling

# A file smaller than this is not worth a thread of its own.
MIN_FILE_BYTES = 64 * 1024 * 1024
# Data files of one save (per rank); each is written by its own thread.
DEFAULT_MAX_FILES = max(2, min(8, os.cpu_count() or 2))
# Largest chunk of a distributed save. A chunk is the unit a checksum covers, so a rank that
# needs part of one (resharding) reads all of it: small chunks bound that overhead, and they
# let replicated tensors be spread over ranks by bytes.
CHUNK_BYTES = 16 * 1024 * 1024

REPLICATED, SHARDED, PER_RANK = "replicated", "sharded", "per_rank"


class WriteItem(NamedTuple):
    """One chunk of a checkpoint: rows ``[start, stop)`` of local entry ``entry`` (the whole
    tensor for 0-d), which are the box at ``offsets`` of ``shape`` of manifest tensor
    ``tensor``. (A named tuple: a distributed plan holds one per chunk of every rank, and the
    coordinator makes a million of them for a large job.)"""

    entry: int
    key: str
    start: int
    stop: int
    nbytes: int
    tensor: int
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class FilePlan:
    name: str
    items: tuple[WriteItem, ...]

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.items)


@dataclass(frozen=True)
class SavePlan:
    """The files one rank writes."""

    files: tuple[FilePlan, ...]

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)


@dataclass(frozen=True)
class LocalEntry:
    """What the planner needs of one local tensor: never its values."""

    dtype: str
    shape: tuple[int, ...]  # the local tensor's
    numpy: bool = False
    box: Box | None = None  # a sharded piece's place in its global tensor
    name: str = ""  # a readable key (the tree path of its first leaf)

    def to_json(self) -> list[object]:
        box = None if self.box is None else [list(self.box.offsets), list(self.box.global_shape)]
        return [self.dtype, list(self.shape), self.numpy, box, self.name]

    @staticmethod
    def from_json(v: list[object]) -> LocalEntry:
        dtype, shape, numpy, box, name = v
        # The wire form this process's peers sent (``to_json``): its types are theirs.
        b = None if box is None else Box(tuple(box[0]), tuple(box[1]))  # type: ignore[index]  # a [lo, hi] pair of lists
        return LocalEntry(dtype, tuple(shape), numpy, b, name)  # type: ignore[arg-type]  # fields as to_json wrote them


@dataclass(frozen=True)
class LocalPlan:
    """One rank's tensors: ``shared`` (one per leaf of the state outside ``tg.PerRank``, the
    same leaves on every rank) and ``own`` (its per-rank subtrees' tensors).

    ``unstaged``: replicated shared entries this rank cannot write (an async save staged only
    the ones its previous plan gave it); the planner gives their chunks to other ranks.
    """

    shared: tuple[LocalEntry, ...]
    own: tuple[LocalEntry, ...]
    unstaged: tuple[int, ...] = ()

    def meta(self) -> str:
        """A digest of the shared leaves as every rank must agree on them: count, dtypes,
        global shapes, which are sharded (not where each rank's piece sits)."""
        h = hashlib.blake2b(digest_size=16)
        for e in self.shared:
            g = e.shape if e.box is None else e.box.global_shape
            h.update(f"{e.dtype}{g}{e.numpy}{e.box is None};".encode())
        return h.hexdigest()

    def boxes(self) -> np.ndarray:
        """The offsets and shape of each sharded piece, concatenated, as int64."""
        flat: list[int] = []
        for e in self.shared:
            if e.box is not None:
                flat += e.box.offsets
                flat += e.shape
        return np.array(flat, dtype=np.int64)

    def signature(self) -> str:
        """A digest of the layout the global plan depends on: equal signatures, equal plans
        (``unstaged`` aside: it only ever follows the plan it is compared with)."""
        h = hashlib.blake2b(replace(self, unstaged=()).to_bytes(full=False), digest_size=16)
        return h.hexdigest()

    def to_bytes(self, *, full: bool = True) -> bytes:
        """The wire form: a JSON header (this rank's own tensors, the agreed ``meta``, and
        with ``full`` every shared leaf), a NUL, then the sharded pieces as int64 (``boxes``).

        Only the coordinator's own plan needs ``full``: every other rank's shared leaves are
        the coordinator's but for where its pieces sit, which travel as packed integers (a
        job of 1,024 ranks holding 2,000 sharded tensors sends no JSON per tensor).
        """
        doc: dict[str, object] = {"meta": self.meta(), "own": [e.to_json() for e in self.own]}
        if self.unstaged:
            doc["unstaged"] = list(self.unstaged)
        if full:
            doc["shared"] = [e.to_json() for e in self.shared]
        return json.dumps(doc, separators=(",", ":")).encode() + b"\0" + self.boxes().tobytes()

    @staticmethod
    def from_bytes(raw: bytes) -> LocalPlan:
        """A full plan (``to_bytes(full=True)``)."""
        doc = json.loads(raw[: raw.index(b"\0")])
        return LocalPlan(
            tuple(LocalEntry.from_json(e) for e in doc["shared"]),
            tuple(LocalEntry.from_json(e) for e in doc["own"]),
            tuple(doc.get("unstaged", ())),
        )


@dataclass(frozen=True)
class TensorRecord:
    """A tensor of the checkpoint as the manifest lists it (its chunks come from the plans)."""

    dtype: str
    shape: tuple[int, ...]  # global
    numpy: bool
    layout: str  # REPLICATED, SHARDED or PER_RANK
    rank: int | None = None  # the rank a PER_RANK tensor belongs to
    name: str = ""  # readable: the tree path of its first leaf


# Columns of the chunk table: one row per chunk of the checkpoint, grouped by tensor in chunk
# order; then ``offsets`` and ``shape`` (``dims`` columns each, unused ones 0).
_OWNER, _FILE, _ENTRY, _START, _STOP, _TENSOR, _INDEX, _NBYTES = range(8)
_FIXED = 8


@dataclass(frozen=True, eq=False)
class GlobalPlan:
    """Every chunk of a save: who writes it, where, and what it holds.

    A table (numpy, one row per chunk, grouped by tensor) rather than objects: the coordinator
    of a large job plans millions of chunks, and the manifest and each rank's plan are cut
    from the table without a Python object per chunk.
    """

    tensors: tuple[TensorRecord, ...]
    files: tuple[str, ...]  # every data file, by rank then number (sorted by name)
    owners: tuple[int, ...]  # the rank writing each file
    file_rows: tuple[np.ndarray, ...]  # each file's chunk rows, in file order
    table: np.ndarray  # int64 [chunks, _FIXED + 2 * dims]
    dims: int
    own_base: tuple[int, ...]  # the manifest index of each rank's first own tensor
    keys: tuple[str, ...] | None  # readable safetensors keys per row (one process) or derived
    entries: tuple[tuple[LocalEntry, ...], ...]  # each rank's shared + own local entries

    @property
    def world(self) -> int:
        return len(self.own_base)

    @property
    def nbytes(self) -> int:
        return int(self.table[:, _NBYTES].sum())

    def tensor_rows(self) -> np.ndarray:
        """Where each tensor's chunk rows start (and, last, the number of rows)."""
        return np.searchsorted(self.table[:, _TENSOR], np.arange(len(self.tensors) + 1))

    def chunks(self, lo: int, hi: int, d: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The file index, offsets and shape of chunk rows ``lo:hi`` (of a ``d``-dim tensor)."""
        rows = self.table[lo:hi]
        dims = self.dims
        return (
            rows[:, _FILE],
            rows[:, _FIXED : _FIXED + d],
            rows[:, _FIXED + dims : _FIXED + dims + d],
        )

    def rank_plan(self, rank: int) -> SavePlan:
        """The files rank ``rank`` writes."""
        mine = [f for f, owner in enumerate(self.owners) if owner == rank]
        return _save_plan(
            [(self.files[f], self.table[self.file_rows[f]]) for f in mine],
            self.entries[rank],
            self.dims,
            None
            if self.keys is None
            else [[self.keys[r] for r in self.file_rows[f]] for f in mine],
        )

    @property
    def ranks(self) -> tuple[SavePlan, ...]:
        """Every rank's plan (for tests and single-process saves; a job asks ``rank_plan``)."""
        return tuple(self.rank_plan(r) for r in range(self.world))

    def to_wire(self) -> bytes:
        """What every rank needs to cut its own plan (``plan_from_wire``): file names, then
        the rows of the chunk table in file order, as int64."""
        order = np.concatenate([*self.file_rows, np.zeros(0, np.int64)])
        head = json.dumps(
            {"files": self.files, "owners": self.owners, "dims": self.dims}, separators=(",", ":")
        )
        return head.encode() + b"\0" + np.ascontiguousarray(self.table[order]).tobytes()


def plan_from_wire(raw: bytes, rank: int, local: LocalPlan) -> SavePlan:
    """Rank ``rank``'s plan from ``GlobalPlan.to_wire`` bytes and its own local plan."""
    cut = raw.index(b"\0")
    head = json.loads(raw[:cut])
    dims = head["dims"]
    table = np.frombuffer(raw[cut + 1 :], dtype=np.int64).reshape(-1, _FIXED + 2 * dims)
    table = table[table[:, _OWNER] == rank]  # in file order
    mine = [f for f, owner in enumerate(head["owners"]) if owner == rank]
    cuts = np.searchsorted(table[:, _FILE], mine[1:])
    return _save_plan(
        [(head["files"][f], rows) for f, rows in zip(mine, np.split(table, cuts), strict=True)],
        (*local.shared, *local.own),
        dims,
        None,
    )


def _save_plan(
    files: list[tuple[str, np.ndarray]],
    entries: Sequence[LocalEntry],
    dims: int,
    keys: list[list[str]] | None,
) -> SavePlan:
    """Write items from chunk-table rows (each file's, in file order).

    Without ``keys`` a chunk's safetensors key is derived: ``name@tensor.index`` (the text
    after the last ``@`` names the chunk, so keys are unique whatever the names hold).
    """
    out = []
    for k, (name, rows) in enumerate(files):
        items = []
        for n, row in enumerate(rows.tolist()):
            e = entries[row[_ENTRY]]
            d = len(e.shape)
            if is_candidate(name):
                key = SHARED_KEY
            elif keys is not None:
                key = keys[k][n]
            else:
                key = f"{e.name}@{row[_TENSOR]}.{row[_INDEX]}"
            items.append(
                WriteItem(
                    row[_ENTRY], key, row[_START], row[_STOP], row[_NBYTES], row[_TENSOR],
                    tuple(row[_FIXED : _FIXED + d]),
                    tuple(row[_FIXED + dims : _FIXED + dims + d]),
                    e.dtype,
                )
            )  # fmt: skip
        out.append(FilePlan(name, tuple(items)))
    return SavePlan(tuple(out))


def entry_key(entry: Entry) -> str:
    """A readable safetensors key: the tree path of the entry's first leaf (maybe not unique)."""
    return "/".join(str(p) for p in entry.paths[0]) if entry.paths and entry.paths[0] else "root"


def local_plan(flat: Flat) -> LocalPlan:
    def describe(e: Entry) -> LocalEntry:
        return LocalEntry(e.dtype, tuple(e.tensor.shape), e.numpy, e.box, entry_key(e))

    return LocalPlan(
        tuple(describe(e) for e in flat.entries), tuple(describe(e) for e in flat.own_entries())
    )


class KeyMaker:
    """Hands out safetensors keys that are unique by construction.

    Readable keys come from tree paths, and a split tensor's chunks add ``@row``; a user's own
    key may spell exactly such a name (``"w@0"``), and ``5`` and ``"5"`` print alike. Every
    key is therefore checked against all keys handed out so far, and a taken one gets the
    first free ``#n`` suffix.
    """

    def __init__(self) -> None:
        self.used: set[str] = set()

    def __call__(self, wanted: str) -> str:
        key, n = wanted, 1
        while key in self.used:
            n += 1
            key = f"{wanted}#{n}"
        self.used.add(key)
        return key


class _Pieces(NamedTuple):
    """Runs of rows some rank must write, one per row: where each sits in its global tensor,
    its size, and who may write it (``holder``: a rank, ALL, or SUBSET - k for ``subsets[k]``)."""

    offsets: np.ndarray  # int64 [n, d]
    sizes: np.ndarray  # int64 [n, d]
    holder: np.ndarray  # int64 [n]


ALL, SUBSET = -1, -2


def _pieces(
    name: str, shape: tuple[int, ...], boxes: np.ndarray, subsets: list[tuple[int, ...]]
) -> _Pieces:
    """The distinct pieces of one sharded tensor, and who holds each.

    ``boxes`` holds each rank's piece as a row of offsets then shape. A piece several ranks
    hold gets a holder from ``subsets`` (appended to). Raises InvalidArgumentError unless the
    pieces cover the tensor exactly once.
    """
    d, world = len(shape), len(boxes)
    # Sorted by box: pieces in order of their place in the tensor, equal ones side by side.
    order = np.lexsort(boxes.T[::-1]) if d else np.arange(world)
    ranked = boxes[order]
    new = np.ones(world, dtype=bool)
    if world > 1:
        new[1:] = (ranked[1:] != ranked[:-1]).any(axis=1)
    starts = np.flatnonzero(new)
    uniq = ranked[starts]
    holder = order[starts].astype(np.int64)
    if len(starts) != world:  # some piece is held by several ranks
        counts = np.diff(np.append(starts, world))
        for k in np.flatnonzero(counts > 1).tolist():
            group = order[starts[k] : starts[k] + counts[k]].tolist()
            if len(group) == world:
                holder[k] = ALL
            else:
                holder[k] = SUBSET - len(subsets)
                subsets.append(tuple(sorted(group)))
    offs, sizes = uniq[:, :d], uniq[:, d:]
    if d == 0:
        return _Pieces(offs[:1], sizes[:1], holder[:1])
    full = np.array(shape, dtype=np.int64)
    try:
        if bool((offs + sizes > full).any()):
            raise TilingError("a piece reaches past the tensor")
        if int(np.prod(sizes, axis=1).sum()) != math.prod(shape):
            raise TilingError("their volumes do not add up to the tensor's")
        live = (sizes > 0).all(axis=1)
        if bool((offs[:, 1:] == 0).all()) and bool((sizes[:, 1:] == full[1:]).all()):
            # Row slabs, the usual sharding: in order, each must start where the last ended.
            starts_, ends = offs[live, 0], offs[live, 0] + sizes[live, 0]
            if len(starts_) and (starts_[0] != 0 or (starts_[1:] != ends[:-1]).any()):
                raise TilingError("the row ranges overlap or leave a gap")
        else:
            boxes_ = [(o, tuple(a + b for a, b in zip(o, n, strict=True)))
                      for o, n in zip(offs[live].tolist(), sizes[live].tolist(), strict=True)]  # fmt: skip
            check_exact_tiling(boxes_, list(shape), max(64, 4 * len(boxes_)))
    except TilingError as e:
        first = lambda k: int(holder[k]) if holder[k] >= 0 else "several"  # noqa: E731
        raise InvalidArgumentError(
            f"state[{name!r}]: the ranks' pieces of this sharded tensor (global shape "
            f"{list(shape)}) do not cover it exactly once ({e}); pieces: "
            + ", ".join(f"rank {first(k)}: offsets {o} shape {n}" for k, (o, n) in
                        enumerate(zip(offs[:8].tolist(), sizes[:8].tolist(), strict=True)))
        ) from None  # fmt: skip
    return _Pieces(offs, sizes, holder)


def _split(p: _Pieces, itemsize: int, target: int) -> tuple[np.ndarray, ...]:
    """Cut pieces into row runs of at most ``target`` bytes (a 0-d or single-row piece, or
    one within ``target``, stays whole). Returns, per chunk: piece, start, stop (rows of the
    piece), offsets, shape and bytes."""
    n, d = p.sizes.shape
    if d == 0:
        one = np.ones(n, dtype=np.int64)
        return (np.arange(n), 0 * one, one, p.offsets, p.sizes, itemsize * one)
    rows = p.sizes[:, 0]
    row_bytes = np.prod(p.sizes[:, 1:], axis=1) * itemsize
    nbytes = rows * row_bytes
    per = np.maximum(1, target // np.maximum(1, row_bytes))
    whole = (nbytes <= target) | (rows <= 1)
    count = np.where(whole, 1, -(-rows // per))
    piece = np.repeat(np.arange(n), count)
    if len(piece) == n:  # no piece was cut (the usual case for a job's many small shards)
        return (piece, 0 * rows, rows, p.offsets, p.sizes, nbytes)
    k = np.arange(len(piece)) - np.repeat(np.cumsum(count) - count, count)
    start = k * per[piece]
    stop = np.where(whole[piece], rows[piece], np.minimum(rows[piece], start + per[piece]))
    offsets = p.offsets[piece]
    offsets[:, 0] += start
    shape = p.sizes[piece]
    shape[:, 0] = stop - start
    return (piece, start, stop, offsets, shape, (stop - start) * row_bytes[piece])


def global_plan(
    plans: Sequence[LocalPlan],
    *,
    max_files: int = DEFAULT_MAX_FILES,
    chunk_bytes: int = CHUNK_BYTES,
    share: bool = False,
    share_chunk_bytes: int = SHARE_CHUNK_BYTES,
) -> GlobalPlan:
    """Merge every rank's local plan into the tensor table and each rank's files.

    Deterministic: the same local plans give the same global plan. Raises
    InvalidArgumentError when ranks disagree on the shared leaves or the pieces of a sharded
    tensor do not tile it exactly once. ``share``: every chunk of ``SHARE_MIN_BYTES`` or
    more is a file of its own (a candidate shared object: ``is_candidate``), tensors split
    into chunks of at most ``share_chunk_bytes``.
    """
    return _merge(
        plans[0].shared,
        [p.meta() for p in plans],
        [p.boxes() for p in plans],
        [p.own for p in plans],
        max_files,
        chunk_bytes,
        [p.unstaged for p in plans],
        share=share_chunk_bytes if share else 0,
    )


def global_plan_from_wire(
    payloads: Sequence[bytes],
    *,
    max_files: int = DEFAULT_MAX_FILES,
    chunk_bytes: int = CHUNK_BYTES,
    share: int = 0,
) -> GlobalPlan:
    """``global_plan`` of ``LocalPlan.to_bytes`` payloads, the first one ``full``; ``share``:
    the largest chunk of a candidate shared object (0: the save shares no data)."""
    metas, boxes, owns, unstaged = [], [], [], []
    shared: tuple[LocalEntry, ...] = ()
    for r, raw in enumerate(payloads):
        cut = raw.index(b"\0")
        doc = json.loads(raw[:cut])
        if r == 0:
            shared = tuple(LocalEntry.from_json(e) for e in doc["shared"])
        metas.append(doc["meta"])
        owns.append(tuple(LocalEntry.from_json(e) for e in doc["own"]))
        unstaged.append(tuple(doc.get("unstaged", ())))
        boxes.append(np.frombuffer(raw[cut + 1 :], dtype=np.int64))
    return _merge(shared, metas, boxes, owns, max_files, chunk_bytes, unstaged, share=share)


# Building a plan makes many small acyclic objects; a cycle collection started meanwhile would
# walk all of them again.
@gc_paused()
def _merge(
    shared: tuple[LocalEntry, ...],
    metas: list[str],
    boxes: list[np.ndarray],
    owns: list[tuple[LocalEntry, ...]],
    max_files: int,
    chunk_bytes: int,
    unstaged: Sequence[tuple[int, ...]] = (),
    *,
    share: int = 0,
) -> GlobalPlan:
    """``share``: the largest chunk of a candidate shared object (0: no sharing)."""
    world = len(metas)
    for r in range(1, world):
        if metas[r] != metas[0]:
            raise InvalidArgumentError(
                f"rank {r} saves other tensors than rank 0 outside tg.PerRank (a different "
                "number, dtype, global shape or sharding): every rank must save the same "
                "state tree; wrap what differs per rank in tg.PerRank."
            )
    table = np.stack(boxes) if world and len(boxes[0]) else np.zeros((world, 0), np.int64)
    if share:
        # A shared object is one chunk; with its header, up to ``share`` bytes.
        chunk_bytes = max(1, share - SHARE_HEADER_BYTES)
    elif world == 1:
        # One process: files of similar size, tensors split only to balance them (the
        # layout of every single-process checkpoint so far).
        total = sum(math.prod(e.shape) * ITEMSIZE[e.dtype] for e in (*shared, *owns[0]))
        n_files = max(1, min(max_files, math.ceil(total / MIN_FILE_BYTES)))
        chunk_bytes = max(1, math.ceil(total / n_files))
    tensors: list[TensorRecord] = []
    subsets: list[tuple[int, ...]] = []
    parts: list[tuple[int, int, _Pieces]] = []  # (tensor, local entry, pieces)
    whole: list[tuple[int, int, int]] = []  # (tensor, local entry, holder): one piece each
    # Who may write each replicated entry: every rank but those that did not stage it.
    lacking: dict[int, list[int]] = {}
    for r, unstaged_here in enumerate(unstaged):
        for i in unstaged_here:
            lacking.setdefault(i, []).append(r)
    pos = 0
    for i, e in enumerate(shared):
        if e.box is None:
            tensors.append(TensorRecord(e.dtype, e.shape, e.numpy, REPLICATED, None, e.name))
            whole.append((i, i, _holder(i, e, lacking.get(i, ()), world, subsets)))
            continue
        shape = e.box.global_shape
        tensors.append(TensorRecord(e.dtype, shape, e.numpy, SHARDED, None, e.name))
        d = len(shape)
        parts.append((i, i, _pieces(e.name, shape, table[:, pos : pos + 2 * d], subsets)))
        pos += 2 * d
    own_base = []
    for r, own in enumerate(owns):
        own_base.append(len(tensors))
        for j, e in enumerate(own):
            tensors.append(TensorRecord(e.dtype, e.shape, e.numpy, PER_RANK, r, e.name))
            whole.append((len(tensors) - 1, len(shared) + j, r))
    dims = max((len(t.shape) for t in tensors), default=0)
    rows = _chunk_table(parts, whole, tensors, dims, chunk_bytes)
    rows[:, _OWNER] = _assign(rows[:, _OWNER], rows[:, _NBYTES], subsets, world)
    itemsize = np.array([ITEMSIZE[t.dtype] for t in tensors], dtype=np.int64)
    names, owners, file_rows = _files(rows, itemsize[rows[:, _TENSOR]], world, max_files, share)
    entries = tuple((*shared, *own) for own in owns)
    keys = _readable_keys(rows, tensors, entries[0]) if world == 1 else None
    return GlobalPlan(
        tuple(tensors), names, owners, file_rows, rows, dims, tuple(own_base), keys, entries
    )


def _holder(
    i: int, e: LocalEntry, lacking: Sequence[int], world: int, subsets: list[tuple[int, ...]]
) -> int:
    """The holder of replicated entry ``i`` that ranks ``lacking`` did not stage."""
    if not lacking:
        return ALL
    have = tuple(sorted(set(range(world)) - set(lacking)))
    if not have:
        raise InvalidArgumentError(
            f"state[{e.name!r}]: no rank staged this replicated tensor for the asynchronous "
            "save (the ranks' previous plans disagree); save again: the next save stages it"
        )
    if len(have) == 1:
        return have[0]
    subsets.append(have)
    return SUBSET - (len(subsets) - 1)


def _chunk_table(
    parts: list[tuple[int, int, _Pieces]],
    whole: list[tuple[int, int, int]],
    tensors: list[TensorRecord],
    dims: int,
    chunk_bytes: int,
) -> np.ndarray:
    """One row per chunk, grouped by tensor (the _OWNER column holds each chunk's holder
    until assigned). Whole tensors that stay one chunk, most of a state's tensors, are laid
    out together; the rest piece by piece, each into its place in one table."""
    small = []
    for tensor, entry, holder in whole:
        t = tensors[tensor]
        size = math.prod(t.shape) * ITEMSIZE[t.dtype]
        if not t.shape or size <= chunk_bytes or t.shape[0] <= 1:
            small.append((tensor, entry, holder, size))
        else:
            box = _Pieces(
                np.zeros((1, len(t.shape)), np.int64),
                np.array([t.shape], dtype=np.int64),
                np.array([holder], dtype=np.int64),
            )
            parts.append((tensor, entry, box))
    cut = [
        (tensor, entry, pieces, _split(pieces, ITEMSIZE[tensors[tensor].dtype], chunk_bytes))
        for tensor, entry, pieces in parts
    ]
    counts = np.ones(len(tensors), dtype=np.int64)
    for tensor, _, _, chunks in cut:
        counts[tensor] = len(chunks[0])
    first = np.cumsum(counts) - counts
    table = np.zeros((int(counts.sum()), _FIXED + 2 * dims), dtype=np.int64)
    for tensor, entry, pieces, (piece, start, stop, offsets, shape, nbytes) in cut:
        rows = table[first[tensor] : first[tensor] + len(piece)]
        rows[:, _OWNER] = pieces.holder[piece]
        rows[:, _ENTRY] = entry
        rows[:, _START] = start
        rows[:, _STOP] = stop
        rows[:, _TENSOR] = tensor
        rows[:, _INDEX] = np.arange(len(piece))
        rows[:, _NBYTES] = nbytes
        d = offsets.shape[1]
        rows[:, _FIXED : _FIXED + d] = offsets
        rows[:, _FIXED + dims : _FIXED + dims + d] = shape
    if small:
        at = first[[t for t, _, _, _ in small]]
        cols = np.array(small, dtype=np.int64)
        for column, values in zip((_TENSOR, _ENTRY, _OWNER, _NBYTES), cols.T, strict=True):
            table[at, column] = values
        shapes = [tensors[t].shape for t, _, _, _ in small]
        table[at, _STOP] = [s[0] if s else 1 for s in shapes]
        table[at, _FIXED + dims :] = [(*s, *(0,) * (dims - len(s))) for s in shapes]
    return table


def _assign(
    holder: np.ndarray, nbytes: np.ndarray, subsets: list[tuple[int, ...]], world: int
) -> np.ndarray:
    """Who writes each chunk: its only holder, else the least loaded holder, largest first."""
    owner = holder.copy()
    single = holder >= 0
    loads_ = np.zeros(world, dtype=np.int64)
    np.add.at(loads_, holder[single], nbytes[single])
    flexible = np.flatnonzero(~single)
    if world == 1:
        owner[flexible] = 0
        return owner
    loads = loads_.tolist()
    heap = [(load, r) for r, load in enumerate(loads)]
    heapq.heapify(heap)
    order = flexible[np.lexsort((flexible, -nbytes[flexible]))]
    for k, h, n in zip(order.tolist(), holder[order].tolist(), nbytes[order].tolist(),
                       strict=True):  # fmt: skip
        if h == ALL:
            while True:  # entries go stale as loads grow; skip those
                load, r = heapq.heappop(heap)
                if load == loads[r]:
                    break
        else:
            r = min(subsets[SUBSET - h], key=lambda r: (loads[r], r))
        owner[k] = r
        loads[r] += n
        heapq.heappush(heap, (loads[r], r))
    return owner


def _files(
    rows: np.ndarray, itemsize: np.ndarray, world: int, max_files: int, share: int = 0
) -> tuple[tuple[str, ...], tuple[int, ...], tuple[np.ndarray, ...]]:
    """Spread each rank's chunks over files of similar size; fills the _FILE column. With
    ``share`` (the largest chunk of a shared object), each chunk a shared object may hold
    (from SHARE_MIN_BYTES to twice that: a tensor that cannot be split finer is not one) is a
    file of its own, after the others.

    Returns the file names, their ranks, and each file's rows in file order.
    """
    owner, nbytes = rows[:, _OWNER], rows[:, _NBYTES]
    alone = (
        (nbytes >= SHARE_MIN_BYTES) & (nbytes <= 2 * share)
        if share
        else np.zeros(len(rows), dtype=bool)
    )
    by_rank = np.argsort(owner, kind="stable")
    bounds = np.searchsorted(owner[by_rank], np.arange(world + 1))
    # In-file order: largest item size first keeps every tensor aligned to its dtype (as
    # safetensors does); the writer and the stager both follow this order.
    names: list[str] = []
    owners: list[int] = []
    file_rows: list[np.ndarray] = []
    for r in range(world):
        mine = by_rank[bounds[r] : bounds[r + 1]]
        candidates = mine[alone[mine]]
        mine = mine[~alone[mine]]
        total = int(nbytes[mine].sum())
        n_files = max(1, min(max_files, math.ceil(total / MIN_FILE_BYTES)))
        if not len(mine) and len(candidates):
            n_files = 0  # every chunk a shared object: no data file of its own
        bins = np.zeros(len(mine), dtype=np.int64)
        if n_files > 1:
            # Largest first into the least loaded file balances bytes across writer threads.
            loads = [0] * n_files
            for k in np.argsort(-nbytes[mine], kind="stable").tolist():
                b = loads.index(min(loads))
                bins[k] = b
                loads[b] += int(nbytes[mine[k]])
        prefix = "data" if world == 1 else f"data-r{r:05d}"
        for b in range(n_files):
            sel = mine[bins == b]
            sel = sel[np.lexsort((rows[sel, _START], rows[sel, _ENTRY], -itemsize[sel]))]
            rows[sel, _FILE] = len(names)
            file_rows.append(sel)
            names.append(f"{prefix}-{b:05d}-of-{n_files:05d}.safetensors")
            owners.append(r)
        for k, row in enumerate(candidates.tolist()):
            rows[row, _FILE] = len(names)
            file_rows.append(np.array([row], dtype=np.int64))
            names.append(f"{prefix}{CANDIDATE}{k:05d}.safetensors")
            owners.append(r)
    return tuple(names), tuple(owners), tuple(file_rows)


def _readable_keys(
    rows: np.ndarray, tensors: list[TensorRecord], entries: tuple[LocalEntry, ...]
) -> tuple[str, ...]:
    """One process's safetensors keys: the tensor's tree path, ``@row`` for a split tensor's
    chunks, ``@offsets`` for a sharded one's (the names every single-process save had)."""
    unique = KeyMaker()
    keys = []
    for row in rows.tolist():
        t = tensors[row[_TENSOR]]
        e = entries[row[_ENTRY]]
        d = len(t.shape)
        if t.layout == SHARDED:
            wanted = f"{e.name}@{','.join(map(str, row[_FIXED : _FIXED + d]))}"
        elif row[_START] != 0 or row[_STOP] != (t.shape[0] if d else 1):
            wanted = f"{e.name}@{row[_START]}"
        else:
            wanted = e.name
        keys.append(unique(wanted))
    return tuple(keys)


def plan_files(flat: Flat, *, max_files: int = DEFAULT_MAX_FILES) -> SavePlan:
    """The files of a single-process save of ``flat``."""
    return global_plan([local_plan(flat)], max_files=max_files).rank_plan(0)


def is_candidate(file: str) -> bool:
    """Whether planned data file ``file`` holds one chunk a shared object may hold (its name
    in the checkpoint is decided by its bytes, or it is not written: ``_write``)."""
    return CANDIDATE in file
