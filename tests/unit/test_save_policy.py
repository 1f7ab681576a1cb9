"""The manager's save policy (``SavePolicy``) on its own: a pure decision, given the clock.

The manager's own tests (``tests/integration/test_manager.py``) show the policies end to end;
here each knob's rule is pinned step by step, with readings of a clock the test controls.
"""

from __future__ import annotations

from tardigrade.manager._policy import SavePolicy


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
    assert not policy.due_by_time(clock, last_save)
    clock.now = 1010.0
    assert policy.due_by_time(clock, last_save)  # the interval is inclusive
    clock.now = 1500.0
    assert policy.due_by_time(clock, last_save)
    assert clock.reads == 3


def test_a_clock_driven_run_saves_at_each_interval_from_the_last_save() -> None:
    policy = SavePolicy(every_seconds=10.0)
    clock, fired = Clock(), []
    last_save = clock()
    for step, now in enumerate([1001, 1005, 1009.9, 1010, 1012, 1019.9, 1020.5, 1021, 1040]):
        clock.now = now
        if policy.due_by_time(clock, last_save):
            fired.append(step)
            last_save = clock()
    assert fired == [3, 6, 8]


def test_policies_that_are_off_never_fire() -> None:
    off, clock = SavePolicy(), Clock(now=1e9)
    assert not any(off.due_by_count(s, epoch=s, last_epoch=s - 1) for s in range(1, 50))
    assert not off.due_by_time(clock, last_save=0.0)
    steps_only = SavePolicy(every_steps=3)
    assert not steps_only.due_by_time(clock, last_save=0.0)
    assert not steps_only.due_by_count(4, epoch=2, last_epoch=1)  # epochs are off
    assert clock.reads == 0  # a policy that is off costs no clock reading per step


def test_any_policy_that_is_on_fires() -> None:
    policy = SavePolicy(every_steps=5, every_epochs=1, every_seconds=100.0)
    assert policy.due_by_count(10, epoch=0, last_epoch=0)  # by steps only
    assert policy.due_by_count(11, epoch=1, last_epoch=0)  # by epochs only
    assert not policy.due_by_count(12, epoch=1, last_epoch=1)
    assert policy.due_by_time(Clock(now=200.0), last_save=100.0)  # by time, whatever the step
