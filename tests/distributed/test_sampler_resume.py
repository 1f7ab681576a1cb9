"""A ResumableSampler saved by a real 4-rank job resumes on 2 and on 3 ranks, no sample lost.

The ranks are real processes in a gloo group; the samplers take their rank and world size from
``torch.distributed`` (no explicit arguments), and the checkpoints go through the collective
``tg.save`` / ``tg.load``. The 4-rank job saves twice: after one lockstep step (global position
8, not a multiple of 3) and at the end of the epoch. The reference is computed in this process
from a 1-rank sampler: the uninterrupted global order, with the padding a pass appends when its
last step does not split evenly over the ranks (:func:`padded`).
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import tardigrade as tg

from ._harness import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

N, BS, SEED = 47, 2, 13  # 47 = 4 x 11 + 3: rank 3's 12th index pads; 6 batches on each rank
MID, END = 1, 6  # steps taken before each save


def _loader(sampler: tg.ResumableSampler) -> DataLoader:
    return DataLoader(
        TensorDataset(torch.arange(N)), batch_size=BS, sampler=sampler, generator=sampler.generator
    )


def save_job(rank: int, world_size: int, root: str) -> dict[str, Any]:
    sampler = tg.ResumableSampler(N, seed=SEED)
    assert (sampler.rank, sampler.world_size) == (rank, world_size)
    seen: list[int] = []
    states: dict[str, Any] = {}
    for step, (batch,) in enumerate(_loader(sampler), 1):
        seen += batch.tolist()
        if step in (MID, END):
            # Collective: every rank calls it with the same replicated sampler state.
            tg.save(Path(root) / f"step-{step}", {"data": sampler, "step": step})
            states[str(step)] = sampler.state_dict()
    return {"seen": seen, "states": states}


def resume_job(rank: int, world_size: int, root: str, step: int) -> dict[str, Any]:
    sampler = tg.ResumableSampler(N, seed=SEED)
    assert (sampler.rank, sampler.world_size) == (rank, world_size)
    state = {"data": sampler, "step": 0}
    loaded = tg.load(Path(root) / f"step-{step}", into=state)
    position = [sampler.epoch, sampler.consumed]
    rest = [i for (batch,) in _loader(sampler) for i in batch.tolist()]
    following = [i for (batch,) in _loader(sampler) for i in batch.tolist()]
    return {"step": loaded["step"], "position": position, "rest": rest, "next": following}


def resume_job_both(rank: int, world_size: int, root: str) -> dict[str, Any]:
    # One group per world size, both checkpoints: process start-up is most of the cost.
    return {str(step): resume_job(rank, world_size, root, step) for step in (MID, END)}


def padded(order: list[int], start: int, world: int) -> list[int]:
    """A pass from ``start`` on ``world`` ranks, globally: the rest of ``order``, then padding
    with the epoch's first indices up to a multiple of ``world`` (rank ``r`` takes ``[r::world]``).
    """
    return order[start:] + [order[j % N] for j in range(-(N - start) % world)]


def _global_order(epoch: int) -> list[int]:
    s = tg.ResumableSampler(N, seed=SEED, rank=0, world_size=1)
    for _ in range(epoch):
        list(s)
    return [int(i) for i in s]


def test_a_4_rank_checkpoint_resumes_on_2_and_on_3_ranks(tmp_path: Path) -> None:
    root = str(tmp_path)
    epochs = [_global_order(e) for e in range(3)]

    saved = run_ranks(save_job, 4, root)
    for rank, out in enumerate(saved):
        assert "error" not in out and "died" not in out, f"rank {rank}: {out}"
        assert out["seen"] == padded(epochs[0], 0, 4)[rank::4], f"rank {rank} strayed"
    for step in (MID, END):
        states = [out["states"][str(step)] for out in saved]
        assert all(st == states[0] for st in states), f"step {step}: ranks disagree: {states}"
    assert (saved[0]["states"][str(MID)]["epoch"], saved[0]["states"][str(MID)]["consumed"]) == (
        0,
        MID * BS * 4,
    )
    assert (saved[0]["states"][str(END)]["epoch"], saved[0]["states"][str(END)]["consumed"]) == (
        1,
        0,
    )

    for world in (2, 3):
        results = run_ranks(resume_job_both, world, root)
        for step, expected_rest, expected_next, position in (
            (MID, padded(epochs[0], MID * BS * 4, world), epochs[1], [0, MID * BS * 4]),
            (END, padded(epochs[1], 0, world), epochs[2], [1, 0]),
        ):
            where = f"saved by 4 ranks after step {step}, resumed on {world}"
            outs = [r if "error" in r or "died" in r else r[str(step)] for r in results]
            assert all("error" not in o and "died" not in o for o in outs), f"{where}: {outs}"
            assert all(o["step"] == step for o in outs), where
            assert all(o["position"] == position for o in outs), f"{where}: {outs}"
            union = [i for o in outs for i in o["rest"]]
            missing = collections.Counter(expected_rest) - collections.Counter(union)
            extra = collections.Counter(union) - collections.Counter(expected_rest)
            assert not missing and not extra, (
                f"{where}: skipped {sorted(missing.elements())}, repeated {sorted(extra.elements())}"
            )
            next_pass = padded(expected_next, 0, world)
            for rank, o in enumerate(outs):
                assert o["rest"] == expected_rest[rank::world], f"{where}: rank {rank}"
                assert o["next"] == next_pass[rank::world], f"{where}: rank {rank} next epoch"
