"""ResumableSampler on several ranks when the epoch does not split evenly over them.

Every rank must take the same number of batches per epoch (a DDP rank with a batch fewer leaves
the others waiting in an all-reduce) and hold the same position after every step (a collective
``tg.save`` stores the sampler once and refuses ranks that disagree), the epoch's ragged last
step included. ``drop_last=False`` pads that step with the epoch's first indices, as
``DistributedSampler(drop_last=False)`` does; ``drop_last=True`` drops what is left after the
last whole global step, as ``DistributedSampler(drop_last=True)`` with a
``DataLoader(drop_last=True)`` does.

The references: ``torch.utils.data.DistributedSampler`` for a pass from the epoch's start, and
:func:`spec_pass` (the rule the docstring states, which agrees with ``DistributedSampler`` where
both apply) for a pass resumed anywhere in the epoch, read against the *uninterrupted* order
of a 1-rank sampler. Positions are tracked with their padding flag, so "no sample skipped or
repeated" is checked on the real positions exactly, and the padding is checked on its own.
"""

from __future__ import annotations

import copy
import itertools
import pickle
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

import tardigrade as tg

pytestmark = pytest.mark.timeout(300)

Item = tuple[int, bool]  # an index and whether it is padding


class Indices(torch.utils.data.Dataset[Any]):
    """``ds[i]`` is ``i`` itself: the batches hold the sampler's ``SampleIndex`` objects."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: Any) -> Any:
        return i


def loader_for(s: tg.ResumableSampler, bs: int) -> DataLoader:
    # The documented pairing: the loader's drop_last is the sampler's.
    return DataLoader(
        Indices(s.dataset_len),
        batch_size=bs,
        sampler=s,
        drop_last=s.drop_last,
        collate_fn=list,
        generator=s.generator,
    )


def items(batch: list[Any]) -> list[Item]:
    # getattr: the old sampler's indices have no flag; they then fail on the positions instead.
    return [(int(i), bool(getattr(i, "padding", False))) for i in batch]


def global_order(n: int, seed: int, epoch: int) -> list[int]:
    """The uninterrupted order of ``epoch``: what one rank alone yields, pass after pass."""
    s = tg.ResumableSampler(n, seed=seed)
    for _ in range(epoch):
        list(s)
    return [int(i) for i in s]


def spec_pass(order: list[int], start: int, world: int, bs: int, drop_last: bool) -> list[Item]:
    """A pass from global position ``start`` on ``world`` ranks, as one sequence.

    Rank ``r`` takes ``[r::world]`` of it. Without ``drop_last`` the pass runs to the next
    multiple of ``world`` past the end; positions ``p >= n`` pad with ``order[(p - n) % n]``.
    With ``drop_last`` it ends after the last whole step of ``world * bs`` positions.
    """
    n, left = len(order), len(order) - start
    count = left // (world * bs) * world * bs if drop_last else -(-left // world) * world
    return [
        (order[p], False) if p < n else (order[(p - n) % n], True)
        for p in range(start, start + count)
    ]


def per_rank_batches(seq: list[Item], world: int, bs: int) -> list[list[list[Item]]]:
    """``seq`` dealt to ``world`` ranks, each rank's share cut into batches of ``bs``."""
    shares = [seq[r::world] for r in range(world)]
    return [[share[i : i + bs] for i in range(0, len(share), bs)] for share in shares]


def make_ranks(
    n: int, world: int, bs: int, drop_last: bool, seed: int
) -> list[tg.ResumableSampler]:
    return [
        tg.ResumableSampler(
            n, seed=seed, rank=r, world_size=world, batch_size=bs, drop_last=drop_last
        )
        for r in range(world)
    ]


def lockstep(
    samplers: list[tg.ResumableSampler], bs: int, steps: int | None, mode: str, where: str
) -> list[list[list[Item]]]:
    """Every rank takes one batch a step, as DDP ranks do, for ``steps`` steps or to the end.

    After every step: every rank had a batch (or none had), the batches are the same size on
    every rank, and every rank reports the same ``state_dict()``.
    """
    loaders = [loader_for(s, bs) for s in samplers]
    assert len({len(lo) for lo in loaders}) == 1, f"{where}: len(loader) {list(map(len, loaders))}"
    sources: list[Iterator[Any]] = [
        iter(s.track(lo)) if mode == "track" else iter(lo)
        for s, lo in zip(samplers, loaders, strict=True)
    ]
    taken: list[list[list[Item]]] = [[] for _ in samplers]
    try:
        for step in itertools.count(1):
            if steps is not None and step > steps:
                break
            got = [next(src, None) for src in sources]
            if all(b is None for b in got):
                break
            short = [r for r, b in enumerate(got) if b is None]
            assert not short, (
                f"{where}: at step {step} rank(s) {short} have no batch, the others do"
            )
            sizes = [len(b) for b in got]
            assert len(set(sizes)) == 1, f"{where}: step {step} batch sizes {sizes}"
            states = [s.state_dict() for s in samplers]
            assert all(st == states[0] for st in states), f"{where}: step {step}: {states}"
            for r, b in enumerate(got):
                taken[r].append(items(b))
    finally:
        for src in sources:
            close = getattr(src, "close", None)
            if close is not None:
                close()
    if steps is not None:
        assert all(len(t) == steps for t in taken), f"{where}: fewer than {steps} steps"
    return taken


