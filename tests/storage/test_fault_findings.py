"""What the fault matrix (``test_fault_matrix.py``) found, each pinned by a test of its own
that fails on the code before the fix."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import threading
import time
from typing import Any

import pytest
import torch
from torch import nn

import tardigrade as tg
from tardigrade._commit import LOCK
from tardigrade.cli import main as cli
from tardigrade.errors import CheckpointLockedError, StorageError, TardigradeError
from tardigrade.storage import open_root
from tardigrade.storage.lease import ObjectLease
from tardigrade.testing import FaultyStorage


def make_state(value: float) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.fill_(value)
    return {"model": model, "step": int(value)}


def weight(state: dict[str, Any]) -> float:
    return float(state["model"].weight.detach()[0, 0])


def gc(location: str) -> int:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return cli(["gc", location])


@pytest.fixture
def store() -> FaultyStorage:
    """A store (manifest-last commit, object lease) whose requests can fail one by one."""
    url = "memory://findings/root"
    open_root(url).delete("")
    return FaultyStorage(url)


# -- the object lease ------------------------------------------------------------------------


def test_a_failed_read_of_the_lease_record_never_takes_a_live_lease(store: FaultyStorage) -> None:
    holder = ObjectLease(store.inner, LOCK)
    holder.acquire()
    try:
        contender = store.lease(LOCK)
        store.fail("read", error="EIO")  # reading the holder's record
        with pytest.raises(StorageError, match=r"\.lock: injected EIO"):
            contender.acquire()
        assert not contender.held
        holder.check()  # still the holder's: no second writer
        with pytest.raises(CheckpointLockedError, match="another job is writing"):
            contender.acquire()  # once the record reads, it names the live holder
    finally:
        holder.release()


def test_a_takeover_right_after_reading_an_expired_record_leaves_one_holder(
    store: FaultyStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two contenders for an expired lease: B takes it over while A is between reading the
    old record and its conditional put. A must fail (its put names the old record's version),
    never overwrite B's record: a version read after the record's bytes named B's record."""
    root = store.inner
    expired = {"owner": "dead", "generation": 4, "heartbeat": time.time() - 3600}
    root.put(".lock", json.dumps({**expired, "lease_seconds": 30.0}).encode(), mode="create")
    a, b = ObjectLease(root, LOCK), ObjectLease(root, LOCK)
    read_bytes = root.read_bytes
    raced = []

    def read_then_b_takes_over(name: str, limit: int) -> bytes:
        raw = read_bytes(name, limit)
        if not raced:
            raced.append(True)
            b.acquire()  # B reads the same expired record and takes the lease
        return raw

    monkeypatch.setattr(root, "read_bytes", read_then_b_takes_over)
    try:
        with pytest.raises(CheckpointLockedError, match="another job is writing"):
            a.acquire()
        assert raced and b.held and not a.held
        b.check()  # the record is still B's
        assert b.generation == 5
    finally:
        b.release()
        a.release()


def test_a_failed_read_in_check_neither_proves_nor_loses_the_lease(store: FaultyStorage) -> None:
    lease = store.lease(LOCK)
    lease.acquire()
    try:
        store.fail("read", error="transient")
        with pytest.raises(StorageError, match="injected transient"):
            lease.check()
        assert lease.held
        lease.check()  # the next check proves it again
    finally:
        lease.release()


def test_a_manager_deletes_nothing_while_its_lease_cannot_be_read(
    store: FaultyStorage, caplog: pytest.LogCaptureFixture
) -> None:
    state = make_state(1.0)
    with tg.CheckpointManager(store.root, state, keep_last=1, async_save=False) as mgr:
        mgr.save(1)
        # The reads after this: the lease record (the save's check before it writes), the
        # new manifest (retention: is step 2 readable?), the lease record (retention's check
        # before it deletes step 1): that one fails.
        store.fail("read", nth=3, error="EIO")
        assert mgr.save(2) is True
        assert mgr.steps() == [1, 2]  # step 1 kept: ownership was not proved
        assert mgr.save(3) is True  # the lease is still held: saves go on
        assert mgr.steps() == [3]
    assert any("not removing old checkpoints" in r.getMessage() for r in caplog.records)


def test_one_failed_release_request_still_releases(store: FaultyStorage) -> None:
    lease = store.lease(LOCK)
    lease.acquire()
    store.fail("put", error="transient")
    lease.release()
    record = store.inner.lease(LOCK).read()
    assert record is not None and record["released"] is True


def test_this_process_takes_over_a_lease_it_could_not_release(store: FaultyStorage) -> None:
    with tg.CheckpointManager(store.root, make_state(1.0)):
        store.fail("put", error="EIO", times=10)  # every try of the release fails
    store.heal()
    record = store.inner.lease(LOCK).read()
    assert record is not None and record["released"] is False  # left as held
    with tg.CheckpointManager(store.root, make_state(1.0)):  # not refused for 30 s
        pass
    assert store.inner.lease(LOCK).read()["released"] is True  # type: ignore[index]
    assert gc(store.root) == 0


# -- what failed saves leave behind ---------------------------------------------------------


