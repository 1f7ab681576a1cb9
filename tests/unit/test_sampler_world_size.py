"""A ResumableSampler saved by a 4-rank job resumes on 2 and on 3 ranks without a gap or a repeat.

In process, no ``torch.distributed``: each rank is a sampler built with an explicit ``rank`` and
``world_size`` and a DataLoader over it, and the ranks take one batch per step in lockstep, as
DDP does. The reference is the *uninterrupted* global order, read from a 1-rank sampler that is
iterated, not from ``order()``: after the resume, the ranks of the new job must together yield
exactly the rest of that order (as a multiset, and position by position: new rank ``r`` of
``M`` takes global positions ``c + r, c + r + M, ...``), and the next epoch must be the next
epoch an uninterrupted run yields, on every rank.

The 4 ranks' saved states must be equal: ``tg.save`` stores the sampler once, as a replicated
value, and a collective save refuses values that differ between ranks. They are equal at every
lockstep step, the epoch's last one included: when that step holds fewer samples than ranks,
the pass is padded with the epoch's first indices so every rank still gets a batch. Padding
follows the real positions of a pass (global positions ``>= n``), so the references below are
the uninterrupted order with that padding appended (:func:`padded`).
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Generator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import tardigrade as tg

pytestmark = pytest.mark.timeout(120)

OLD_WORLD = 4


def loader_for(sampler: tg.ResumableSampler, n: int, bs: int, workers: int) -> DataLoader:
    ds = TensorDataset(torch.arange(n))
    if workers == 0:
        return DataLoader(ds, batch_size=bs, sampler=sampler, generator=sampler.generator)
    return DataLoader(
        ds,
        batch_size=bs,
        sampler=sampler,
        num_workers=workers,
        prefetch_factor=4,  # the loader runs well ahead of the training loop
        generator=sampler.generator,
    )


def batch_stream(
    sampler: tg.ResumableSampler, loader: DataLoader, tracked: bool
) -> Generator[list[int], None, None]:
    """One pass (the rest of the current epoch) as the training loop sees it."""
    source = sampler.track(loader) if tracked else loader
    for (batch,) in source:
        yield batch.tolist()


def one_pass(samplers: list[tg.ResumableSampler], n: int, bs: int, mode: str) -> list[list[int]]:
    """Every rank runs one pass to its end; what each rank yielded, in order."""
    tracked, workers = mode != "plain", 1 if mode == "track_workers" else 0
    return [
        [i for b in batch_stream(s, loader_for(s, n, bs, workers), tracked) for i in b]
        for s in samplers
    ]


def global_order(epoch: int, n: int, seed: int) -> list[int]:
    """The uninterrupted order of ``epoch``: what one rank alone yields, pass after pass."""
    s = tg.ResumableSampler(n, seed=seed)
    for _ in range(epoch):
        list(s)
    assert s.epoch == epoch
    return [int(i) for i in s]


def padded(order: list[int], start: int, world: int) -> list[int]:
    """A pass from ``start`` on ``world`` ranks, globally: the rest of ``order``, then padding.

    Positions ``n, n + 1, ...`` up to the next multiple of ``world`` past ``start`` repeat the
    epoch's first indices, as ``DistributedSampler(drop_last=False)`` pads.
    """
    n = len(order)
    return order[start:] + [order[j % n] for j in range(-(n - start) % world)]


def interleave(per_rank: list[list[int]]) -> list[int]:
    """Rank ``r``'s ``j``-th sample is global position ``r + j * world``: put them back in order."""
    out: list[int] = []
    for row in itertools.zip_longest(*per_rank):
        out.extend(i for i in row if i is not None)
    return out


def run_old_job(
    n: int, bs: int, seed: int, start: int, k: int, mode: str
) -> tuple[list[dict[str, Any]], list[int]]:
    """A 4-rank job from global position ``start`` of epoch 0, ``k`` lockstep steps; states, seen."""
    tracked, workers = mode != "plain", 1 if mode == "track_workers" else 0
    ranks = [
        tg.ResumableSampler(n, seed=seed, rank=r, world_size=OLD_WORLD) for r in range(OLD_WORLD)
    ]
    for s in ranks:
        s.load_state_dict({**s.state_dict(), "consumed": start})
    streams = [batch_stream(s, loader_for(s, n, bs, workers), tracked) for s in ranks]
    seen: list[list[int]] = [[] for _ in ranks]
    for _ in range(k):
        for r, stream in enumerate(streams):
            seen[r].extend(next(stream))
    # Saved inside the training loop: prefetching workers are still running ahead.
    states = [s.state_dict() for s in ranks]
    for stream in streams:
        stream.close()
    return states, interleave(seen)


