"""ResumableSampler: a data position that resumes exactly, on any world size, with any loader.

The reference everywhere is the *uninterrupted* run: the sequence of batches a loader delivers
without stopping. Every interruption (save after ``k`` batches, build a fresh sampler and
loader, restore, go on) must deliver exactly the rest of that sequence: no sample skipped,
none repeated, none reordered.
"""

from __future__ import annotations

import collections
import copy
import itertools
import json
import pickle
import random
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import tardigrade as tg
from tardigrade.errors import InvalidArgumentError, StateMismatchError

pytestmark = pytest.mark.timeout(120)


def make_loader(
    n: int, sampler: tg.ResumableSampler, batch_size: int, num_workers: int = 0
) -> DataLoader:
    ds = TensorDataset(torch.arange(n))
    if num_workers == 0:
        return DataLoader(ds, batch_size=batch_size, sampler=sampler)
    return DataLoader(
        ds,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        prefetch_factor=2,
        persistent_workers=False,
    )


def batches(
    sampler: tg.ResumableSampler,
    loader: DataLoader,
    count: int,
    *,
    tracked: bool = False,
    on_batch: Callable[[int], None] | None = None,
) -> list[list[int]]:
    """Deliver ``count`` batches, pass after pass (epochs roll over by themselves)."""
    out: list[list[int]] = []
    empty_passes = 0
    while len(out) < count:
        before = len(out)
        source: Iterable[Any] = sampler.track(loader) if tracked else loader
        for (batch,) in source:
            out.append(batch.tolist())
            if on_batch is not None:
                on_batch(len(out))
            if len(out) == count:
                break
        # One empty pass is legal (resumed exactly at the end of an epoch); two in a row means
        # the sampler stopped advancing.
        empty_passes = empty_passes + 1 if len(out) == before else 0
        assert empty_passes < 2, f"the loader delivers nothing after {len(out)} batches"
    return out


def interrupted(
    n: int,
    batch_size: int,
    k: int,
    total: int,
    *,
    num_workers: int = 0,
    tracked: bool = False,
    seed: int = 0,
) -> tuple[list[list[int]], list[list[int]], dict[str, Any]]:
    """Run ``k`` batches, capture the state, then resume in a fresh sampler+loader to ``total``."""
    s1 = tg.ResumableSampler(n, seed=seed)
    saved = s1.state_dict()

    def save_at_k(delivered: int) -> None:
        # Saved inside the training loop, while a prefetching loader is still running.
        nonlocal saved
        if delivered == k:
            saved = s1.state_dict()

    loader = make_loader(n, s1, batch_size, num_workers)
    first = batches(s1, loader, k, tracked=tracked, on_batch=save_at_k) if k else []
    s2 = tg.ResumableSampler(n, seed=seed)
    s2.load_state_dict(saved)
    rest = batches(s2, make_loader(n, s2, batch_size, num_workers), total - k, tracked=tracked)
    return first, rest, saved


def flat(bs: Iterable[list[int]]) -> list[int]:
    return [i for b in bs for i in b]


# --------------------------------------------------------------------------------------------
# order


def test_order_is_a_permutation_fixed_by_seed_and_epoch() -> None:
    a, b = tg.ResumableSampler(101, seed=7), tg.ResumableSampler(101, seed=7)
    for epoch in range(3):
        assert torch.equal(a.order(epoch), b.order(epoch))
        assert sorted(a.order(epoch).tolist()) == list(range(101))
    assert a.order(0).tolist() != list(range(101)), "shuffle=True must shuffle"
    assert a.order(0).tolist() != a.order(1).tolist(), "epochs must differ"
    assert a.order(1).tolist() != a.order(2).tolist()
    assert a.order(0).tolist() != tg.ResumableSampler(101, seed=8).order(0).tolist()
    # Not state of the process: the global RNG has no say.
    torch.manual_seed(123)
    x = tg.ResumableSampler(101, seed=7).order(1)
    torch.manual_seed(456)
    assert torch.equal(x, tg.ResumableSampler(101, seed=7).order(1))


def test_shuffle_false_is_dataset_order_every_epoch() -> None:
    s = tg.ResumableSampler(9, shuffle=False)
    assert list(s) == list(range(9))
    assert list(s) == list(range(9))
    assert s.epoch == 2


def test_iteration_runs_to_the_end_of_the_epoch_then_advances_it() -> None:
    s = tg.ResumableSampler(20, seed=3)
    assert (s.epoch, s.consumed) == (0, 0)
    assert list(s) == s.order(0).tolist()
    assert (s.epoch, s.consumed) == (1, 0)
    assert list(s) == s.order(1).tolist()
    assert (s.epoch, s.consumed) == (2, 0)
    # From a position in the middle: only the rest of that epoch, then the next one whole.
    s.load_state_dict({**s.state_dict(), "epoch": 5, "consumed": 7})
    assert list(s) == s.order(5).tolist()[7:]
    assert (s.epoch, s.consumed) == (6, 0)
    assert list(s) == s.order(6).tolist()


def test_works_as_a_dataloader_sampler_across_epochs_without_set_epoch() -> None:
    n, bs = 23, 4
    s = tg.ResumableSampler(n, seed=1)
    loader = make_loader(n, s, bs)
    for epoch in range(3):
        got = [b.tolist() for (b,) in loader]
        expected = s.order(epoch).tolist()
        assert got == [expected[i : i + bs] for i in range(0, n, bs)]
        assert (s.epoch, s.consumed) == (epoch + 1, 0)


