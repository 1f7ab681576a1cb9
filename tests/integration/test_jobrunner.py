"""Job and JobRunner: the Caffe2 epoch-level job, checkpointed after init and every epoch.

The job folds each epoch into a running total with an order-sensitive rule
(``total = 3 * total + epoch``), so running an epoch twice, skipping one, running init again
on resume, or restoring the wrong epoch all change the final number. Its state lives in a user
object with ``state_dict``/``load_state_dict`` (CNTK's "external state") next to a model.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import tardigrade as tg
from tardigrade.errors import (
    CheckpointNotFoundError,
    InvalidArgumentError,
    StorageError,
)
from tardigrade.testing import FaultyStorage

pytestmark = pytest.mark.timeout(120)

EPOCHS = 6
ASYNC = pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])


def expected_total(epoch: int) -> int:
    total = 1  # what init sets
    for e in range(1, epoch + 1):
        total = 3 * total + e
    return total


def expected_weight(epoch: int) -> torch.Tensor:
    w = torch.zeros(2, 3)
    for e in range(1, epoch + 1):
        w = w * 0.5 + e
    return w


class Accumulator:
    """User state: a running total, the last finished epoch and a history tensor."""

    def __init__(self) -> None:
        # Garbage until init runs or a checkpoint is restored.
        self.total = -999
        self.epoch = -999
        self.hist = torch.full((EPOCHS + 1,), -1.0)

    def state_dict(self) -> dict[str, Any]:
        return {"total": self.total, "epoch": self.epoch, "hist": self.hist}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.total = sd["total"]
        self.epoch = sd["epoch"]
        self.hist = sd["hist"].clone()


class Run:
    """One process's view of the job: its live state, its job and the calls it saw."""

    def __init__(
        self, epochs: int = EPOCHS, crash_at: int | None = None, sigterm_in: Any = None
    ) -> None:
        self.acc = Accumulator()
        self.model = torch.nn.Linear(3, 2, bias=False)
        with torch.no_grad():
            self.model.weight.fill_(-7.0)
        self.state = {"acc": self.acc, "model": self.model}
        self.calls: list[Any] = []
        self.epochs = epochs
        self.crash_at = crash_at
        # Where a SIGTERM arrives: "init", ("epoch", e) or ("stop", e) (after epoch e's save).
        self.sigterm_in = sigterm_in
        self.mgr: tg.CheckpointManager | None = None
        self.job = tg.Job(
            init=self.init, epoch=self.epoch, stop=self.stop, download=self.download, exit=self.exit
        )

    def preempt(self, where: Any) -> None:
        if where != self.sigterm_in:
            return
        assert self.mgr is not None
        os.kill(os.getpid(), signal.SIGTERM)  # what a cluster sends before the SIGKILL
        deadline = time.monotonic() + 5  # the handler runs at the next bytecode boundary
        while self.mgr._preemption.received is None and time.monotonic() < deadline:
            time.sleep(0.001)
        assert self.mgr._preemption.received == signal.SIGTERM

    def init(self) -> None:
        self.calls.append("init")
        self.preempt("init")
        self.acc.total, self.acc.epoch = 1, 0
        self.acc.hist.zero_()
        self.acc.hist[0] = 1
        with torch.no_grad():
            self.model.weight.zero_()

    def epoch(self, e: int) -> None:
        self.calls.append(("epoch", e))
        if e == self.crash_at:
            raise RuntimeError(f"simulated crash in epoch {e}")
        assert e == self.acc.epoch + 1, f"epoch {e} runs after epoch {self.acc.epoch}"
        self.acc.total = 3 * self.acc.total + e
        self.acc.epoch = e
        self.acc.hist[e] = float(self.acc.total % 1000)
        with torch.no_grad():
            self.model.weight.mul_(0.5).add_(e)
        self.preempt(("epoch", e))

    def stop(self) -> bool:
        self.preempt(("stop", self.acc.epoch))
        return self.acc.epoch >= self.epochs

    def download(self) -> None:
        # The last epoch's checkpoint is committed before the download phase starts.
        assert self.mgr is not None
        self.calls.append(("download", self.acc.total, self.mgr.exists(self.acc.epoch)))

    def exit(self) -> None:
        self.calls.append(("exit", self.acc.total))

    def run(self, directory: Path, resume_from_epoch: int | None = None, **mgr_kw: Any) -> int:
        with tg.CheckpointManager(directory, self.state, **mgr_kw) as mgr:
            self.mgr = mgr
            return tg.JobRunner(self.job, mgr, resume_from_epoch=resume_from_epoch).run()


