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
from typing import NamedTuple

import numpy as np

from ._sharding import Box
from ._tree import Entry, Flat
from .errors import InvalidArgumentError
from .format.dtypes import ITEMSIZE
from .format.jsonio import gc_paused
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
        b = None if box is None else Box(tuple(box[0]), tuple(box[1]))  # type: ignore[index]
        return LocalEntry(dtype, tuple(shape), numpy, b, name)  # type: ignore[arg-type]


@dataclass(frozen=True)
class LocalPlan:
    """One rank's tensors: ``shared`` (one per leaf of the state outside ``tg.PerRank``, the
    same leaves on every rank) and ``own`` (its per-rank subtrees' tensors)."""

    shared: tuple[LocalEntry, ...]
    own: tuple[LocalEntry, ...]

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
        """A digest of what the global plan depends on: equal signatures, equal plans."""
        h = hashlib.blake2b(self.to_bytes(full=False), digest_size=16)
        return h.hexdigest()

    def to_bytes(self, *, full: bool = True) -> bytes:
        """The wire form: a JSON header (this rank's own tensors, the agreed ``meta``, and
        with ``full`` every shared leaf), a NUL, then the sharded pieces as int64 (``boxes``).

        Only the coordinator's own plan needs ``full``: every other rank's shared leaves are
        the coordinator's but for where its pieces sit, which travel as packed integers (a
        job of 1,024 ranks holding 2,000 sharded tensors sends no JSON per tensor).
        """
        doc: dict[str, object] = {"meta": self.meta(), "own": [e.to_json() for e in self.own]}
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


class _Unit(NamedTuple):
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


