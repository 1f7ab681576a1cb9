"""CheckpointManager in one process: argument checks, save policies, retention, restore, stats.

Faults (failing storage, full disks, corrupt checkpoints, preemption of real processes) live in
``tests/faults/test_manager_faults.py``; the directory lock in ``tests/faults/test_lock.py``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tardigrade as tg
import tardigrade.manager._checkpoint_manager as manager_mod
from tardigrade._catalog import Catalog
from tardigrade._commit import RenameCommit
from tardigrade.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    InvalidArgumentError,
    SaveError,
    StorageError,
)
from tardigrade.format.manifest import data_path
from tardigrade.storage import local
from tardigrade.testing import FaultyStorage

pytestmark = pytest.mark.timeout(60)

ASYNC = pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])


def make_state(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    return {
        "model": model,
        "optim": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        "step": 0,
        "extra": {"hist": torch.zeros(5), "tag": "run"},
    }


def mark(state: dict[str, Any], value: float) -> None:
    """Put ``value`` into the state so every checkpoint's content says which step wrote it."""
    with torch.no_grad():
        state["model"].weight.fill_(value)
    state["extra"]["hist"].fill_(value)
    state["step"] = int(value)


def saved_value(mgr: tg.CheckpointManager, step: int) -> float:
    return float(mgr.load(step, keys=["model"])["model"]["weight"][0, 0])


def save_steps(mgr: tg.CheckpointManager, steps: list[int], metrics: Any = None) -> None:
    for s in steps:
        mark(mgr.state, s)
        assert mgr.save(s, metrics=None if metrics is None else metrics(s)) is True
    mgr.wait()


def dir_names(d: Path) -> list[str]:
    return sorted(os.listdir(d))


# -- 1. construction, lifecycle ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"every_steps": 0}, "every_steps"),
        ({"every_steps": -5}, "every_steps"),
        ({"every_steps": 2.5}, "every_steps"),
        ({"every_epochs": 0}, "every_epochs"),
        ({"every_epochs": -1}, "every_epochs"),
        ({"every_seconds": 0}, "every_seconds"),
        ({"every_seconds": -1.5}, "every_seconds"),
        ({"keep_last": 0}, "keep_last"),
        ({"keep_last": -2}, "keep_last"),
        ({"keep_every_steps": 0}, "keep_every_steps"),
        ({"keep_best": 0, "best_metric": "loss"}, "keep_best"),
        ({"best_mode": "median"}, "best_mode"),
        ({"keep_best": 2}, "best_metric"),
        ({"keep_best": 2, "best_metric": 3}, "best_metric"),
        ({"on_save_error": "ignore"}, "on_save_error"),
        ({"on_save_error": None}, "on_save_error"),
    ],
)
def test_constructor_rejects_bad_arguments(tmp_path: Path, kwargs: dict[str, Any], names: str):
    with pytest.raises(InvalidArgumentError, match=names):
        tg.CheckpointManager(tmp_path / "ckpt", make_state(), **kwargs)
    # A rejected configuration must not leave the directory locked (or even created).
    assert not (tmp_path / "ckpt" / ".lock").exists()
    tg.CheckpointManager(tmp_path / "ckpt", make_state()).close()


def test_constructor_accepts_float_seconds_and_none_policies(tmp_path: Path):
    with tg.CheckpointManager(tmp_path, make_state(), every_seconds=0.5, keep_last=None) as mgr:
        assert mgr.every_seconds == 0.5
        assert mgr.keep_last is None
    with tg.CheckpointManager(tmp_path, make_state(), every_seconds=2) as mgr:
        assert mgr.every_seconds == 2


def test_bad_save_on_signals_is_rejected_and_leaves_no_lock(tmp_path: Path):
    with pytest.raises(InvalidArgumentError, match="save_on_signals"):
        tg.CheckpointManager(tmp_path, make_state(), save_on_signals=(signal.SIGKILL,))
    # The failed constructor must not keep the directory locked for this very process.
    tg.CheckpointManager(tmp_path, make_state(), save_on_signals=()).close()


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.step(1),
        lambda m: m.save(1),
        lambda m: m.restore(),
        lambda m: m.restore(step=0),
        lambda m: m.load(0),
        lambda m: m.wait(),
    ],
    ids=["step", "save", "restore", "restore_step", "load", "wait"],
)
def test_calls_after_close_raise(tmp_path: Path, call: Any):
    mgr = tg.CheckpointManager(tmp_path, make_state())
    mgr.save(0)
    mgr.close()
    with pytest.raises(InvalidArgumentError, match=r"after close\(\)"):
        call(mgr)


@ASYNC
def test_close_is_idempotent_waits_and_releases_the_lock(tmp_path: Path, async_save: bool):
    mgr = tg.CheckpointManager(tmp_path, make_state(), async_save=async_save)
    assert (tmp_path / ".lock").exists()
    mgr.save(3)
    mgr.close()
    # close() waited for the in-flight save and recorded it.
    assert mgr.exists(3)
    assert [s.step for s in mgr.stats] == [3] and mgr.stats[0].ok
    assert not (tmp_path / ".lock").exists()
    mgr.close()
    mgr.close()
    # Listing still works on a closed manager; the directory is free for the next job.
    assert mgr.steps() == [3]
    tg.CheckpointManager(tmp_path, make_state()).close()


def test_context_manager_closes_even_on_error(tmp_path: Path):
    with (
        pytest.raises(RuntimeError, match="boom"),
        tg.CheckpointManager(tmp_path, make_state(), every_steps=1) as mgr,
    ):
        assert isinstance(mgr, tg.CheckpointManager)
        mgr.step(0)
        raise RuntimeError("boom")
    assert mgr.exists(0)
    with pytest.raises(InvalidArgumentError):
        mgr.step(1)
    assert not (tmp_path / ".lock").exists()


def test_steps_must_increase(tmp_path: Path):
    with tg.CheckpointManager(tmp_path, make_state(), every_steps=100) as mgr:
        mgr.step(5)
        with pytest.raises(InvalidArgumentError, match="step 5 is not after the previous step 5"):
            mgr.step(5)
        with pytest.raises(InvalidArgumentError, match="step 4 is not after"):
            mgr.step(4)
        mgr.step(6)
        for bad in (-1, 7.0, "8", None, True):
            with pytest.raises(InvalidArgumentError, match="step must be"):
                mgr.step(bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match="step must be"):
            mgr.save(-3)


