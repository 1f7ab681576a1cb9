"""Does a set of integer boxes tile a region exactly? In O(n log n) for every layout writers make.

A tensor's chunks must cover it exactly once. Comparing every pair of chunks is quadratic, and a
hostile manifest within the caps could hold millions, so the check works by structure instead:

- dims every box spans completely are dropped (a row split of a 5-d tensor is a 1-d problem);
- 1 split dim: sorted intervals must follow each other with no gap or overlap;
- 2 split dims: a sweep in the order of the boxes' starts along one dim, keeping the "skyline"
  (how far each stretch of the other dim is filled) as sorted breakpoints. In an exact tiling
  every box starts exactly on the skyline over its whole width; conversely, boxes that all
  start on the skyline are disjoint. Any tiling in 2-d works, guillotine or not;
- 3 or more split dims: cut the region where no box straddles a plane (all such planes of one
  dim at once) and check each slab on its own, which takes a grid (what a device mesh makes)
  apart in one pass per dim. A small remainder no plane separates is compared pairwise; a large
  one, or a layout that needs too many cuts, is refused as too complex to check.

A sub-region whose boxes' volumes do not sum to its own volume cannot be tiled exactly, which,
given that the volumes sum to the whole region's (checked first), means two boxes overlap.
"""

from __future__ import annotations

import bisect
import math
import operator
from collections.abc import Sequence

__all__ = [
    "TilingError",
    "check_exact_tiling",
]

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (lo, hi), hi exclusive


_FEW = 6  # below this many boxes comparing every pair is the cheapest check


class TilingError(Exception):
    """The boxes do not tile the region exactly; ``args[0]`` says how."""


def _volume(lo: Sequence[int], hi: Sequence[int]) -> int:
    return math.prod(map(operator.sub, hi, lo))


def check_exact_tiling(boxes: list[Box], shape: Sequence[int], max_stuck: int) -> None:
    """Raise TilingError unless the non-empty ``boxes`` (inside ``shape``) tile it exactly.

    ``max_stuck`` bounds a set of boxes in 3+ split dims that no plane separates, which is
    compared pairwise.
    """
    n = len(boxes)
    if n <= _FEW:
        _check_pairwise(boxes)  # the volumes are equal, so disjoint means an exact tiling
        return
    budget = n * (n.bit_length() + 2) + 4096  # box visits; a grid needs one per split dim
    work: list[tuple[list[Box], tuple[int, ...], tuple[int, ...]]] = [
        (boxes, (0,) * len(shape), tuple(shape))
    ]
    while work:
        part, lo, hi = work.pop()
        budget -= len(part)
        if budget < 0:
            raise TilingError("its chunk layout needs too many cuts to check; it is not a grid")
        if sum(_volume(a, b) for a, b in part) != _volume(lo, hi):
            raise TilingError("two of its chunks overlap")
        # Split dims: those where some box does not span the region (columns via zip, in C).
        los, his = zip(*part, strict=True)
        split = [
            k
            for k, (col_lo, col_hi) in enumerate(
                zip(zip(*los, strict=True), zip(*his, strict=True), strict=True)
            )
            if col_lo.count(lo[k]) != len(part) or col_hi.count(hi[k]) != len(part)
        ]
        if not split:
            if len(part) > 1:  # equal volumes, all spanning the region: copies of one box
                raise TilingError("two of its chunks overlap")
            continue
        if len(split) == 1:
            _check_1d(part, split[0], lo[split[0]], hi[split[0]])
        elif len(split) == 2:
            _check_2d(part, split, lo, hi)
        else:
            pieces = _cut(part, split, lo, hi)
            if pieces is not None:
                work.extend(pieces)
            elif len(part) <= max_stuck:
                _check_pairwise(part)
            else:
                raise TilingError(
                    f"{len(part)} of its chunks split {len(split)} dims in a layout no plane "
                    "separates, too complex to check (writers emit rows or grids)"
                )


def _check_1d(part: list[Box], k: int, lo: int, hi: int) -> None:
    pos = lo
    for a, b in sorted((a[k], b[k]) for a, b in part):
        if a != pos:
            raise TilingError("two of its chunks overlap" if a < pos else "its chunks leave a gap")
        pos = b
    if pos != hi:
        raise TilingError("its chunks leave a gap")


def _check_2d(part: list[Box], split: list[int], lo: tuple[int, ...], hi: tuple[int, ...]) -> None:
    # Sweep along the dim whose partner has fewer distinct boundaries: that bounds the skyline.
    k0, k1 = split
    if len({a[k0] for a, _ in part}) < len({a[k1] for a, _ in part}):
        k0, k1 = k1, k0
    starts = [lo[k1]]  # skyline: stretch j covers [starts[j], starts[j+1]) up to heights[j]
    heights = [lo[k0]]
    end = hi[k1]
    for a0, b0, a1, b1 in sorted((a[k0], b[k0], a[k1], b[k1]) for a, b in part):
        j = bisect.bisect_right(starts, a1) - 1
        stop = starts[j + 1] if j + 1 < len(starts) else end
        if heights[j] != a0 or stop < b1:
            raise TilingError("two of its chunks overlap")
        # Raise [a1, b1) to b0, splitting stretch j, then merge equal neighbours.
        new_s, new_h = [a1], [b0]
        if a1 > starts[j]:
            new_s.insert(0, starts[j])
            new_h.insert(0, heights[j])
        if b1 < stop:
            new_s.append(b1)
            new_h.append(heights[j])
        first = j
        if new_s[0] == a1 and j > 0 and heights[j - 1] == b0:
            first = j - 1
            new_s[0], new_h[0] = starts[j - 1], b0
        last = j + 1
        if b1 == stop and last < len(starts) and heights[last] == new_h[-1]:
            last += 1
        starts[first:last] = new_s
        heights[first:last] = new_h


def _cut(
    part: list[Box], split: list[int], lo: tuple[int, ...], hi: tuple[int, ...]
) -> list[tuple[list[Box], tuple[int, ...], tuple[int, ...]]] | None:
    """Slabs between every plane of one dim that no box straddles, or None if there is none."""
    for k in split:
        order = sorted(part, key=lambda box: box[0][k])
        pieces = []
        start, reach, first = lo[k], order[0][1][k], 0
        for i in range(1, len(order)):
            a = order[i][0][k]
            if a >= reach:  # nothing before i crosses the plane at `a`: cut there
                pieces.append((order[first:i], start, a))
                start, first = a, i
            reach = max(reach, order[i][1][k])
        if not pieces:
            continue
        pieces.append((order[first:], start, hi[k]))
        return [
            (boxes, (*lo[:k], s, *lo[k + 1 :]), (*hi[:k], e, *hi[k + 1 :]))
            for boxes, s, e in pieces
        ]
    return None


def _check_pairwise(part: list[Box]) -> None:
    order = sorted(part)
    for x, (lo1, hi1) in enumerate(order):
        for lo2, hi2 in order[x + 1 :]:
            if lo2[0] >= hi1[0]:
                break  # sorted by the first dim: nothing later reaches back into this box
            if all(
                max(p1, p2) < min(q1, q2) for p1, q1, p2, q2 in zip(lo1, hi1, lo2, hi2, strict=True)
            ):
                raise TilingError("two of its chunks overlap")