def check_checkpoint(directory: Path, epoch: int) -> None:
    """Epoch ``epoch``'s checkpoint holds exactly the state after that epoch."""
    with tg.CheckpointManager(directory, {}, save_on_signals=()) as mgr:
        assert mgr.exists(epoch)
        tree = mgr.load(epoch)
        assert tree["acc"]["total"] == expected_total(epoch), f"epoch {epoch}"
        assert tree["acc"]["epoch"] == epoch
        assert torch.equal(tree["model"]["weight"], expected_weight(epoch)), f"epoch {epoch}"
        weights_only = mgr.load(epoch, keys=["model"])
        assert set(weights_only) == {"model"}
        assert torch.equal(weights_only["model"]["weight"], expected_weight(epoch))
    assert tg.read_manifest(directory / f"step-{epoch:09d}")["epoch"] == epoch


def done_calls(total: int) -> list[Any]:
    return [("download", total, True), ("exit", total)]


@ASYNC
def test_fresh_run_phases_in_order_and_a_checkpoint_per_epoch(
    tmp_path: Path, async_save: bool
) -> None:
    run = Run()
    last = run.run(tmp_path / "ckpt", async_save=async_save)
    assert last == EPOCHS
    final = expected_total(EPOCHS)
    assert run.calls == [
        "init",
        *[("epoch", e) for e in range(1, EPOCHS + 1)],
        *done_calls(final),
    ]
    assert run.acc.total == final
    assert run.mgr is not None and run.mgr.stats.failed == 0
    assert run.mgr.stats.succeeded == EPOCHS + 1
    with tg.CheckpointManager(tmp_path / "ckpt", {}, save_on_signals=()) as mgr:
        assert mgr.steps() == list(range(EPOCHS + 1))
    for e in range(EPOCHS + 1):
        check_checkpoint(tmp_path / "ckpt", e)


@ASYNC
def test_resume_from_every_epoch_reaches_the_same_final_total(
    tmp_path: Path, async_save: bool
) -> None:
    ref_dir = tmp_path / "ref"
    assert Run().run(ref_dir, async_save=async_save) == EPOCHS
    ref_ids = {e: tg.read_manifest(ref_dir / f"step-{e:09d}")["save_id"] for e in range(EPOCHS + 1)}
    final = expected_total(EPOCHS)

    for k in range(EPOCHS + 1):
        d = tmp_path / f"resume-{k}"
        shutil.copytree(ref_dir, d)
        check_checkpoint(d, k)
        run = Run()
        last = run.run(d, resume_from_epoch=k, async_save=async_save)
        assert last == EPOCHS, f"resumed from {k}"
        assert run.calls == [
            *[("epoch", e) for e in range(k + 1, EPOCHS + 1)],
            *done_calls(final),
        ], f"resumed from {k}: init must not run, epochs {k + 1}.. must"
        assert run.acc.total == final, f"resumed from {k}"
        assert torch.equal(run.model.weight.detach(), expected_weight(EPOCHS))
        for e in range(EPOCHS + 1):
            check_checkpoint(d, e)
        for e in range(k + 1, EPOCHS + 1):
            new_id = tg.read_manifest(d / f"step-{e:09d}")["save_id"]
            assert new_id != ref_ids[e], f"resumed from {k}: epoch {e} was not saved again"