def test_step_after_restore_must_follow_the_restored_step(tmp_path: Path):
    with tg.CheckpointManager(tmp_path, make_state()) as mgr:
        save_steps(mgr, [0, 10])
    with tg.CheckpointManager(tmp_path, make_state(), every_steps=1) as mgr:
        assert mgr.restore() == 10
        with pytest.raises(InvalidArgumentError, match="restore"):
            mgr.step(10)
        assert mgr.step(11) is True


# -- 2. save policies ---------------------------------------------------------------------------


@ASYNC
def test_every_steps(tmp_path: Path, async_save: bool):
    with tg.CheckpointManager(tmp_path, make_state(), every_steps=3, async_save=async_save) as mgr:
        fired = [s for s in range(10) if mgr.step(s)]
        mgr.wait()
        assert fired == [0, 3, 6, 9]
        assert mgr.steps() == [0, 3, 6, 9]


@ASYNC
def test_every_epochs_saves_when_the_epoch_changes(tmp_path: Path, async_save: bool):
    with tg.CheckpointManager(tmp_path, make_state(), every_epochs=2, async_save=async_save) as mgr:
        schedule = [  # (step, epoch)
            (0, 0),
            (1, 0),
            (2, 1),  # changed, but 1 % 2 != 0
            (3, 1),
            (4, 2),  # changed and 2 % 2 == 0: save
            (5, 2),  # same epoch: no second save
            (6, 3),
            (7, 4),  # save
            (8, 4),
            (9, 6),  # jumped two epochs: still a change to a multiple of 2
        ]
        fired = [s for s, e in schedule if mgr.step(s, epoch=e)]
        mgr.wait()
        assert fired == [4, 7, 9]
        assert mgr.steps() == [4, 7, 9]
        assert tg.read_manifest(mgr.path(7))["epoch"] == 4


def test_every_epochs_without_epoch_never_fires(tmp_path: Path):
    with tg.CheckpointManager(tmp_path, make_state(), every_epochs=1) as mgr:
        assert not any(mgr.step(s) for s in range(5))
        assert mgr.steps() == []


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@ASYNC
def test_every_seconds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool):
    clock = FakeClock()
    monkeypatch.setattr(time, "monotonic", clock)
    with tg.CheckpointManager(
        tmp_path, make_state(), every_seconds=10.0, async_save=async_save
    ) as mgr:
        fired = []
        for s, now in enumerate([1001, 1005, 1009.9, 1010, 1012, 1019.9, 1020.5, 1021, 1040]):
            clock.now = now
            if mgr.step(s):
                fired.append(s)
        mgr.wait()
    # The interval counts from construction, then from the last save.
    assert fired == [3, 6, 8]
    assert mgr.steps() == [3, 6, 8]


