"""The directory lock under races, containers, full disks and deaths, with real processes.

- Racing contenders: whatever they see, never two holders at once.
- PID namespaces: a pid in a lock record says nothing about a process in another namespace;
  the kernel's file lock (same machine) or the lease (another machine) decides.
- Full disk: a holder that cannot write its record keeps the lock and writes it later; what a
  failed write leaves behind never blocks the next job.
- Deaths: a holder that dies (SIGKILL, exit without close) frees the lock at once, also while
  the DataLoader workers it forked live on.
- Fencing: a holder whose lock was taken over learns it from ``check()`` and then neither writes
  nor removes anything.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import multiprocessing
import os
import select
import shutil
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
from tardigrade.cli import main
from tardigrade.errors import CheckpointLockedError
from tardigrade.storage import local_lease as _lock
from tardigrade.storage.local_lease import DirectoryLock

pytestmark = pytest.mark.timeout(120)

CHILD_TIMEOUT = 60
BOOT_ID = Path("/proc/sys/kernel/random/boot_id").read_text().strip()  # this kernel


def record(directory: Path) -> dict[str, Any]:
    return json.loads((directory / ".lock").read_bytes())


def write_record(directory: Path, **fields: Any) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    rec = {
        "owner": uuid.uuid4().hex,
        "generation": 7,
        "host": socket.gethostname(),
        "pid": 999_999_999,
        "boot_id": BOOT_ID,
        "heartbeat": time.time(),
        "lease_seconds": 30.0,
        "flock": True,
        "released": False,
    }
    rec.update(fields)
    (directory / ".lock").write_text(json.dumps(rec))


def took_over(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "took over the lock" in r.getMessage()]


# -- 1. racing contenders -----------------------------------------------------------------------

CONTENDERS = 8
TRIALS = 300
HOLD_SECONDS = 0.004


def contend(directory: str, start: Any, done: Any, results: Any, trials: int) -> None:
    """One contender process: in each trial, try once to take the lock; report the tenure."""
    for trial in range(trials):
        start.wait(CHILD_TIMEOUT)
        lock = DirectoryLock(os.path.join(directory, ".lock"), lease_seconds=30)
        try:
            lock.acquire()
        except CheckpointLockedError:
            results.put((trial, "locked", None))
        except BaseException as e:  # anything else is a bug the parent reports
            results.put((trial, "error", repr(e)))
        else:
            began = time.monotonic()
            time.sleep(HOLD_SECONDS)  # hold it a while: a second holder would overlap here
            try:
                lock.check()
                lost = None
            except BaseException as e:
                lost = f"check() of a fresh holder: {e!r}"
            results.put((trial, "held", (began, time.monotonic(), lost)))
            lock.release()
        done.wait(CHILD_TIMEOUT)


@pytest.mark.crash
def test_contenders_for_a_stale_lock_never_hold_it_together(tmp_path: Path):
    # Each trial starts from the lock of a dead writer: half the time a record from another
    # machine whose lease expired, half the time one from a pid of this machine that is gone.
    # Eight processes then race for it. The lock that renamed a stale file aside by its path
    # let two of them win now and then (about 1 trial in 100).
    d = tmp_path / "ckpt"
    d.mkdir()
    ctx = multiprocessing.get_context("fork")  # cheap real processes: tardigrade is imported
    start, done = ctx.Barrier(CONTENDERS + 1), ctx.Barrier(CONTENDERS + 1)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=contend, args=(str(d), start, done, results, TRIALS), daemon=True)
        for _ in range(CONTENDERS)
    ]
    for p in procs:
        p.start()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(CHILD_TIMEOUT)  # a pid that existed on this machine and is gone
    overlaps, errors, untaken = [], [], []
    try:
        for trial in range(TRIALS):
            if trial % 2:
                write_record(d, host="otherhost", boot_id="another-kernel", heartbeat=0.0)
            else:
                write_record(d, pid=dead.pid, heartbeat=time.time())
            start.wait(CHILD_TIMEOUT)
            outcomes = [results.get(timeout=CHILD_TIMEOUT) for _ in range(CONTENDERS)]
            done.wait(CHILD_TIMEOUT)
            assert {t for t, _, _ in outcomes} == {trial}
            errors += [info for _, what, info in outcomes if what == "error"]
            tenures = sorted(info for _, what, info in outcomes if what == "held")
            errors += [lost for _, _, lost in tenures if lost is not None]
            if not tenures:
                untaken.append(trial)
            for (_, first_end, _), (second_start, _, _) in itertools.pairwise(tenures):
                if second_start < first_end:
                    overlaps.append(trial)
    finally:
        for p in procs:
            p.join(CHILD_TIMEOUT)
            if p.is_alive():
                p.kill()
                p.join(CHILD_TIMEOUT)
    assert overlaps == [], f"two holders at once in trials {overlaps} of {TRIALS}"
    assert errors == []
    assert untaken == [], f"the stale lock was not taken over in trials {untaken}"
    assert all(p.exitcode == 0 for p in procs)


# -- 2. PID namespaces (containers sharing this kernel and host name) ---------------------------

NS_HOLDER = textwrap.dedent(
    r"""
    import json, os, sys
    from tardigrade.storage.local_lease import DirectoryLock

    lock = DirectoryLock(os.path.join(sys.argv[1], ".lock"), lease_seconds=30)
    lock.acquire()
    print(json.dumps({"pid": os.getpid()}), flush=True)
    sys.stdin.readline()
    lock.release()
    print("RELEASED", flush=True)
    """
)


def descendants(pid: int) -> list[int]:
    found = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            for child in map(int, f.read().split()):
                found += [child, *descendants(child)]
    return found


class NamespaceHolder:
    """A process in a new PID namespace holding the lock, as a job in a container would.

    ``as_init``: it runs as pid 1 of its namespace (a container's main process), a pid that
    always exists outside too; otherwise it gets a pid no process here can have.
    """

    def __init__(self, tmp_path: Path, directory: Path, *, as_init: bool) -> None:
        self.pidfds: list[int] = []
        script = tmp_path / "ns_holder.py"
        script.write_text(NS_HOLDER)
        run = [sys.executable, str(script), str(directory)]
        if not as_init:
            # The next pid in the new namespace far above this machine's pid range; the
            # trailing `true` keeps the shell from exec'ing python as pid 1.
            cmd = f"echo 3999000 > /proc/sys/kernel/ns_last_pid && {' '.join(run)}; true"
            run = ["sh", "-c", cmd]
        self.proc = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", *run],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("{"):
            self.kill()
            _, err = self.proc.communicate(timeout=CHILD_TIMEOUT)
            if "Operation not permitted" in err:
                pytest.skip("creating a PID namespace is not permitted here")
            pytest.fail(f"namespace holder printed {line!r}; stderr:\n{err}")
        self.pid_inside = json.loads(line)["pid"]
        # Its processes as this namespace sees them, to wait for their deaths below: the kernel
        # drops the flock when the process exits, and nobody here can wait() for it.
        self.pidfds = [os.pidfd_open(pid) for pid in descendants(self.proc.pid)]

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the whole namespace, its init included
        self.proc.wait(CHILD_TIMEOUT)
        for fd in self.pidfds:
            assert select.select([fd], [], [], CHILD_TIMEOUT)[0] == [fd]  # readable: exited
            os.close(fd)
        self.pidfds = []
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()


@pytest.fixture
def ns_holder(tmp_path: Path) -> Iterator[Any]:
    started: list[NamespaceHolder] = []

    def start(directory: Path, *, as_init: bool) -> NamespaceHolder:
        if os.geteuid() != 0 or shutil.which("unshare") is None:
            pytest.skip("creating a PID namespace needs root and unshare(1)")
        h = NamespaceHolder(tmp_path, directory, as_init=as_init)
        started.append(h)
        return h

    yield start
    for h in started:
        h.kill()


def test_a_live_holder_in_another_pid_namespace_keeps_the_lock(
    tmp_path: Path, ns_holder: Any, caplog: pytest.LogCaptureFixture
):
    # A job in a container on this machine: same host name and kernel, its own PID namespace.
    # Its pid means nothing here (no process here has it), yet it is alive: the old lock saw
    # "pid gone from this host" and took the lock over from the live job.
    d = tmp_path / "ckpt"
    holder = ns_holder(d, as_init=False)
    rec = record(d)
    assert rec["host"] == socket.gethostname() and rec["pid"] == holder.pid_inside
    assert not _lock._pid_alive(holder.pid_inside)  # this pid exists only in its namespace
    caplog.set_level(logging.WARNING, logger="tardigrade")
    with pytest.raises(CheckpointLockedError) as info:
        DirectoryLock(os.path.join(str(d), ".lock"), lease_seconds=30).acquire()
    msg = str(info.value)
    assert f"pid {holder.pid_inside} in another PID namespace" in msg and str(d) in msg
    with pytest.raises(CheckpointLockedError, match="another PID namespace"):
        tg.CheckpointManager(d, {"x": torch.zeros(2)}, save_on_signals=())
    assert record(d) == rec and took_over(caplog) == []


@pytest.mark.crash
def test_a_sigkilled_holder_in_another_pid_namespace_frees_the_lock_at_once(
    tmp_path: Path, ns_holder: Any, caplog: pytest.LogCaptureFixture
):
    # A container's main process is pid 1 of its namespace, and pid 1 is alive out here too:
    # the old lock therefore waited out the whole lease (30 s) after the container was killed.
    d = tmp_path / "ckpt"
    holder = ns_holder(d, as_init=True)
    assert record(d)["pid"] == 1 == holder.pid_inside
    with pytest.raises(CheckpointLockedError):
        DirectoryLock(os.path.join(str(d), ".lock"), lease_seconds=30).acquire()
    holder.kill()
    caplog.set_level(logging.WARNING, logger="tardigrade")
    lock = DirectoryLock(os.path.join(str(d), ".lock"), lease_seconds=30)
    lock.acquire()  # within the holder's 30 s lease: acquire() never waits, it would raise
    try:
        assert record(d)["pid"] == os.getpid()
    finally:
        lock.release()
    (msg,) = took_over(caplog)
    assert "pid 1" in msg and "exited" in msg


def test_a_fresh_record_from_another_kernel_is_respected_until_its_lease_expires(tmp_path: Path):
    # Same host name, a pid that does not exist here, nobody holding the file lock: what a job
    # on another machine (or a VM) sharing this file system and host name looks like when the
    # file system's locks do not reach us. Only its heartbeat can tell; the old lock judged it
    # by the pid and took it over at once.
    write_record(tmp_path, boot_id="another-kernel", lease_seconds=1.0, pid=999_999_999)
    with pytest.raises(CheckpointLockedError) as info:
        DirectoryLock(os.path.join(str(tmp_path), ".lock"), lease_seconds=30).acquire()
    assert "pid 999999999" in str(info.value) and "wait 1 s after it dies" in str(info.value)
    time.sleep(1.2)  # the lease itself is what is tested: nothing else can be waited on
    lock = DirectoryLock(os.path.join(str(tmp_path), ".lock"), lease_seconds=30)
    lock.acquire()
    assert lock.generation == 8 and record(tmp_path)["generation"] == 8
    lock.release()


def test_a_dead_writer_whose_pid_was_reused_frees_the_lock_at_once(tmp_path: Path):
    # The record of a writer of this kernel that has gone, whose pid now belongs to another
    # process (here: this one's parent). The free file lock proves the writer is gone; the old
    # lock believed the pid and waited for the whole lease.
    write_record(tmp_path, pid=os.getppid(), heartbeat=time.time(), lease_seconds=30)
    lock = DirectoryLock(os.path.join(str(tmp_path), ".lock"), lease_seconds=30)
    lock.acquire()
    assert record(tmp_path)["pid"] == os.getpid() and lock.generation == 8
    lock.release()


# -- 3. deaths ----------------------------------------------------------------------------------

FORKING_HOLDER = textwrap.dedent(
    r"""
    import os, sys, time
    from tardigrade.storage.local_lease import DirectoryLock

    lock = DirectoryLock(os.path.join(sys.argv[1], ".lock"), lease_seconds=30)
    lock.acquire()
    worker = os.fork()
    if worker == 0:  # a DataLoader-like worker that outlives its parent (killed by the test)
        assert not lock.held and lock.generation is None
        lock.release()  # a child's release must not touch the parent's lock
        time.sleep(120)
        os._exit(0)
    print(worker, flush=True)
    if sys.argv[2] == "exit":
        os._exit(0)  # dies without close(), no cleanup at all
    sys.stdin.readline()
    """
)


@pytest.mark.crash
@pytest.mark.parametrize("death", ["sigkill", "exit"])
def test_a_dead_holder_frees_the_lock_at_once_while_its_forked_worker_lives(
    tmp_path: Path, death: str, caplog: pytest.LogCaptureFixture
):
    # SIGTERM to a process group, the OOM killer or an exit without close(): the holder is
    # gone, its forked DataLoader worker not yet. The worker must not keep the lock (nor release
    # the parent's while the parent lives), and nobody must wait for the lease.
    d = tmp_path / "ckpt"
    holder = subprocess.Popen(
        [sys.executable, "-c", FORKING_HOLDER, str(d), death],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    worker = 0
    try:
        assert holder.stdout is not None
        worker = int(holder.stdout.readline())
        if death == "sigkill":
            with pytest.raises(CheckpointLockedError, match=f"pid {holder.pid}"):
                DirectoryLock(os.path.join(str(d), ".lock"), lease_seconds=30).acquire()
            holder.kill()
        assert holder.wait(CHILD_TIMEOUT) in (0, -signal.SIGKILL)
        assert _lock._pid_alive(worker)
        caplog.set_level(logging.WARNING, logger="tardigrade")
        # Within the holder's 30 s lease: taking the lock never waits, it would raise.
        with tg.CheckpointManager(d, {"x": torch.ones(2)}, save_on_signals=()) as mgr:
            assert mgr.save(1) is True
            mgr.wait()
        (msg,) = took_over(caplog)
        assert f"pid {holder.pid}" in msg and "exited" in msg
    finally:
        if worker:
            os.kill(worker, signal.SIGKILL)
        holder.kill()
        holder.communicate(timeout=CHILD_TIMEOUT)


# -- 4. a full disk -----------------------------------------------------------------------------


@pytest.fixture
def full_tmpfs(small_tmpfs: Path) -> tuple[Path, Path]:
    """The 16 MiB tmpfs, filled up: (the mount point, the file that fills it)."""
    (small_tmpfs / "ckpt").mkdir()
    filler = small_tmpfs / "filler"
    with open(filler, "wb", buffering=0) as f:
        for size in (1 << 20, 4096):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError as e:
                assert e.errno == errno.ENOSPC
    return small_tmpfs, filler


def test_a_holder_on_a_full_disk_keeps_the_lock_and_writes_its_record_later(
    full_tmpfs: tuple[Path, Path], caplog: pytest.LogCaptureFixture
):
    mnt, filler = full_tmpfs
    d = mnt / "ckpt"
    caplog.set_level(logging.INFO, logger="tardigrade")
    lock = DirectoryLock(os.path.join(str(d), ".lock"), lease_seconds=30)
    lock.acquire()  # the record cannot be written; the lock is held all the same
    try:
        assert lock.held and (d / ".lock").read_bytes() == b""
        assert any("cannot write the lock record" in r.getMessage() for r in caplog.records)
        with pytest.raises(CheckpointLockedError, match="owner unknown"):
            DirectoryLock(
                os.path.join(str(d), ".lock"), lease_seconds=30
            ).acquire()  # a live holder, record or not
        lock.check()  # still ours: no one else can hold the file lock
        filler.unlink()  # space is back: the record is written at the next check or heartbeat
        lock.check()
        rec = record(d)
        assert rec["owner"] == lock.owner and rec["generation"] == lock.generation
    finally:
        lock.release()
    assert not (d / ".lock").exists()


HOLD_AND_DIE = textwrap.dedent(
    r"""
    import os, sys
    from tardigrade.storage.local_lease import DirectoryLock

    lock = DirectoryLock(os.path.join(sys.argv[1], ".lock"), lease_seconds=30)
    try:
        lock.acquire()
        print("HELD", flush=True)
    except OSError as e:  # the old lock: its record write failed and left an empty file
        print(f"FAILED {e}", flush=True)
    sys.stdin.readline()
    """
)


@pytest.mark.crash
def test_what_a_writer_left_on_a_full_disk_does_not_block_the_next_one(
    full_tmpfs: tuple[Path, Path],
):
    mnt, filler = full_tmpfs
    d = mnt / "ckpt"
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD_AND_DIE, str(d)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        said = child.stdout.readline().strip()
        child.kill()
        child.wait(CHILD_TIMEOUT)
    finally:
        child.kill()
        child.communicate(timeout=CHILD_TIMEOUT)
    assert (d / ".lock").read_bytes() == b""  # its record never made it to the disk
    lock = DirectoryLock(os.path.join(str(d), ".lock"), lease_seconds=30)
    lock.acquire()  # at once, and still on a full disk
    assert said == "HELD"  # the dead one held the lock while it lived, record or not
    filler.unlink()
    lock.check()
    assert record(d)["owner"] == lock.owner
    lock.release()


def test_a_manager_created_on_a_full_disk_saves_once_there_is_space(
    full_tmpfs: tuple[Path, Path], caplog: pytest.LogCaptureFixture
):
    # The old lock's record write failed, left an empty .lock, and that empty file blocked
    # every save of the manager that wrote it for the whole lease.
    mnt, filler = full_tmpfs
    caplog.set_level(logging.WARNING, logger="tardigrade")
    d = mnt / "ckpt"
    with tg.CheckpointManager(d, {"x": torch.arange(4.0)}, async_save=False) as mgr:
        assert mgr.save(1) is False  # no space
        assert "No space left" in (mgr.stats[-1].error or "")
        filler.unlink()
        assert mgr.save(2) is True, mgr.stats[-1].error
        assert mgr.steps() == [2]
        assert record(d)["pid"] == os.getpid()
    assert not (mnt / "ckpt" / ".lock").exists()


def test_gc_frees_a_full_disk(full_tmpfs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]):
    # A full disk is when leftovers of interrupted saves matter most; the old lock could not
    # write its record there, so `tardigrade gc` failed instead of removing them.
    mnt, filler = full_tmpfs
    d = mnt / "ckpt"
    filler.unlink()
    leftover = d / f".tmp-step-000000007-{uuid.uuid4().hex}"
    leftover.mkdir()
    with open(leftover / "data-00000-of-00001.safetensors", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
        except OSError as e:
            assert e.errno == errno.ENOSPC
    assert main(["gc", str(d)]) == 0
    assert "removed" in capsys.readouterr().out
    assert not leftover.exists() and not (d / ".lock").exists()
    assert os.statvfs(mnt).f_bavail > 0


# -- 5. fencing ---------------------------------------------------------------------------------

STALLER = textwrap.dedent(
    r"""
    import os, sys
    from tardigrade.storage.local_lease import DirectoryLock
    from tardigrade.errors import CheckpointLockedError

    lock = DirectoryLock(os.path.join(sys.argv[1], ".lock"), lease_seconds=float(sys.argv[2]))
    lock.acquire()
    print(lock.generation, flush=True)
    sys.stdin.readline()  # SIGSTOPped meanwhile: stalled past its lease
    try:
        lock.check()
        print("STILL MINE", flush=True)
    except CheckpointLockedError as e:
        print(f"LOST {e}", flush=True)
    lock.release()
    print("RELEASED", flush=True)
    """
)


def no_flock(fd: int, op: int) -> None:
    raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))


@pytest.mark.crash
def test_a_holder_stalled_past_its_lease_is_fenced_off_after_a_takeover(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    # A holder stalls (SIGSTOP) past its lease, and a job on a machine whose file locks do not
    # reach ours (simulated: flock fails here, as on NFS without a lock manager) takes the
    # directory over. When the old holder wakes up, check() (which the manager calls before it
    # writes or deletes anything) must tell it, and its release must leave the new record.
    d = tmp_path / "ckpt"
    old = subprocess.Popen(
        [sys.executable, "-c", STALLER, str(d), "2.0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert old.stdout is not None and old.stdin is not None
        old_generation = int(old.stdout.readline())
        monkeypatch.setattr(_lock.fcntl, "flock", no_flock)
        new = DirectoryLock(os.path.join(str(d), ".lock"), lease_seconds=30)
        with pytest.raises(CheckpointLockedError, match=f"pid {old.pid}"):
            new.acquire()  # its heartbeat is fresh
        old.send_signal(signal.SIGSTOP)
        time.sleep(2.2)  # past the stalled holder's lease: what is tested is the lease itself
        caplog.set_level(logging.WARNING, logger="tardigrade")
        new.acquire()
        assert new.generation == old_generation + 1
        assert any("heartbeat" in m for m in took_over(caplog))
        old.send_signal(signal.SIGCONT)
        old.stdin.write("go\n")
        old.stdin.flush()
        assert old.stdout.readline().startswith("LOST ")
        assert old.stdout.readline().strip() == "RELEASED"
        assert old.wait(CHILD_TIMEOUT) == 0
        rec = record(d)
        assert (rec["owner"], rec["generation"]) == (new.owner, new.generation)
        new.check()
        new.release()
    finally:
        old.kill()
        old.communicate(timeout=CHILD_TIMEOUT)
    assert not (d / ".lock").exists()


def test_a_holder_whose_lock_file_was_removed_is_fenced_off(tmp_path: Path):
    # Someone removed .lock (by hand, or an old version of this library) and another job made
    # a new one: the old holder's flock is on a file nobody sees any more. check() must say so,
    # and its release must not remove the new holder's file.
    old = DirectoryLock(os.path.join(str(tmp_path), ".lock"), lease_seconds=30)
    old.acquire()
    os.unlink(tmp_path / ".lock")
    new = DirectoryLock(os.path.join(str(tmp_path), ".lock"), lease_seconds=30)
    new.acquire()
    assert new.generation == 1
    with pytest.raises(CheckpointLockedError, match="no longer holds the directory lock"):
        old.check()
    assert not old.held and old.generation is None
    old.release()
    assert record(tmp_path)["owner"] == new.owner
    new.check()
    new.release()


def die(lock: DirectoryLock) -> None:
    """What the kernel does for a holder that dies: its descriptor closes, the flock goes."""
    lock._stop.set()
    assert lock._thread is not None
    lock._thread.join()
    os.close(lock._fd)
    lock._fd, lock.held = -1, False


def test_each_takeover_gets_the_next_generation(tmp_path: Path):
    seen = []
    for _ in range(3):
        lock = DirectoryLock(os.path.join(str(tmp_path), ".lock"), lease_seconds=30)
        lock.acquire()
        seen.append((lock.generation, record(tmp_path)["generation"]))
        die(lock)
    assert seen == [(1, 1), (2, 2), (3, 3)]
    # A clean release removes the file: no holder is left to fence off, so counting restarts
    # (the owner id, unique per lock, is compared together with the generation).
    lock = DirectoryLock(os.path.join(str(tmp_path), ".lock"), lease_seconds=30)
    lock.acquire()
    assert lock.generation == 4
    lock.release()
    lock.acquire()
    assert lock.generation == 1
    lock.release()


# -- 6. release never leaves the lock held -------------------------------------------------------


def test_release_drops_the_lock_even_when_retiring_the_record_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    lock = DirectoryLock(os.path.join(str(tmp_path), ".lock"), lease_seconds=30)
    lock.acquire()

    def refuse(path: Any) -> None:
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(_lock.os, "unlink", refuse)
    caplog.set_level(logging.WARNING, logger="tardigrade")
    lock.release()  # never raises
    lock.release()  # idempotent
    monkeypatch.undo()
    assert not lock.held and lock.generation is None
    assert any("Permission denied" in r.getMessage() for r in caplog.records)
    assert record(tmp_path)["released"] is True  # the file stayed, marked free
    caplog.clear()
    nxt = DirectoryLock(os.path.join(str(tmp_path), ".lock"), lease_seconds=30)
    nxt.acquire()  # at once, and without a takeover
    assert took_over(caplog) == []
    nxt.release()


def test_release_drops_the_lock_when_interrupted_half_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    lock = DirectoryLock(os.path.join(str(tmp_path), ".lock"), lease_seconds=30)
    lock.acquire()

    def interrupt(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(lock, "_retire", interrupt)
    with pytest.raises(KeyboardInterrupt):
        lock.release()
    assert not lock.held
    nxt = DirectoryLock(os.path.join(str(tmp_path), ".lock"), lease_seconds=30)
    nxt.acquire()  # the flock went with the interrupted release
    nxt.release()