def test_partial_pass_then_new_pass_continues_where_it_stopped() -> None:
    n, bs = 23, 4
    s = tg.ResumableSampler(n, seed=1)
    loader = make_loader(n, s, bs)
    head = []
    for (b,) in loader:
        head.append(b.tolist())
        if len(head) == 2:
            break
    assert s.state_dict()["consumed"] == 2 * bs
    tail = [b.tolist() for (b,) in loader]
    assert flat(head + tail) == s.order(0).tolist()
    assert s.epoch == 1


# --------------------------------------------------------------------------------------------
# state


def test_state_dict_round_trip() -> None:
    s = tg.ResumableSampler(50, seed=4)
    it = iter(s)
    taken = [next(it) for _ in range(13)]
    sd = s.state_dict()
    assert sd["epoch"] == 0 and sd["consumed"] == 13
    t = tg.ResumableSampler(50, seed=4)
    t.load_state_dict(sd)
    assert t.state_dict() == sd
    assert taken + list(t) == s.order(0).tolist()


def test_round_trip_through_save_and_load_into(tmp_path: Path) -> None:
    n, bs = 37, 5
    s = tg.ResumableSampler(n, seed=9)
    got = batches(s, make_loader(n, s, bs), 11)  # 8 batches per epoch: into epoch 1
    assert (s.epoch, s.consumed) == (1, 3 * bs)
    tg.save(tmp_path / "ck", {"data": s, "step": 11})
    fresh = tg.ResumableSampler(n, seed=9)
    state = {"data": fresh, "step": 0}
    tg.load(tmp_path / "ck", into=state)
    assert state["data"] is fresh and state["step"] == 11
    assert (fresh.epoch, fresh.consumed) == (1, 3 * bs)
    # The plain tree holds the position as plain values.
    tree = tg.load(tmp_path / "ck")
    assert tree["data"]["epoch"] == 1 and tree["data"]["consumed"] == 3 * bs
    rest = batches(fresh, make_loader(n, fresh, bs), 5)
    ref = tg.ResumableSampler(n, seed=9)
    assert got + rest == batches(ref, make_loader(n, ref, bs), 16)


@pytest.mark.parametrize(("key", "value"), [("dataset_len", 99), ("seed", 1), ("shuffle", False)])
def test_load_state_dict_from_another_order_raises(key: str, value: Any) -> None:
    sd = tg.ResumableSampler(100, seed=0).state_dict()
    sd["consumed"] = 10
    kw: dict[str, Any] = {"seed": 0, "shuffle": True}
    n = 100
    if key == "dataset_len":
        n = value
    else:
        kw[key] = value
    other = tg.ResumableSampler(n, **kw)
    with pytest.raises(StateMismatchError, match=key):
        other.load_state_dict(sd)
    assert (other.epoch, other.consumed) == (0, 0), "a rejected state must not be applied"


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("consumed", -5),
        ("consumed", 21),
        ("consumed", 2.5),
        ("consumed", "3"),
        ("consumed", True),
        ("consumed", None),
        ("epoch", -1),
        ("epoch", 1.0),
        ("epoch", None),
        ("epoch", "missing"),
    ],
)
def test_load_state_dict_rejects_a_malformed_position(key: str, value: Any) -> None:
    # A checkpoint is untrusted input: a position outside the epoch must not silently skip
    # or repeat samples.
    s = tg.ResumableSampler(20, seed=0)
    sd = s.state_dict()
    if value == "missing":
        del sd[key]
    else:
        sd[key] = value
    with pytest.raises(tg.TardigradeError, match=key):
        s.load_state_dict(sd)
    assert (s.epoch, s.consumed) == (0, 0)


def test_load_into_a_sampler_of_another_dataset_raises(tmp_path: Path) -> None:
    tg.save(tmp_path / "ck", {"data": tg.ResumableSampler(100, seed=0)})
    with pytest.raises(StateMismatchError, match="dataset_len"):
        tg.load(tmp_path / "ck", into={"data": tg.ResumableSampler(101, seed=0)})
    with pytest.raises(StateMismatchError, match="seed"):
        tg.load(tmp_path / "ck", into={"data": tg.ResumableSampler(100, seed=1)})


@pytest.mark.parametrize(
    "kwargs",
    [
        {"dataset_len": -1},
        {"dataset_len": 2.5},
        {"dataset_len": "10"},
        {"dataset_len": None},
        {"dataset_len": 10, "seed": "0"},
        {"dataset_len": 10, "seed": 1.5},
        {"dataset_len": 10, "world_size": 0, "rank": 0},
        {"dataset_len": 10, "world_size": -2, "rank": 0},
        {"dataset_len": 10, "world_size": 2.0, "rank": 0},
        {"dataset_len": 10, "world_size": 2, "rank": 2},
        {"dataset_len": 10, "world_size": 2, "rank": -1},
        {"dataset_len": 10, "world_size": 2, "rank": "0"},
        {"dataset_len": 10, "rank": 1},  # no process group: world size 1
    ],
)
def test_invalid_arguments_raise(kwargs: dict[str, Any]) -> None:
    n = kwargs.pop("dataset_len")
    with pytest.raises(InvalidArgumentError):
        tg.ResumableSampler(n, **kwargs)


def test_track_needs_a_batch_size() -> None:
    s = tg.ResumableSampler(10)
    no_bs = DataLoader(TensorDataset(torch.arange(10)), batch_size=None, sampler=s)
    with pytest.raises(InvalidArgumentError, match="batch_size"):
        next(iter(s.track(no_bs)))
    with pytest.raises(InvalidArgumentError, match="batch_size"):
        next(iter(s.track(make_loader(10, s, 2), batch_size=0)))


def test_default_is_rank_0_of_1_without_a_process_group() -> None:
    s = tg.ResumableSampler(10)
    assert (s.rank, s.world_size) == (0, 1)
    assert list(s) == s.order(0).tolist()


