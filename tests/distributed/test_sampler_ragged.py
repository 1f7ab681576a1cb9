"""A real 4-rank job saves collectively at the epoch's ragged last step and resumes on 2 and 3.

Two samplers, one epoch each, in the same gloo group of 4 processes:

* ``N_PAD = 43`` with ``drop_last=False``: 43 = 5 steps of 4 x 2 samples + 3, so the last step
  holds fewer samples than ranks. Rank 3 gets one padding index there (the epoch's first), and
  every rank takes 6 batches.
* ``N_DROP = 46`` with ``drop_last=True``: the ranks' shares (12, 12, 11, 11) straddle a batch
  boundary; the sampler drops the 6 samples after the 5th whole step on every rank alike.

The ranks move as DDP ranks do: before each step they agree through an all-reduce that every
rank has a batch (a rank without one would leave the others blocked in DDP's all-reduce; here
every rank raises instead, so a broken sampler fails fast). The job calls the collective
``tg.save`` after the first step, after the step before the last, and after the last step.
Each checkpoint is then resumed on 2 and on 3 ranks, which run to the end of that epoch and
through the next. The reference is computed in this process from the uninterrupted order of a
1-rank sampler: the real positions (global position < n) must be handed out exactly once, in
order, and padding only where a pass's last step is ragged.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import tardigrade as tg

from ._harness import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

BS, SEED, OLD_WORLD = 2, 21, 4
CASES = {"pad": (43, False), "drop": (46, True)}  # name: (dataset length, drop_last)
SAVE_STEPS = {"pad": (1, 5, 6), "drop": (1, 4, 5)}  # the last is the epoch's last step


class Indices(torch.utils.data.Dataset[Any]):
    """``ds[i]`` is the sampler's ``SampleIndex`` itself, padding flag and all."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: Any) -> Any:
        return i


def make_sampler(case: str) -> tg.ResumableSampler:
    n, drop_last = CASES[case]
    # rank and world size come from torch.distributed
    return tg.ResumableSampler(n, seed=SEED, batch_size=BS, drop_last=drop_last)


def lockstep_pass(
    sampler: tg.ResumableSampler, on_step: Any = None
) -> list[list[tuple[int, bool]]]:
    """One pass as a DDP rank takes it: a batch a step, while every rank has one."""
    loader = DataLoader(
        Indices(sampler.dataset_len),
        batch_size=BS,
        sampler=sampler,
        drop_last=sampler.drop_last,
        collate_fn=list,
        generator=sampler.generator,
    )
    batches: list[list[tuple[int, bool]]] = []
    it = iter(loader)
    for step in itertools.count(1):
        batch = next(it, None)
        have = torch.tensor([batch is not None], dtype=torch.int64)
        low, high = have.clone(), have.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        if low.item() != high.item():
            raise RuntimeError(
                f"step {step}: rank {dist.get_rank()} has {'a' if batch else 'no'} batch, "
                "another rank has not: DDP would hang here"
            )
        if batch is None:
            return batches
        # getattr: an index without the flag fails on its position, not here.
        batches.append([(int(i), bool(getattr(i, "padding", False))) for i in batch])
        if on_step is not None:
            on_step(step)
    raise AssertionError("unreachable")


