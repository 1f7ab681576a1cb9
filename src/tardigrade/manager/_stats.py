"""What the manager's saves did: one record per attempt, and the totals."""

from __future__ import annotations

from dataclasses import dataclass

from .._units import gbps
from ._policy import Cadence, Costs


@dataclass(frozen=True)
class SaveStats:
    """One save attempt: step, bytes, seconds blocked in the caller, total seconds, outcome.

    ``nbytes``: the bytes it wrote (with ``dedup``, shared data it referenced rather than
    wrote is not counted). ``error`` is a failed save's error, or that of a save that failed
    after it committed (``ok`` True: it counts as saved; its bytes are not known, 0).

    Unlike :class:`~tardigrade.SaveResult` (what one committed ``tg.save`` wrote: its path and
    files), it records every attempt a ``CheckpointManager`` made, failed ones included.
    """

    step: int
    nbytes: int
    blocking_seconds: float
    total_seconds: float
    ok: bool
    error: str | None = None

    @property
    def throughput_gbps(self) -> float:
        return gbps(self.nbytes, self.total_seconds)


class ManagerStats(list[SaveStats]):
    """Every save attempt, oldest first, plus totals, and what saves cost: the seconds
    training waits on one (``blocking_cost``) and those it runs on in the background after
    (``background_cost``), the median of the latest saves; the seconds between saves the
    policy in force aims at (``interval``: None for a policy of steps or epochs alone), and
    the work a failure is expected to lose (``expected_loss_seconds``: half an interval, plus
    the background time of the save under way)."""

    cadence: Cadence | None = None  # the manager's: its policy in force

    def costs(self) -> Costs:
        """What the latest committed saves cost (``Costs.of``)."""
        return Costs.of(
            [(s.blocking_seconds, s.total_seconds) for s in self if s.ok and not s.error]
        )

    @property
    def blocking_cost(self) -> float | None:
        return self.costs().blocking

    @property
    def background_cost(self) -> float | None:
        return self.costs().background

    @property
    def interval(self) -> float | None:
        return None if self.cadence is None else self.cadence.interval()

    @property
    def expected_loss_seconds(self) -> float | None:
        interval = self.interval
        if interval is None:
            return None
        return interval / 2 + (self.background_cost or 0.0)

    @property
    def failed(self) -> int:
        return sum(not s.ok for s in self)

    @property
    def succeeded(self) -> int:
        return sum(s.ok for s in self)

    @property
    def blocking_seconds(self) -> float:
        return sum(s.blocking_seconds for s in self)

    @property
    def total_seconds(self) -> float:
        return sum(s.total_seconds for s in self)
