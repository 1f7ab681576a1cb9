"""What the manager's saves did: one record per attempt, and the totals."""

from __future__ import annotations

from dataclasses import dataclass

from .._units import gbps


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
    """Every save attempt, oldest first, plus totals."""

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
