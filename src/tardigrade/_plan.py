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
from dataclasses import dataclass

from ._sharding import Box
from ._tree import Entry, Flat
from .errors import InvalidArgumentError
from .format.dtypes import ITEMSIZE
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


@dataclass(frozen=True)
class WriteItem:
    """One chunk of a checkpoint: rows ``[start, stop)`` of local entry ``entry`` (the whole
    tensor for 0-d), which are the box at ``offsets`` of ``shape`` of manifest tensor
    ``tensor``."""

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
        b = None if box is None else Box(tuple(box[0]), tuple(box[1]))  # type: ignore[index]
        return LocalEntry(dtype, tuple(shape), numpy, b, name)  # type: ignore[arg-type]


@dataclass(frozen=True)
class LocalPlan:
    """One rank's tensors: ``shared`` (one per leaf of the state outside ``tg.PerRank``, the
    same leaves on every rank) and ``own`` (its per-rank subtrees' tensors)."""

    shared: tuple[LocalEntry, ...]
    own: tuple[LocalEntry, ...]

    def signature(self) -> str:
        """A digest of what the global plan depends on: equal signatures, equal plans."""
        return hashlib.blake2b(self.to_bytes(), digest_size=16).hexdigest()

    def to_bytes(self) -> bytes:
        doc = {"shared": [e.to_json() for e in self.shared], "own": [e.to_json() for e in self.own]}
        return json.dumps(doc, separators=(",", ":")).encode()

    @staticmethod
    def from_bytes(raw: bytes) -> LocalPlan:
        doc = json.loads(raw)
        return LocalPlan(
            tuple(LocalEntry.from_json(e) for e in doc["shared"]),
            tuple(LocalEntry.from_json(e) for e in doc["own"]),
        )


@dataclass(frozen=True)
class TensorRecord:
    """A tensor of the checkpoint as the manifest lists it (its chunks come from the plans)."""

    dtype: str
    shape: tuple[int, ...]  # global
    numpy: bool
    layout: str  # REPLICATED, SHARDED or PER_RANK
    rank: int | None = None  # the rank a PER_RANK tensor belongs to


@dataclass(frozen=True)
class GlobalPlan:
    tensors: tuple[TensorRecord, ...]
    ranks: tuple[SavePlan, ...]  # each rank's final plan
    own_base: tuple[int, ...]  # the manifest index of each rank's first own tensor

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.ranks)


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


@dataclass(frozen=True)
class _Unit:
    """A run of rows of one local tensor that some rank must write, and who can write it."""

    holders: tuple[int, ...]  # ranks holding these bytes; () = every rank
    entry: int  # local entry index on the holders
    tensor: int
    start: int
    stop: int
    offsets: tuple[int, ...]  # of row `start` in the global tensor
    shape: tuple[int, ...]  # of the chunk
    nbytes: int
    dtype: str
    name: str