def test_gc_removes_the_data_a_dead_save_left_on_a_store(store: FaultyStorage) -> None:
    tg.save(store.url("step-1"), make_state(1.0))
    dead = "step-2/0123456789abcdef.data-00000-of-00001.safetensors"
    w = store.inner.open_writer(dead)
    w.write(b"x" * 100)
    w.close()
    assert gc(store.root) == 0
    assert store.inner.list() == [".lock", "step-1"]
    assert tg.load(store.url("step-1"))["step"] == 1


def test_a_failed_abort_reports_the_save_s_own_error_and_gc_removes_its_leftovers(
    root_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    faulty = FaultyStorage(root_url)
    tg.save(faulty.url("step-1"), make_state(1.0))
    faulty.fail("write", error="ENOSPC")
    faulty.fail("abort", error="EIO")  # and removing what the save wrote fails too
    with pytest.raises(tg.SaveError, match=r"nothing was committed.*injected ENOSPC \(write #"):
        tg.save(faulty.url("step-2"), make_state(2.0))
    assert any("could not remove what the failed save" in r.getMessage() for r in caplog.records)
    faulty.heal()
    if faulty.inner.can_move:  # a directory: the staging is left, for gc (a store's object
        assert [n for n in faulty.inner.list() if n != "step-1"]  # appears only once closed)
    assert gc(faulty.root) == 0
    assert [n for n in faulty.inner.list() if n != ".lock"] == ["step-1"]
    tg.save(faulty.url("step-2"), make_state(2.0))


def test_restore_raises_when_storage_fails_reading_every_checkpoint(root_url: str) -> None:
    faulty = FaultyStorage(root_url)
    state = make_state(0.0)
    with tg.CheckpointManager(faulty.root, state, async_save=False) as mgr:
        for step in (1, 2):
            state["model"].weight.data.fill_(float(step))
            mgr.save(step)
    state = make_state(-1.0)
    with tg.CheckpointManager(faulty.root, state) as mgr:
        faulty.fail("open_reader", error="EIO", times=1000)
        with pytest.raises(StorageError, match=r"no checkpoint could be restored.*\[1, 2\]"):
            mgr.restore()  # not None: that would start training from scratch
        faulty.heal()
        assert mgr.restore() == 2 and weight(state) == 2.0


def test_a_failed_listing_after_a_save_is_logged(
    root_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    faulty = FaultyStorage(root_url)
    caplog.set_level(logging.WARNING, logger="tardigrade")
    with tg.CheckpointManager(faulty.root, make_state(1.0), async_save=False) as mgr:
        mgr.save(1)
        if faulty.inner.can_move:
            faulty.fail("list", error="EIO")  # the listing for abandoned checkpoints to remove
        faulty.log.clear()
        assert mgr.save(2) is True
        fired = list(faulty.injected)
        faulty.heal()
    if faulty.inner.can_move:
        assert fired and any("could not list" in r.getMessage() for r in caplog.records)
    else:
        # A store holds no checkpoint set aside (it cannot rename), and no record of abandoned
        # ones here: a save lists nothing for them (one request less per save); what it lists
        # is what lies under its own name (is anything but its own data in the way?).
        assert ("list", f"{faulty.root}/") not in faulty.log
        assert ("list", faulty.url("step-000000002")) in faulty.log


# -- a manager's preflight on a store --------------------------------------------------------


def test_a_transient_store_error_at_manager_creation_only_warns(
    store: FaultyStorage, caplog: pytest.LogCaptureFixture
) -> None:
    store.fail("put", error="transient")  # the preflight's probe
    with tg.CheckpointManager(store.root, make_state(1.0), async_save=False) as mgr:
        assert mgr.save(1) is True  # the job was not failed for it, and saves work
    assert any("saves will fail until this is fixed" in r.getMessage() for r in caplog.records)


def test_a_store_that_denies_writes_is_refused_at_manager_creation(store: FaultyStorage) -> None:
    store.fail("put", error="EACCES")
    with pytest.raises(StorageError, match=r"faulty://\d+: cannot be used as a checkpoint"):
        tg.CheckpointManager(store.root, make_state(1.0))


def test_a_probe_that_could_not_be_deleted_is_removed_by_gc(store: FaultyStorage) -> None:
    store.fail("delete", error="EIO")  # the preflight's probe stays
    with tg.CheckpointManager(store.root, make_state(1.0)):
        pass
    assert [n for n in store.inner.list() if n.startswith(".probe-")]
    assert gc(store.root) == 0
    assert store.inner.list() == [".lock"]


# -- a manager in "warn" mode never fails the job for storage ---------------------------------


def test_step_counts_a_failed_existence_check_as_a_failed_save(root_url: str) -> None:
    faulty = FaultyStorage(root_url)
    state = make_state(1.0)
    with tg.CheckpointManager(faulty.root, state, every_steps=1, async_save=False) as mgr:
        faulty.fail("stat", error="EIO")  # is step 1 there already? storage cannot say
        assert mgr.step(1) is False  # not raised: counted, training goes on
        assert mgr.stats.failed == 1 and "injected EIO" in (mgr.stats[0].error or "")
        assert mgr.step(2) is True
        assert mgr.steps() == [2]


def test_a_failed_retention_listing_does_not_count_a_committed_save_as_failed(
    root_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    faulty = FaultyStorage(root_url)
    state = make_state(1.0)
    with tg.CheckpointManager(faulty.root, state, keep_last=1, async_save=False) as mgr:
        mgr.save(1)
        # After step 2 commits: on a directory, the listing for abandoned checkpoints (set
        # aside there), then retention's; on a store, the save's own look under its name
        # before it commits, then retention's.
        faulty.fail("list", nth=2, error="EIO")
        assert mgr.save(2) is True
        assert [(s.step, s.ok) for s in mgr.stats] == [(1, True), (2, True)]
        assert mgr.steps() == [1, 2]  # nothing deleted this time
        mgr.save(3)
        assert mgr.steps() == [3]  # retention catches up
    assert any("to apply retention" in r.getMessage() for r in caplog.records)


# -- a lost reply: the store did it, the caller got an error ---------------------------------


def test_a_lease_whose_reply_was_lost_is_held(store: FaultyStorage) -> None:
    lease = store.lease(LOCK)
    store.fail("put", error="lost_reply")  # the record was written; the answer timed out
    lease.acquire()
    assert lease.held
    lease.check()
    lease.release()
    assert store.inner.lease(LOCK).read()["released"] is True  # type: ignore[index]


def test_a_manager_whose_lease_reply_was_lost_saves(store: FaultyStorage) -> None:
    state = make_state(1.0)
    store.fail("put", nth=2, error="lost_reply")  # the preflight's probe, then the lease
    with tg.CheckpointManager(store.root, state, async_save=False) as mgr:
        assert mgr.save(1) is True  # not refused by its own lease record
        assert mgr.steps() == [1]
    assert gc(store.root) == 0  # nor is the next holder


def test_a_commit_whose_reply_was_lost_says_it_committed(root_url: str) -> None:
    faulty = FaultyStorage(root_url)
    faulty.fail("commit", error="lost_reply")
    with pytest.raises(TardigradeError, match=r"committed nonetheless \(committed=True\)") as e:
        tg.save(faulty.url("step-1"), make_state(1.0))
    assert e.value.committed is True
    assert tg.load(faulty.url("step-1"))["step"] == 1


def test_a_heartbeat_whose_reply_was_lost_keeps_the_lease(store: FaultyStorage) -> None:
    lease = store.lease(LOCK, lease_seconds=0.06)  # a heartbeat every 20 ms
    lease.acquire()
    try:
        beats = store.count["put"]
        store.fail("put", error="lost_reply")  # the next beat lands; its answer is lost
        # Wait for that beat and two more: the first after it finds a record version it did
        # not know it wrote (bounded by operations, not by time; the test's timeout guards).
        while store.count["put"] < beats + 3 and lease.held:
            threading.Event().wait(0.005)
        assert lease.held
        lease.check()
    finally:
        lease.release()


def test_gc_removes_a_failed_replace_s_data_from_a_committed_checkpoint_on_a_store(
    store: FaultyStorage,
) -> None:
    tg.save(store.url("step-1"), make_state(1.0))
    # A replace (overwrite=True) that wrote its data, then could not tell whether it committed
    # (storage went away): it leaves its data objects under the committed name.
    store.fail("stat", where=".data-", error="EIO", outage=True)  # its data file is written
    with pytest.raises(tg.SaveError, match="committed=None"):
        tg.save(store.url("step-1"), make_state(2.0), overwrite=True)
    store.heal()
    listed = {f["name"] for f in tg.read_manifest(store.url("step-1"))["files"]}
    assert set(store.inner.list("step-1")) - listed - {"manifest.json"}  # the stray data
    assert gc(store.root) == 0
    assert set(store.inner.list("step-1")) == listed | {"manifest.json"}
    assert tg.load(store.url("step-1"))["step"] == 1


def test_a_target_whose_manifest_cannot_be_read_fails_the_save_with_the_storage_error(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before a save replaces a checkpoint it reads what is there. An I/O error on that read is
    the storage's error, said as such: not taken for "something that is not a checkpoint is in
    the way" (what the old ``Storage.describe`` made of it), and nothing is replaced."""
    from tardigrade.storage import local

    tg.save(tmp_path / "ckpt", make_state(1.0))
    real = local.LocalStorage.open_reader

    def failing(self: Any, name: str) -> Any:
        if name.endswith("manifest.json"):
            raise StorageError(5, f"{self.url(name)}: injected EIO")
        return real(self, name)

    monkeypatch.setattr(local.LocalStorage, "open_reader", failing)
    with pytest.raises(TardigradeError, match="injected EIO") as raised:
        tg.save(tmp_path / "ckpt", make_state(2.0), overwrite=True)
    assert "in the way" not in str(raised.value)
    monkeypatch.undo()
    assert float(tg.load(tmp_path / "ckpt")["model"]["weight"][0, 0]) == 1.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no staging left
