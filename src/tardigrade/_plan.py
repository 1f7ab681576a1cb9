"""The save planner: which bytes go into which file. Plain frozen data, no I/O.

Distributed and async saves reuse these plans unchanged: a plan item names an entry (a stored
tensor), the slice of it to write, and the file it goes to; writers only move those bytes.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from ._tree import Entry
from .format.dtypes import ITEMSIZE

# A file smaller than this is not worth a thread of its own.
MIN_FILE_BYTES = 64 * 1024 * 1024
# Data files of one save; each is written by its own thread.
DEFAULT_MAX_FILES = max(2, min(8, os.cpu_count() or 2))


@dataclass(frozen=True)
class WriteItem:
    """Rows ``[start, stop)`` along dim 0 of entry ``entry`` (the whole tensor for 0-d)."""

    entry: int
    key: str
    start: int
    stop: int
    nbytes: int


@dataclass(frozen=True)
class FilePlan:
    name: str
    items: tuple[WriteItem, ...]

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.items)


@dataclass(frozen=True)
class SavePlan:
    files: tuple[FilePlan, ...]

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)


def entry_key(entry: Entry) -> str:
    """A readable safetensors key: the tree path of the entry's first leaf (maybe not unique)."""
    return "/".join(str(p) for p in entry.paths[0]) if entry.paths and entry.paths[0] else "root"


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


def plan_files(entries: list[Entry], *, max_files: int = DEFAULT_MAX_FILES) -> SavePlan:
    """Spread entries over files of similar size, splitting large tensors by rows."""
    total = sum(e.tensor.numel() * ITEMSIZE[e.dtype] for e in entries)
    n_files = max(1, min(max_files, math.ceil(total / MIN_FILE_BYTES)))
    target = max(1, math.ceil(total / n_files))
    unique = KeyMaker()
    items: list[WriteItem] = []
    for i, e in enumerate(entries):
        key = entry_key(e)
        t = e.tensor
        nbytes = t.numel() * ITEMSIZE[e.dtype]
        rows = t.shape[0] if t.dim() else 1
        if nbytes > target and t.dim() and rows > 1:
            row_bytes = nbytes // rows
            per = max(1, target // max(1, row_bytes))
            for start in range(0, rows, per):
                stop = min(rows, start + per)
                items.append(
                    WriteItem(i, unique(f"{key}@{start}"), start, stop, (stop - start) * row_bytes)
                )
        else:
            items.append(WriteItem(i, unique(key), 0, rows, nbytes))
    # Largest first into the least loaded file balances bytes across writer threads.
    loads = [0] * n_files
    bins: list[list[WriteItem]] = [[] for _ in range(n_files)]
    for item in sorted(items, key=lambda it: -it.nbytes):
        k = loads.index(min(loads))
        bins[k].append(item)
        loads[k] += item.nbytes
    # In-file order: largest item size first keeps every tensor aligned to its dtype (as
    # safetensors does); the writer and the stager both follow this order.
    files = tuple(
        FilePlan(
            f"data-{k:05d}-of-{n_files:05d}.safetensors",
            tuple(
                sorted(b, key=lambda it: (-ITEMSIZE[entries[it.entry].dtype], it.entry, it.start))
            ),
        )
        for k, b in enumerate(bins)
    )
    return SavePlan(files)
