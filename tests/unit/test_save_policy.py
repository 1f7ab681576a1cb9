"""The manager's save policy (``SavePolicy``) on its own: a pure decision, given the clock.

The manager's own tests (``tests/integration/test_manager.py``) show the policies end to end;
here each knob's rule is pinned step by step, with readings of a clock the test controls.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

import tardigrade as tg
from tardigrade.errors import InvalidArgumentError
from tardigrade.manager._policy import Costs, Moment, SavePolicy


class Clock:
    """A clock the test sets; counts its readings."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now


def due_steps(policy: SavePolicy, steps: range) -> list[int]:
    return [s for s in steps if policy.due_by_count(s, epoch=None, last_epoch=None)]


def test_every_steps_fires_on_multiples_only() -> None:
    assert due_steps(SavePolicy(every_steps=5), range(0, 21)) == [0, 5, 10, 15, 20]
    assert due_steps(SavePolicy(every_steps=1), range(3, 6)) == [3, 4, 5]


def test_every_epochs_fires_once_at_the_first_step_of_a_matching_epoch() -> None:
    policy = SavePolicy(every_epochs=2)
    fired, last_epoch = [], None
    # (step, epoch): epochs 0..4, three steps each
    for step, epoch in enumerate(e for e in range(5) for _ in range(3)):
        if policy.due_by_count(step, epoch, last_epoch):
            fired.append((step, epoch))
        last_epoch = epoch
    # Epoch 0 is where the run started (no previous epoch): not a change; then 2 and 4.
    assert fired == [(6, 2), (12, 4)]


def test_an_epoch_does_not_fire_without_a_previous_epoch_or_an_epoch() -> None:
    policy = SavePolicy(every_epochs=1)
    assert not policy.due_by_count(7, epoch=3, last_epoch=None)  # first call after a restart
    assert not policy.due_by_count(7, epoch=None, last_epoch=2)  # step() without an epoch
    assert not policy.due_by_count(7, epoch=2, last_epoch=2)  # same epoch
    assert policy.due_by_count(7, epoch=3, last_epoch=2)


def test_every_seconds_reads_the_clock_it_is_given() -> None:
    policy = SavePolicy(every_seconds=10.0)
    clock, last_save = Clock(), 1000.0
    clock.now = 1009.9
    assert not policy.due_by_time(Moment(clock, last_save))
    clock.now = 1010.0
    assert policy.due_by_time(Moment(clock, last_save))  # the interval is inclusive
    clock.now = 1500.0
    assert policy.due_by_time(Moment(clock, last_save))
    assert clock.reads == 3


def test_a_clock_driven_run_saves_at_each_interval_from_the_last_save() -> None:
    policy = SavePolicy(every_seconds=10.0)
    clock, fired = Clock(), []
    last_save = clock()
    for step, now in enumerate([1001, 1005, 1009.9, 1010, 1012, 1019.9, 1020.5, 1021, 1040]):
        clock.now = now
        if policy.due_by_time(Moment(clock, last_save)):
            fired.append(step)
            last_save = clock()
    assert fired == [3, 6, 8]


def test_policies_that_are_off_never_fire() -> None:
    off, clock = SavePolicy(), Clock(now=1e9)
    assert not any(off.due_by_count(s, epoch=s, last_epoch=s - 1) for s in range(1, 50))
    assert not off.due_by_time(Moment(clock, last_save=0.0))
    steps_only = SavePolicy(every_steps=3)
    assert not steps_only.due_by_time(Moment(clock, last_save=0.0))
    assert not steps_only.due_by_count(4, epoch=2, last_epoch=1)  # epochs are off
    assert clock.reads == 0  # a policy that is off costs no clock reading per step


def test_any_policy_that_is_on_fires() -> None:
    policy = SavePolicy(every_steps=5, every_epochs=1, every_seconds=100.0)
    assert policy.due_by_count(10, epoch=0, last_epoch=0)  # by steps only
    assert policy.due_by_count(11, epoch=1, last_epoch=0)  # by epochs only
    assert not policy.due_by_count(12, epoch=1, last_epoch=1)
    assert policy.due_by_time(
        Moment(Clock(now=200.0), last_save=100.0)
    )  # by time, whatever the step


# -- policies of the measured cost -----------------------------------------------------------


