"""Save policies: whether a finished training step is due for a checkpoint.

Pure: the caller passes what it remembers (the previous epoch, the clock's reading at the last
save, what its saves cost) and the clock, so the same calls give the same answer on every rank
and in tests. A policy answers two questions: ``due_by_count`` (steps and epochs: every rank
alike) and ``due_by_time`` (the clock and the measured costs: rank 0 decides, and the ranks
agree on its answer). ``interval`` says how many seconds apart it aims to save, for
``mgr.stats``.

The manager's ``every_steps=``, ``every_epochs=`` and ``every_seconds=`` are shorthands for
:class:`SavePolicy`; ``policy=`` takes any of these, ``|`` (or :class:`AnyOf`) combines them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgumentError

__all__ = [
    "AnyOf",
    "Cadence",
    "Continuous",
    "Costs",
    "EveryEpochs",
    "EverySeconds",
    "EverySteps",
    "Moment",
    "OverheadBudget",
    "Policy",
    "SavePolicy",
    "YoungDaly",
    "check_save_policy",
]


@dataclass(frozen=True)
class Costs:
    """What the manager measured of its recent saves: the seconds training waited on one
    (``blocking``) and the seconds it ran on behind training after that (``background``);
    None before the first save finished."""

    blocking: float | None = None
    background: float | None = None

    @classmethod
    def of(cls, saves: Sequence[tuple[float, float]]) -> Costs:
        """The median of ``(blocking, total)`` seconds of the latest saves (at most 5: a cost
        that drifts is followed, one slow save is not)."""
        recent = list(saves)[-5:]
        if not recent:
            return cls()
        blocking = sorted(b for b, _ in recent)[len(recent) // 2]
        background = sorted(max(0.0, t - b) for b, t in recent)[len(recent) // 2]
        return cls(blocking, background)


@dataclass(frozen=True)
class Moment:
    """What a policy of the clock decides on at a step boundary: the ``clock`` (read only by a
    policy that needs it), its reading at the last save, what saves cost, and whether one still
    runs in the background."""

    clock: Callable[[], float]
    last_save: float
    costs: Costs = Costs()
    in_flight: bool = False

    def since_save(self) -> float:
        return self.clock() - self.last_save


class Policy:
    """When to save (see the module docstring). Every answer is False unless a subclass
    says otherwise; ``a | b`` is :class:`AnyOf` ``(a, b)``."""

    def due_by_count(self, step: int, epoch: int | None, last_epoch: int | None) -> bool:
        """Whether ``step`` of ``epoch`` is due by count (the previous step's epoch:
        ``last_epoch``); every rank answers alike."""
        return False

    def due_by_time(self, now: Moment) -> bool:
        """Whether a save is due at ``now`` (the clock is read only by a policy that needs
        it)."""
        return False

    def interval(self, costs: Costs) -> float | None:
        """The seconds between saves this policy aims at, given ``costs`` (None: it does not
        go by the clock)."""
        return None

    def __or__(self, other: Policy) -> AnyOf:
        return AnyOf(self, check_save_policy(other))


@dataclass(frozen=True)
class SavePolicy(Policy):
    """Save every ``every_steps`` steps, ``every_epochs`` epochs, ``every_seconds`` seconds.

    Each is off when None; a step is due when any one that is on fires.

    >>> p = SavePolicy(every_steps=100)
    >>> p.due_by_count(200, epoch=None, last_epoch=None), p.due_by_count(250, None, None)
    (True, False)
    """

    every_steps: int | None = None
    every_epochs: int | None = None
    every_seconds: float | None = None

    def due_by_count(self, step: int, epoch: int | None, last_epoch: int | None) -> bool:
        """The step and epoch policies for ``step`` in ``epoch`` (the previous step's epoch:
        ``last_epoch``); an epoch fires once, at the first step after it began."""
        if self.every_steps is not None and step % self.every_steps == 0:
            return True
        return (
            self.every_epochs is not None
            and epoch is not None
            and epoch != last_epoch
            and last_epoch is not None
            and epoch % self.every_epochs == 0
        )

    def due_by_time(self, now: Moment) -> bool:
        """The time policy: ``every_seconds`` have passed since ``last_save`` (a reading of
        ``clock``); the clock is read only when the policy is on."""
        return self.every_seconds is not None and now.since_save() >= self.every_seconds

    def interval(self, costs: Costs) -> float | None:
        return self.every_seconds


def EverySteps(n: int) -> SavePolicy:
    """Save at every step that is a multiple of ``n``."""
    return SavePolicy(every_steps=_positive("EverySteps", n, int))


def EveryEpochs(n: int) -> SavePolicy:
    """Save at the first step of every epoch that is a multiple of ``n``."""
    return SavePolicy(every_epochs=_positive("EveryEpochs", n, int))


def EverySeconds(seconds: float) -> SavePolicy:
    """Save at the first step at least ``seconds`` after the last save."""
    return SavePolicy(every_seconds=_positive("EverySeconds", seconds, float))


class _ByInterval(Policy):
    """A policy of the clock that saves once ``interval(costs)`` seconds passed since the last
    save; before any save was measured, at once (the first save measures the cost), unless
    that first save is still in flight: its cost is what the interval waits for."""

    def due_by_time(self, now: Moment) -> bool:
        if now.costs.blocking is None and now.in_flight:
            return False
        interval = self.interval(now.costs)
        return interval is not None and now.since_save() >= interval


@dataclass(frozen=True)
class Continuous(_ByInterval):
    """Save whenever no save is in flight, at most every ``min_interval`` seconds: the
    newest state is always on its way, at whatever rate the tiers take it."""

    min_interval: float = 0.0

    def __post_init__(self) -> None:
        _at_least_zero("Continuous(min_interval=)", self.min_interval)

    def due_by_time(self, now: Moment) -> bool:
        return not now.in_flight and now.since_save() >= self.min_interval

    def interval(self, costs: Costs) -> float | None:
        taken = (costs.blocking or 0.0) + (costs.background or 0.0)
        return max(self.min_interval, taken)


@dataclass(frozen=True)
class OverheadBudget(_ByInterval):
    """Save as often as keeps the time training waits on saves under ``max_overhead`` of the
    wall time (0.02: 2 %): every ``blocking / max_overhead`` seconds, from the measured
    blocking cost of the latest saves; never more often than a save takes to finish in the
    background (it would only queue behind the one before)."""

    max_overhead: float

    def __post_init__(self) -> None:
        v = self.max_overhead
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1:
            raise InvalidArgumentError(
                f"OverheadBudget(max_overhead={v!r}): expected a fraction of the wall time "
                "between 0 and 1 (0.02: at most 2 % of the time spent waiting on saves)"
            )

    def interval(self, costs: Costs) -> float | None:
        if costs.blocking is None:
            return 0.0
        return max(costs.blocking / self.max_overhead, costs.background or 0.0)


@dataclass(frozen=True)
class YoungDaly(_ByInterval):
    """Save every T* = sqrt(2 x C x ``mtbf``) seconds, the interval that minimises the work
    a failure loses plus the time spent saving (Young 1974, Daly 2006): C is the measured
    blocking cost of the latest saves (re-estimated as it drifts), ``mtbf`` the mean time
    between failures of the whole job, in seconds. Never more often than a save takes to
    finish in the background."""

    mtbf: float

    def __post_init__(self) -> None:
        v = self.mtbf
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
            raise InvalidArgumentError(
                f"YoungDaly(mtbf={v!r}): expected the job's mean time between failures in "
                "seconds, a positive finite number (a node failing once a week on a job of "
                "64 nodes: mtbf=7 * 24 * 3600 / 64)"
            )

    def interval(self, costs: Costs) -> float | None:
        if costs.blocking is None:
            return 0.0
        return max(math.sqrt(2 * costs.blocking * self.mtbf), costs.background or 0.0)


class AnyOf(Policy):
    """Due when any of ``policies`` is; aims at the shortest interval among them."""

    def __init__(self, *policies: Policy) -> None:
        self.policies = tuple(check_save_policy(p) for p in policies)

    def due_by_count(self, step: int, epoch: int | None, last_epoch: int | None) -> bool:
        return any(p.due_by_count(step, epoch, last_epoch) for p in self.policies)

    def due_by_time(self, now: Moment) -> bool:
        return any(p.due_by_time(now) for p in self.policies)

    def interval(self, costs: Costs) -> float | None:
        found = [i for p in self.policies if (i := p.interval(costs)) is not None]
        return min(found, default=None)

    def __repr__(self) -> str:
        return f"AnyOf({', '.join(map(repr, self.policies))})"


class Cadence:
    """The manager's policy in force (its ``every_*`` shorthands, ``shorthand``, and its
    ``policy=``, any of them), the clock's reading at its last save, and what its saves cost
    (``wire``: its stats, which report the interval in turn). It holds no reference to the
    manager: a manager dropped is freed at once, its staging memory with it."""

    def __init__(self, shorthand: SavePolicy, clock: Callable[[], float] | None = None) -> None:
        self.shorthand = shorthand  # replaced as a whole when a knob (mgr.every_steps) is set
        self._extra: Policy | None = None
        self._costs: Callable[[], Costs] = Costs
        # time.monotonic looked up at each reading: tests put a clock of their own in its place.
        self._clock = clock or (lambda: time.monotonic())
        self.last_save = self._clock()

    def wire(self, policy: Any, stats: Any) -> None:
        """Take the manager's ``policy=`` (checked) and the costs its ``stats`` (a
        ``ManagerStats``) measure, which report this cadence's interval."""
        self._extra = None if policy is None else check_save_policy(policy)
        self._costs = stats.costs
        stats.cadence = self

    @property
    def policy(self) -> Policy:
        return self.shorthand if self._extra is None else AnyOf(self.shorthand, self._extra)

    def saved(self) -> None:
        """A save started (or a restore brought the state of one): the interval restarts."""
        self.last_save = self._clock()

    def due_by_time(self, in_flight: bool) -> bool:
        moment = Moment(self._clock, self.last_save, self._costs(), in_flight)
        return self.policy.due_by_time(moment)

    def interval(self) -> float | None:
        return self.policy.interval(self._costs())


def check_save_policy(policy: Any) -> Policy:
    """``policy=``: a policy object (see the module docstring)."""
    if not isinstance(policy, Policy):
        raise InvalidArgumentError(
            f"policy must be a save policy (tg.EverySteps(100), tg.EverySeconds(600), "
            f"tg.Continuous(), tg.OverheadBudget(0.02), tg.YoungDaly(mtbf=...), or several "
            f"joined with |), got {policy!r}"
        )
    return policy


def _positive(what: str, v: Any, kind: type) -> Any:
    ok = not isinstance(v, bool) and isinstance(v, (int, float) if kind is float else int)
    if not ok or not 0 < v < math.inf:
        raise InvalidArgumentError(f"{what}({v!r}): expected a positive {kind.__name__}")
    return kind(v)


def _at_least_zero(what: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
        raise InvalidArgumentError(f"{what} {v!r}: expected seconds, 0 or more")
