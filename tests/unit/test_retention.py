"""The manager's retention (``Retention``) on its own: which checkpoints a save retires.

Pure: the steps, which of them read, and their metrics are given; the manager's own tests
(``tests/integration/test_manager.py``, ``tests/faults/test_manager_faults.py``) show the
deletes on disk.
"""

from __future__ import annotations

from typing import Any

import pytest

from tardigrade.manager._retention import Retention

STEPS = [10, 20, 30, 40, 50, 60]
LOSS = {10: 0.9, 20: 0.3, 30: 0.5, 40: 0.1, 50: 0.7, 60: 0.8}


def readable(s: int) -> bool:
    return True


def loss(s: int) -> float | None:
    return LOSS.get(s)


def retire(r: Retention, steps: list[int] = STEPS, **kw: Any) -> list[int]:
    kw.setdefault("readable", readable)
    kw.setdefault("metric", loss)
    return r.retire(steps, **kw)


def test_keep_last_retires_the_older_ones() -> None:
    assert retire(Retention(keep_last=2)) == [10, 20, 30, 40]
    assert retire(Retention(keep_last=10)) == []


def test_keep_every_steps_keeps_the_multiples_and_the_newest() -> None:
    assert retire(Retention(keep_every_steps=20)) == [10, 30, 50]


def test_keep_best_ranks_by_the_metric_in_either_direction() -> None:
    assert retire(Retention(keep_best=2, best_metric="loss")) == [10, 30, 50]  # 0.1, 0.3, +60
    best_high = Retention(keep_best=1, best_metric="acc", best_mode="max")
    assert retire(best_high) == [20, 30, 40, 50]  # 0.9 at step 10, and the newest


def test_steps_without_a_metric_are_not_ranked() -> None:
    r = Retention(keep_best=2, best_metric="loss")
    assert retire(r, metric=lambda s: None) == STEPS[:-1]


def test_the_knobs_keep_their_union() -> None:
    r = Retention(keep_last=1, keep_every_steps=30, keep_best=1, best_metric="loss")
    assert retire(r) == [10, 20, 50]  # 60 last, 30 and 60 multiples, 40 best


def test_without_a_knob_retention_is_off() -> None:
    # The manager retires nothing (it does not ask) while retention is not active.
    assert not Retention().active
    assert Retention(keep_last=1).active and Retention(keep_every_steps=2).active
    assert Retention(keep_best=1, best_metric="m").active


@pytest.mark.parametrize(
    "r",
    [
        Retention(keep_last=1),
        Retention(keep_every_steps=7),
        Retention(keep_best=1, best_metric="loss"),
    ],
    ids=["keep_last", "keep_every_steps", "keep_best"],
)
def test_the_newest_loadable_step_is_never_retired(r: Retention) -> None:
    # The two newest cannot be read (damaged since, or from a newer writer): the newest that
    # can stays, whatever the knobs say, and so does the newest of all.
    unreadable = {50, 60}
    asked = []

    def reads(s: int) -> bool:
        asked.append(s)
        return s not in unreadable

    doomed = retire(r, readable=reads)
    assert 40 not in doomed and 60 not in doomed
    assert asked == [60, 50, 40]  # newest first, and no further than the first that reads


def test_nothing_readable_keeps_the_newest() -> None:
    assert retire(Retention(keep_last=1), readable=lambda s: False) == STEPS[:-1]


def test_busy_and_abandoned_steps_are_never_retired() -> None:
    r = Retention(keep_last=1)
    assert retire(r, busy={20}) == [10, 30, 40, 50]
    # An abandoned timeline above a restored step: kept and not counted, so the newest of
    # the live timeline (40) is what keep_last keeps.
    assert retire(r, abandoned={50, 60}) == [10, 20, 30]
    assert r.keep(STEPS, readable=readable, metric=loss, abandoned=set(STEPS)) == set(STEPS)


def test_an_empty_directory_retires_nothing() -> None:
    assert retire(Retention(keep_last=1), steps=[]) == []