def test_every_seconds_counts_from_restore(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    with tg.CheckpointManager(tmp_path, make_state()) as mgr:
        save_steps(mgr, [4])
    clock = FakeClock()
    monkeypatch.setattr(time, "monotonic", clock)
    with tg.CheckpointManager(tmp_path, make_state(), every_seconds=60.0) as mgr:
        clock.now = 2000.0
        assert mgr.restore() == 4  # restore takes a while; the interval starts after it
        clock.now = 2030.0
        assert mgr.step(5) is False
        clock.now = 2060.0
        assert mgr.step(6) is True


def test_any_policy_fires(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    clock = FakeClock()
    monkeypatch.setattr(time, "monotonic", clock)
    with tg.CheckpointManager(
        tmp_path, make_state(), every_steps=5, every_epochs=1, every_seconds=100.0
    ) as mgr:
        fired = []
        for s in range(1, 12):
            epoch = 0 if s < 7 else 1
            clock.now = 1000.0 + (150.0 if s == 3 else 0.0) + (1.0 if s > 3 else 0.0)
            if mgr.step(s, epoch=epoch):
                fired.append(s)
        mgr.wait()
    # 3: seconds, 5 and 10: steps, 7: epoch 0 -> 1.
    assert fired == [3, 5, 7, 10]


def test_no_policy_saves_only_on_request(tmp_path: Path):
    with tg.CheckpointManager(tmp_path, make_state()) as mgr:
        assert not any(mgr.step(s) for s in range(20))
        assert mgr.steps() == []
        assert mgr.save(20) is True
        mgr.wait()
        assert mgr.steps() == [20]


# -- 2. retention -------------------------------------------------------------------------------


@ASYNC
def test_keep_last(tmp_path: Path, async_save: bool):
    with tg.CheckpointManager(tmp_path, make_state(), keep_last=2, async_save=async_save) as mgr:
        save_steps(mgr, [1, 2, 3, 4, 5])
        assert mgr.steps() == [4, 5]
        assert [saved_value(mgr, s) for s in (4, 5)] == [4.0, 5.0]
    # Deleted checkpoints leave nothing behind: no renamed-aside or staging directories.
    assert dir_names(tmp_path) == ["step-000000004", "step-000000005"]


def test_keep_everything_by_default(tmp_path: Path):
    with tg.CheckpointManager(tmp_path, make_state(), every_steps=1) as mgr:
        for s in range(12):
            mgr.step(s)
        mgr.wait()
        assert mgr.steps() == list(range(12))


@ASYNC
def test_keep_every_steps_with_keep_last(tmp_path: Path, async_save: bool):
    with tg.CheckpointManager(
        tmp_path, make_state(), keep_last=1, keep_every_steps=3, async_save=async_save
    ) as mgr:
        save_steps(mgr, [1, 2, 3, 4, 5, 6, 7, 8])
        assert mgr.steps() == [3, 6, 8]


LOSSES = {1: 5.0, 2: 1.0, 3: 4.0, 4: 2.0, 5: 9.0, 6: 3.0}


@ASYNC
@pytest.mark.parametrize(
    ("mode", "expected"),
    [("min", [2, 4, 6]), ("max", [1, 5, 6])],  # best two, plus the newest (6)
)
def test_keep_best(tmp_path: Path, async_save: bool, mode: str, expected: list[int]):
    with tg.CheckpointManager(
        tmp_path,
        make_state(),
        keep_best=2,
        best_metric="loss",
        best_mode=mode,
        async_save=async_save,
    ) as mgr:
        save_steps(mgr, list(LOSSES), metrics=lambda s: {"loss": LOSSES[s], "other": -s})
        assert mgr.steps() == expected


@ASYNC
def test_retention_keeps_the_union(tmp_path: Path, async_save: bool):
    acc = {1: 0.9, 2: 0.1, 3: 0.2, 4: 0.3, 5: 0.5, 6: 0.4, 7: 0.0, 8: 0.35, 9: 0.1}
    with tg.CheckpointManager(
        tmp_path,
        make_state(),
        keep_last=2,
        keep_every_steps=4,
        keep_best=1,
        best_metric="acc",
        best_mode="max",
        async_save=async_save,
    ) as mgr:
        save_steps(mgr, list(acc), metrics=lambda s: {"acc": acc[s]})
        # last two {8, 9}, every 4th {4, 8}, best one {1}
        assert mgr.steps() == [1, 4, 8, 9]


def test_retention_never_deletes_the_newest(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    with tg.CheckpointManager(tmp_path, make_state(), keep_best=1, best_metric="loss") as mgr:
        save_steps(mgr, [1, 2], metrics=lambda s: {"loss": float(s)})
        assert mgr.steps() == [1, 2]  # 2 is the worst but the newest
        save_steps(mgr, [3], metrics=lambda s: {"loss": 10.0})
        assert mgr.steps() == [1, 3]
        caplog.set_level(logging.WARNING, logger="tardigrade")
        save_steps(mgr, [4])  # no metric at all: cannot rank, still the newest
        assert mgr.steps() == [1, 4]
        assert "step 4 saved without metric 'loss'" in caplog.text


def test_retention_after_restart_reads_metrics_from_disk(tmp_path: Path):
    with tg.CheckpointManager(tmp_path, make_state()) as mgr:  # keeps everything
        save_steps(mgr, list(LOSSES), metrics=lambda s: {"loss": LOSSES[s]})
        assert mgr.steps() == [1, 2, 3, 4, 5, 6]
    with tg.CheckpointManager(
        tmp_path, make_state(), keep_last=1, keep_best=2, best_metric="loss", every_steps=1
    ) as mgr:
        assert mgr.restore() == 6
        assert mgr.step(7, metrics={"loss": 8.0}) is True
        mgr.wait()
        # best two by the losses written in the manifests by the first manager: 2 and 4.
        assert mgr.steps() == [2, 4, 7]
    with tg.CheckpointManager(tmp_path, make_state(), keep_last=2) as mgr:
        assert mgr.restore() == 7
        save_steps(mgr, [8])
        assert mgr.steps() == [7, 8]


@ASYNC
def test_retention_deletes_only_after_the_new_checkpoint_commits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool
):
    mgr = tg.CheckpointManager(tmp_path, make_state(), keep_last=1, async_save=async_save)
    save_steps(mgr, [1])
    # Every deletion must happen while the newest save is already committed.
    newest: list[int] = []
    real_retire = Catalog.retire

    def retire(self: Catalog, name: str) -> None:
        assert mgr.exists(newest[-1]), "deleted an old checkpoint before the new one committed"
        real_retire(self, name)

    monkeypatch.setattr(Catalog, "retire", retire)

    real_commit = RenameCommit.commit

    def failing_commit(self: Any, staging: str, name: str, manifest: bytes, **kw: Any) -> None:
        if name.endswith("000000002"):
            raise StorageError(5, "injected commit failure")
        real_commit(self, staging, name, manifest, **kw)

    monkeypatch.setattr(RenameCommit, "commit", failing_commit)
    newest.append(2)
    mark(mgr.state, 2)
    mgr.save(2)
    mgr.wait()
    assert mgr.stats.failed == 1
    assert mgr.steps() == [1]  # the failed save deleted nothing
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]
    newest.append(3)
    save_steps(mgr, [3])
    assert mgr.steps() == [3]
    mgr.close()


def test_retention_spares_a_checkpoint_being_loaded(tmp_path: Path):
    with tg.CheckpointManager(tmp_path, make_state(), keep_last=1) as mgr:
        save_steps(mgr, [1])
        mgr._loading.add(1)  # as while mgr.load(1) / restore() reads it
        save_steps(mgr, [2, 3])
        assert mgr.steps() == [1, 3]
        mgr._loading.discard(1)
        save_steps(mgr, [4])
        assert mgr.steps() == [4]


def test_retention_after_restore_to_an_older_step_keeps_the_new_timeline(tmp_path: Path):
    with tg.CheckpointManager(tmp_path, make_state()) as mgr:
        save_steps(mgr, [1, 2, 3, 4, 5])
    with tg.CheckpointManager(tmp_path, make_state(), keep_last=2, every_steps=1) as mgr:
        assert mgr.restore(step=2) == 2
        mark(mgr.state, 30)
        assert mgr.step(3) is True
        mgr.wait()
        # The checkpoint just saved is the newest of this run: it must survive retention.
        assert mgr.exists(3)
        assert saved_value(mgr, 3) == 30.0
        assert 2 in mgr.steps()


@ASYNC
def test_keep_best_ranks_a_replaced_checkpoint_by_its_new_metric(tmp_path: Path, async_save):
    with tg.CheckpointManager(
        tmp_path,
        make_state(),
        keep_last=1,
        keep_best=1,
        best_metric="loss",
        async_save=async_save,
    ) as mgr:
        save_steps(mgr, [1], metrics=lambda s: {"loss": 1.0})
        save_steps(mgr, [2], metrics=lambda s: {"loss": 9.0})
        assert mgr.steps() == [1, 2]
        mark(mgr.state, 20)
        assert mgr.save(2, metrics={"loss": 0.5}, force=True) is True  # now the best
        mgr.wait()
        assert tg.read_manifest(mgr.path(2))["metrics"] == {"loss": 0.5}
        save_steps(mgr, [3], metrics=lambda s: {"loss": 5.0})
        assert mgr.steps() == [2, 3]
        assert saved_value(mgr, 2) == 20.0


# -- 3. restore ---------------------------------------------------------------------------------


def test_restore_on_an_empty_or_missing_directory_returns_none(tmp_path: Path):
    with tg.CheckpointManager(tmp_path / "fresh", make_state()) as mgr:
        assert mgr.restore() is None
        assert mgr.steps() == [] and mgr.latest() is None


@ASYNC
def test_restore_latest_and_exact_step(tmp_path: Path, async_save: bool):
    with tg.CheckpointManager(tmp_path, make_state(), async_save=async_save) as mgr:
        save_steps(mgr, [0, 5, 10])
    state = make_state(seed=1)
    with tg.CheckpointManager(tmp_path, state, async_save=async_save) as mgr:
        assert mgr.restore() == 10
        assert float(state["model"].weight.detach()[0, 0]) == 10.0
        assert state["step"] == 10
        assert torch.equal(state["extra"]["hist"], torch.full((5,), 10.0))
        assert mgr.restore(step=5) == 5
        assert float(state["model"].weight.detach()[1, 2]) == 5.0
        assert state["step"] == 5
        # restore(step=5) set step 10 aside: it belongs to an abandoned timeline now
        with pytest.raises(CheckpointNotFoundError, match=r"step 7.*\[0, 5\]"):
            mgr.restore(step=7)


def test_restore_restores_optimizer_state(tmp_path: Path):
    state = make_state()
    model, opt = state["model"], state["optim"]
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    buf = opt.state[model.weight]["momentum_buffer"].clone()
    with tg.CheckpointManager(tmp_path, state) as mgr:
        mgr.save(3)
    fresh = make_state(seed=7)
    with tg.CheckpointManager(tmp_path, fresh) as mgr:
        assert mgr.restore() == 3
    for k, v in fresh["model"].state_dict().items():
        assert torch.equal(v, expected[k])
    fresh_model = fresh["model"]
    assert torch.equal(fresh["optim"].state[fresh_model.weight]["momentum_buffer"], buf)


def big_state(seed: int) -> dict[str, Any]:
    """A model + optimizer state spread over several data files, with a step's values."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256), nn.Linear(256, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 256)).sum().backward()
        opt.step()
    # 80 MiB: two data files (64 MiB each at least).
    return {"model": model, "optim": opt, "buf": torch.randn(80, 256 * 1024), "step": seed}


def state_bytes_of(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of the state (model, optimizer moments, buffers), flattened, as bytes."""
    out = {f"model.{k}": v for k, v in state["model"].state_dict().items()}
    for i, (k, v) in enumerate(state["optim"].state_dict()["state"].items()):
        for name, t in v.items():
            out[f"optim.{k}.{name}.{i}"] = t
    out["buf"] = state["buf"]
    return {k: v.detach().clone().reshape(-1).view(torch.uint8) for k, v in out.items()}


def data_files(ckpt: str) -> list[Path]:
    """Every data file of checkpoint ``ckpt``: its own and the shared objects it references."""
    return sorted(Path(ckpt).parent / data_path(Path(ckpt).name, f["name"]) for f in tg.read_manifest(ckpt)["files"])  # fmt: skip


def test_restore_reads_each_byte_of_the_checkpoint_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """restore() verifies while it loads: one pass over the bytes, every byte checked."""
    with tg.CheckpointManager(tmp_path, big_state(1), async_save=False) as mgr:
        mgr.save(1)
        files = data_files(mgr.path(1))
    assert len(files) >= 2
    reads: dict[str, list[tuple[int, int]]] = {}
    original = local.LocalReader.readinto

    def counted(self: Any, offset: int, buf: memoryview) -> None:
        reads.setdefault(os.path.basename(self.name), []).append((offset, buf.nbytes))
        original(self, offset, buf)

    monkeypatch.setattr(local.LocalReader, "readinto", counted)
    state = big_state(2)
    with tg.CheckpointManager(tmp_path, state, async_save=False) as mgr:
        assert mgr.restore() == 1
    for f in files:
        spans = sorted(reads.get(f.name, []))
        covered = 0
        for offset, n in spans:
            assert offset == covered, f"{f.name}: byte {min(offset, covered)} read twice or skipped"
            covered += n
        assert covered == f.stat().st_size, f"{f.name}: {covered} of {f.stat().st_size} bytes read"
    assert state["step"] == 1


def test_restore_after_damage_found_mid_read_restores_the_next_checkpoint_exactly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    """Damaged tensor bytes are found as they are read, after other tensors of the same
    checkpoint have landed in the live state; the older checkpoint then rewrites all of it."""
    with tg.CheckpointManager(tmp_path, big_state(1), async_save=False) as mgr:
        mgr.save(1)
    newer = big_state(2)
    with tg.CheckpointManager(tmp_path, newer, async_save=False) as mgr:
        mgr.save(2)
        damaged = data_files(mgr.path(2))
    expected = state_bytes_of(big_state(1))
    # The last byte of every data file of step 2 is damaged: each file's other tensors are read
    # into the live state before its last one fails its checksum.
    for f in damaged:
        raw = bytearray(f.read_bytes())
        raw[-1] ^= 0xFF
        f.write_bytes(bytes(raw))
    caplog.set_level(logging.WARNING, logger="tardigrade")
    state = big_state(3)
    with tg.CheckpointManager(tmp_path, state, async_save=False) as mgr:
        assert mgr.restore() == 1
    (msg,) = [r.getMessage() for r in caplog.records if "step-000000002" in r.getMessage()]
    assert "skipping" in msg and "checksum" in msg and "partly overwritten" in msg
    got = state_bytes_of(state)
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        assert torch.equal(got[k], v), f"{k} differs from step 1's checkpoint after the fallback"
    assert state["step"] == 1


def test_restore_raises_when_damaged_bytes_landed_and_no_older_checkpoint_restores(
    tmp_path: Path,
):
    with tg.CheckpointManager(tmp_path, big_state(1), async_save=False) as mgr:
        mgr.save(1)
        (f, *_) = data_files(mgr.path(1))
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF
    f.write_bytes(bytes(raw))
    with (
        tg.CheckpointManager(tmp_path, big_state(3), async_save=False) as mgr,
        pytest.raises(tg.CorruptCheckpointError, match=r"step-000000001.*no older checkpoint"),
    ):
        mgr.restore()


def test_load_verify_all_checks_what_it_does_not_read(tmp_path: Path):
    """verify="all" (restore's one pass) checks every byte a full verify() would, also the
    tensors this load does not read; verify=True checks only what it reads."""
    tg.save(tmp_path / "c", big_state(1))
    m = tg.read_manifest(tmp_path / "c")
    bias = next(t for t in m["tensors"] if t["shape"] == [8])  # a bias or its Adam moment
    chunk = bias["chunks"][0]
    f = tmp_path / "c" / chunk["file"]
    raw = bytearray(f.read_bytes())
    head = 8 + int.from_bytes(raw[:8], "little")
    begin = json.loads(raw[8:head])[chunk["key"]]["data_offsets"][0]
    raw[head + begin] ^= 0xFF
    f.write_bytes(bytes(raw))

    assert tg.load(tmp_path / "c", keys=["buf"])["buf"].shape == (80, 256 * 1024)
    with pytest.raises(tg.ChecksumMismatchError, match=chunk["key"]):
        tg.load(tmp_path / "c", keys=["buf"], verify="all")
    with pytest.raises(InvalidArgumentError, match="verify"):
        tg.load(tmp_path / "c", verify="full")


# -- 7. stats -----------------------------------------------------------------------------------


@ASYNC
def test_stats_one_entry_per_save(tmp_path: Path, caplog: pytest.LogCaptureFixture, async_save):
    caplog.set_level(logging.INFO, logger="tardigrade")
    state = make_state()
    state["extra"]["big"] = torch.randn(256, 1024)  # 1 MiB
    with tg.CheckpointManager(tmp_path, state, every_steps=2, async_save=async_save) as mgr:
        for s in range(5):
            mgr.step(s)
        mgr.wait()
        assert [s.step for s in mgr.stats] == [0, 2, 4]
        # The bytes each save wrote: "big" once, its shared object referenced after that.
        assert [s.nbytes > 1024 * 1024 for s in mgr.stats] == [True, False, False]
        for s in mgr.stats:
            assert isinstance(s, tg.SaveStats)
            assert s.ok and s.error is None
            assert s.nbytes > 0
            assert 0 <= s.blocking_seconds <= s.total_seconds
            assert s.total_seconds > 0
            assert s.throughput_gbps > 0
            assert s.throughput_gbps == pytest.approx(s.nbytes / s.total_seconds / 1e9)
        assert mgr.stats.succeeded == 3 and mgr.stats.failed == 0
    saved = [
        r
        for r in caplog.records
        if r.name == "tardigrade" and r.levelno == logging.INFO and "saved step" in r.getMessage()
    ]
    assert [r.getMessage().split("saved step ")[1].split(":")[0] for r in saved] == ["0", "2", "4"]
    assert "MB" in saved[0].getMessage() and "GB/s" in saved[0].getMessage()


def test_async_save_blocks_less_than_it_takes(tmp_path: Path):
    state = {"big": torch.randn(4 * 1024 * 1024)}  # 16 MiB
    with tg.CheckpointManager(tmp_path, state, async_save=True) as mgr:
        mgr.save(1)
        mgr.wait()
        s = mgr.stats[0]
        assert s.ok and s.blocking_seconds < s.total_seconds


# -- 8. abandoned futures, existing steps -------------------------------------------------------


@ASYNC
def test_restore_to_an_older_step_replaces_the_abandoned_future(tmp_path: Path, async_save):
    with tg.CheckpointManager(tmp_path, make_state()) as mgr:
        save_steps(mgr, [1, 2, 3, 4])
    with tg.CheckpointManager(tmp_path, make_state(), every_steps=1, async_save=async_save) as mgr:
        assert mgr.restore(step=2) == 2
        assert mgr.steps() == [1, 2]  # 3 and 4 are set aside, not deleted
        assert abandoned(tmp_path) == [3, 4]
        mark(mgr.state, 300)
        assert mgr.step(3) is True
        mgr.wait()
        assert mgr.stats[-1].ok
        assert saved_value(mgr, 3) == 300.0  # the new timeline
        assert abandoned(tmp_path) == [4]  # not yet reached again
        assert mgr.steps() == [1, 2, 3]
        mark(mgr.state, 400)
        assert mgr.save(4) is True
        mgr.wait()
        assert saved_value(mgr, 4) == 400.0
        assert abandoned(tmp_path) == []


def abandoned(d: Path) -> list[int]:
    """Steps of the checkpoints restore(step) moved aside (``step-N.abandoned-<time>``)."""
    return sorted(int(n[5:14]) for n in os.listdir(d) if ".abandoned-" in n)


def test_only_the_abandoned_timeline_is_replaced_silently(tmp_path: Path):
    with tg.CheckpointManager(tmp_path, make_state()) as mgr:
        save_steps(mgr, [1, 2, 3, 4])
    with tg.CheckpointManager(tmp_path, make_state()) as mgr:
        assert mgr.restore(step=1) == 1
        save_steps(mgr, [2])  # replaces the abandoned step 2
        mark(mgr.state, 99)
        with pytest.raises(CheckpointExistsError):
            mgr.save(2)  # this run's own checkpoint: not abandoned any more
        assert saved_value(mgr, 2) == 2.0


def test_saving_an_existing_step_raises_without_a_restore(tmp_path: Path):
    with tg.CheckpointManager(tmp_path, make_state()) as mgr:
        save_steps(mgr, [1, 2, 3])
        with pytest.raises(CheckpointExistsError, match=r"step 2 already exists.*force=True"):
            mgr.save(2)
    with tg.CheckpointManager(tmp_path, make_state()) as mgr:
        with pytest.raises(CheckpointExistsError):
            mgr.save(3)
        assert mgr.restore() == 3
        with pytest.raises(CheckpointExistsError):
            mgr.save(2)  # older than the restored step: not an abandoned future
        assert mgr.stats == []  # a programming error is not a failed save
        mark(mgr.state, 22)
        assert mgr.save(2, force=True) is True
        mgr.wait()
        assert saved_value(mgr, 2) == 22.0
        assert mgr.steps() == [1, 2, 3]


def test_a_step_that_exists_never_escapes_step_in_warn_mode(tmp_path: Path):
    """step() is the training loop's call: in "warn" mode an existing step is reported and
    counted like a failed save (the checkpoint there is kept), never raised into training;
    an explicit save(step) still raises (a programming error), as does "raise" mode."""
    with tg.CheckpointManager(tmp_path, make_state()) as mgr:
        save_steps(mgr, [1, 2])
    with tg.CheckpointManager(tmp_path, make_state(), every_steps=1) as mgr:  # no restore()
        mark(mgr.state, 99)
        assert mgr.step(2) is False
        (failed,) = mgr.stats
        assert failed.step == 2 and "already exists" in (failed.error or "")
        assert saved_value(mgr, 2) == 2.0
        assert mgr.step(3) is True  # training went on
    raising = tg.CheckpointManager(tmp_path, make_state(), every_steps=1, on_save_error="raise")
    with raising, pytest.raises(CheckpointExistsError):
        raising.step(3)


def test_force_replaces_in_raise_mode_too(tmp_path: Path):
    with tg.CheckpointManager(tmp_path, make_state(), on_save_error="raise") as mgr:
        save_steps(mgr, [1])
        mark(mgr.state, 11)
        assert mgr.save(1, force=True) is True
        mgr.wait()
        assert saved_value(mgr, 1) == 11.0
        with pytest.raises(CheckpointExistsError):
            mgr.save(1)


# -- 9. load, listing -------------------------------------------------------------------------


def test_load_keys_latest_steps_exists(tmp_path: Path):
    with tg.CheckpointManager(tmp_path, make_state()) as mgr:
        assert mgr.latest() is None and mgr.steps() == [] and not mgr.exists(0)
        with pytest.raises(CheckpointNotFoundError):
            mgr.load()
        save_steps(mgr, [7, 3, 12])  # saved out of order on purpose: steps() sorts
        assert mgr.steps() == [3, 7, 12]
        assert mgr.latest() == 12
        assert mgr.exists(7) and not mgr.exists(8)
        assert mgr.path(7) == os.path.join(os.fspath(tmp_path), "step-000000007")

        tree = mgr.load(7, keys=["model"])
        assert set(tree) == {"model"}
        assert set(tree["model"]) == {"weight", "bias"}
        assert torch.equal(tree["model"]["weight"], torch.full((3, 4), 7.0))

        full = mgr.load()  # latest
        assert {"model", "optim", "step", "extra"} <= set(full)
        assert full["step"] == 12
        with pytest.raises(CheckpointNotFoundError, match="step 8"):
            mgr.load(8)
        assert mgr._loading == set()


def test_steps_ignores_foreign_and_staging_entries(tmp_path: Path):
    with tg.CheckpointManager(tmp_path, make_state()) as mgr:
        save_steps(mgr, [1])
        (tmp_path / "step-000000002").mkdir()  # incomplete: no manifest
        (tmp_path / ".tmp-step-000000003-abc").mkdir()
        (tmp_path / "notes.txt").write_text("hi")
        (tmp_path / "step-12").mkdir()
        assert mgr.steps() == [1]
        assert mgr.latest() == 1
        assert not mgr.exists(2)


# -- 6. signals, in process ---------------------------------------------------------------------


def test_signal_handler_installed_and_restored(tmp_path: Path):
    def original(signum: int, frame: Any) -> None:  # pragma: no cover - never delivered
        pass

    before = signal.signal(signal.SIGTERM, original)
    try:
        mgr = tg.CheckpointManager(tmp_path, make_state(), save_on_signals=(signal.SIGTERM,))
        assert signal.getsignal(signal.SIGTERM) != original
        mgr.close()
        assert signal.getsignal(signal.SIGTERM) is original
        with tg.CheckpointManager(tmp_path, make_state(), save_on_signals=()):
            assert signal.getsignal(signal.SIGTERM) is original
    finally:
        signal.signal(signal.SIGTERM, before)


@ASYNC
def test_signal_saves_at_the_next_step_and_stops(tmp_path: Path, async_save: bool):
    before = signal.getsignal(signal.SIGTERM)
    try:
        with tg.CheckpointManager(
            tmp_path,
            make_state(),
            every_steps=1000,
            async_save=async_save,
            save_on_signals=(signal.SIGTERM,),
        ) as mgr:
            for s in range(1, 4):
                assert mgr.step(s) is False
            mark(mgr.state, 4)
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.monotonic() + 5
            while mgr._preemption.received is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not mgr.should_stop
            assert mgr.step(4) is True
            assert mgr.should_stop
            # Saved synchronously: committed before step() returned.
            assert mgr.exists(4)
            assert saved_value(mgr, 4) == 4.0
    finally:
        signal.signal(signal.SIGTERM, before)


def test_stop_at_boundary_stops_when_finished_or_preempted(tmp_path: Path):
    # The public hook JobRunner stops with between epochs: the state is saved already, so a
    # signal commits what is in flight and stops, without saving again.
    before = signal.getsignal(signal.SIGTERM)
    try:
        with tg.CheckpointManager(
            tmp_path, make_state(), async_save=True, save_on_signals=(signal.SIGTERM,)
        ) as mgr:
            assert mgr.stop_at_boundary() is False
            assert mgr.stop_at_boundary(finished=True) is True
            assert not mgr.should_stop  # finished is the caller's own reason: no signal taken
            assert mgr.save(1)
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.monotonic() + 5
            while mgr._preemption.received is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert mgr.stop_at_boundary() is True
            assert mgr.should_stop
            # The save in flight was committed and recorded before it returned; nothing more.
            assert [(s.step, s.ok) for s in mgr.stats] == [(1, True)]
            assert mgr.steps() == [1]
        with pytest.raises(InvalidArgumentError, match="stop_at_boundary"):
            mgr.stop_at_boundary()
    finally:
        signal.signal(signal.SIGTERM, before)


# -- 5. save errors, in process ---------------------------------------------------------------


@ASYNC
def test_injected_storage_failure_warn_and_raise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, async_save
):
    caplog.set_level(logging.INFO, logger="tardigrade")
    real_commit = RenameCommit.commit
    failing = {"on": False}

    def commit(self: Any, staging: str, name: str, manifest: bytes, **kw: Any) -> None:
        if failing["on"]:
            raise StorageError(5, "injected I/O error")
        real_commit(self, staging, name, manifest, **kw)

    monkeypatch.setattr(RenameCommit, "commit", commit)
    with tg.CheckpointManager(tmp_path / "w", make_state(), async_save=async_save) as mgr:
        save_steps(mgr, [1])
        failing["on"] = True
        mark(mgr.state, 2)
        ok = mgr.save(2)
        mgr.wait()
        assert ok is async_save  # async: the failure surfaces on wait()
        assert mgr.stats.failed == 1 and mgr.stats.succeeded == 1
        assert mgr.stats[-1].step == 2 and not mgr.stats[-1].ok
        assert "injected I/O error" in (mgr.stats[-1].error or "")
        failing["on"] = False
        save_steps(mgr, [3])
        assert mgr.steps() == [1, 3]
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "SAVE FAILED for step 2" in errors[0].getMessage()
    assert "injected I/O error" in errors[0].getMessage()