def test_an_overhead_budget_saves_at_once_then_every_blocking_over_budget_seconds() -> None:
    policy = tg.OverheadBudget(max_overhead=0.02)
    clock = Clock(now=1000.0)
    # Nothing measured yet: the first save measures what a save costs.
    assert policy.interval(Costs()) == 0.0 and policy.due_by_time(Moment(clock, 1000.0))
    costs = Costs(blocking=0.1, background=0.5)
    assert policy.interval(costs) == pytest.approx(5.0)  # 0.1 s of every 5 s: 2 %
    clock.now = 1004.99
    assert not policy.due_by_time(Moment(clock, 1000.0, costs))
    clock.now = 1005.0
    assert policy.due_by_time(Moment(clock, 1000.0, costs))
    # Never more often than a save takes to finish behind training.
    assert policy.interval(Costs(blocking=0.01, background=3.0)) == 3.0


def test_young_daly_aims_at_the_square_root_of_twice_the_cost_times_the_mtbf() -> None:
    policy = tg.YoungDaly(mtbf=3600.0)
    assert policy.interval(Costs(blocking=0.5, background=1.0)) == pytest.approx(60.0)
    assert policy.interval(Costs(blocking=2.0, background=1.0)) == pytest.approx(120.0)
    assert policy.interval(Costs(blocking=1e-6, background=2.0)) == 2.0
    clock = Clock(now=1059.0)
    assert not policy.due_by_time(Moment(clock, 1000.0, Costs(0.5, 0.0)))
    clock.now = 1060.0
    assert policy.due_by_time(Moment(clock, 1000.0, Costs(0.5, 0.0)))


def test_continuous_saves_whenever_nothing_is_in_flight_at_most_every_min_interval() -> None:
    policy = tg.Continuous(min_interval=2.0)
    clock = Clock(now=1003.0)
    assert policy.due_by_time(Moment(clock, 1000.0, in_flight=False))
    assert not policy.due_by_time(Moment(clock, 1000.0, in_flight=True))
    clock.now = 1001.0
    assert not policy.due_by_time(Moment(clock, 1000.0, in_flight=False))
    assert tg.Continuous().interval(Costs(0.2, 1.0)) == pytest.approx(1.2)


def test_policies_joined_are_due_when_any_is_and_aim_at_the_shortest_interval() -> None:
    policy = tg.EverySteps(10) | tg.EverySeconds(60) | tg.YoungDaly(mtbf=1800)
    assert isinstance(policy, tg.AnyOf)
    assert policy.due_by_count(20, None, None) and not policy.due_by_count(21, None, None)
    assert policy.interval(Costs(blocking=0.25, background=0.0)) == pytest.approx(30.0)
    assert policy.interval(Costs(blocking=4.0, background=0.0)) == pytest.approx(60.0)
    clock = Clock(now=1030.0)
    assert policy.due_by_time(Moment(clock, 1000.0, Costs(0.25, 0.0)))
    assert tg.AnyOf(tg.EveryEpochs(2)).interval(Costs(1.0, 1.0)) is None


def test_costs_follow_the_median_of_the_latest_five_saves() -> None:
    assert Costs.of([]) == Costs()
    saves = [(0.1, 1.0)] * 4 + [(9.0, 20.0)]  # one slow save does not move it
    assert Costs.of(saves) == Costs(0.1, pytest.approx(0.9))
    drifted = saves + [(0.4, 2.0)] * 3  # the cost rose for good: followed
    assert Costs.of(drifted) == Costs(0.4, pytest.approx(1.6))


@pytest.mark.parametrize(
    "make",
    [
        lambda: tg.OverheadBudget(0),
        lambda: tg.OverheadBudget(1),
        lambda: tg.OverheadBudget(-0.1),
        lambda: tg.OverheadBudget(True),
        lambda: tg.OverheadBudget("2%"),
        lambda: tg.YoungDaly(mtbf=0),
        lambda: tg.YoungDaly(mtbf=-5),
        lambda: tg.YoungDaly(mtbf=math.inf),
        lambda: tg.YoungDaly(mtbf=math.nan),
        lambda: tg.Continuous(min_interval=-1),
        lambda: tg.EverySteps(0),
        lambda: tg.EverySeconds(math.nan),
        lambda: tg.EverySteps(100) | 5,
    ],
)
def test_impossible_policies_are_refused_by_name(make: Callable[[], object]) -> None:
    with pytest.raises(InvalidArgumentError) as e:
        make()
    assert any(
        w in str(e.value) for w in ("OverheadBudget", "YoungDaly", "Continuous", "Every", "policy")
    )


def test_a_policy_of_the_cost_waits_for_its_first_save_to_be_measured() -> None:
    """Before any save was measured the first step saves; while that save is still in flight
    (its cost unknown), the next steps do not save again and again."""
    for policy in (tg.OverheadBudget(0.02), tg.YoungDaly(mtbf=3600.0)):
        clock = Clock(now=1000.0)
        assert policy.due_by_time(Moment(clock, 900.0, Costs(), in_flight=False))
        assert not policy.due_by_time(Moment(clock, 999.0, Costs(), in_flight=True))
