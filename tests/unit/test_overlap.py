"""Async saves whose copy overlaps training (``overlap``): the save returns before the state is
copied, the next forward and backward run beside the copy, and every optimizer's ``step()``
waits for it (the fence). What an optimizer does not own is snapshotted first (BatchNorm's
running statistics, changed by the very next forward); an in-place update the fence cannot
see fails the save by name instead of writing a checkpoint of mixed steps.

The copy is held at a gate here (``stage_copy`` waits for the test), so "before the copy is
done" is a fact of each test, not a race: a fence that did not wait would let the optimizer
change the weights first, and the checkpoint (or the version check) would show it.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tardigrade as tg
from tardigrade import _async
from tardigrade.errors import SaveError


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Staging starts only once the test sets the event."""
    event = threading.Event()
    real = _async.stage_copy

    def gated(*args: Any, **kwargs: Any) -> None:
        assert event.wait(60), "the test never opened the gate"
        real(*args, **kwargs)

    monkeypatch.setattr(_async, "stage_copy", gated)
    yield event
    event.set()


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    _train_step(model, optim)  # the moments exist
    return model, optim


def _train_step(model: nn.Module, optim: torch.optim.Optimizer, *, step: bool = True) -> None:
    x = torch.randn(8, 16)
    model(x).square().sum().backward()
    if step:
        optim.step()
        optim.zero_grad()


def _expected(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": copy.deepcopy(model.state_dict()), "optim": copy.deepcopy(optim.state_dict())}


def _loaded(path: Path) -> dict[str, Any]:
    model, optim = _model()
    state = {"model": model, "optim": optim}
    tg.load(str(path), into=state)
    return {"model": model.state_dict(), "optim": optim.state_dict()}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if torch.is_tensor(a):
        return torch.equal(a.cpu(), b.cpu())
    return bool(a == b)


def test_the_next_forward_and_backward_run_beside_the_copy_and_the_step_waits(
    tmp_path: Path, gate: threading.Event
) -> None:
    model, optim = _model()
    state = {"model": model, "optim": optim}
    expected = _expected(model, optim)
    with tg.AsyncCheckpointer() as ckpt:
        fut = ckpt.save(tmp_path / "step-1", state, overlap=True)
        assert fut is not None and not fut.staged()  # returned before the copy
        # The next step's forward (BatchNorm's running stats change: snapshotted first) and
        # backward run while nothing is copied yet.
        _train_step(model, optim, step=False)
        assert not fut.staged()
        stepped = threading.Event()

        def optimizer_step() -> None:
            optim.step()  # the fence: waits for the copy
            stepped.set()

        thread = threading.Thread(target=optimizer_step)
        thread.start()
        assert not stepped.wait(0.2)  # held at the fence (the copy has not started)
        gate.set()
        thread.join(60)
        assert stepped.is_set() and fut.staged()
        result = fut.result()
    assert _same(_loaded(tmp_path / "step-1"), expected)
    # The fence's wait counts as blocking: training waited for it.
    assert result.blocking_seconds > fut.blocking_seconds


def test_an_update_the_fence_cannot_see_fails_the_save_by_name_writing_nothing(
    tmp_path: Path, gate: threading.Event
) -> None:
    model, optim = _model()
    state = {"model": model, "optim": optim}
    with tg.AsyncCheckpointer() as ckpt:
        fut = ckpt.save(tmp_path / "step-1", state, overlap=True)
        assert fut is not None
        with torch.no_grad():
            model[0].weight.mul_(2.0)  # in place, outside optimizer.step(), before the copy
        gate.set()
        with pytest.raises(SaveError, match=r"model/0\.weight.*changed while the save"):
            fut.result()
    assert not (tmp_path / "step-1").exists()
    # After wait_staged(), the same update is the user's business: the checkpoint holds the
    # values from before it.
    expected = _expected(model, optim)
    with tg.AsyncCheckpointer() as ckpt:
        fut = ckpt.save(tmp_path / "step-2", state, overlap=True)
        assert fut is not None and fut.wait_staged(60)
        with torch.no_grad():
            model[0].weight.data.mul_(2.0)
            model[3].bias.numpy()[:] = 7.0
        fut.result()
    assert _same(_loaded(tmp_path / "step-2"), expected)


def test_what_no_optimizer_owns_is_snapshotted_before_the_save_returns(
    tmp_path: Path, gate: threading.Event
) -> None:
    model, optim = _model()
    counter = torch.zeros(3)
    state = {"model": model, "optim": optim, "counter": counter}
    expected = _expected(model, optim)
    with tg.AsyncCheckpointer() as ckpt:
        fut = ckpt.save(tmp_path / "step-1", state, overlap=True)
        assert fut is not None
        # A plain tensor and a buffer change before the copy: neither is the optimizer's, so
        # both were copied before save() returned.
        counter.add_(5.0)
        with torch.no_grad():
            model[1].running_mean.add_(1.0)
        gate.set()
        fut.result()
    tree = tg.load(str(tmp_path / "step-1"))
    assert torch.equal(tree["counter"], torch.zeros(3))
    assert torch.equal(tree["model"]["1.running_mean"], expected["model"]["1.running_mean"])


def test_a_manager_overlaps_when_asked_in_a_single_process_without_a_budget(
    tmp_path: Path, gate: threading.Event
) -> None:
    """Off by default: an update through ``.data`` before the fence is invisible to the version
    check, so only a loop known to update the state in ``optimizer.step()`` (or to call
    ``wait_staged()`` first) should turn it on."""
    model, optim = _model()
    state = {"model": model, "optim": optim}
    gate.set()  # the manager's own first save reserves; no gate needed here
    with tg.CheckpointManager(tmp_path / "on", state, overlap=True) as mgr:
        assert mgr._dispatch.overlap
        for step in range(1, 4):
            _train_step(model, optim)
            expected = _expected(model, optim)
            mgr.save(step)
        mgr.wait_staged()  # before an update that is not the optimizer's step()
        with torch.no_grad():
            model[0].weight.data.add_(1.0)
        mgr.wait()
    assert _same(_loaded(tmp_path / "on" / "step-000000003"), expected)
    with tg.CheckpointManager(tmp_path / "off", state) as mgr:
        assert not mgr._dispatch.overlap
    with tg.CheckpointManager(
        tmp_path / "bounded", state, overlap=True, max_staging_bytes=8 << 20
    ) as mgr:
        assert not mgr._dispatch.overlap
    with pytest.raises(tg.InvalidArgumentError, match="overlap"):
        tg.CheckpointManager(tmp_path / "bad", state, overlap="yes")


def test_without_an_optimizer_to_fence_it_the_copy_is_made_before_save_returns(
    tmp_path: Path, gate: threading.Event
) -> None:
    state = {"w": torch.randn(1000), "b": torch.zeros(10)}
    expected = {k: v.clone() for k, v in state.items()}
    gate.set()
    with tg.AsyncCheckpointer() as ckpt:
        fut = ckpt.save(tmp_path / "step-1", state, overlap=True)
        assert fut is not None and fut.staged()  # nothing could fence a background copy
        state["w"].add_(1.0)
        fut.result()
    got = tg.load(str(tmp_path / "step-1"))
    assert all(torch.equal(got[k], expected[k]) for k in state)