def _pieces(
    name: str, shape: tuple[int, ...], boxes: np.ndarray
) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """The distinct pieces of one sharded tensor: (offsets, shape, ranks holding it).

    ``boxes`` holds each rank's piece as a row of offsets then shape. Raises
    InvalidArgumentError unless the pieces cover the tensor exactly once.
    """
    d = len(shape)
    uniq, inverse = np.unique(boxes, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    order = np.argsort(inverse, kind="stable")
    if len(uniq) == len(boxes):  # every rank its own piece (the usual case): no grouping
        holders = [(r,) for r in order.tolist()]
    else:
        cuts = np.searchsorted(inverse[order], np.arange(1, len(uniq)))
        holders = [tuple(g.tolist()) for g in np.split(order, cuts)]
    offs, sizes = uniq[:, :d], uniq[:, d:]
    pieces = [
        (tuple(o), tuple(n), h)
        for o, n, h in zip(offs.tolist(), sizes.tolist(), holders, strict=True)
    ]
    if d == 0:
        return pieces[:1]
    full = np.array(shape, dtype=np.int64)
    try:
        if bool(np.any(offs + sizes > full)):
            raise TilingError("a piece reaches past the tensor")
        if sum(math.prod(n) for _, n, _ in pieces) != math.prod(shape):
            raise TilingError("their volumes do not add up to the tensor's")
        live = np.all(sizes > 0, axis=1)
        if bool(np.all(offs[:, 1:] == 0)) and bool(np.all(sizes[:, 1:] == full[1:])):
            # Row slabs, the usual sharding: sorted, each must start where the last ended.
            starts = np.sort(offs[live, 0])
            ends = np.sort(offs[live, 0] + sizes[live, 0])
            if len(starts) and (starts[0] != 0 or np.any(starts[1:] != ends[:-1])):
                raise TilingError("the row ranges overlap or leave a gap")
        else:
            boxes_ = [(o, tuple(a + b for a, b in zip(o, n, strict=True))) for o, n, _ in pieces
                      if 0 not in n]  # fmt: skip
            check_exact_tiling(boxes_, list(shape), max(64, 4 * len(boxes_)))
    except TilingError as e:
        raise InvalidArgumentError(
            f"state[{name!r}]: the ranks' pieces of this sharded tensor (global shape "
            f"{list(shape)}) do not cover it exactly once ({e}); pieces: "
            + ", ".join(f"rank {h[0]}: offsets {list(o)} shape {list(n)}"
                        for o, n, h in pieces[:8])
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
    InvalidArgumentError when ranks disagree on the shared leaves or the pieces of a sharded
    tensor do not tile it exactly once.
    """
    return _merge(
        plans[0].shared,
        [p.meta() for p in plans],
        [p.boxes() for p in plans],
        [p.own for p in plans],
        max_files,
        chunk_bytes,
    )


def global_plan_from_wire(
    payloads: Sequence[bytes],
    *,
    max_files: int = DEFAULT_MAX_FILES,
    chunk_bytes: int = CHUNK_BYTES,
) -> GlobalPlan:
    """``global_plan`` of ``LocalPlan.to_bytes`` payloads, the first one ``full``."""
    metas, boxes, owns = [], [], []
    shared: tuple[LocalEntry, ...] = ()
    for r, raw in enumerate(payloads):
        cut = raw.index(b"\0")
        doc = json.loads(raw[:cut])
        if r == 0:
            shared = tuple(LocalEntry.from_json(e) for e in doc["shared"])
        metas.append(doc["meta"])
        owns.append(tuple(LocalEntry.from_json(e) for e in doc["own"]))
        boxes.append(np.frombuffer(raw[cut + 1 :], dtype=np.int64))
    return _merge(shared, metas, boxes, owns, max_files, chunk_bytes)


# A large job's plan is millions of small acyclic objects; each cycle collection started while
# building them would walk all of them again.
@gc_paused()
def _merge(
    shared: tuple[LocalEntry, ...],
    metas: list[str],
    boxes: list[np.ndarray],
    owns: list[tuple[LocalEntry, ...]],
    max_files: int,
    chunk_bytes: int,
) -> GlobalPlan:
    world = len(metas)
    for r in range(1, world):
        if metas[r] != metas[0]:
            raise InvalidArgumentError(
                f"rank {r} saves other tensors than rank 0 outside tg.PerRank (a different "
                "number, dtype, global shape or sharding): every rank must save the same "
                "state tree; wrap what differs per rank in tg.PerRank."
            )
    table = np.stack(boxes) if world and len(boxes[0]) else np.zeros((world, 0), np.int64)
    tensors: list[TensorRecord] = []
    units: list[_Unit] = []
    if world == 1:
        # One process: files of similar size, tensors split only to balance them (the
        # layout of every single-process checkpoint so far).
        total = sum(math.prod(e.shape) * ITEMSIZE[e.dtype] for e in (*shared, *owns[0]))
        n_files = max(1, min(max_files, math.ceil(total / MIN_FILE_BYTES)))
        chunk_bytes = max(1, math.ceil(total / n_files))
    pos = 0
    for i, e in enumerate(shared):
        if e.box is None:
            tensors.append(TensorRecord(e.dtype, e.shape, e.numpy, REPLICATED))
            units += _rows(e, i, i, (0,) * len(e.shape), (), chunk_bytes)
            continue
        shape = e.box.global_shape
        tensors.append(TensorRecord(e.dtype, shape, e.numpy, SHARDED))
        d = len(shape)
        for offsets, size, holders in _pieces(e.name, shape, table[:, pos : pos + 2 * d]):
            held = LocalEntry(e.dtype, size, e.numpy, None, e.name)
            h = () if len(holders) == world else holders
            units += _rows(held, i, i, offsets, h, chunk_bytes)
        pos += 2 * d
    own_base = []
    for r, own in enumerate(owns):
        own_base.append(len(tensors))
        for j, e in enumerate(own):
            tensors.append(TensorRecord(e.dtype, e.shape, e.numpy, PER_RANK, r))
            t = len(tensors) - 1
            units += _rows(e, len(shared) + j, t, (0,) * len(e.shape), (r,), chunk_bytes)
    owners = _assign(units, world)
    unique = KeyMaker()
    per_rank: list[list[WriteItem]] = [[] for _ in range(world)]
    for u, r in zip(units, owners, strict=True):
        if tensors[u.tensor].layout == SHARDED:
            wanted = f"{u.name}@{','.join(map(str, u.offsets))}"
        elif u.start != 0 or u.stop != (u.shape[0] if u.shape else 1):
            wanted = f"{u.name}@{u.start}"
        else:
            wanted = u.name
        per_rank[r].append(
            WriteItem(u.entry, unique(wanted), u.start, u.stop, u.nbytes, u.tensor, u.offsets,
                      u.shape, u.dtype)
        )  # fmt: skip
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
    total = sum([it.nbytes for it in items])
    n_files = max(1, min(max_files, math.ceil(total / MIN_FILE_BYTES)))
    # Largest first into the least loaded file balances bytes across writer threads.
    loads = [0] * n_files
    bins: list[list[WriteItem]] = [[] for _ in range(n_files)]
    if n_files == 1:
        bins[0] = items
    else:
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
