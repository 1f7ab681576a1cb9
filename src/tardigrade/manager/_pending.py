"""The manager's background saves in flight, what each one's ending counts as, and the
recording of every save's outcome (``Outcomes``)."""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterator

from .._async import SaveFuture
from .._catalog import Catalog, step_name
from .._save_job import SaveResult
from ..errors import InvalidArgumentError, SaveError, TardigradeError, UnsupportedTypeError
from ._agreement import Agreement
from ._stats import ManagerStats, SaveStats
from ._tiers import Tiers
from ._timeline import Timeline

log = logging.getLogger("tardigrade")


class Failure(enum.Enum):
    """What a background save that raised counts as."""

    COMMITTED = "committed"
    """Failed after its commit point: the checkpoint is complete and counts as saved."""
    MISUSE = "misuse"
    """A programming error found in the background (a leaf the format cannot store, ranks'
    states that differ): raised whatever ``on_save_error`` says, as a synchronous save would."""
    FAILED = "failed"
    """Failed before its commit point: reported as ``on_save_error`` says."""


def failure_of(exc: BaseException) -> Failure:
    """What a save that raised ``exc`` counts as."""
    if isinstance(exc, TardigradeError) and exc.committed is True:
        return Failure.COMMITTED
    if isinstance(exc, (InvalidArgumentError, UnsupportedTypeError)):
        return Failure.MISUSE
    return Failure.FAILED


class PendingSaves:
    """Background saves not yet recorded, oldest first, each with the step it saves."""

    def __init__(self) -> None:
        self._saves: list[tuple[int, SaveFuture]] = []

    def add(self, step: int, fut: SaveFuture) -> None:
        self._saves.append((step, fut))

    def __len__(self) -> int:
        return len(self._saves)

    def steps(self) -> set[int]:
        """The steps being written (not to be deleted under their writer)."""
        return {s for s, _ in self._saves}

    def running(self) -> bool:
        """Whether any of them is still running."""
        return any(not fut.done() for _, fut in self._saves)

    def finished(self, *, wait: bool) -> Iterator[tuple[int, SaveFuture]]:
        """The saves that have finished, oldest first; with ``wait``, all of them, each waited
        for in turn. Without it a save still running is passed over: a save into a faster
        tier (the RAM tier alone) may end while an older one still writes the directory, and
        is recorded (its tier keeping it, retiring the older copies there) at once.

        Each leaves the list before it is yielded: recording it may raise
        (``on_save_error="raise"``), and a failure must be reported exactly once.
        """
        i = 0
        while i < len(self._saves):
            step, fut = self._saves[i]
            if not wait and not fut.done():
                i += 1
                continue
            self._saves.pop(i)
            yield step, fut


class Outcomes:
    """How each save ended, recorded once: counted in ``stats``, reported as ``on_save_error``
    says, and a committed one handed on (the timeline it replaced, the other tiers, retention).

    Background saves wait in ``pending`` until ``drain`` records them, oldest first (a save
    that ended before an older one still running, first).
    """

    def __init__(
        self,
        *,
        catalog: Catalog,
        ranks: Agreement,
        tiers: Tiers,
        timeline: Timeline,
        pending: PendingSaves,
        stats: ManagerStats,
        on_save_error: str,
        teed: bool,
        forget: Callable[[int], None],
        retain: Callable[[], None],
    ) -> None:
        self.catalog = catalog
        self.ranks = ranks
        self.tiers = tiers
        self.timeline = timeline
        self.stats = stats
        self.on_save_error = on_save_error
        self.teed = teed  # the saves are async: their sinks copied them into the tiers
        self.forget = forget  # what retention remembers of a step
        self.retain = retain
        self.pending = pending

    def ok(
        self,
        step: int,
        res: SaveResult | None,
        seconds: float = 0.0,
        error: BaseException | None = None,
    ) -> None:
        """Count a committed save; ``res`` None: one that raised ``error`` after committing."""
        self.forget(step)  # a replaced checkpoint has a new metric
        self.timeline.abandoned.discard(step)
        if res is None:
            self.stats.append(SaveStats(step, 0, seconds, seconds, True, str(error)))
            log.warning(
                "tardigrade: step %d was committed in %s, but its save then failed; it counts "
                "as saved. Cause: %s",
                step,
                self.catalog.root,
                error,
            )
        else:
            s = SaveStats(step, res.nbytes, res.blocking_seconds, res.total_seconds, True)
            self.stats.append(s)
            log.info(
                "tardigrade: saved step %d: %.1f MB, blocked %.3f s, total %.3f s, %.2f GB/s",
                step,
                s.nbytes / 1e6,
                s.blocking_seconds,
                s.total_seconds,
                s.throughput_gbps,
            )
        self.tiers.committed(step_name(step), teed=self.teed)
        if not self.tiers.root.takes(step_name(step)):
            # Saved into the faster tiers alone (``persist_every``): the directory holds what
            # it held, so its timeline and retention wait for its next save (listing a store
            # here would cost the training thread a request per save).
            return
        if self.ranks.coordinator:
            self.timeline.saved_past(step)
        self.retain()

    def failure(self, step: int, e: BaseException, seconds: float) -> None:
        """Count a failed save; raise it with ``on_save_error="raise"``, else log it."""
        self.stats.append(SaveStats(step, 0, seconds, seconds, False, str(e)))
        if self.on_save_error == "raise":
            if isinstance(e, TardigradeError):
                raise e
            path = self.catalog.path(step_name(step))
            raise SaveError(f"{path}: save of step {step} failed: {e}") from e
        log.error(
            "tardigrade: SAVE FAILED for step %d in %s (%d failed so far); training continues, "
            "earlier checkpoints are intact. Cause: %s",
            step,
            self.catalog.root,
            self.stats.failed,
            e,
        )

    def drain(self, *, wait: bool, agree: bool, forget_forks: Callable[[], None]) -> None:
        """Record the outcome of finished background saves (all of them when ``wait``).

        In a distributed job every rank calls it at the same point with ``wait=True`` (the
        pending saves are the same on every rank), and each outcome is agreed there unless
        ``agree`` is False (a rank leaving alone).
        """
        for step, fut in self.pending.finished(wait=wait):
            exc = fut.exception()
            if agree:
                path = self.catalog.path(step_name(step))
                exc = self.ranks.outcome(exc, path=path, step=step, forget_forks=forget_forks)
            if exc is None:
                self.ok(step, fut.result())
                continue
            failure = failure_of(exc)
            if failure is Failure.COMMITTED:
                self.ok(step, None, fut.blocking_seconds, exc)
            elif failure is Failure.MISUSE:
                # A collective save learns only in the background that a rank cannot flatten
                # its state, or that the ranks' states differ.
                seconds = fut.blocking_seconds
                self.stats.append(SaveStats(step, 0, seconds, seconds, False, str(exc)))
                raise exc
            else:
                self.failure(step, exc, fut.blocking_seconds)