def _rows(
    e: LocalEntry, entry: int, tensor: int, origin: tuple[int, ...], holders: tuple[int, ...],
    target: int,
) -> list[_Unit]:  # fmt: skip
    """Split a local tensor into row runs of at most ``target`` bytes (whole if it is 0-d)."""
    nbytes = math.prod(e.shape) * ITEMSIZE[e.dtype]
    rows = e.shape[0] if e.shape else 1
    if not e.shape or nbytes <= target or rows <= 1:
        return [_Unit(holders, entry, tensor, 0, rows, origin, e.shape, nbytes, e.dtype, e.name)]
    row_bytes = nbytes // rows
    per = max(1, target // max(1, row_bytes))
    return [
        _Unit(
            holders, entry, tensor, start, min(rows, start + per),
            (origin[0] + start, *origin[1:]), (min(rows, start + per) - start, *e.shape[1:]),
            (min(rows, start + per) - start) * row_bytes, e.dtype, e.name,
        )
        for start in range(0, rows, per)
    ]  # fmt: skip


def _disagree(what: str, i: int, name: str, ranks: Sequence[int], detail: str) -> Exception:
    return InvalidArgumentError(
        f"state[{name!r}] (tensor #{i}): {what} differs between ranks {list(ranks)}: {detail}. "
        "Every rank must save the same leaves; wrap values that differ per rank in tg.PerRank "
        "and pieces of one tensor in tg.Sharded (or use DTensor)."
    )


def _check_shared(plans: Sequence[LocalPlan]) -> None:
    """Every rank must hold the same shared leaves: same count, kinds, dtypes, global shapes."""
    first = plans[0].shared
    for r, p in enumerate(plans[1:], 1):
        if len(p.shared) != len(first):
            raise InvalidArgumentError(
                f"rank {r} saves {len(p.shared)} tensors outside tg.PerRank and rank 0 saves "
                f"{len(first)}: every rank must save the same state tree (wrap what differs "
                "per rank in tg.PerRank)."
            )
        if p.shared == first:
            continue
        for i, (a, b) in enumerate(zip(first, p.shared, strict=True)):
            if (a.box is None) != (b.box is None):
                raise _disagree("being sharded", i, a.name, [0, r], "sharded on one, not the other")
            if a.dtype != b.dtype:
                raise _disagree("the dtype", i, a.name, [0, r], f"{a.dtype} vs {b.dtype}")
            ga = a.shape if a.box is None else a.box.global_shape
            gb = b.shape if b.box is None else b.box.global_shape
            if ga != gb:
                raise _disagree("the shape", i, a.name, [0, r], f"{list(ga)} vs {list(gb)}")


Piece = tuple[tuple[int, ...], tuple[int, ...]]  # offsets and shape of a box


def _pieces(plans: Sequence[LocalPlan], i: int) -> dict[Piece, list[int]]:
    """The distinct pieces of sharded tensor ``i``, each with the ranks holding it."""
    pieces: dict[Piece, list[int]] = {}
    for r, p in enumerate(plans):
        e = p.shared[i]
        assert e.box is not None
        pieces.setdefault((e.box.offsets, e.shape), []).append(r)
    shape = plans[0].shared[i].box.global_shape  # type: ignore[union-attr]
    boxes = [(o, tuple(a + n for a, n in zip(o, s, strict=True))) for o, s in pieces if 0 not in s]
    try:
        if sum(math.prod(s) for _, s in pieces) != math.prod(shape):
            raise TilingError("their volumes do not add up to the tensor's")
        check_exact_tiling(boxes, list(shape), max(64, 4 * len(boxes)))
    except TilingError as e:
        name = plans[0].shared[i].name
        raise InvalidArgumentError(
            f"state[{name!r}]: the ranks' pieces of this sharded tensor (global shape "
            f"{list(shape)}) do not cover it exactly once ({e}); pieces: "
            + ", ".join(f"rank {rs[0]}: offsets {list(o)} shape {list(s)}"
                        for (o, s), rs in list(pieces.items())[:8])
        ) from None  # fmt: skip
    return pieces


def global_plan(
    plans: Sequence[LocalPlan],
    *,
    max_files: int = DEFAULT_MAX_FILES,
    chunk_bytes: int = CHUNK_BYTES,
) -> GlobalPlan:
    """Merge every rank's local plan into the tensor table and each rank's files.

    Deterministic: the same local plans give the same global plan. Raises
    InvalidArgumentError naming the leaf when ranks disagree on the shared state or the
    pieces of a sharded tensor do not tile it exactly once.
    """
    world = len(plans)
    _check_shared(plans)
    shared = plans[0].shared
    tensors: list[TensorRecord] = []
    units: list[_Unit] = []
    if world == 1:
        # One process: files of similar size, tensors split only to balance them (the
        # layout of every single-process checkpoint so far).
        total = sum(math.prod(e.shape) * ITEMSIZE[e.dtype] for e in (*shared, *plans[0].own))
        n_files = max(1, min(max_files, math.ceil(total / MIN_FILE_BYTES)))
        chunk_bytes = max(1, math.ceil(total / n_files))
    for i, e in enumerate(shared):
        if e.box is None:
            tensors.append(TensorRecord(e.dtype, e.shape, e.numpy, REPLICATED))
            units += _rows(e, i, i, (0,) * len(e.shape), (), chunk_bytes)
            continue
        tensors.append(TensorRecord(e.dtype, e.box.global_shape, e.numpy, SHARDED))
        for (offsets, shape), holders in _pieces(plans, i).items():
            held = LocalEntry(e.dtype, shape, e.numpy, None, e.name)
            h = () if len(holders) == world else tuple(holders)
            units += _rows(held, i, i, offsets, h, chunk_bytes)
    own_base = []
    for r, p in enumerate(plans):
        own_base.append(len(tensors))
        for j, e in enumerate(p.own):
            tensors.append(TensorRecord(e.dtype, e.shape, e.numpy, PER_RANK, r))
            t = len(tensors) - 1
            units += _rows(e, len(shared) + j, t, (0,) * len(e.shape), (r,), chunk_bytes)
    owners = _assign(units, world)
    unique = KeyMaker()
    per_rank: list[list[WriteItem]] = [[] for _ in range(world)]
    for u, r in zip(units, owners, strict=True):
        split = u.start != 0 or u.stop != (u.shape[0] if u.shape else 1)
        tensor = tensors[u.tensor]
        if tensor.layout == SHARDED:
            wanted = f"{u.name}@{','.join(map(str, u.offsets))}"
        elif split:
            wanted = f"{u.name}@{u.start}"
        else:
            wanted = u.name
        key = unique(wanted)
        per_rank[r].append(
            WriteItem(
                u.entry, key, u.start, u.stop, u.nbytes, u.tensor, u.offsets, u.shape, u.dtype
            )
        )
    return GlobalPlan(
        tuple(tensors),
        tuple(_files(items, r, world, max_files) for r, items in enumerate(per_rank)),
        tuple(own_base),
    )


def _assign(units: Sequence[_Unit], world: int) -> list[int]:
    """Who writes each unit: its only holder, else the least loaded holder, largest first."""
    loads = [0] * world
    owner = [0] * len(units)
    flexible = []
    for k, u in enumerate(units):
        if len(u.holders) == 1:
            owner[k] = u.holders[0]
            loads[owner[k]] += u.nbytes
        elif world == 1:
            owner[k] = 0
        else:
            flexible.append(k)
    heap = [(load, r) for r, load in enumerate(loads)]
    heapq.heapify(heap)
    for k in sorted(flexible, key=lambda k: (-units[k].nbytes, k)):
        u = units[k]
        if u.holders:
            r = min(u.holders, key=lambda r: (loads[r], r))
        else:
            while True:  # entries go stale as loads grow; skip those
                load, r = heapq.heappop(heap)
                if load == loads[r]:
                    break
        owner[k] = r
        loads[r] += u.nbytes
        heapq.heappush(heap, (loads[r], r))
    return owner


def _files(items: list[WriteItem], rank: int, world: int, max_files: int) -> SavePlan:
    """Spread one rank's items over files of similar size."""
    total = sum(it.nbytes for it in items)
    n_files = max(1, min(max_files, math.ceil(total / MIN_FILE_BYTES)))
    # Largest first into the least loaded file balances bytes across writer threads.
    loads = [0] * n_files
    bins: list[list[WriteItem]] = [[] for _ in range(n_files)]
    for item in sorted(items, key=lambda it: -it.nbytes):
        k = loads.index(min(loads))
        bins[k].append(item)
        loads[k] += item.nbytes
    prefix = "data" if world == 1 else f"data-r{rank:05d}"
    # In-file order: largest item size first keeps every tensor aligned to its dtype (as
    # safetensors does); the writer and the stager both follow this order.
    return SavePlan(
        tuple(
            FilePlan(
                f"{prefix}-{k:05d}-of-{n_files:05d}.safetensors",
                tuple(sorted(b, key=lambda it: (-ITEMSIZE[it.dtype], it.entry, it.start))),
            )
            for k, b in enumerate(bins)
        )
    )


def plan_files(flat: Flat, *, max_files: int = DEFAULT_MAX_FILES) -> SavePlan:
    """The files of a single-process save of ``flat``."""
    return global_plan([local_plan(flat)], max_files=max_files).ranks[0]
