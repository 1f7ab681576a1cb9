"""CheckpointManager on every backend: policy, retention, restore, the lease, failed saves.

The manager lists, locks, retires and cleans up only through the catalog over the storage
contract, so the same run works on a local directory and on ``memory://``; faults come from
``tardigrade.testing.FaultyStorage`` around either.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import nn

import tardigrade as tg
from tardigrade._commit import LOCK
from tardigrade.storage import open_root
from tardigrade.testing import FaultyStorage


def make_state(value: float = 0.0) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.fill_(value)
    return {"model": model, "step": 0}


def mark(state: dict[str, Any], step: int) -> None:
    with torch.no_grad():
        state["model"].weight.fill_(float(step))
    state["step"] = step


def weight(state: dict[str, Any]) -> float:
    return float(state["model"].weight.detach()[0, 0])


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_policy_retention_and_restore(root_url: str, async_save: bool) -> None:
    state = make_state()
    with tg.CheckpointManager(root_url, state, every_steps=2, keep_last=2,
                              async_save=async_save) as mgr:  # fmt: skip
        for step in range(1, 9):
            mark(state, step)
            mgr.step(step)
        mgr.wait()
        assert mgr.steps() == [6, 8] and mgr.latest() == 8 and mgr.exists(6)
        assert not mgr.exists(4)
        assert float(mgr.load(6, keys=["model"])["model"]["weight"][0, 0]) == 6.0
        assert mgr.stats.succeeded == 4
    # Only the checkpoints: no staging; no lease held (a store keeps the released record,
    # whose generation the next holder continues).
    storage = open_root(root_url)
    assert [n for n in storage.list() if n != ".lock"] == ["step-000000006", "step-000000008"]
    assert storage.lease(LOCK).read() in (
        None,
        {**(storage.lease(LOCK).read() or {}), "released": True},
    )
    state = make_state(-1.0)
    with tg.CheckpointManager(root_url, state) as mgr:
        assert mgr.restore() == 8 and weight(state) == 8.0 and state["step"] == 8


def test_one_writer_per_location(root_url: str) -> None:
    with (
        tg.CheckpointManager(root_url, make_state()),
        pytest.raises(tg.CheckpointLockedError, match="another job is writing"),
    ):
        tg.CheckpointManager(root_url, make_state())
    with tg.CheckpointManager(root_url, make_state()):  # free again after close()
        pass


def test_restore_falls_back_past_a_damaged_checkpoint(root_url: str, caplog: Any) -> None:
    state = make_state()
    with tg.CheckpointManager(root_url, state, async_save=False) as mgr:
        for step in (1, 2):
            mark(state, step)
            mgr.save(step)
    storage = open_root(root_url)
    data = next(n for n in storage.list("step-000000002") if n.endswith(".safetensors"))
    raw = bytearray(storage.read_bytes(f"step-000000002/{data}", 1 << 30))
    raw[-1] ^= 0xFF  # a tensor byte
    storage.put(f"step-000000002/{data}", bytes(raw), mode="overwrite")
    state = make_state(-1.0)
    with tg.CheckpointManager(root_url, state) as mgr:
        assert mgr.restore() == 1 and weight(state) == 1.0
    assert any("skipping checkpoint" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("op", ["write", "close", "commit", "begin"])
def test_a_failed_save_is_counted_and_training_goes_on(
    root_url: str, op: str, caplog: pytest.LogCaptureFixture
) -> None:
    faulty = FaultyStorage(root_url)
    state = make_state()
    caplog.set_level(logging.ERROR, logger="tardigrade")
    with tg.CheckpointManager(faulty.root, state, keep_last=1, async_save=False) as mgr:
        mark(state, 1)
        assert mgr.save(1) is True
        faulty.fail(op, error="ENOSPC")
        mark(state, 2)
        assert mgr.save(2) is False  # warn mode: reported, counted, not raised
        assert mgr.stats.failed == 1 and mgr.steps() == [1]  # nothing lost, nothing new
        mark(state, 3)
        assert mgr.save(3) is True  # the fault is gone: the next save commits
        assert mgr.steps() == [3]
    assert any("SAVE FAILED for step 2" in r.getMessage() for r in caplog.records)
    assert [n for n in faulty.inner.list() if n != ".lock"] == ["step-000000003"]


def test_a_failed_retention_delete_loses_nothing(root_url: str) -> None:
    faulty = FaultyStorage(root_url)
    state = make_state()
    with tg.CheckpointManager(faulty.root, state, keep_last=1, async_save=False) as mgr:
        mark(state, 1)
        mgr.save(1)
        faulty.fail("delete", error="EIO")
        mark(state, 2)
        assert mgr.save(2) is True  # the save committed; only the retire of step 1 failed
        assert 2 in mgr.steps()
        mark(state, 3)
        mgr.save(3)
        assert mgr.steps() == [3]  # retention catches up once deletes work again
    state = make_state(-1.0)
    with tg.CheckpointManager(faulty.root, state) as mgr:
        assert mgr.restore() == 3