def interleave(per_rank: list[list[list[Item]]]) -> list[Item]:
    """Rank ``r``'s ``j``-th sample is position ``r + j * world``: back to global order."""
    flat = [[i for b in batches for i in b] for batches in per_rank]
    return [i for row in itertools.zip_longest(*flat) for i in row if i is not None]


# --------------------------------------------------------------------------------------------
# a pass from the epoch's start is DistributedSampler's


SIZES = [0, 1, 2, 3, 5, 7, 8, 11, 13, 23, 24, 25]


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_each_rank_gets_what_distributed_sampler_gives_it(drop_last: bool, shuffle: bool) -> None:
    # DistributedSampler (shuffle=False) deals *positions*; read through the uninterrupted order
    # they are the indices. With drop_last both samplers and the loader drop.
    for n, world, bs in itertools.product(SIZES, [1, 2, 3, 4], [1, 2, 3]):
        where = f"n={n} world={world} bs={bs} drop_last={drop_last} shuffle={shuffle}"
        ours = [
            tg.ResumableSampler(
                n,
                shuffle=shuffle,
                seed=4,
                rank=r,
                world_size=world,
                batch_size=bs,
                drop_last=drop_last,
            )
            for r in range(world)
        ]
        for epoch in range(2):
            order = ours[0].order(epoch).tolist()
            for r, s in enumerate(ours):
                reference = DataLoader(
                    Indices(n),
                    batch_size=bs,
                    sampler=DistributedSampler(
                        Indices(n), num_replicas=world, rank=r, shuffle=False, drop_last=drop_last
                    ),
                    drop_last=drop_last,
                    collate_fn=list,
                )
                expected = [[order[p] for p in b] for b in reference]
                loader = loader_for(s, bs)
                assert len(loader) == len(reference), f"{where} rank {r}: len(loader)"
                got = [[int(i) for i in b] for b in loader]
                assert got == expected, f"{where} epoch {epoch} rank {r}"
                assert (s.epoch, s.consumed) == (epoch + 1, 0), f"{where} rank {r}"


def test_padding_indices_say_so_and_keep_the_flag_through_pickle() -> None:
    n, world = 7, 4  # 7 = 4 + 3: the last round pads one index on rank 3
    samplers = [tg.ResumableSampler(n, seed=2, rank=r, world_size=world) for r in range(world)]
    per_rank = [list(s) for s in samplers]
    order = samplers[0].order(0).tolist()
    assert [len(p) for p in per_rank] == [2, 2, 2, 2]
    assert [[i.padding for i in p] for p in per_rank] == [[False, False]] * 3 + [[False, True]]
    pad = per_rank[3][1]
    assert pad == order[0], "padding repeats the epoch's first index"
    assert (pad.epoch, pad.seed) == (0, 2)
    assert repr(pad) == f"SampleIndex({order[0]}, epoch=0, seed=2, padding=True)"
    for twin in (pickle.loads(pickle.dumps(pad)), copy.deepcopy(pad)):
        assert type(twin) is tg.SampleIndex and twin.padding is True and twin == pad
    # Padding is augmented as the sample it repeats: the seed does not see the flag.
    with tg.seed_sample(pad) as a, tg.seed_sample(tg.SampleIndex(order[0], 0, 2)) as b:
        assert a == b


# --------------------------------------------------------------------------------------------
# lockstep, save at any step, resume on any world size