def save_points(n: int, bs: int, start: int) -> list[int]:
    """Every lockstep step count of the pass from ``start``, the epoch's last step included."""
    per_rank = -(-(n - start) // OLD_WORLD)  # padded: the same on every rank
    return list(range(-(-per_rank // bs) + 1))


def check_resume(n: int, bs: int, seed: int, start: int, k: int, new_world: int, mode: str) -> None:
    where = f"n={n} bs={bs} seed={seed} start={start} k={k} 4 -> {new_world} ranks, {mode}"
    epoch0, epoch1, epoch2 = (global_order(e, n, seed) for e in range(3))
    states, seen = run_old_job(n, bs, seed, start, k, mode)

    assert all(st == states[0] for st in states), f"{where}: ranks disagree: {states}"
    consumed = start + k * bs * OLD_WORLD
    done = k == save_points(n, bs, start)[-1]
    assert (states[0]["epoch"], states[0]["consumed"]) == ((1, 0) if done else (0, consumed)), where
    old_pass = padded(epoch0, start, OLD_WORLD)
    assert seen == (old_pass if done else old_pass[: consumed - start]), (
        f"{where}: the old job strayed from the global order"
    )

    new = [
        tg.ResumableSampler(n, seed=seed, rank=r, world_size=new_world) for r in range(new_world)
    ]
    for s in new:
        s.load_state_dict(states[0])
    rest = one_pass(new, n, bs, mode)
    expected, following = (epoch1, epoch2) if done else (epoch0, epoch1)
    resumed_at = 0 if done else consumed

    # The real positions: exactly the rest of the uninterrupted order, nothing else.
    real = interleave(rest)[: n - resumed_at]
    missing = collections.Counter(expected[resumed_at:]) - collections.Counter(real)
    extra = collections.Counter(real) - collections.Counter(expected[resumed_at:])
    assert not missing and not extra, (
        f"{where}: skipped {sorted(missing.elements())}, repeated or foreign "
        f"{sorted(extra.elements())}"
    )
    new_pass = padded(expected, resumed_at, new_world)
    assert len({len(mine) for mine in rest}) == 1, f"{where}: ranks got {list(map(len, rest))}"
    for r, mine in enumerate(rest):
        assert mine == new_pass[r::new_world], f"{where}: new rank {r} took the wrong positions"
    assert interleave(rest) == new_pass, where
    next_epoch = 2 if done else 1
    assert all((s.epoch, s.consumed) == (next_epoch, 0) for s in new), where

    # The next epoch: the same as an uninterrupted run's, globally and on every new rank.
    nxt = one_pass(new, n, bs, mode)
    assert interleave(nxt) == padded(following, 0, new_world), (
        f"{where}: the next epoch differs from the reference"
    )
    fresh = [
        tg.ResumableSampler(n, seed=seed, rank=r, world_size=new_world) for r in range(new_world)
    ]
    for _ in range(next_epoch):
        one_pass(fresh, n, bs, mode)
    assert nxt == one_pass(fresh, n, bs, mode), (
        f"{where}: the next epoch's per-rank split differs from an uninterrupted "
        f"{new_world}-rank run"
    )


# 23, 25, 35 and 47 are divisible by none of 4, 3, 2.
@pytest.mark.parametrize("new_world", [2, 3])
@pytest.mark.parametrize("seed", [0, 7, 2024])
@pytest.mark.parametrize(("n", "bs"), [(23, 2), (25, 1), (35, 3), (47, 2), (24, 3)])
@pytest.mark.parametrize("start", [0, 5])
def test_a_4_rank_save_resumes_on_fewer_ranks_without_a_gap_or_a_repeat(
    n: int, bs: int, seed: int, start: int, new_world: int
) -> None:
    # start=5: the 4-rank job itself resumed a job of another world size, so its positions
    # are odd too and not multiples of 2, 3 or 4.
    points = save_points(n, bs, start)
    assert len(points) >= 2, "too few save points for this case to mean anything"
    for k in points:
        check_resume(n, bs, seed, start, k, new_world, "plain")


@pytest.mark.parametrize("new_world", [2, 3])
@pytest.mark.parametrize(("n", "bs", "start"), [(25, 2, 0), (35, 3, 5)])
def test_a_4_rank_save_through_track_resumes_on_fewer_ranks(
    n: int, bs: int, start: int, new_world: int
) -> None:
    for k in save_points(n, bs, start):
        check_resume(n, bs, 3, start, k, new_world, "track")


@pytest.mark.slow
@pytest.mark.parametrize("new_world", [2, 3])
def test_a_4_rank_save_with_prefetching_workers_resumes_on_fewer_ranks(new_world: int) -> None:
    n, bs, start = 47, 2, 5
    points = save_points(n, bs, start)
    # Mid-epoch points where the global position is not a multiple of the new world size.
    for k in (1, 3, points[-1]):
        assert (start + k * bs * OLD_WORLD) % new_world
        check_resume(n, bs, 9, start, k, new_world, "track_workers")


def test_the_cases_include_positions_that_are_not_multiples_of_the_new_world_size() -> None:
    # Guards the parametrization above: resuming at a multiple of M only would hide an
    # off-by-rank slice.
    for new_world in (2, 3):
        positions = {
            start + k * bs * OLD_WORLD
            for n, bs in [(23, 2), (25, 1), (35, 3), (47, 2), (24, 3)]
            for start in (0, 5)
            for k in save_points(n, bs, start)
        }
        assert any(p % new_world for p in positions), new_world