@ASYNC
def test_resume_from_latest_after_a_crash(tmp_path: Path, async_save: bool) -> None:
    d = tmp_path / "ckpt"
    crashed = Run(crash_at=4)
    with pytest.raises(RuntimeError, match="simulated crash in epoch 4"):
        crashed.run(d, async_save=async_save)
    with tg.CheckpointManager(d, {}, save_on_signals=()) as mgr:
        assert mgr.latest() == 3

    run = Run()
    assert run.run(d, async_save=async_save) == EPOCHS  # resume_from_epoch=None: the latest
    assert run.calls == [
        *[("epoch", e) for e in range(4, EPOCHS + 1)],
        *done_calls(expected_total(EPOCHS)),
    ]
    assert run.acc.total == expected_total(EPOCHS)
    for e in range(EPOCHS + 1):
        check_checkpoint(d, e)

    # Finished: running again resumes after the last epoch and runs no epoch at all.
    again = Run()
    assert again.run(d, async_save=async_save) == EPOCHS
    assert again.calls == done_calls(expected_total(EPOCHS))


@ASYNC
def test_stop_before_the_first_epoch(tmp_path: Path, async_save: bool) -> None:
    run = Run(epochs=0)
    assert run.run(tmp_path / "ckpt", async_save=async_save) == 0
    assert run.calls == ["init", *done_calls(1)]
    check_checkpoint(tmp_path / "ckpt", 0)


def test_without_download_and_exit(tmp_path: Path) -> None:
    run = Run()
    job = tg.Job(init=run.init, epoch=run.epoch, stop=run.stop)
    with tg.CheckpointManager(tmp_path / "ckpt", run.state) as mgr:
        assert tg.JobRunner(job, mgr).run() == EPOCHS
    assert run.calls == ["init", *[("epoch", e) for e in range(1, EPOCHS + 1)]]


@pytest.mark.parametrize("on_save_error", ["warn", "raise"])
@ASYNC
def test_unwritable_directory_fails_before_the_job_starts(
    tmp_path: Path, async_save: bool, on_save_error: str
) -> None:
    # A directory that can never hold a checkpoint: with the old "warn and go on" a job ran for
    # days saving nothing. It now fails at once, before init; failures that can pass (a full
    # disk, test_failing_writes_do_not_stop_the_job) still never stop the job.
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"not a directory")
    d = blocker / "ckpt"  # every mkdir/open under a regular file fails (even for root)
    run = Run()
    with pytest.raises(StorageError, match="a-file is a regular file") as info:
        run.run(d, async_save=async_save, on_save_error=on_save_error)
    assert isinstance(info.value, OSError)  # StorageError: a TardigradeError and an OSError
    assert info.value.errno == errno.ENOTDIR
    assert str(d) in str(info.value)
    assert run.calls == []
    assert blocker.read_bytes() == b"not a directory"


