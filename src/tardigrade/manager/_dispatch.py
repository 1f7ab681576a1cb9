"""Save dispatch: one save of the manager's state started, in the background or not.

``SaveDispatch.save`` checks what holds the step's name (a committed checkpoint is replaced
only when asked, when restore(step) abandoned it, or when a writer committed it after losing
the lease), prepares the root on rank 0 (the lock, an uncommitted step set aside), and starts
the save: through the async saver, feeding every tier's sinks from one staged copy, or in
the caller's thread. ``Outcomes`` records how it ended.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._async import AsyncCheckpointer, image_sizes
from .._catalog import Catalog, step_name
from .._ramtier import SAVED_ALONE
from .._save import save_with
from .._save_job import SaveOptions, SaveResult
from .._shared import Changes, Held, SharedIndex
from ..errors import (
    CheckpointExistsError,
    CheckpointLockedError,
    CorruptCheckpointError,
    DistributedError,
    InvalidArgumentError,
    SaveError,
    StorageError,
    TardigradeError,
    UnsupportedTypeError,
)
from ._agreement import Agreement
from ._options import check_flag
from ._pending import Outcomes
from ._preflight import RunLock
from ._retainer import Retainer
from ._signals import Preemption
from ._tiers import Tiers
from ._timeline import Timeline

log = logging.getLogger("tardigrade")


class _Until(threading.Event):
    """A copy's ``go`` that lets it on for ``seconds``, then stops it (TimeoutError)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.end = time.monotonic() + seconds
        self.set()

    def wait(self, timeout: float | None = None) -> bool:
        if time.monotonic() > self.end:
            raise TimeoutError("the preemption budget ran out")
        return True


@dataclass(frozen=True)
class SaveModes:
    """How the manager's saves are made: in the background (``async_save``) or not, sharing
    data between checkpoints (``dedup``), copying the state to host memory while training
    goes on (``overlap``), and how many may run in the background at once (``max_in_flight``;
    one in a distributed job)."""

    dedup: bool = False
    overlap: bool = False
    max_in_flight: int = 1
    async_save: bool = True

    @classmethod
    def check(
        cls, dedup: Any, overlap: Any, max_in_flight: Any = 1, async_save: Any = True
    ) -> SaveModes:
        """The manager's ``dedup=``, ``overlap=``, ``max_in_flight=`` and ``async_save=``
        arguments, checked."""
        if type(max_in_flight) is not int or max_in_flight < 1:
            raise InvalidArgumentError(
                f"max_in_flight must be an int >= 1 (saves running at once), got {max_in_flight!r}"
            )
        return cls(
            check_flag("dedup", dedup),
            check_flag("overlap", overlap),
            max_in_flight,
            check_flag("async_save", async_save),
        )