@pytest.mark.parametrize(
    "async_save",
    [
        False,
        True,
    ],
    ids=["sync", "async"],
)
def test_raise_mode_raises_each_failure_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool
):
    real_commit = RenameCommit.commit
    failing = {"on": True}

    def commit(self: Any, staging: str, name: str, manifest: bytes, **kw: Any) -> None:
        if failing["on"]:
            raise StorageError(5, "injected I/O error")
        real_commit(self, staging, name, manifest, **kw)

    monkeypatch.setattr(RenameCommit, "commit", commit)
    mgr = tg.CheckpointManager(tmp_path, make_state(), on_save_error="raise", async_save=async_save)
    try:
        with pytest.raises(SaveError, match="injected I/O error"):
            mgr.save(1)
            mgr.wait()
        assert mgr.stats.failed == 1
        failing["on"] = False
        mgr.wait()  # the failure was reported already
        assert mgr.save(2) is True
        mgr.wait()
        assert [(s.step, s.ok) for s in mgr.stats] == [(1, False), (2, True)]
    finally:
        failing["on"] = False
        mgr.close()
    assert mgr.steps() == [2]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]


# -- an uncommitted step-N directory in the way (issue 8, item 6) ------------------------------


def moved_aside(d: Path, step: int) -> list[Path]:
    return sorted(d.glob(f"step-{step:09d}.incomplete-*"))