@ASYNC
def test_failing_writes_do_not_stop_the_job(
    tmp_path: Path,
    async_save: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The directory is fine but the disk "fills up" while epochs 2 and 3 are written: with
    # async saves the error happens in the background writer and must still only be reported.
    d = tmp_path / "ckpt"
    faulty = FaultyStorage(str(d))
    for step in ("step-000000002", "step-000000003"):
        faulty.fail("write", where=step, error="ENOSPC", times=1_000)
    caplog.set_level(logging.ERROR, logger="tardigrade")
    run = Run()
    assert run.run(faulty.root, async_save=async_save) == EPOCHS  # type: ignore[arg-type]
    assert run.acc.total == expected_total(EPOCHS)
    assert run.mgr is not None
    assert sorted(s.step for s in run.mgr.stats if not s.ok) == [2, 3]
    failures = [r.getMessage() for r in caplog.records if "SAVE FAILED" in r.getMessage()]
    assert len(failures) == 2 and "injected ENOSPC" in failures[0], failures

    faulty.heal()
    with tg.CheckpointManager(d, {}, save_on_signals=()) as mgr:
        assert mgr.steps() == [0, 1, 4, 5, 6]
    for e in (0, 1, 4, 5, 6):
        check_checkpoint(d, e)
    # Resuming from a checkpoint that survived the failures still reaches the same result.
    again = Run()
    assert again.run(d, resume_from_epoch=1, async_save=async_save) == EPOCHS
    assert again.acc.total == expected_total(EPOCHS)
    for e in range(EPOCHS + 1):
        check_checkpoint(d, e)


def test_invalid_arguments(tmp_path: Path) -> None:
    run = Run()
    with pytest.raises(InvalidArgumentError, match="init"):
        tg.Job(init=None, epoch=run.epoch, stop=run.stop)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="download"):
        tg.Job(init=run.init, epoch=run.epoch, stop=run.stop, download=3)  # type: ignore[arg-type]
    with tg.CheckpointManager(tmp_path / "ckpt", run.state) as mgr:
        with pytest.raises(InvalidArgumentError, match="Job"):
            tg.JobRunner(lambda: None, mgr)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match="CheckpointManager"):
            tg.JobRunner(run.job, str(tmp_path))  # type: ignore[arg-type]
        for bad in (-1, 1.0, "2", True):
            with pytest.raises(InvalidArgumentError, match="resume_from_epoch"):
                tg.JobRunner(run.job, mgr, resume_from_epoch=bad)  # type: ignore[arg-type]
        with pytest.raises(CheckpointNotFoundError, match="step 3"):
            tg.JobRunner(run.job, mgr, resume_from_epoch=3).run()
    assert run.calls == [], "a rejected resume must not start the job"


# -- preemption (issue 8, item 11) --------------------------------------------------------------


@pytest.fixture
def sigterm_restored() -> Any:
    before = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize(
    "where, stopped",
    [("init", 0), (("epoch", 1), 1), (("epoch", 3), 3), (("stop", 2), 2), (("stop", 0), 0)],
    ids=["init", "epoch-1", "epoch-3", "after-save-2", "after-save-0"],
)
@ASYNC
def test_sigterm_stops_after_the_epoch_it_arrived_in_and_resumes(
    tmp_path: Path, sigterm_restored: None, async_save: bool, where: Any, stopped: int
) -> None:
    d = tmp_path / "ckpt"
    run = Run(sigterm_in=where)
    assert run.run(d, async_save=async_save) == stopped
    assert run.mgr is not None and run.mgr.should_stop
    # The epoch in which the signal arrived ran to its end and was saved; no later epoch ran,
    # and neither did download/exit: the job is not finished.
    assert run.calls == ["init", *[("epoch", e) for e in range(1, stopped + 1)]]
    assert run.mgr.stats.failed == 0
    with tg.CheckpointManager(d, {}, save_on_signals=()) as mgr:
        assert mgr.steps() == list(range(stopped + 1))
    for e in range(stopped + 1):
        check_checkpoint(d, e)

    resumed = Run()
    assert resumed.run(d, async_save=async_save) == EPOCHS
    assert resumed.calls == [
        *[("epoch", e) for e in range(stopped + 1, EPOCHS + 1)],
        *done_calls(expected_total(EPOCHS)),
    ]
    assert resumed.acc.total == expected_total(EPOCHS)
    for e in range(EPOCHS + 1):
        check_checkpoint(d, e)


@ASYNC
def test_sigterm_while_resuming_stops_without_running_an_epoch(
    tmp_path: Path, sigterm_restored: None, async_save: bool
) -> None:
    d = tmp_path / "ckpt"
    with pytest.raises(RuntimeError, match="simulated crash"):
        Run(crash_at=3).run(d, async_save=async_save)
    run = Run()
    with tg.CheckpointManager(d, run.state, async_save=async_save) as mgr:
        run.mgr = mgr
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while mgr._preemption.received is None and time.monotonic() < deadline:
            time.sleep(0.001)
        assert tg.JobRunner(run.job, mgr).run() == 2
        assert mgr.should_stop
        assert mgr.steps() == [0, 1, 2]
    assert run.calls == []
    assert run.acc.total == expected_total(2)
