"""Job and JobRunner: the Caffe2 epoch-level training job, with checkpoints after every epoch.

``JobRunner.run()`` runs ``init`` once (skipped when resuming), checkpoints epoch 0, then runs
epochs, checkpointing after each, until ``stop()`` is true; then the ``download`` phase (e.g.
gather sharded parameters) and the ``exit`` phase (e.g. export the final model). It returns the
last epoch. In a distributed job every rank runs it, and every rank stops at the same epoch. A failed save never stops the job when the manager runs with
``on_save_error="warn"``. A preemption signal (the manager's ``save_on_signals``) stops it after
the epoch in which it arrived, once that epoch is saved.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import InvalidArgumentError
from .manager import CheckpointManager

log = logging.getLogger("tardigrade")


@dataclass(frozen=True)
class Job:
    """The phases of a job. ``epoch`` receives the 1-based epoch number it runs.

    >>> job = tg.Job(init=init_fn, epoch=run_epoch, stop=lambda: state["epoch"] >= 10,
    ...              download=gather_fn, exit=export_fn)                     # doctest: +SKIP
    """

    init: Callable[[], Any]
    epoch: Callable[[int], Any]
    stop: Callable[[], bool]
    download: Callable[[], Any] | None = None
    exit: Callable[[], Any] | None = None

    def __post_init__(self) -> None:
        for name in ("init", "epoch", "stop"):
            if not callable(getattr(self, name)):
                raise InvalidArgumentError(f"Job.{name} must be callable")
        for name in ("download", "exit"):
            fn = getattr(self, name)
            if fn is not None and not callable(fn):
                raise InvalidArgumentError(f"Job.{name} must be callable or None")


class JobRunner:
    """Runs a :class:`Job` with a :class:`CheckpointManager`, resuming where it left off.

    ``resume_from_epoch=None`` resumes from the latest checkpoint on disk (or starts fresh);
    an int resumes from exactly that epoch, and the later checkpoints of the abandoned run are
    replaced as the epochs are run again.

    On a preemption signal (SIGTERM by default) the epoch that is running finishes, is saved
    synchronously, and ``run()`` returns it with ``manager.should_stop`` set; ``download`` and
    ``exit`` do not run, since the job is not finished: the restarted job resumes after that
    epoch and runs them at its end.

    In a distributed job (the manager's ``process_group``) every rank runs ``run()``: each
    phase runs on every rank, the epochs are the same everywhere, the job stops on every rank
    as soon as ``stop()`` is true on any rank or a signal reached any rank, and ``download``
    and ``exit`` run on every rank. ``download`` gathers sharded parameters with collectives
    that every rank takes part in (``dtensor.full_tensor()``, ``dist.gather``); ``exit``
    typically writes the export on rank 0 only (``if dist.get_rank() == 0``).

    >>> with tg.CheckpointManager("ckpt", state) as mgr:                    # doctest: +SKIP
    ...     last = tg.JobRunner(job, mgr).run()
    """

    def __init__(
        self, job: Job, manager: CheckpointManager, resume_from_epoch: int | None = None
    ) -> None:
        if not isinstance(job, Job):
            raise InvalidArgumentError(f"job must be a tg.Job, got {type(job).__name__}")
        if not isinstance(manager, CheckpointManager):
            raise InvalidArgumentError("manager must be a tg.CheckpointManager")
        if resume_from_epoch is not None and (
            type(resume_from_epoch) is not int or resume_from_epoch < 0
        ):
            raise InvalidArgumentError(
                f"resume_from_epoch must be a non-negative int or None, got {resume_from_epoch!r}"
            )
        self.job = job
        self.manager = manager
        self.resume_from_epoch = resume_from_epoch

    def run(self) -> int:
        """Run to completion, or until preempted; return the last epoch (saved in both cases)."""
        mgr = self.manager
        epoch = mgr.restore(self.resume_from_epoch)
        if epoch is None:
            log.info("tardigrade: job starts from scratch")
            self.job.init()
            epoch = 0
            mgr.save(0, epoch=0, force=True)  # after a signal: synchronous, sets should_stop
        else:
            log.info("tardigrade: job resumes after epoch %d", epoch)
        while not mgr.should_stop:
            # A signal that arrived during restore, during the async save of the last epoch or
            # in stop() finds nothing new to save: stop_at_boundary commits what is in flight.
            # In a distributed job it also stops every rank when stop() is true on any of them.
            if mgr.stop_at_boundary(finished=bool(self.job.stop())):
                break
            epoch += 1
            self.job.epoch(epoch)
            mgr.save(epoch, epoch=epoch)  # after a signal: synchronous, sets should_stop
        mgr.wait()
        if mgr.should_stop:
            log.warning(
                "tardigrade: job preempted: stopped after epoch %d (saved); restart it to "
                "resume from there",
                epoch,
            )
            return epoch
        if self.job.download is not None:
            self.job.download()
        if self.job.exit is not None:
            self.job.exit()
        return epoch