@pytest.mark.parametrize("on_save_error", ["warn", "raise"])
@ASYNC
def test_a_step_dir_without_manifest_is_moved_aside_and_training_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, async_save: bool, on_save_error: str
):
    with tg.CheckpointManager(tmp_path, make_state()) as mgr:
        save_steps(mgr, [1, 2])
    # What a save that died before the commit of another tool, or a user half-way through
    # copying a checkpoint back, leaves: a step directory with data but no manifest.
    half = tmp_path / "step-000000003"
    half.mkdir()
    (half / "data-00000-of-00001.safetensors").write_bytes(b"half a copy")
    caplog.set_level(logging.WARNING, logger="tardigrade")
    with tg.CheckpointManager(
        tmp_path, make_state(), every_steps=1, async_save=async_save, on_save_error=on_save_error
    ) as mgr:
        assert mgr.restore() == 2  # skipped, with a warning
        for s in (3, 4):
            mark(mgr.state, s)
            assert mgr.step(s) is True
        mgr.wait()
        assert [(s.step, s.ok) for s in mgr.stats] == [(3, True), (4, True)]
        assert mgr.steps() == [1, 2, 3, 4]
        assert saved_value(mgr, 3) == 3.0
    (aside,) = moved_aside(tmp_path, 3)
    # Kept, byte for byte, under a visible name that steps() ignores; the warning names it.
    assert (aside / "data-00000-of-00001.safetensors").read_bytes() == b"half a copy"
    assert not aside.name.startswith(".")
    (warning,) = [r.getMessage() for r in caplog.records if str(aside) in r.getMessage()]
    assert "no manifest.json" in warning and "Nothing was deleted" in warning
    assert str(half) in warning


