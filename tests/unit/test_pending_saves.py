"""The manager's background saves in flight (``PendingSaves``) and what each ending counts as
(``failure_of``), on their own with futures the test finishes by hand.

The manager's own tests show the recording end to end (``tests/integration/test_manager.py``,
``tests/faults/test_commit_outcome_local.py``).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from tardigrade import SaveResult
from tardigrade._async import SaveFuture
from tardigrade.errors import (
    InvalidArgumentError,
    SaveError,
    StorageError,
    UnsupportedTypeError,
)
from tardigrade.manager._pending import Failure, PendingSaves, failure_of


def future(step: int) -> tuple[SaveFuture, Future[SaveResult]]:
    inner: Future[SaveResult] = Future()
    return SaveFuture(f"ckpt/step-{step:09d}", inner), inner


def result(step: int) -> SaveResult:
    return SaveResult(f"ckpt/step-{step:09d}", step, 10, 1, 0.0, 0.0)


def test_finished_saves_are_taken_oldest_first_passing_over_those_still_running() -> None:
    # A save into the RAM tier alone may end while an older one still writes the directory:
    # it is recorded at once (its tier retires the older copies there), not held behind it.
    pending = PendingSaves()
    futs = {s: future(s) for s in (1, 2, 3)}
    for s, (fut, _) in futs.items():
        pending.add(s, fut)
    assert pending.running() and pending.steps() == {1, 2, 3}
    futs[1][1].set_result(result(1))
    futs[3][1].set_result(result(3))  # finished while step 2 still runs
    assert [s for s, _ in pending.finished(wait=False)] == [1, 3]
    assert len(pending) == 1 and pending.steps() == {2}
    futs[2][1].set_exception(SaveError("ckpt/step-000000002: injected"))
    assert not pending.running()
    assert [s for s, _ in pending.finished(wait=False)] == [2]
    assert len(pending) == 0 and not pending.steps()


def test_waiting_takes_every_save_oldest_first() -> None:
    pending = PendingSaves()
    futs = {s: future(s) for s in (1, 2)}
    for s, (fut, _) in futs.items():
        pending.add(s, fut)
    futs[2][1].set_result(result(2))
    threading.Timer(0.05, futs[1][1].set_result, (result(1),)).start()
    assert [s for s, _ in pending.finished(wait=True)] == [1, 2]


def test_a_save_whose_recording_raises_is_reported_once() -> None:
    # on_save_error="raise" raises while the manager records a failure: the failed save must
    # be off the list by then, or the next drain would report it again.
    pending = PendingSaves()
    fut, inner = future(4)
    pending.add(4, fut)
    inner.set_exception(SaveError("ckpt/step-000000004: injected"))
    with pytest.raises(SaveError):
        for _step, f in pending.finished(wait=True):
            exc = f.exception()
            assert exc is not None
            raise exc
    assert len(pending) == 0
    assert list(pending.finished(wait=True)) == []


def test_what_an_ending_counts_as() -> None:
    committed = SaveError("ckpt/step-000000005: fsync of the directory failed")
    committed.committed = True
    assert failure_of(committed) is Failure.COMMITTED
    assert failure_of(SaveError("ckpt/step-000000005: disk full")) is Failure.FAILED
    assert failure_of(StorageError(5, "EIO")) is Failure.FAILED
    assert failure_of(RuntimeError("a bug in a state_dict()")) is Failure.FAILED
    assert failure_of(InvalidArgumentError("ranks' states differ")) is Failure.MISUSE
    assert failure_of(UnsupportedTypeError("a leaf the format cannot store")) is Failure.MISUSE