class SaveDispatch:
    """Starts the saves of ``state`` into the root of ``catalog`` (see the module docstring).

    ``saver`` is the async saver once the manager made one (None: every save synchronous).
    """

    def __init__(
        self,
        state: Any,
        *,
        catalog: Catalog,
        ranks: Agreement,
        lock: RunLock,
        tiers: Tiers,
        timeline: Timeline,
        outcomes: Outcomes,
        retainer: Retainer,
        storage_options: Mapping[str, Any] | None,
        preemption: Preemption | None = None,
        modes: SaveModes | None = None,
    ) -> None:
        self.state = state
        self.modes = modes or SaveModes()
        self._changes = Changes()  # what each save found new: the next one's guess
        self.preemption = preemption or Preemption()
        self.catalog = catalog
        self.ranks = ranks
        self.lock = lock
        self.tiers = tiers
        self.timeline = timeline
        self.outcomes = outcomes
        self.retainer = retainer
        self.storage_options = storage_options
        self.saver: AsyncCheckpointer | None = None

    @property
    def dedup(self) -> bool:
        """Whether saves share data between checkpoints (as asked)."""
        return self.modes.dedup

    @property
    def overlap(self) -> bool:
        """Whether an async save copies the state beside training (``_overlap``): as asked,
        in a single process without a staging budget (a collective save copies in the
        caller, not yet beside training)."""
        saver = self.saver
        if not self.modes.overlap or saver is None or saver.pool.max_bytes is not None:
            return False
        return not self.ranks.collective

    @property
    def in_flight(self) -> bool:
        """Whether a save of this rank still runs in the background."""
        return self.outcomes.pending.running()

    def start_saver(self, max_staging_bytes: int | None) -> None:
        """Make the async saver: its staging budget, as many saves in flight as the modes say."""
        self.saver = AsyncCheckpointer(
            max_staging_bytes=max_staging_bytes, max_in_flight=self.modes.max_in_flight
        )

    def close_saver(self) -> None:
        """Wait for the saves in flight and let the async saver go."""
        if self.saver is not None:
            self.saver.close()

    def _sweep_after_failure(self) -> None:
        """After a failed save (a full disk: an operator may have deleted checkpoints by hand
        since), the shared objects no checkpoint references go before the next save tries."""
        stats = self.outcomes.stats
        if not (self.dedup and self.ranks.coordinator and stats and not stats[-1].ok):
            return
        try:
            self.catalog.sweep_shared(grace=False)
        except (OSError, TardigradeError) as e:
            log.warning("tardigrade: removing unreferenced shared data: %s", e)

    def staging_need(self, state: Any) -> Any:
        """What the async saver reserves for saving ``state`` (``AsyncCheckpointer.reserve``):
        the files a save lays out, as it shares data or not."""
        if self.dedup and not self.ranks.collective:
            return image_sizes(state, share=True)
        return self.ranks.split.staging_need(state)

    def _base(self, step: int) -> SharedIndex:
        """The shared objects a save of ``step`` may reference: those of the newest committed
        checkpoint before it (each save references every unchanged object again, so the
        newest holds all a save can find); none when it does not read. Read by the save's
        first large chunk: a state without one costs no listing, no read."""
        return SharedIndex(load=functools.partial(self._held_before, step), changes=self._changes)

    def _held_before(self, step: int) -> dict[str, Held]:
        try:
            steps = [s for s in self.catalog.steps() if s < step]
            if not steps:
                return {}
            return SharedIndex.held_by([self.catalog.manifest(step_name(steps[-1]))])
        except (OSError, TardigradeError) as e:
            log.warning(
                "tardigrade: the save of step %d writes all of its data: the newest "
                "checkpoint before it does not read (%s)",
                step,
                e,
            )
            return {}

    def drain(self, *, wait: bool, agree: bool = True) -> None:
        """Record the outcome of finished async saves (all of them when ``wait``)."""
        self.outcomes.drain(wait=wait, agree=agree, forget_forks=self.forget_forks)

    def save(
        self,
        step: int,
        epoch: int | None,
        metrics: Mapping[str, float] | None,
        *,
        sync: bool,
        force: bool = False,
        from_step: bool = False,
        preempted: bool = False,
    ) -> bool:
        """Save ``step``; False when it failed to start (reported as ``on_save_error`` says).
        ``sync``: in the caller's thread; ``force``: replace a committed checkpoint of the
        step; ``from_step``: asked by ``step()`` (a repeated step is then a failed save);
        ``preempted``: into the fastest tiers first, then the root within the budget."""
        # Outside the try below: the failure of a save in flight is not this one's.
        self.ranks.before_save(self.drain)
        self._sweep_after_failure()
        started = time.perf_counter()
        self._warn_unranked(step, metrics)
        alone = not preempted and self.tiers.alone(step_name(step))
        replace = self._may_replace(step, started, force=force, from_step=from_step, alone=alone)
        if replace is None:
            return False
        try:
            self._prepare(step, replace, alone=alone)
            options = SaveOptions(
                overwrite=replace,
                step=step,
                epoch=epoch,
                metrics=metrics,
                storage_options=self.storage_options,
                lease_generation=self.lock.lease.generation,
                shared=self._base(step) if self.dedup else None,
                overlap=self.overlap,
            )
            self._start(step, options, sync=sync, fastest=preempted)
        except (InvalidArgumentError, UnsupportedTypeError):
            raise  # a programming error, not a storage failure: never swallowed
        except Exception as e:
            if getattr(e, "committed", False) is True:
                # The failure came after the commit point: the checkpoint is there and
                # complete. Counted as saved (retention, stats), so nobody saves it again.
                self.outcomes.ok(step, None, time.perf_counter() - started, e)
                if isinstance(e, DistributedError):
                    raise  # the group is in an unknown state: never swallowed
            elif isinstance(e, (SaveError, StorageError, CheckpointLockedError, OSError)):
                # OSError includes CheckpointExistsError here: something else put a checkpoint
                # at this step's name after the check above (a user copying one in). Nothing
                # was overwritten; report it like any failed save.
                self.outcomes.failure(step, e, time.perf_counter() - started)
                return False
            else:
                raise
        if preempted:
            self._hold_on(step_name(step))
        return True

    def _hold_on(self, name: str) -> None:
        """After a preemption's save of ``name`` into the fastest tiers: wait for the peers'
        replicas (whatever the budget: they are what a node's loss needs; each transfer is
        bounded by the timeout), then copy it into the root while the budget lasts (rank 0's
        clock decides, for every rank); the log says which tiers hold it."""
        what = f"CheckpointManager({self.catalog.root!r}): preemption of {name}"
        self.preemption.joined()
        held = self.tiers.holding(name)
        src = self.tiers.memory_copy()
        if src is not None and self.tiers.root.where not in held:
            left = float(self.ranks.shared(what, self.preemption.left))
            try:
                if left <= 0:
                    raise TimeoutError("no time was left")
                self.ranks.split.copy(src, name, self.catalog.storage, go=_Until(left))
                self.tiers.persisted(name)
                held.append(self.tiers.root.where)
                self.retainer.retain()
            except Exception as e:
                if self.ranks.coordinator:
                    log.warning(
                        "tardigrade: preemption: %s is not in %s: %s (preemption_budget=%g s)",
                        name,
                        self.catalog.root,
                        e,
                        self.preemption.budget,
                    )
        if self.ranks.coordinator:
            log.warning(
                "tardigrade: preemption: %s is held in %s, %.1f s after the signal; stopping",
                name,
                ", ".join(held) or "no tier",
                self.preemption.budget - self.preemption.left(),
            )

    def _start(self, step: int, options: SaveOptions, *, sync: bool, fastest: bool) -> None:
        """Start the save: in the background, feeding every tier's sinks from one staged
        copy, or here (waiting for the saves in flight first); ``fastest``: into the fastest
        tier a save can target."""
        path, persisted = self.tiers.target(step_name(step), fastest=fastest)
        # A step the root does not take is saved into the RAM tier alone: in a distributed
        # job every rank commits it (its files and the manifest) in its own; no sink copies it
        # (the RAM tier's then removes the older copies there, in the save's thread).
        sinks = self.tiers.sinks(alone=not persisted)
        if not persisted:
            options = dataclasses.replace(
                options, each_rank_commits=True, metadata={SAVED_ALONE: True}
            )
        if self.saver is not None and not sync:
            with self.tiers.held():  # training waits on the staging copy: uploads wait
                fut = self.ranks.split.submit(self.saver, path, self.state, options, sinks)
            fut.observed = True  # the manager reports the outcome itself
            self.outcomes.pending.add(step, fut)
            return
        if self.saver is not None:
            self.drain(wait=True)
        with self.tiers.held():  # training waits on the whole save: uploads wait too
            res = save_with(path, self.state, options, **self.ranks.collective)
        assert isinstance(res, SaveResult)  # a synchronous save's
        self.outcomes.ok(step, res)

    def _warn_unranked(self, step: int, metrics: Mapping[str, float] | None) -> None:
        policy = self.retainer.policy
        ranked = policy.best_metric is not None and policy.keep_best is not None
        if ranked and (metrics is None or policy.best_metric not in metrics):
            log.warning(
                "tardigrade: step %d saved without metric %r; it will not rank as a best "
                "checkpoint",
                step,
                policy.best_metric,
            )

    def _may_replace(
        self, step: int, started: float, *, force: bool, from_step: bool, alone: bool = False
    ) -> bool | None:
        """Whether saving ``step`` replaces a committed checkpoint; None: it must not be saved
        (reported as a failed save). A committed checkpoint is replaced only when asked
        (force), when it belongs to the timeline abandoned by restore(step), or when a writer
        committed it after losing the lease; repeating a step otherwise is a programming
        error."""
        if alone:
            # A save into the faster tiers alone leaves the directory as it is: nothing there
            # to replace (a busy store would cost the training thread the request).
            return force
        try:
            occupant = self.ranks.shared(
                f"CheckpointManager({self.catalog.root!r}): is step {step} there",
                lambda: self.catalog.occupant(step_name(step)),
            )
        except (StorageError, CheckpointLockedError, CorruptCheckpointError) as e:
            # Storage failed before the save began (a transient error, a full disk): a failed
            # save like any other, never an error out of step() in "warn" mode.
            self.outcomes.failure(step, e, time.perf_counter() - started)
            return None
        if occupant == "run" and not force and step not in self.timeline.abandoned:
            exists = CheckpointExistsError(
                f"{self.catalog.path(step_name(step))}: a checkpoint for step {step} already "
                "exists; steps must not repeat (pass force=True to replace it)."
            )
            if from_step and self.outcomes.on_save_error == "warn":
                # Training goes on (the checkpoint there is kept): reported like a failed save.
                self.outcomes.failure(step, exists, time.perf_counter() - started)
                return None
            raise exists
        if occupant == "fenced":
            log.warning(
                "tardigrade: replacing %s: it was committed by a writer after it lost the lease",
                self.catalog.path(step_name(step)),
            )
        return occupant != ""

    def _prepare(self, step: int, replace: bool, *, alone: bool = False) -> None:
        """Before saving ``step``: hold the lock, move an uncommitted ``step-N`` aside (not for
        a save into the faster tiers alone: ``alone``).

        Rank 0's work in a distributed job; its failure raises on every rank, as the same error
        (an OSError there arrives as a SaveError).
        """

        def prepare_here() -> None:
            self.lock.ready(raising=self.outcomes.on_save_error == "raise")
            if not replace and not alone:
                self.timeline.set_aside_incomplete(step)

        self.ranks.on_coordinator(
            f"CheckpointManager({self.catalog.root!r}): prepare step {step}",
            prepare_here,
            lambda e: SaveError(
                f"{self.catalog.path(step_name(step))}: cannot prepare the save: {e}"
            ),
        )

    def forget_forks(self) -> None:
        """Drop the gloo groups forked for background saves (a lost save left them unusable)."""
        if self.saver is not None:
            self.saver.forget_forks()