@ASYNC
def test_a_regular_file_named_like_a_step_is_moved_aside(tmp_path: Path, async_save: bool):
    (tmp_path / "step-000000005").write_text("someone's notes")
    with tg.CheckpointManager(tmp_path, make_state(), async_save=async_save) as mgr:
        assert mgr.restore() is None
        mark(mgr.state, 5)
        assert mgr.save(5) is True
        mgr.wait()
        assert mgr.steps() == [5] and saved_value(mgr, 5) == 5.0
    (aside,) = moved_aside(tmp_path, 5)
    assert aside.read_text() == "someone's notes"


def test_moving_aside_never_replaces_an_earlier_leftover(tmp_path: Path):
    with tg.CheckpointManager(tmp_path, make_state()) as mgr:
        for round_ in range(3):
            # The same step, uncommitted again each time (force=True replaces a committed one;
            # here each leftover has no manifest, so each is moved aside).
            shutil.rmtree(mgr.path(7), ignore_errors=True)
            (tmp_path / "step-000000007").mkdir()
            (tmp_path / "step-000000007" / "n").write_text(str(round_))
            assert mgr.save(7, force=True) is True
            mgr.wait()
    kept = sorted(p.joinpath("n").read_text() for p in moved_aside(tmp_path, 7))
    assert kept == ["0", "1", "2"]