# --------------------------------------------------------------------------------------------
# ranks and world sizes


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [0, 1, 2, 7, 10, 13, 23, 24])
def test_ranks_partition_the_global_order(world: int, n: int) -> None:
    samplers = [tg.ResumableSampler(n, seed=5, rank=r, world_size=world) for r in range(world)]
    order = samplers[0].order(0).tolist()
    assert order == tg.ResumableSampler(n, seed=5).order(0).tolist(), "same for any world size"
    for epoch in range(2):
        order = samplers[0].order(epoch).tolist()
        lens = [len(s) for s in samplers]
        per_rank = [list(s) for s in samplers]
        assert [len(p) for p in per_rank] == lens, "__len__ must match what is yielded"
        assert len(set(lens)) == 1, f"epoch {epoch}: ranks hand out {lens} indices"
        # Position p of the global order goes to rank p % world, in order; positions past the
        # end pad with the epoch's first indices, as DistributedSampler does.
        padded = order + [order[p % n] for p in range(-n % world)]
        for r, mine in enumerate(per_rank):
            assert mine == padded[r::world]
            assert [i.padding for i in mine] == [p >= n for p in range(r, len(padded), world)]
        union = [i for i in flat(per_rank) if not i.padding]
        assert sorted(union) == list(range(n)), f"epoch {epoch}: skipped or repeated samples"
        assert all(s.epoch == epoch + 1 for s in samplers)


def padding(n: int, epoch: int, start: int, ranks: int) -> collections.Counter[int]:
    """What a pass from ``start`` on ``ranks`` ranks pads with: the epoch's first indices."""
    order = tg.ResumableSampler(n, seed=11).order(epoch).tolist()
    return collections.Counter(order[j % n] for j in range(-(n - start) % ranks))


def lockstep(iters: list[Iterator[Any]], k: int | None) -> list[list[int]]:
    """Every rank takes one batch per step; ``k=None`` runs until every rank is exhausted."""
    taken: list[list[int]] = [[] for _ in iters]
    for _ in range(k) if k is not None else itertools.count():
        progressed = False
        for r, it in enumerate(iters):
            b = next(it, None)
            if b is not None:
                taken[r].extend(b[0].tolist())
                progressed = True
        if not progressed:
            break
    return taken


