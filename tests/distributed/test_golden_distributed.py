"""The golden distributed checkpoints (``tests/compat/v4``, ``v5``) restored on two ranks, as
they were saved: each rank gets its own rows of the sharded tensor and its own tg.PerRank
values."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import tardigrade as tg

from ._harness import run_ranks

pytestmark = pytest.mark.distributed

COMPAT = Path(__file__).resolve().parents[1] / "compat"
ROWS = ((0, 3), (3, 5))


def restore_rank(rank: int, world: int, ckpt: str) -> Any:
    lo, hi = ROWS[rank]
    live = {
        "emb": tg.Sharded(torch.zeros(hi - lo, 3), (lo, 0), (5, 3)),
        "bias": torch.zeros(3),
        "step": 0,
        "mine": tg.PerRank({"rank": -1, "seen": torch.zeros(2, dtype=torch.int64)}),
    }
    tg.load(ckpt, into=live)
    return {
        "emb": live["emb"].local.tolist(),
        "bias": live["bias"].tolist(),
        "step": live["step"],
        "mine": [live["mine"].value["rank"], live["mine"].value["seen"].tolist()],
    }


@pytest.mark.parametrize("version", [4, 5])
def test_golden_distributed_checkpoint_restores_on_two_ranks(version: int) -> None:
    emb = (torch.arange(15, dtype=torch.float32) * 0.5 - 3).reshape(5, 3)
    got = run_ranks(restore_rank, 2, str(COMPAT / f"v{version}" / "ckpt"))
    for rank, (lo, hi) in enumerate(ROWS):
        assert got[rank] == {
            "emb": emb[lo:hi].tolist(),
            "bias": [0.25, -1.0, 3.5],
            "step": 7,
            "mine": [rank, [10 * rank, 10 * rank + 1]],
        }