def test_a_step_dir_that_cannot_be_moved_aside_is_a_failed_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    (tmp_path / "step-000000002").mkdir()
    faulty = FaultyStorage(str(tmp_path))
    faulty.fail("move", error="EACCES")  # the rename of step-2 to step-2.incomplete-*
    caplog.set_level(logging.ERROR, logger="tardigrade")
    with tg.CheckpointManager(faulty.root, make_state(), every_steps=1) as mgr:
        assert mgr.step(2) is False  # reported, counted, training goes on
        assert mgr.step(3) is True
        mgr.wait()
        assert [(s.step, s.ok) for s in mgr.stats] == [(2, False), (3, True)]
    assert any("SAVE FAILED for step 2" in r.getMessage() for r in caplog.records)
    assert (tmp_path / "step-000000002").is_dir()  # left where it was, not deleted


# -- signal handlers: many managers, any order (issue 8, item 12) -------------------------------


def original_handler(signum: int, frame: Any) -> None:  # pragma: no cover - never delivered
    pass


@pytest.fixture
def sigterm_original() -> Any:
    before = signal.signal(signal.SIGTERM, original_handler)
    try:
        yield original_handler
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 1, 0), (1, 0, 2), (0, 2, 1)])
def test_signal_handler_restored_whatever_the_close_order(
    tmp_path: Path, sigterm_original: Any, order: tuple[int, ...]
):
    mgrs = [tg.CheckpointManager(tmp_path / str(i), make_state()) for i in range(3)]
    for i in order:
        assert signal.getsignal(signal.SIGTERM) is not sigterm_original
        mgrs[i].close()
    assert signal.getsignal(signal.SIGTERM) is sigterm_original


def wait_signalled(mgr: tg.CheckpointManager) -> None:
    # The Python-level handler runs in the main thread at the next bytecode boundary; give
    # it a few chances (a signal sent to ourselves is pending at once).
    deadline = time.monotonic() + 5
    while mgr._preemption.received is None and time.monotonic() < deadline:
        time.sleep(0.01)


def test_signal_reaches_every_open_manager_after_others_closed(
    tmp_path: Path, sigterm_original: Any
):
    first = tg.CheckpointManager(tmp_path / "a", make_state(), every_steps=1000)
    second = tg.CheckpointManager(tmp_path / "b", make_state(), every_steps=1000)
    third = tg.CheckpointManager(tmp_path / "c", make_state(), every_steps=1000)
    try:
        first.close()  # creation order: the old code left SIGTERM bound to `first`
        os.kill(os.getpid(), signal.SIGTERM)
        wait_signalled(second)
        wait_signalled(third)
        for mgr in (second, third):
            assert mgr.step(5) is True and mgr.should_stop
            assert mgr.exists(5)
        assert not first.should_stop and first.steps() == []
    finally:
        second.close()
        third.close()
    assert signal.getsignal(signal.SIGTERM) is sigterm_original


def test_a_handler_installed_after_the_manager_is_not_clobbered(
    tmp_path: Path, sigterm_original: Any
):
    def users_own(signum: int, frame: Any) -> None:  # pragma: no cover - never delivered
        pass

    mgr = tg.CheckpointManager(tmp_path, make_state())
    signal.signal(signal.SIGTERM, users_own)
    mgr.close()
    assert signal.getsignal(signal.SIGTERM) is users_own
    # A manager created now saves on the signal again; closing it puts the user's back.
    with tg.CheckpointManager(tmp_path, make_state()):
        assert signal.getsignal(signal.SIGTERM) is not users_own
    assert signal.getsignal(signal.SIGTERM) is users_own