def save_job(rank: int, world_size: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case in CASES:
        sampler = make_sampler(case)
        states: dict[str, Any] = {}

        def save(step: int, case: str = case, sampler: Any = sampler, states: Any = states) -> None:
            if step in SAVE_STEPS[case]:
                # Collective: refuses a sampler state that differs between ranks.
                tg.save(Path(root) / f"{case}-{step}", {"data": sampler, "step": step})
                states[str(step)] = sampler.state_dict()

        out[case] = {"batches": lockstep_pass(sampler, save), "states": states}
    return out


def resume_job(rank: int, world_size: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case, steps in SAVE_STEPS.items():
        for step in steps:
            sampler = make_sampler(case)
            loaded = tg.load(Path(root) / f"{case}-{step}", into={"data": sampler, "step": 0})
            position = [sampler.epoch, sampler.consumed]
            rest = lockstep_pass(sampler)
            following = lockstep_pass(sampler)
            out[f"{case}-{step}"] = {
                "step": loaded["step"],
                "position": position,
                "rest": rest,
                "next": following,
            }
    return out


def global_order(n: int, epoch: int) -> list[int]:
    s = tg.ResumableSampler(n, seed=SEED)
    for _ in range(epoch):
        list(s)
    return [int(i) for i in s]


def expected_pass(
    order: list[int], start: int, world: int, drop_last: bool
) -> list[list[list[list[Any]]]]:
    """Each rank's batches of a pass from ``start``: ``[index, padding]`` pairs, as JSON has them.

    Without drop_last, positions up to the next multiple of ``world`` past the end pad with the
    epoch's first indices; with it, the pass ends after its last whole step of world x BS.
    """
    n, left = len(order), len(order) - start
    count = left // (world * BS) * world * BS if drop_last else -(-left // world) * world
    seq = [
        [order[p], False] if p < n else [order[(p - n) % n], True]
        for p in range(start, start + count)
    ]
    shares = [seq[r::world] for r in range(world)]
    return [[share[i : i + BS] for i in range(0, len(share), BS)] for share in shares]


def real_positions(per_rank: list[list[list[list[Any]]]]) -> list[int]:
    """The real (non-padding) indices of a pass, back in global order."""
    flat = [[item for batch in batches for item in batch] for batches in per_rank]
    return [i for row in itertools.zip_longest(*flat) for i, pad in filter(None, row) if not pad]


def test_a_collective_save_at_the_ragged_last_step_resumes_on_2_and_3_ranks(
    tmp_path: Path,
) -> None:
    root = str(tmp_path)
    saved = run_ranks(save_job, OLD_WORLD, root, timeout=90)
    for rank, out in enumerate(saved):
        assert "error" not in out and "died" not in out, f"rank {rank}: {out}"

    for case, (n, drop_last) in CASES.items():
        epochs = [global_order(n, e) for e in range(3)]
        old = expected_pass(epochs[0], 0, OLD_WORLD, drop_last)
        assert [out[case]["batches"] for out in saved] == old, f"{case}: the 4-rank job"
        assert len(old[0]) == SAVE_STEPS[case][-1], f"{case}: the last save is the last step"
        if not drop_last:
            assert sum(pad for b in old[3] for _, pad in b) == 1, "rank 3 pads the last step"
        for step in SAVE_STEPS[case]:
            states = [out[case]["states"][str(step)] for out in saved]
            assert all(st == states[0] for st in states), f"{case} step {step}: {states}"

    for world in (2, 3):
        results = run_ranks(resume_job, world, root, timeout=90)
        for rank, out in enumerate(results):
            assert "error" not in out and "died" not in out, f"{world} ranks, rank {rank}: {out}"
        for case, (n, drop_last) in CASES.items():
            epochs = [global_order(n, e) for e in range(3)]
            for step in SAVE_STEPS[case]:
                where = f"{case}: saved by 4 ranks after step {step}, resumed on {world}"
                outs = [r[f"{case}-{step}"] for r in results]
                last = step == SAVE_STEPS[case][-1]
                at = [1, 0] if last else [0, step * BS * OLD_WORLD]
                assert all(o["step"] == step and o["position"] == at for o in outs), where
                epoch, start = at
                rest = [o["rest"] for o in outs]
                assert rest == expected_pass(epochs[epoch], start, world, drop_last), where
                # No real sample skipped or repeated: the 4-rank job's first positions and the
                # resumed job's real ones make the uninterrupted order (with drop_last: up to
                # the tail the resumed pass drops, fewer than world x BS samples).
                real = epochs[epoch][:start] + real_positions(rest)
                assert real == epochs[epoch][: len(real)], where
                assert n - len(real) < (world * BS if drop_last else 1), where
                nxt = [o["next"] for o in outs]
                assert nxt == expected_pass(epochs[epoch + 1], 0, world, drop_last), where