def check_save_and_resume(
    n: int, world: int, new_world: int, bs: int, drop_last: bool, start: int, mode: str
) -> None:
    """Save a ``world``-rank pass from ``start`` after every step; resume each on ``new_world``."""
    seed = 5
    epochs = [global_order(n, seed, e) for e in range(3)]
    old_pass = spec_pass(epochs[0], start, world, bs, drop_last)
    old_batches = per_rank_batches(old_pass, world, bs)
    steps = len(old_batches[0])
    for k in range(steps + 1):
        where = (
            f"n={n} bs={bs} drop_last={drop_last} from {start}, {world} ranks saved after "
            f"{k} of {steps} steps, resumed on {new_world}, {mode}"
        )
        old = make_ranks(n, world, bs, drop_last, seed)
        for s in old:
            s.load_state_dict({**s.state_dict(), "consumed": start})
        seen = lockstep(old, bs, k, mode, where)
        assert seen == [b[:k] for b in old_batches], f"{where}: the old job strayed"
        state = old[0].state_dict()  # lockstep() checked that every rank's is the same
        done = k == steps > 0  # an empty pass (drop_last, too few samples) ends nothing
        at = (1, 0) if done else (0, start + k * bs * world)
        assert (state["epoch"], state["consumed"]) == at, f"{where}: {state}"

        new = make_ranks(n, new_world, bs, drop_last, seed)
        for s in new:
            s.load_state_dict(state)
        rest = lockstep(new, bs, None, mode, where)
        epoch, resumed_at = at
        new_pass = spec_pass(epochs[epoch], resumed_at, new_world, bs, drop_last)
        assert rest == per_rank_batches(new_pass, new_world, bs), f"{where}: the new job"

        # What "no sample skipped or repeated" means: the real positions handed out by the old
        # and the new job together are the uninterrupted order, once each, in order, up to the
        # end of the epoch (with drop_last, up to the tail the last pass drops: fewer than
        # new_world * bs positions). Padding comes only at the end of a pass, fewer than
        # world_size indices, the epoch's first ones again.
        if not done:
            handed = interleave(seen) + interleave(rest)
            real = [i for i, pad in handed if not pad]
            padding = [i for i, pad in handed if pad]
            assert real == epochs[0][start : start + len(real)], f"{where}: skipped or reordered"
            if drop_last:
                assert not padding, f"{where}: drop_last pads nothing"
                assert 0 <= n - start - len(real) < new_world * bs, f"{where}: dropped too much"
            else:
                assert len(real) == n - start, f"{where}: {n - start - len(real)} skipped"
                assert padding == [epochs[0][j % n] for j in range(len(padding))], where
                assert len(padding) == -(n - resumed_at) % new_world, where
                assert all(not pad for i, pad in handed[: len(real)]), f"{where}: padding early"
        assert all((s.epoch, s.consumed) == (epoch + 1, 0) for s in new), where

        # The next epoch is the one an uninterrupted new_world-rank run takes.
        following = lockstep(new, bs, None, mode, where)
        expected = spec_pass(epochs[epoch + 1], 0, new_world, bs, drop_last)
        assert following == per_rank_batches(expected, new_world, bs), f"{where}: next epoch"


RESUME_SIZES = [1, 2, 3, 5, 7, 11, 13, 17, 23, 25]


def ragged_counts(world: int, new_world: int, bs: int, starts: tuple[int, ...]) -> tuple[int, int]:
    """How many passes the sweep runs where the bug lives, on ``world`` and on ``new_world``.

    Starved: the last global step holds fewer samples than ranks, so without padding some rank
    gets nothing. Straddled: the ranks' shares straddle a multiple of the batch size, so a
    per-rank drop_last would leave ranks a batch apart.
    """
    starved = straddled = 0
    for n, ranks, start in itertools.product(RESUME_SIZES, (world, new_world), starts):
        left = n - start
        if left > 0 and ranks > 1:
            starved += 0 < left % (ranks * bs) < ranks
            shares = [-(-(left - r) // ranks) for r in range(ranks)]
            straddled += len({share // bs for share in shares}) > 1
    return starved, straddled


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_save_at_any_step_resumes_on_any_world_size(world: int, drop_last: bool) -> None:
    starved = straddled = 0
    for new_world, bs in itertools.product([1, 2, 3, 4], [1, 2, 3]):
        counts = ragged_counts(world, new_world, bs, (0, 5))
        starved, straddled = starved + counts[0], straddled + counts[1]
        for n, start in itertools.product(RESUME_SIZES, (0, 5)):
            if start < n:
                check_save_and_resume(n, world, new_world, bs, drop_last, start, "plain")
    # The sweep covers where the bug lives, often (a guard on the parameters above).
    assert starved >= 20 and straddled >= 20, (starved, straddled)


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_save_through_track_at_any_step_resumes_on_any_world_size(drop_last: bool) -> None:
    for n, (world, new_world), bs in itertools.product(
        [7, 13, 23], [(4, 2), (4, 3), (3, 4), (2, 3)], [1, 2]
    ):
        check_save_and_resume(n, world, new_world, bs, drop_last, 0, "track")