def test_a_manager_dropped_without_close_does_not_swallow_the_signal(
    tmp_path: Path, sigterm_original: Any
):
    got: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    mgr = tg.CheckpointManager(tmp_path, make_state(), save_on_signals=(signal.SIGTERM,))
    mgr._lock.release()  # what the lock's own cleanup would do; the handler is the point
    del mgr
    import gc

    gc.collect()
    os.kill(os.getpid(), signal.SIGTERM)
    deadline = time.monotonic() + 5
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    assert got == [signal.SIGTERM]  # forwarded to the handler from before the manager


# -- close() always releases the lock (issue 8, item 13) ----------------------------------------


@ASYNC
def test_close_releases_everything_when_a_step_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sigterm_original: Any, async_save: bool
):
    def boom(self: Any, *, wait: bool, **kw: Any) -> None:
        raise RuntimeError("injected failure while draining")

    mgr = tg.CheckpointManager(tmp_path, make_state(), async_save=async_save)
    monkeypatch.setattr(manager_mod.CheckpointManager, "_drain", boom)
    with pytest.raises(RuntimeError, match="injected failure while draining"):
        mgr.close()
    assert not (tmp_path / ".lock").exists()
    assert signal.getsignal(signal.SIGTERM) is sigterm_original
    if async_save:
        assert mgr._async is not None and mgr._async._closed
    mgr.close()  # idempotent, raises nothing more
    monkeypatch.undo()
    tg.CheckpointManager(tmp_path, make_state(), save_on_signals=()).close()


def test_close_survives_an_exception_raised_by_a_signal_handler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sigterm_original: Any
):
    """PyTorch's SIGCHLD handler raises "DataLoader worker ... is killed by signal" in the main
    thread, at whatever statement it is running; here a real child exits while close() runs."""

    class WorkerDied(RuntimeError):
        pass

    def sigchld(signum: int, frame: Any) -> None:
        raise WorkerDied("DataLoader worker (pid 1234) is killed by signal: Terminated.")

    mgr = tg.CheckpointManager(tmp_path, make_state(), async_save=True)
    mark(mgr.state, 1)
    mgr.save(1)
    assert mgr._async is not None
    real_close = mgr._async.close

    def close_while_a_child_dies() -> None:
        real_close()
        child = subprocess.Popen([sys.executable, "-c", "pass"])
        try:
            time.sleep(30)  # interrupted by the handler's exception when the child exits
        finally:
            child.wait(30)

    monkeypatch.setattr(mgr._async, "close", close_while_a_child_dies)
    before = signal.signal(signal.SIGCHLD, sigchld)
    try:
        with pytest.raises(WorkerDied):
            mgr.close()
    finally:
        signal.signal(signal.SIGCHLD, before)
    assert mgr.exists(1) and mgr.stats.succeeded == 1
    assert not (tmp_path / ".lock").exists()
    assert signal.getsignal(signal.SIGTERM) is sigterm_original
    tg.CheckpointManager(tmp_path, make_state(), save_on_signals=()).close()


@ASYNC
def test_save_honours_a_pending_signal_like_step(
    tmp_path: Path, sigterm_original: Any, async_save: bool
):
    with tg.CheckpointManager(tmp_path, make_state(), async_save=async_save) as mgr:
        save_steps(mgr, [1])
        mark(mgr.state, 2)
        os.kill(os.getpid(), signal.SIGTERM)
        wait_signalled(mgr)
        assert mgr.save(2) is True
        assert mgr.should_stop
        # Saved synchronously: committed before save() returned, nothing left in flight.
        assert mgr.exists(2) and not mgr._outcomes.pending
        assert saved_value(mgr, 2) == 2.0
        assert mgr._preemption.received is None


def test_a_policy_of_the_measured_cost_sets_the_interval_stats_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    clock = FakeClock()
    monkeypatch.setattr(time, "monotonic", clock)
    mtbf = 1e6
    with tg.CheckpointManager(
        tmp_path, make_state(), async_save=False, policy=tg.YoungDaly(mtbf=mtbf)
    ) as mgr:
        assert mgr.stats.interval == 0.0  # nothing measured yet: the first step saves
        assert mgr.step(1)
        cost = mgr.stats.blocking_cost
        assert cost is not None and cost > 0
        assert mgr.stats.background_cost == 0.0  # a synchronous save blocks for all of it
        interval = mgr.stats.interval
        assert interval == pytest.approx(math.sqrt(2 * cost * mtbf))
        assert mgr.stats.expected_loss_seconds == pytest.approx(interval / 2)
        clock.now += interval * 0.99
        assert not mgr.step(2)
        clock.now += interval * 0.02
        assert mgr.step(3)
        assert mgr.steps() == [1, 3]
    with pytest.raises(InvalidArgumentError, match="policy must be a save policy"):
        tg.CheckpointManager(tmp_path, make_state(), policy="every 10 minutes")


def test_a_policy_joins_the_shorthands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    clock = FakeClock()
    monkeypatch.setattr(time, "monotonic", clock)
    with tg.CheckpointManager(
        tmp_path, make_state(), every_steps=4, policy=tg.EverySeconds(100)
    ) as mgr:
        fired = []
        for s in range(1, 10):
            clock.now = 1000.0 + (150.0 if s >= 6 else 0.0)
            if mgr.step(s):
                fired.append(s)
        mgr.wait()
        assert mgr.stats.interval == 100.0
    assert fired == [4, 6, 8]


def test_a_closed_manager_is_freed_at_once_with_its_staging_memory(tmp_path: Path):
    """No reference cycle holds a manager (its cadence once closed over it): a program that
    drops one gets its staging memory (a copy of the state) back at once, not at the next
    run of the cyclic collector, which a loop of managers outran (make bench's same-node
    part, a manager of a 3 GB state per measurement, ran out of memory with 24 GB)."""
    import gc
    import weakref

    model = nn.Linear(64, 64)
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    optim.step()
    enabled = gc.isenabled()
    gc.disable()
    try:
        mgr = tg.CheckpointManager(tmp_path, {"model": model, "optim": optim}, every_steps=1)
        mgr.step(1)
        mgr.wait()
        manager, saver = weakref.ref(mgr), weakref.ref(mgr._async)
        mgr.close()
        del mgr
        assert manager() is None and saver() is None
    finally:
        if enabled:
            gc.enable()
