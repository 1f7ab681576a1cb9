"""Leaf classes of a distributed state: sharded tensors and per-rank values.

Every leaf of a distributed state is one of three classes (README, "Distributed"). A plain tensor is
*replicated* (every rank holds the same values, as under DDP) and is written once in total. A
``DTensor`` or a :class:`Sharded` is *sharded*: each rank holds one box of a global tensor and
writes only that box. A :class:`PerRank` subtree is each rank's own value. This module only
describes leaves; it never talks to other ranks, so the single-process pipeline can use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .errors import InvalidArgumentError, UnsupportedTypeError

__all__ = ["Box", "PerRank", "Sharded", "box_of"]


@dataclass(frozen=True)
class Box:
    """Where a local tensor sits in its global tensor: per-dimension offsets and global shape."""

    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]


class Sharded:
    """A piece of a global tensor held by this rank: ``local`` sits at ``offsets`` of a tensor
    of ``global_shape`` (e.g. this rank's rows of an embedding table).

    >>> rows = table_rows_of_this_rank()              # doctest: +SKIP
    >>> state = {"emb": tg.Sharded(rows, offsets=(start, 0), global_shape=(n_rows, dim))}
    >>> tg.save("ckpt/step-100", state)               # every rank writes its own rows

    The pieces of all ranks must cover the global tensor exactly once (pieces held by several
    ranks with the same box count once: written by one of them). On load the live ``Sharded``
    receives exactly its box, whatever the pieces were at save time (resharding); loading the
    checkpoint without ``into=`` returns the whole global tensor.
    """

    __slots__ = ("global_shape", "local", "offsets")

    def __init__(
        self, local: torch.Tensor, offsets: Sequence[int], global_shape: Sequence[int]
    ) -> None:
        if not isinstance(local, torch.Tensor) or local.layout != torch.strided:
            raise InvalidArgumentError(
                f"tg.Sharded takes a dense tensor as its local piece, got {type(local).__name__}"
            )
        offsets = tuple(offsets)
        global_shape = tuple(global_shape)
        if not (
            len(offsets) == len(global_shape) == local.dim()
            and all(type(n) is int and n >= 0 for n in (*offsets, *global_shape))
        ):
            raise InvalidArgumentError(
                f"tg.Sharded: offsets {list(offsets)} and global_shape {list(global_shape)} "
                f"must be non-negative ints, one per dimension of the local piece "
                f"(shape {list(local.shape)})"
            )
        for d, (o, n, g) in enumerate(zip(offsets, local.shape, global_shape, strict=True)):
            if o + n > g:
                raise InvalidArgumentError(
                    f"tg.Sharded: the local piece (shape {list(local.shape)}) at offsets "
                    f"{list(offsets)} reaches past dimension {d} of global_shape "
                    f"{list(global_shape)}"
                )
        self.local = local
        self.offsets = offsets
        self.global_shape = global_shape

    def __repr__(self) -> str:
        return (
            f"tg.Sharded(local={self.local.dtype}{list(self.local.shape)}, "
            f"offsets={list(self.offsets)}, global_shape={list(self.global_shape)})"
        )


class PerRank:
    """Each rank's own value for a subtree (data position, RNG, worker state, user state).

    >>> state = {"model": model, "rng": tg.PerRank(tg.RNGState()), "seen": tg.PerRank(counts)}

    Plain values outside a ``PerRank`` must be equal on every rank (a difference is an error
    naming the key and the ranks). On load rank r gets what rank r saved; a rank that did not
    exist at save time gets rank 0's value (``per_rank_fallback="rank0"``, the default) or an
    error (``"error"``). In one process without ``torch.distributed`` it is rank 0's value.
    """

    __slots__ = ("value",)
    value: Any

    def __init__(self, value: Any) -> None:
        if isinstance(value, PerRank):
            value = value.value
        self.value = value

    def __repr__(self) -> str:
        return f"tg.PerRank({self.value!r})"


def is_dtensor(t: Any) -> bool:
    cls = type(t)
    return cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed")


def box_of(obj: Any, path_text: str) -> tuple[torch.Tensor, Box] | None:
    """The local tensor and box of a sharded leaf (``Sharded`` or ``DTensor``); None otherwise."""
    if isinstance(obj, Sharded):
        return obj.local, Box(obj.offsets, obj.global_shape)
    if not is_dtensor(obj):
        return None
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for p in obj.placements:
        if type(p) not in (Shard, Replicate):
            raise UnsupportedTypeError(
                f"{path_text}: a DTensor with placement {p} cannot be saved; only Shard(d) and "
                "Replicate placements hold final values. Redistribute it (e.g. "
                "t.redistribute(placements=[Replicate()])) before saving."
            )
    local = obj.to_local()
    shape, offsets = compute_local_shape_and_global_offset(
        obj.shape, obj.device_mesh, obj.placements
    )
    if tuple(shape) != tuple(local.shape):
        raise UnsupportedTypeError(
            f"{path_text}: a DTensor's local tensor has shape {list(local.shape)} but its "
            f"placements give {list(shape)}; save t.full_tensor() instead."
        )
    return local, Box(tuple(int(o) for o in offsets), tuple(int(n) for n in obj.shape))
