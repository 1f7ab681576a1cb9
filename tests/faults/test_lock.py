"""One writer per checkpoint directory: the ``.lock`` lease, tested with real processes.

A second live manager (in another process, or this one) gets ``CheckpointLockedError`` naming
the owner; a lock whose owner was SIGKILLed, or whose heartbeat is older than its lease, is taken
over; a live owner keeps its lease alive by heartbeat; a manager whose lock was taken from it
stops writing.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tardigrade as tg
from tardigrade._commit import LOCK
from tardigrade.errors import CheckpointLockedError, TardigradeError
from tardigrade.storage import open_root

pytestmark = pytest.mark.timeout(90)

CHILD_TIMEOUT = 60

HOLDER = textwrap.dedent(
    r"""
    import sys

    import torch

    import tardigrade as tg

    mgr = tg.CheckpointManager(
        sys.argv[1], {"x": torch.zeros(3)}, lock_lease_seconds=float(sys.argv[2]),
        save_on_signals=(),
    )
    print("READY", flush=True)
    sys.stdin.readline()  # hold the lock until the parent says so (or kills us)
    mgr.close()
    print("RELEASED", flush=True)
    """
)


def state() -> dict[str, Any]:
    return {"x": torch.arange(3.0)}


class Holder:
    """A child process that holds the lock of ``directory`` until told to release it."""

    def __init__(self, tmp_path: Path, directory: Path, lease: float = 30.0) -> None:
        script = tmp_path / "holder.py"
        script.write_text(HOLDER)
        self.proc = subprocess.Popen(
            [sys.executable, str(script), str(directory), str(lease)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.expect("READY")

    def expect(self, word: str) -> None:
        assert self.proc.stdout is not None
        # readline() cannot time out by itself; the child is bounded by proc.wait below and
        # the per-test timeout, and a dead child gives EOF at once.
        line = self.proc.stdout.readline().strip()
        if line != word:
            self.kill()
            _, err = self.proc.communicate(timeout=CHILD_TIMEOUT)
            pytest.fail(f"holder printed {line!r}, expected {word!r}; stderr:\n{err}")

    def release(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        self.expect("RELEASED")
        assert self.proc.wait(CHILD_TIMEOUT) == 0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        # Reap it: a zombie still answers kill(pid, 0) as if it were alive.
        self.proc.wait(CHILD_TIMEOUT)


@pytest.fixture
def holder_factory(tmp_path: Path) -> Iterator[Any]:
    started: list[Holder] = []

    def start(directory: Path, lease: float = 30.0) -> Holder:
        h = Holder(tmp_path, directory, lease)
        started.append(h)
        return h

    yield start
    for h in started:
        h.kill()
        for f in (h.proc.stdin, h.proc.stdout, h.proc.stderr):
            if f is not None:
                f.close()


def write_lock(directory: Path, **fields: Any) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    rec = {"owner": "x", "host": "otherhost", "pid": 1, "heartbeat": time.time()}
    rec.update(fields)
    (directory / ".lock").write_text(json.dumps(rec))


def took_over(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "took over the lock" in r.getMessage()]


# -- a live owner in another process ----------------------------------------------------------


@pytest.mark.crash
def test_second_process_is_locked_out_until_the_owner_is_sigkilled(
    tmp_path: Path, holder_factory: Any, caplog: pytest.LogCaptureFixture
):
    d = tmp_path / "ckpt"
    # A short lease: the owner must keep it alive by heartbeat while we wait past it.
    holder = holder_factory(d, lease=1.5)
    pid = holder.proc.pid
    rec = json.loads((d / ".lock").read_text())
    assert rec["pid"] == pid and rec["host"] == socket.gethostname()

    with pytest.raises(CheckpointLockedError) as info:
        tg.CheckpointManager(d, state())
    msg = str(info.value)
    assert str(d) in msg
    assert repr(socket.gethostname()) in msg and f"pid {pid}" in msg
    assert isinstance(info.value, BlockingIOError) and isinstance(info.value, TardigradeError)

    time.sleep(2.0)  # past the lease: only the heartbeat keeps the lock alive
    with pytest.raises(CheckpointLockedError, match=f"pid {pid}"):
        tg.CheckpointManager(d, state())
    assert json.loads((d / ".lock").read_text())["heartbeat"] > rec["heartbeat"]

    holder.kill()  # SIGKILL: no cleanup, the lock file stays with a fresh heartbeat
    assert (d / ".lock").exists()
    caplog.set_level(logging.WARNING, logger="tardigrade")
    with tg.CheckpointManager(d, state()) as mgr:
        assert json.loads((d / ".lock").read_text())["pid"] == os.getpid()
        assert mgr.save(1) is True
        mgr.wait()
        assert mgr.steps() == [1]
    (msg,) = took_over(caplog)
    assert f"pid {pid}" in msg and "exited" in msg
    assert not (d / ".lock").exists()
    assert not [n for n in os.listdir(d) if n.startswith(".lock")]


def test_lock_is_free_after_the_owner_closes(
    tmp_path: Path, holder_factory: Any, caplog: pytest.LogCaptureFixture
):
    d = tmp_path / "ckpt"
    holder = holder_factory(d)
    with pytest.raises(CheckpointLockedError):
        tg.CheckpointManager(d, state())
    holder.release()
    assert not (d / ".lock").exists()
    caplog.set_level(logging.WARNING, logger="tardigrade")
    with tg.CheckpointManager(d, state()):
        pass
    assert took_over(caplog) == []


def test_second_manager_in_the_same_process_is_locked_out(tmp_path: Path):
    first = tg.CheckpointManager(tmp_path, state())
    try:
        with pytest.raises(CheckpointLockedError, match=f"pid {os.getpid()}"):
            tg.CheckpointManager(tmp_path, state())
    finally:
        first.close()
    with tg.CheckpointManager(tmp_path, state()):
        pass


# -- foreign hosts: only the heartbeat can tell ------------------------------------------------


def test_foreign_lock_with_an_expired_lease_is_taken_over(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    write_lock(tmp_path, heartbeat=time.time() - 100, lease_seconds=5)
    caplog.set_level(logging.WARNING, logger="tardigrade")
    with tg.CheckpointManager(tmp_path, state()) as mgr:
        rec = json.loads((tmp_path / ".lock").read_text())
        assert rec["host"] == socket.gethostname() and rec["pid"] == os.getpid()
        assert mgr.save(1) is True
    (msg,) = took_over(caplog)
    assert "heartbeat" in msg and "lease" in msg


def test_foreign_lock_with_a_fresh_heartbeat_blocks_until_its_lease_expires(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    write_lock(tmp_path, heartbeat=time.time(), lease_seconds=60)
    with pytest.raises(CheckpointLockedError) as info:
        tg.CheckpointManager(tmp_path, state(), lock_timeout=0)
    assert "'otherhost'" in str(info.value) and "pid 1" in str(info.value)
    assert not info.value.alive  # another machine's: it may be dead
    caplog.set_level(logging.WARNING, logger="tardigrade")
    with pytest.raises(CheckpointLockedError, match="otherhost"):
        tg.CheckpointManager(tmp_path, state(), lock_timeout=0.2)  # waited, then refused
    assert any("waiting up to" in r.getMessage() for r in caplog.records)
    # pid 1 exists here, but on another host a pid says nothing: the lease alone decides. By
    # default the constructor waits for it (lock_timeout: one lease of its own) and takes over.
    write_lock(tmp_path, heartbeat=time.time(), lease_seconds=1.5, pid=999_999_999)
    with pytest.raises(CheckpointLockedError, match="otherhost"):
        tg.CheckpointManager(tmp_path, state(), lock_timeout=0)
    with tg.CheckpointManager(tmp_path, state()):
        assert json.loads((tmp_path / ".lock").read_text())["host"] == socket.gethostname()
    assert took_over(caplog)


def test_an_unreadable_record_that_nobody_holds_is_taken_over_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    # A record that is empty (a write that failed on a full disk) or half-written (a crash
    # mid-write) under a file lock nobody holds is debris, not an owner: a live holder on this
    # kernel would hold the flock. It used to be judged by its mtime, so a manager whose own
    # record write failed locked itself out for the whole lease.
    caplog.set_level(logging.WARNING, logger="tardigrade")
    for debris in (b'{"owner": "half-writ', b"", b"\0" * 300):
        (tmp_path / ".lock").write_bytes(debris)
        with tg.CheckpointManager(tmp_path, state(), lock_lease_seconds=30) as mgr:
            assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
            assert mgr.save(1, force=True) is True
    # Taking over garbage is worth a warning; an empty file (nothing was lost) is not.
    assert [m for m in took_over(caplog) if "unreadable" in m] != []
    assert len(took_over(caplog)) == 2


FLOCK_HOLDER = textwrap.dedent(
    r"""
    import fcntl, os, sys
    fd = os.open(sys.argv[1], os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    print("READY", flush=True)
    sys.stdin.readline()
    """
)


def test_an_unreadable_record_blocks_while_a_process_holds_the_file_lock(tmp_path: Path):
    # A holder that has not managed to write its record yet (just starting, or its disk is
    # full) is alive: its flock says so, whatever the record looks like.
    lock = tmp_path / ".lock"
    lock.write_bytes(b'{"owner": "half-writ')
    holder = subprocess.Popen(
        [sys.executable, "-c", FLOCK_HOLDER, str(lock)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "READY"
        with pytest.raises(CheckpointLockedError, match="owner unknown") as info:
            tg.CheckpointManager(tmp_path, state(), lock_lease_seconds=1)
        assert str(tmp_path) in str(info.value) and "free the moment" in str(info.value)
        assert lock.read_bytes() == b'{"owner": "half-writ'  # not touched
    finally:
        holder.kill()
        holder.communicate(timeout=CHILD_TIMEOUT)
    with tg.CheckpointManager(tmp_path, state(), lock_lease_seconds=1):
        assert json.loads(lock.read_text())["pid"] == os.getpid()


# -- losing the lock ----------------------------------------------------------------------------


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_manager_whose_lock_was_taken_stops_writing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, async_save: bool
):
    caplog.set_level(logging.ERROR, logger="tardigrade")
    mgr = tg.CheckpointManager(tmp_path, state(), async_save=async_save)
    try:
        assert mgr.save(1) is True
        mgr.wait()
        # Another job decided we were dead and took the directory over.
        write_lock(tmp_path, owner="intruder", heartbeat=time.time(), lease_seconds=60)
        mgr.save(2)
        mgr.wait()
        assert mgr.steps() == [1]
        assert [(s.step, s.ok) for s in mgr.stats] == [(1, True), (2, False)]
        assert any("SAVE FAILED for step 2" in r.getMessage() for r in caplog.records)
    finally:
        mgr.close()
    # Closing does not delete a lock that is no longer ours.
    assert json.loads((tmp_path / ".lock").read_text())["owner"] == "intruder"


# -- stores: a lease object judged by its record ------------------------------------------------

HOLD_AND_DIE = """
import os, signal, sys
import torch
import tardigrade as tg
mgr = tg.CheckpointManager(sys.argv[1], {"x": torch.zeros(3)})
mgr.save(1)
mgr.wait()
os.kill(os.getpid(), signal.SIGKILL)  # a crash: the lease is never released
"""


@pytest.mark.s3
def test_a_store_lease_whose_holder_died_on_this_machine_is_taken_over_at_once(
    s3_env: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A restarter (SLURM requeue, torchrun) starts the job again right after a crash: the
    lease record names this machine and a dead pid, so it is taken at once, not after 30 s."""
    url = f"s3://{s3_env.bucket}/dead-holder-{uuid.uuid4().hex[:12]}"
    child = subprocess.run(
        [sys.executable, "-c", HOLD_AND_DIE, url], capture_output=True, text=True, timeout=300
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    rec = open_root(url).lease(LOCK).read()
    assert rec is not None and rec["pid"] == child_pid(rec) and rec["released"] is False
    caplog.set_level(logging.WARNING, logger="tardigrade")
    with tg.CheckpointManager(url, state(), lock_timeout=0) as mgr:  # no waiting allowed
        assert mgr.steps() == [1]
    (msg,) = [r.getMessage() for r in caplog.records if "took over the lease" in r.getMessage()]
    assert f"its owner (pid {rec['pid']} on this machine) has exited" in msg


def child_pid(rec: dict[str, Any]) -> int:
    """The pid the record names, checked to be no process now (the child was SIGKILLed)."""
    with pytest.raises(ProcessLookupError):
        os.kill(rec["pid"], 0)
    return int(rec["pid"])


def test_a_store_lease_held_by_this_process_is_refused_at_once(tmp_path: Path) -> None:
    url = f"memory://live-holder-{uuid.uuid4().hex[:12]}/run"
    with tg.CheckpointManager(url, state()):
        with pytest.raises(CheckpointLockedError, match=f"pid {os.getpid()}") as info:
            tg.CheckpointManager(url, state())  # this very process: no wait by default
        assert info.value.alive