@pytest.mark.parametrize("n", [23, 24])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_saved_at_world_n_resumes_at_world_m(world: int, m: int, n: int) -> None:
    bs = 2
    per_rank = -(-n // world)  # padded: the same on every rank
    steps = -(-per_rank // bs)  # batches per epoch on every rank
    for k in range(steps + 1):  # every lockstep position, the epoch's last step included
        old = [tg.ResumableSampler(n, seed=11, rank=r, world_size=world) for r in range(world)]
        old_loaders = [make_loader(n, s, bs) for s in old]
        before = flat(lockstep([iter(lo) for lo in old_loaders], k))
        states = [s.state_dict() for s in old]
        assert all(sd == states[0] for sd in states), "ranks disagree about the position"
        # Taking the epoch's last batch ends the epoch at once (not when the loader is drained).
        done = k == steps
        assert (states[0]["epoch"], states[0]["consumed"]) == (
            (1, 0) if done else (0, k * bs * world)
        )

        new = [tg.ResumableSampler(n, seed=11, rank=r, world_size=m) for r in range(m)]
        for s in new:
            s.load_state_dict(states[0])
        loaders = [make_loader(n, s, bs) for s in new]
        after = flat(lockstep([iter(lo) for lo in loaders], None))
        where = f"N={world} M={m} n={n} saved after {k} lockstep batches"

        whole = collections.Counter(range(n))
        if done:
            assert collections.Counter(before) == whole + padding(n, 0, 0, world), where
            assert collections.Counter(after) == whole + padding(n, 1, 0, m), where
        else:
            real_after = collections.Counter(after) - padding(n, 0, k * bs * world, m)
            assert collections.Counter(before) + real_after == whole, (
                f"{where}: skipped or repeated"
            )
            assert not set(before) & set(real_after), f"{where}: consumed samples seen again"

        # The epoch rolled over on every new rank: the next epoch is whole and fresh.
        next_epoch = 2 if done else 1
        assert all((s.epoch, s.consumed) == (next_epoch, 0) for s in new), where
        nxt = flat(lockstep([iter(lo) for lo in loaders], None))
        assert collections.Counter(nxt) == whole + padding(n, next_epoch, 0, m), where


# --------------------------------------------------------------------------------------------
# resume cost


def test_resume_near_the_end_of_a_huge_epoch_yields_only_the_rest() -> None:
    n = 10**6
    s = tg.ResumableSampler(n, seed=2)
    s.load_state_dict({**s.state_dict(), "consumed": n - 5})
    calls: list[int] = []
    real_order = s.order
    s.order = lambda epoch: calls.append(epoch) or real_order(epoch)  # type: ignore[method-assign]
    it = iter(s)
    got = [next(it) for _ in range(5)]
    assert next(it, None) is None
    assert got == real_order(0).tolist()[-5:]
    assert calls == [0], "the order must be computed once, not walked"


def test_resume_near_the_end_of_a_huge_epoch_does_not_walk_the_consumed_part(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Counted as work, not timed: every tensor the sampler turns into Python values or walks
    # element by element is recorded with its length. A resume 3 samples before the end of
    # a 3M-sample epoch must touch 3 of them, not the 2,999,997 consumed ones.
    n = 3 * 10**6
    s = tg.ResumableSampler(n, shuffle=False)
    walked: list[int] = []
    tolist, iterate = torch.Tensor.tolist, torch.Tensor.__iter__

    def counted_tolist(t: torch.Tensor) -> Any:
        walked.append(t.numel())
        return tolist(t)

    def counted_iter(t: torch.Tensor) -> Any:
        walked.append(t.numel())
        return iterate(t)

    s.load_state_dict({**s.state_dict(), "epoch": 0, "consumed": n - 3})
    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    monkeypatch.setattr(torch.Tensor, "__iter__", counted_iter)
    assert list(s) == [n - 3, n - 2, n - 1]
    assert walked and max(walked) <= 3, f"the sampler walked {max(walked)} samples to resume"


# --------------------------------------------------------------------------------------------
# exact position with a DataLoader


def test_exact_position_with_num_workers_0() -> None:
    n, bs = 11, 3  # 4 batches per epoch, the last one short
    total = 12
    ref = tg.ResumableSampler(n, seed=6)
    full = batches(ref, make_loader(n, ref, bs), total)
    assert [len(b) for b in full[:4]] == [3, 3, 3, 2]
    assert flat(full[:4]) == ref.order(0).tolist()
    assert flat(full[4:8]) == ref.order(1).tolist()
    for k in range(total + 1):
        first, rest, saved = interrupted(n, bs, k, total, seed=6)
        assert saved["epoch"] == k // 4 or (k % 4 == 0 and saved["epoch"] == k // 4 - 1)
        assert first + rest == full, f"saved after {k} batches ({saved})"


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 3, 6, 12, 13, 19])
def test_exact_position_with_workers_through_track(k: int) -> None:
    n, bs, total = 50, 4, 26  # 13 batches per epoch (the last one short), two epochs
    ref = tg.ResumableSampler(n, seed=8)
    full = batches(ref, make_loader(n, ref, bs, num_workers=2), total, tracked=True)
    assert flat(full[:13]) == ref.order(0).tolist()
    assert flat(full[13:]) == ref.order(1).tolist()
    # The second pass was stopped at its last batch, which ended that epoch all the same.
    assert (ref.epoch, ref.consumed) == (2, 0)
    first, rest, saved = interrupted(n, bs, k, total, num_workers=2, tracked=True, seed=8)
    assert (saved["epoch"], saved["consumed"]) == (k // 13, k % 13 * bs), saved
    assert first + rest == full, f"saved after {k} delivered batches ({saved})"


@pytest.mark.slow
def test_without_track_prefetching_workers_run_the_position_ahead() -> None:
    # Why track() exists: the loader pulls indices for prefetched batches before training sees
    # them, so the sampler's own count is ahead of what was delivered.
    n, bs, k = 200, 4, 2
    s = tg.ResumableSampler(n, seed=8)
    loader = make_loader(n, s, bs, num_workers=2)
    for delivered, _ in enumerate(loader, 1):
        if delivered == k:
            consumed = s.state_dict()["consumed"]
            break
    assert consumed > k * bs, "expected prefetching to run the naive position ahead"
    # With track() the same loop reports exactly what was delivered.
    s2 = tg.ResumableSampler(n, seed=8)
    for delivered, _ in enumerate(s2.track(make_loader(n, s2, bs, num_workers=2)), 1):
        if delivered == k:
            assert s2.state_dict()["consumed"] == k * bs
            break


# --------------------------------------------------------------------------------------------
# the DataLoader and the global RNG


def _draws_with_resume(n: int, bs: int, k: int, total: int, **loader_kw: Any) -> list[float]:
    """Per batch, one draw from the global torch RNG (as dropout would); resume after ``k``."""

    def run(state: dict[str, Any], count: int) -> list[float]:
        s = state["data"]
        kw = {"generator": s.generator} if loader_kw.get("generator") == "sampler" else loader_kw
        loader = DataLoader(TensorDataset(torch.arange(n)), batch_size=bs, sampler=s, **kw)
        out: list[float] = []
        while len(out) < count:
            for _ in loader:
                out.append(torch.rand(()).item())
                if len(out) == count:
                    break
        return out

    torch.manual_seed(0)
    state = {"rng": tg.RNGState(), "data": tg.ResumableSampler(n, seed=1)}
    first = run(state, k)
    snap = {"rng": state["rng"].state_dict(), "data": state["data"].state_dict()}

    torch.manual_seed(12345)  # a new process: its RNG is anything until restored
    resumed = {"rng": tg.RNGState(), "data": tg.ResumableSampler(n, seed=1)}
    resumed["rng"].load_state_dict(snap["rng"])
    resumed["data"].load_state_dict(snap["data"])
    return first + run(resumed, total - k)


def _uninterrupted_draws(n: int, bs: int, total: int, **loader_kw: Any) -> list[float]:
    torch.manual_seed(0)
    s = tg.ResumableSampler(n, seed=1)
    kw = {"generator": s.generator} if loader_kw.get("generator") == "sampler" else loader_kw
    loader = DataLoader(TensorDataset(torch.arange(n)), batch_size=bs, sampler=s, **kw)
    out: list[float] = []
    while len(out) < total:
        for _ in loader:
            out.append(torch.rand(()).item())
            if len(out) == total:
                break
    return out


def test_global_rng_resumes_exactly_with_a_loader_generator() -> None:
    # The workaround that test_exact_resume's training script uses.
    kw = {"generator": torch.Generator()}
    full = _uninterrupted_draws(20, 3, 16, **kw)
    for k in (2, 5, 7, 10):
        assert _draws_with_resume(20, 3, k, 16, generator=torch.Generator()) == full, k


def test_global_rng_resumes_exactly_with_the_documented_loader() -> None:
    """DataLoader(..., generator=sampler.generator), as data.py documents."""
    full = _uninterrupted_draws(20, 3, 16, generator="sampler")
    for k in (2, 5, 7, 10):
        assert _draws_with_resume(20, 3, k, 16, generator="sampler") == full, k


def test_without_a_loader_generator_resume_draws_differ() -> None:
    """Why the generator is documented: the loader otherwise draws from the global RNG."""
    full = _uninterrupted_draws(20, 3, 16)
    assert any(_draws_with_resume(20, 3, k, 16) != full for k in (2, 5, 7, 10))


# --------------------------------------------------------------------------------------------
# loops that stop after len(loader) batches (PyTorch Lightning, any loop that counts batches)


def _per_rank_epoch(s: tg.ResumableSampler, epoch: int, bs: int, drop_last: bool) -> list[int]:
    mine = s.order(epoch).tolist()[s.rank :: s.world_size]
    return mine[: len(mine) // bs * bs] if drop_last else mine


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_a_loop_that_takes_exactly_len_loader_batches_gets_every_epoch_whole(
    world: int, drop_last: bool
) -> None:
    # Lightning's loop: a fresh iter(loader) per epoch, exactly len(loader) batches taken with
    # next(), the iterator never drained (it is kept alive until the next epoch replaces it).
    # Without drop_last, the epoch's last batch is full on every rank (24 = 4 * 3 * 2): the
    # loader hands it over before asking the sampler for more, so nothing drains the sampler.
    n, bs, epochs = (26 if drop_last else 24), 4, 4
    kw: dict[str, Any] = {"batch_size": bs, "drop_last": True} if drop_last else {}
    samplers = [
        tg.ResumableSampler(n, seed=3, rank=r, world_size=world, **kw) for r in range(world)
    ]
    loaders = [
        DataLoader(TensorDataset(torch.arange(n)), batch_size=bs, sampler=s, drop_last=drop_last)
        for s in samplers
    ]
    lengths = [len(lo) for lo in loaders]
    kept: list[Iterator[Any]] = []
    for epoch in range(epochs):
        union: list[int] = []
        kept.clear()
        for s, lo, length in zip(samplers, loaders, lengths, strict=True):
            assert len(lo) == length, f"epoch {epoch}: len(loader) changed"
            it = iter(lo)
            kept.append(it)
            got = flat(next(it)[0].tolist() for _ in range(length))
            assert got == _per_rank_epoch(s, epoch, bs, drop_last), f"epoch {epoch}, rank {s.rank}"
            assert (s.epoch, s.consumed) == (epoch + 1, 0), f"epoch {epoch} did not advance"
            union += got
        assert len(union) == len(set(union)), f"epoch {epoch}: a sample came twice"
        if not drop_last:
            assert sorted(union) == list(range(n)), f"epoch {epoch}: samples skipped"


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_len_loader_loop_saved_at_the_epoch_end_resumes_with_the_next_epoch(
    tmp_path: Path, drop_last: bool
) -> None:
    n, bs = (23 if drop_last else 24), 4
    kw: dict[str, Any] = {"batch_size": bs, "drop_last": True} if drop_last else {}
    s = tg.ResumableSampler(n, seed=5, **kw)
    loader = DataLoader(TensorDataset(torch.arange(n)), batch_size=bs, sampler=s)
    it = iter(loader)
    first = [next(it)[0].tolist() for _ in range(len(loader))]
    tg.save(tmp_path / "ck", {"data": s})
    fresh = tg.ResumableSampler(n, seed=5, **kw)
    tg.load(tmp_path / "ck", into={"data": fresh})
    assert (fresh.epoch, fresh.consumed) == (1, 0)
    loader2 = DataLoader(TensorDataset(torch.arange(n)), batch_size=bs, sampler=fresh)
    assert len(loader2) == len(loader)
    it2 = iter(loader2)
    second = flat(next(it2)[0].tolist() for _ in range(len(loader2)))
    assert flat(first) == _per_rank_epoch(s, 0, bs, drop_last)
    assert second == _per_rank_epoch(s, 1, bs, drop_last)


@pytest.mark.slow
@pytest.mark.parametrize(("world", "drop_last"), [(1, False), (1, True), (2, False), (2, True)])
def test_track_with_workers_advances_the_epoch_with_its_last_batch(
    world: int, drop_last: bool
) -> None:
    # Prefetching workers, track(), a loop that stops after len(loader) batches per epoch.
    # drop_last comes from the loader: track() reads it there. Without drop_last every rank's
    # last batch is full, so nothing but track() can end the epoch.
    n, bs, epochs = (30 if drop_last else 32), 4, 3
    for rank in range(world):
        s = tg.ResumableSampler(n, seed=4, rank=rank, world_size=world)
        loader = DataLoader(
            TensorDataset(torch.arange(n)),
            batch_size=bs,
            sampler=s,
            num_workers=2,
            drop_last=drop_last,
            generator=s.generator,
        )
        length = len(loader)
        for epoch in range(epochs):
            got: list[list[int]] = []
            for (batch,) in s.track(loader):
                got.append(batch.tolist())
                if len(got) == length:
                    break
            assert flat(got) == _per_rank_epoch(s, epoch, bs, drop_last), (rank, epoch)
            assert (s.epoch, s.consumed) == (epoch + 1, 0), f"rank {rank} epoch {epoch} stuck"
            assert len(loader) == length


@pytest.mark.parametrize(
    "kwargs",
    [
        {"drop_last": True},  # needs the batch size
        {"batch_size": 0},
        {"batch_size": 2.0},
        {"batch_size": 2, "drop_last": 1},
    ],
)
def test_drop_last_needs_a_valid_batch_size(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError, match=r"batch_size|drop_last"):
        tg.ResumableSampler(10, **kwargs)


def test_track_refuses_a_loader_with_another_batch_size() -> None:
    s = tg.ResumableSampler(10, batch_size=3, drop_last=True)
    with pytest.raises(InvalidArgumentError, match="batch_size=3"):
        next(iter(s.track(make_loader(10, s, 2))))


# --------------------------------------------------------------------------------------------
# random augmentation in the dataset: tg.SampleIndex, tg.seed_sample, tg.SeededDataset


class Augmented(torch.utils.data.Dataset[torch.Tensor]):
    """Row ``i``: the index, then one draw each from torch, random and numpy (as augmentation)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.classes = ["a", "b"]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(
            [
                float(i),
                torch.rand((), dtype=torch.float64).item(),
                random.random(),
                np.random.rand(),
            ],
            dtype=torch.float64,
        )


def global_rng_states() -> tuple[Any, ...]:
    return (random.getstate(), np.random.get_state(), torch.get_rng_state())


def assert_same_global_rng(a: tuple[Any, ...], b: tuple[Any, ...]) -> None:
    assert a[0] == b[0], "python random moved"
    assert a[1][0] == b[1][0] and np.array_equal(a[1][1], b[1][1]) and a[1][2:] == b[1][2:], (
        "numpy's global RNG moved"
    )
    assert torch.equal(a[2], b[2]), "torch's CPU RNG moved"


def draws() -> tuple[float, float, float]:
    return torch.rand(()).item(), random.random(), float(np.random.rand())


def aug_loader(
    ds: torch.utils.data.Dataset[Any], s: tg.ResumableSampler, workers: int, **kw: Any
) -> DataLoader:
    return DataLoader(ds, batch_size=3, sampler=s, num_workers=workers, generator=s.generator, **kw)


def rows(loader: DataLoader, s: tg.ResumableSampler, count: int) -> list[torch.Tensor]:
    """``count`` batches through ``track()``, pass after pass."""
    out: list[torch.Tensor] = []
    while len(out) < count:
        for b in s.track(loader):
            out.append(b)
            if len(out) == count:
                break
    return out


def test_the_sampler_yields_sample_indices_that_behave_as_ints() -> None:
    s = tg.ResumableSampler(10, seed=3)
    for epoch in range(2):
        got = list(s)
        assert got == s.order(epoch).tolist()
        assert all(type(i) is tg.SampleIndex for i in got)
        assert all((i.epoch, i.seed) == (epoch, 3) for i in got)
    i = tg.SampleIndex(7, epoch=2, seed=3)
    assert i == 7 and hash(i) == hash(7) and {i: 1}[7] == 1
    assert str(i) == "7" and f"img-{i}.png" == "img-7.png" and format(i, "03d") == "007"
    assert repr(i) == "SampleIndex(7, epoch=2, seed=3)"
    assert json.dumps([i]) == "[7]"
    assert torch.arange(10)[i].item() == 7 and np.arange(10)[i] == 7 and list(range(10))[i] == 7
    assert torch.equal(
        torch.utils.data.default_collate([i, tg.SampleIndex(1, 0, 0)]), torch.tensor([7, 1])
    )
    # DataLoader pickles indices into its workers: epoch and seed must survive.
    j = pickle.loads(pickle.dumps(i))
    assert type(j) is tg.SampleIndex and (int(j), j.epoch, j.seed) == (7, 2, 3)
    k = copy.deepcopy(i)
    assert (int(k), k.epoch, k.seed) == (7, 2, 3)


def test_seed_sample_draws_are_a_function_of_seed_epoch_and_index() -> None:
    def under(index: int, **kw: Any) -> tuple[Any, ...]:
        with tg.seed_sample(index, **kw) as seed:
            return (seed, *draws())

    base = under(tg.SampleIndex(5, epoch=1, seed=0))
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)  # the global state before the block has no say
    assert under(tg.SampleIndex(5, epoch=1, seed=0)) == base
    assert under(5, seed=0, epoch=1) == base, "a plain int with seed= and epoch= is the same"
    assert under(tg.SampleIndex(5, epoch=9, seed=9), seed=0, epoch=1) == base, "explicit wins"
    others = [
        under(tg.SampleIndex(6, epoch=1, seed=0)),
        under(tg.SampleIndex(5, epoch=2, seed=0)),
        under(tg.SampleIndex(5, epoch=1, seed=1)),
    ]
    for other in others:
        assert all(a != b for a, b in zip(other, base, strict=True)), (other, base)
    # The three libraries get their own streams. Python's random and NumPy's legacy RNG are
    # both MT19937: seeded alike they would draw the very same numbers.
    with tg.seed_sample(tg.SampleIndex(5, epoch=1, seed=0)):
        assert random.random() != np.random.random_sample()
    assert isinstance(base[0], int) and 0 <= base[0] < 2**64


def test_seed_sample_leaves_the_global_rngs_where_they_were() -> None:
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    before = global_rng_states()
    with tg.seed_sample(tg.SampleIndex(1, epoch=0, seed=0)):
        draws()
        np.random.randn(5)  # leaves a cached gaussian behind in the legacy state
    assert_same_global_rng(global_rng_states(), before)
    with pytest.raises(KeyError), tg.seed_sample(tg.SampleIndex(1, epoch=0, seed=0)):
        draws()
        raise KeyError("augmentation failed")
    assert_same_global_rng(global_rng_states(), before)


def test_seed_sample_streams_are_pinned() -> None:
    # A run resumed by a newer Tardigrade, on another machine, must augment as the original
    # did: the derivation (seed, epoch, index) -> streams is part of the contract.
    with tg.seed_sample(tg.SampleIndex(5, epoch=1, seed=0)) as seed:
        got = (random.random(), float(np.random.rand()), torch.rand((), dtype=torch.float64).item())
    assert seed == 17602806766147250078
    assert got == (0.28178753148696467, 0.5958349511592989, 0.4205685575847494)


def test_seed_sample_takes_any_integer_index() -> None:
    def under(index: Any) -> tuple[float, float, float]:
        with tg.seed_sample(index, seed=0, epoch=1):
            return draws()

    assert under(np.int64(5)) == under(torch.tensor(5)) == under(5)


def test_seed_sample_leaves_cuda_rngs_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch.manual_seed would reseed every CUDA device (lazily, even where none is visible);
    # their states are training state that the block does not restore.
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: calls.append("cuda"))
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda seed: calls.append("cuda"))
    with tg.seed_sample(tg.SampleIndex(1, epoch=0, seed=0)):
        draws()
    tg.SeededDataset(Augmented(3))[tg.SampleIndex(2, epoch=0, seed=0)]
    assert calls == []
    torch.manual_seed(0)
    assert calls == ["cuda"], "the probe must see what torch.manual_seed does"


@pytest.mark.parametrize(
    ("index", "kw", "match"),
    [
        (3, {}, r"plain int.*seed=\.\.\. and epoch=\.\.\."),
        (3, {"seed": 0}, "seed=... and epoch=..."),
        (3, {"epoch": 0}, "seed=... and epoch=..."),
        (3, {"seed": 0, "epoch": -1}, "epoch must be an int >= 0"),
        (3, {"seed": "0", "epoch": 0}, "seed must be an int"),
        (3, {"seed": 0, "epoch": True}, "epoch must be an int"),
        (2.0, {"seed": 0, "epoch": 0}, "index must be an int"),
        (True, {"seed": 0, "epoch": 0}, "index must be an int"),
        (np.bool_(True), {"seed": 0, "epoch": 0}, "index must be an int"),
    ],
)
def test_seed_sample_rejects_what_does_not_fix_the_stream(
    index: Any, kw: dict[str, Any], match: str
) -> None:
    before = global_rng_states()
    with pytest.raises(InvalidArgumentError, match=match), tg.seed_sample(index, **kw):
        pass
    assert_same_global_rng(global_rng_states(), before)


class Stream(torch.utils.data.IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(3))


def test_seeded_dataset_wraps_a_dataset() -> None:
    ds = tg.SeededDataset(Augmented(7))
    assert len(ds) == 7 and ds.classes == ["a", "b"] and ds.n == 7
    i = tg.SampleIndex(4, epoch=1, seed=2)
    before = global_rng_states()
    a = ds[i]
    assert_same_global_rng(global_rng_states(), before)
    assert a[0] == 4 and torch.equal(ds[i], a)
    with tg.seed_sample(i):
        assert torch.equal(Augmented(7)[i], a)
    # Spawned workers unpickle the wrapper: its attribute forwarding must not recurse.
    assert torch.equal(pickle.loads(pickle.dumps(ds))[i], a)
    with pytest.raises(InvalidArgumentError, match=r"tg\.ResumableSampler"):
        ds[4]
    with pytest.raises(AttributeError):
        ds.missing  # noqa: B018
    with pytest.raises(InvalidArgumentError, match="map-style"):
        tg.SeededDataset(Stream())  # type: ignore[arg-type]


def test_seeded_dataset_seeds_each_sample_even_when_the_dataset_fetches_batches() -> None:
    # DataLoader prefers a dataset's __getitems__ (one call per batch); the wrapper must not
    # forward it, or the samples of a batch would share one stream.
    class Batched(Augmented):
        def __getitems__(self, idx: list[int]) -> list[torch.Tensor]:
            raise AssertionError("SeededDataset forwarded __getitems__")

    s = tg.ResumableSampler(6, seed=0)
    got = torch.cat(list(aug_loader(tg.SeededDataset(Batched(6)), s, 0)))
    plain = Augmented(6)
    for row in got:
        with tg.seed_sample(int(row[0]), seed=0, epoch=0):
            assert torch.equal(plain[int(row[0])], row)


def test_a_loader_over_seeded_dataset_does_not_move_the_main_process_rngs() -> None:
    # num_workers=0: __getitem__ runs in the training process, whose RNGs (dropout, ...) are
    # training state.
    def run(ds: torch.utils.data.Dataset[Any]) -> list[tuple[float, float, float]]:
        torch.manual_seed(0)
        random.seed(0)
        np.random.seed(0)
        s = tg.ResumableSampler(len(ds), seed=1)  # type: ignore[arg-type]
        return [draws() for _ in aug_loader(ds, s, 0)]

    assert run(tg.SeededDataset(Augmented(10))) == run(TensorDataset(torch.arange(10)))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_augmented_batches_are_the_same_for_any_worker_count() -> None:
    n, count = 14, 12  # 5 batches per epoch, the last one short: crosses two epoch ends
    ref_s = tg.ResumableSampler(n, seed=4)
    ref = rows(aug_loader(tg.SeededDataset(Augmented(n)), ref_s, 0), ref_s, count)
    assert [int(i) for i in torch.cat(ref[:5])[:, 0]] == ref_s.order(0).tolist()
    assert len({b[:, 1:].sum().item() for b in ref}) == count, "augmentation must draw"
    for workers, persistent in [(1, False), (3, False), (2, True)]:
        s = tg.ResumableSampler(n, seed=4)
        loader = aug_loader(
            tg.SeededDataset(Augmented(n)), s, workers, persistent_workers=persistent
        )
        got = rows(loader, s, count)
        for k, (a, b) in enumerate(zip(got, ref, strict=True)):
            assert torch.equal(a, b), f"{workers} workers (persistent={persistent}), batch {k}"


def resumed_rows(
    ds: Callable[[], torch.utils.data.Dataset[Any]], k: int, total: int, before: int, after: int
) -> list[torch.Tensor]:
    """``k`` batches with ``before`` workers, save, resume in a fresh loader with ``after``."""
    s = tg.ResumableSampler(14, seed=4)
    first = rows(aug_loader(ds(), s, before), s, k)
    saved = s.state_dict()
    s2 = tg.ResumableSampler(14, seed=4)
    s2.load_state_dict(saved)
    return first + rows(aug_loader(ds(), s2, after), s2, total - k)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("after", [0, 1, 3])
def test_augmentation_resumes_exactly_with_another_worker_count(after: int) -> None:
    def seeded() -> torch.utils.data.Dataset[Any]:
        return tg.SeededDataset(Augmented(14))

    s = tg.ResumableSampler(14, seed=4)
    full = rows(aug_loader(seeded(), s, 2), s, 12)
    for k in (2, 7):  # mid-epoch 0; mid-epoch 1
        got = resumed_rows(seeded, k, 12, before=2, after=after)
        for j, (a, b) in enumerate(zip(got, full, strict=True)):
            assert torch.equal(a, b), f"saved after {k} batches, resumed with {after}: batch {j}"


@pytest.mark.slow
def test_without_seeding_augmentation_in_workers_does_not_resume() -> None:
    """Why the hook exists: worker RNG streams are in no checkpoint."""
    s = tg.ResumableSampler(14, seed=4)
    full = rows(aug_loader(Augmented(14), s, 2), s, 12)
    got = resumed_rows(lambda: Augmented(14), 2, 12, before=2, after=2)
    assert all(torch.equal(a[:, 0], b[:, 0]) for a, b in zip(got, full, strict=True)), (
        "same samples"
    )
    assert not torch.equal(got[2], full[2]), "expected other augmentation after the resume"


@pytest.mark.parametrize("world", [2, 3])
def test_each_sample_is_augmented_the_same_for_any_world_size(world: int) -> None:
    n = 13

    def by_index(samplers: list[tg.ResumableSampler], epochs: int) -> dict[tuple[int, int], Any]:
        out: dict[tuple[int, int], Any] = {}
        for epoch in range(epochs):
            repeats = 0
            for s in samplers:
                for b in aug_loader(tg.SeededDataset(Augmented(n)), s, 0):
                    for row in b:
                        key = (epoch, int(row[0]))
                        if key in out:  # padding of the last step: augmented as the original
                            assert torch.equal(out[key], row), f"padding {key} differs"
                            repeats += 1
                        out[key] = row
            assert repeats == -n % len(samplers), f"epoch {epoch}: {repeats} samples came twice"
        return out

    one = by_index([tg.ResumableSampler(n, seed=6)], 2)
    many = by_index(
        [tg.ResumableSampler(n, seed=6, rank=r, world_size=world) for r in range(world)], 2
    )
    assert one.keys() == many.keys() == {(e, i) for e in range(2) for i in range(n)}
    for key, row in one.items():
        assert torch.equal(many[key], row), f"epoch {key[0]}, sample {key[1]}"
    # The indices themselves carry the same seed and epoch on every rank.
    r1 = tg.ResumableSampler(n, seed=6, rank=1, world_size=world)
    assert all((i.seed, i.epoch) == (6, 0) for i in r1)


@pytest.mark.parametrize("track", [False, True])
def test_len_loader_holds_still_while_workers_prefetch(track: bool) -> None:
    # A loop that asks len(loader) once an iterator exists (tqdm, Lightning, range(len(...))):
    # the workers have pulled indices ahead, which used to shrink len() (10 -> 6 batches) and
    # leave 40 of the epoch's 100 samples untrained, in an uninterrupted run.
    n, bs = 100, 10
    s = tg.ResumableSampler(n, seed=2)
    loader = DataLoader(
        TensorDataset(torch.arange(n)),
        batch_size=bs,
        sampler=s,
        num_workers=2,
        generator=s.generator,
    )
    for epoch in range(2):
        it = iter(s.track(loader)) if track else iter(loader)
        first = next(it)
        length = len(loader)
        got = [first[0].tolist()] + [next(it)[0].tolist() for _ in range(length - 1)]
        assert length == n // bs
        assert sorted(flat(got)) == list(range(n)), f"epoch {epoch}: not every sample"
        assert (s.epoch, s.consumed) == (epoch + 1, 0)
        del it


@pytest.mark.slow
@pytest.mark.parametrize("how", ["loader", "track"])
def test_len_of_a_tracked_loader_holds_still_for_the_whole_pass(how: str) -> None:
    """Workers draw every index of a short pass long before training gets its batches: the
    length must not follow the position, or ``if i + 1 >= len(loader): break`` ends the pass
    early and ``i == len(loader) - 1`` never fires."""
    n, bs = 100, 10
    s = tg.ResumableSampler(n, seed=3)
    ds = TensorDataset(torch.arange(n))
    if how == "loader":
        loader: Any = s.loader(ds, batch_size=bs, num_workers=2)
        tracked = lambda: loader  # noqa: E731
        length = lambda: len(loader)  # noqa: E731
    else:
        plain = DataLoader(ds, batch_size=bs, sampler=s, num_workers=2)
        tracked = lambda: s.track(plain)  # noqa: E731
        length = lambda: len(plain)  # noqa: E731
    seen, ends = [], 0
    for i, _ in enumerate(tracked()):
        seen.append(length())
        ends += i == length() - 1
    assert seen == [10] * 10 and ends == 1
    # A pass resumed 60 % in: 4 batches, each time, and the epoch-end test fires once.
    s.load_state_dict({**s.state_dict(), "consumed": 60})
    seen, ends, taken = [], 0, 0
    for i, _ in enumerate(tracked()):
        taken += 1
        seen.append(length())
        ends += i == length() - 1
        if i + 1 >= length():
            break
    assert seen == [4] * 4 and ends == 1 and taken == 4
    assert (s.epoch, s.consumed) == (2, 0)
