"""One writer per checkpoint directory: ``DIR/.lock``, a kernel file lock plus a lease record.

Who may write is decided by the kernel. The holder keeps an exclusive ``flock`` on ``.lock``
for its whole tenure: taking it is atomic (no contender can act on a lock another one has just
taken, which renaming a stale lock file by its path could), it works between processes in
different PID namespaces (containers sharing the file system and the host name), and the kernel
drops it the moment the holder dies, SIGKILL included, so a dead writer on this machine never
blocks the next job.

Inside the file is a record: owner id, generation, host, pid (and PID namespace), boot id,
heartbeat time, lease, whether its holder has the flock, and a ``released`` flag. The holder rewrites it in place through its own descriptor every
``lease / 3`` seconds; nobody replaces it by path, and only a holder (under its flock, when the
record is still its own) removes the file. The record covers what the flock cannot:

- A holder on another kernel (another host, or a VM on a network file system whose locks may
  not reach us) is known only by its heartbeat: a record from another boot id with a fresh
  heartbeat is respected until its lease expires. A record from this kernel proves nothing
  once its flock is free: its writer is gone, whatever its pid (pids say nothing across PID
  namespaces, and are reused).
- Fencing: each tenure gets a generation one above its predecessor's; ``check()`` verifies
  that the record still names our owner and generation before the manager deletes anything.
- An empty or unparseable record under a free flock is debris (a write that failed on a full
  disk, a crash mid-write), not an owner: it never blocks anyone.

A holder that cannot write its record (full disk) keeps the flock, warns, and writes the record
at the next heartbeat. Forked children (DataLoader workers) close their copy of the descriptor,
so a worker that outlives its parent does not keep the lock. Where the file system refuses
flock (NFS without a lock manager) the lock falls back to the lease record alone.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
import weakref
from typing import Any

from ..errors import CheckpointLockedError
from .lease import BOOT_ID, PID_NAMESPACE, Lease, Takeover, _pid_alive, local_pid

__all__ = [
    "DirectoryLock",
]

log = logging.getLogger("tardigrade")

# Records are padded to whole blocks: after the first write a heartbeat rewrites bytes the file
# already owns, so it needs no new space on a full disk, and a reader never sees a shorter tail.
_BLOCK = 512
_MAX_RECORD = 64 * 1024
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _parse(data: bytes) -> dict[str, Any] | None:
    """The record in ``data``, or None when it is empty or not a record at all."""
    try:
        rec = json.loads(data)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or absurdly nested
        return None
    return rec if isinstance(rec, dict) else None


def _pread(fd: int) -> bytes:
    return os.pread(fd, _MAX_RECORD, 0)


def _same_file(fd: int, path: str) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (a lock on a removed file is void)."""
    st = os.fstat(fd)
    try:
        at = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return st.st_nlink > 0 and (st.st_dev, st.st_ino) == (at.st_dev, at.st_ino)


# Locks held by this process: a forked child must drop its inherited copies (see below).
_HELD: weakref.WeakSet[DirectoryLock] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for lock in list(_HELD):
        lock._forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


class DirectoryLock(Lease):
    """Exclusive ownership of a checkpoint directory while a manager writes into it (POSIX).

    ``generation`` is the fencing token of the current tenure (None while not held).
    """

    def __init__(self, path: str, *, lease_seconds: float = 30.0) -> None:
        """The lease kept in the file ``path`` (in the directory it guards)."""
        self.directory = os.path.dirname(path)
        self.path = path
        self.lease = lease_seconds
        self.owner = uuid.uuid4().hex
        self.generation: int | None = None
        self.held = False
        self._fd = -1
        self._flocked = False  # False where the file system has no flock: lease only
        self._unwritten = False  # our record could not be written yet (full disk)
        self._mutex = threading.Lock()  # guards _fd and the record against the heartbeat
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the record ----------------------------------------------------------------------------

    def _record(self, *, released: bool = False) -> bytes:
        data = json.dumps(
            {
                "owner": self.owner,
                "generation": self.generation,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "pid_namespace": PID_NAMESPACE,
                "boot_id": BOOT_ID,
                "heartbeat": time.time(),
                "lease_seconds": self.lease,
                "flock": self._flocked,
                "released": released,
            }
        ).encode()
        return data.ljust(-(-(len(data) + 1) // _BLOCK) * _BLOCK - 1) + b"\n"

    def _write(self, held: int, data: bytes, *, sync: bool = True) -> None:
        """Rewrite the record of the lock file open as ``held``.

        The holder keeps only a read-only descriptor (enough for flock) and opens the file for
        writing just for the write: a file held open for writing would keep its file system
        from being remounted read-only for as long as a training job runs.
        """
        fd = os.open(self.path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            now, ours = os.fstat(fd), os.fstat(held)
            if (now.st_dev, now.st_ino) != (ours.st_dev, ours.st_ino):
                raise FileNotFoundError(errno.ENOENT, "the lock file was replaced", self.path)
            done = 0
            while done < len(data):
                done += os.pwrite(fd, data[done:], done)
            if now.st_size != len(data):
                os.ftruncate(fd, len(data))
            if sync:
                os.fsync(fd)  # another host reads the file through the server, not our cache
        finally:
            os.close(fd)

    def _publish(self) -> None:
        """Write our record; on a full disk keep the lock and try again at the next heartbeat."""
        try:
            self._write(self._fd, self._record())
        except OSError as e:
            if e.errno not in _DISK_FULL:
                raise
            if not self._unwritten:
                log.warning(
                    "tardigrade: cannot write the lock record %s (%s); this job still holds "
                    "the lock and writes the record once there is space.",
                    self.path,
                    e.strerror,
                )
            self._unwritten = True
            return
        if self._unwritten:
            log.info("tardigrade: lock record %s written after an earlier failure", self.path)
        self._unwritten = False

    def _ours(self, rec: dict[str, Any] | None) -> bool:
        return (
            rec is not None
            and rec.get("owner") == self.owner
            and rec.get("generation") == self.generation
        )

    def read(self) -> dict[str, Any] | None:
        """The record at the path (None when there is no lock file, {} when unreadable)."""
        try:
            with open(self.path, "rb") as f:
                rec = _parse(f.read(_MAX_RECORD))
        except FileNotFoundError:
            return None
        except OSError:
            return {}
        return {} if rec is None else rec

    # -- taking the lock -----------------------------------------------------------------------

    def acquire(self) -> None:
        """Take the lock, or raise CheckpointLockedError naming the live owner.

        Filesystem problems raise OSError (the directory cannot be created, the lock file
        cannot be opened). A full disk does not: the lock is held and its record written later.
        """
        if self.held:
            return
        os.makedirs(self.directory, exist_ok=True)
        for _ in range(100):
            fd = os.open(self.path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            self._fd = fd  # from here on a fork closes the child's copy (see _forget_after_fork)
            _HELD.add(self)
            try:
                flocked = self._flock(fd)
                if flocked and not _same_file(fd, self.path):
                    # Its holder removed it on release after we opened it: the lock that
                    # counts is the file at the path now, so compete for that one.
                    self._lose()
                    continue
                self._take(fd, flocked)
            except BaseException:
                self._lose()  # closes the file, which drops the flock
                raise
            return
        raise CheckpointLockedError(
            f"{self.directory}: could not take the lock: its lock file kept being replaced. "
            "Check that no other program removes .lock files here, then try again."
        )

    def _flock(self, fd: int) -> bool:
        """Take the flock on ``fd`` (False: this file system has none), or raise if it is held."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise self._locked(_parse(_pread(fd)), held_now=True) from None
        except OSError as e:
            if e.errno not in _NO_FLOCK:
                raise
            log.warning(
                "tardigrade: the file system of %s does not support file locks (%s); only the "
                "lease record keeps a second job out.",
                self.directory,
                e.strerror,
            )
            return False
        return True

    def _take(self, fd: int, flocked: bool) -> None:
        rec = _parse(_pread(fd))
        taken = self._takeover_reason(fd, rec, flocked)
        prev = rec.get("generation") if rec is not None else None
        ok = isinstance(prev, int) and not isinstance(prev, bool) and prev >= 0
        with self._mutex:
            self.generation = prev + 1 if ok and isinstance(prev, int) else 1
            may_live = taken is not None and taken.may_live
            self.superseded = (prev if ok else 0) if may_live else None
            self._flocked, self.held, self._unwritten = flocked, True, False
            self._publish()
            if not flocked and not self._ours(_parse(_pread(fd))):
                raise self._locked(_parse(_pread(fd)), held_now=False)  # someone else won
        if taken is not None:
            log.warning("tardigrade: took over the lock of %s: %s", self.directory, taken.why)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat, name="tardigrade-lock", daemon=True)
        self._thread.start()

    def _takeover_reason(
        self, fd: int, rec: dict[str, Any] | None, flocked: bool
    ) -> Takeover | None:
        """Why the previous holder's record does not stop us (None: nothing to take over).

        Raises CheckpointLockedError while it may still be alive.
        """
        if rec is None:
            if flocked:
                # No live holder on this kernel (it would hold the flock), and a record that
                # names no kernel cannot be a holder elsewhere: debris of a failed write.
                if os.fstat(fd).st_size:
                    return Takeover(
                        "its record was unreadable and no process holds the lock", False
                    )
                return None
            rec = {}  # lease only: judge an unreadable record by the file's age below
        if rec.get("released") is True or rec.get("owner") == self.owner:
            return None
        pid = rec.get("pid")
        if (
            flocked
            and BOOT_ID is not None
            and rec.get("boot_id") == BOOT_ID
            and rec.get("flock") is True
        ):
            # Same kernel: its holder would still hold the flock. A pid proves nothing here
            # (another PID namespace, or reused), so it is not consulted.
            return Takeover(f"its owner (pid {pid}) has exited", may_live=False)
        here = local_pid(rec)
        if not flocked and here is not None and here != os.getpid() and not _pid_alive(here):
            return Takeover(f"its owner (pid {pid}) has exited", may_live=False)
        beat = _number(rec.get("heartbeat"))
        age = time.time() - (os.fstat(fd).st_mtime if beat is None else beat)
        lease = self._lease_of(rec)
        if age > lease:
            # Judged by its heartbeat alone: it may be stalled, not dead (see Lease.superseded).
            return Takeover(f"its heartbeat is {age:.0f} s old (lease {lease:.0f} s)", True)
        raise self._locked(rec, held_now=False)

    def _lease_of(self, rec: dict[str, Any] | None) -> float:
        lease = _number(rec.get("lease_seconds")) if rec is not None else None
        return lease if lease is not None and lease > 0 else self.lease

    def _locked(self, rec: dict[str, Any] | None, *, held_now: bool) -> CheckpointLockedError:
        if rec is None:
            who = "owner unknown: its lock record is empty, it may be starting or its disk full"
        else:
            pid = f"pid {rec.get('pid')}"
            if rec.get("boot_id") == BOOT_ID and rec.get("pid_namespace") != PID_NAMESPACE:
                pid += " in another PID namespace (a container?)"
            beat = _number(rec.get("heartbeat"))
            ago = f"{time.time() - beat:.0f} s ago" if beat is not None else "never"
            who = f"owner host {rec.get('host')!r}, {pid}, heartbeat {ago}"
        if held_now:
            what = (
                "Stop it or use another directory; it holds the lock now, and the lock is free "
                "the moment that process exits."
            )
        else:
            what = (
                f"Stop it, use another directory, or wait {self._lease_of(rec):.0f} s after it "
                "dies (its lease: only its heartbeat shows whether it lives)."
            )
        err = CheckpointLockedError(
            f"{self.directory}: another job is writing checkpoints here ({who}). {what}"
        )
        err.alive = held_now  # its flock, held: a live process on this kernel
        return err

    # -- holding it ----------------------------------------------------------------------------

    def check(self) -> None:
        """Raise CheckpointLockedError unless we still hold the lock (fencing before deletes)."""
        with self._mutex:
            if self.held and self._still_ours():
                return
            self._lose()
        raise CheckpointLockedError(
            f"{self.directory}: this manager no longer holds the directory lock (another job "
            "took it over, probably after this process stalled past the lease, or its lock "
            "file was removed). Nothing more is written or deleted here by this manager."
        )

    def _still_ours(self) -> bool:
        """With the mutex held: is the file at the path still ours, with our record in it?"""
        if not _same_file(self._fd, self.path):
            return False
        rec = _parse(_pread(self._fd))
        if rec is None and self._unwritten:
            self._publish()  # the disk may have room again
            return self._flocked or not self._unwritten
        return self._ours(rec)

    def _lose(self) -> None:
        """Close our descriptor (dropping any flock) and leave the file alone.

        For a lock taken from us, or one we failed to take; the caller holds the mutex, or no
        heartbeat runs yet.
        """
        fd, self._fd = self._fd, -1
        self.held, self.generation = False, None
        _HELD.discard(self)
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass

    def _heartbeat(self) -> None:
        stop = self._stop
        while not stop.wait(self.lease / 3):
            with self._mutex:
                if not self.held:
                    return
                try:
                    if not self._still_ours():
                        log.error(
                            "tardigrade: lost the lock of %s: another job took it over",
                            self.directory,
                        )
                        self._lose()
                        return
                    self._publish()
                except OSError as e:
                    log.warning("tardigrade: lock heartbeat for %s failed: %s", self.directory, e)

    def _forget_after_fork(self) -> None:
        # A forked child shares our open file description, hence our flock: keeping it would
        # let a DataLoader worker that outlives us hold the lock, and an unlock or a release in
        # the child would drop or retire the parent's. The child closes its copy and holds
        # nothing (the parent's heartbeat thread does not exist here).
        if self._fd >= 0:
            try:
                os.close(self._fd)
            except OSError:
                pass
        self._fd, self.held, self.generation, self._thread = -1, False, None, None
        self._mutex = threading.Lock()
        self._stop = threading.Event()

    # -- letting go ----------------------------------------------------------------------------

    def release(self) -> None:
        """Give the lock up; idempotent and never raises. The flock is dropped whatever fails."""
        self._stop.set()
        thread, self._thread = self._thread, None
        try:
            if thread is not None and thread is not threading.current_thread():
                thread.join()
        finally:
            with self._mutex:
                fd, self._fd = self._fd, -1
                held, self.held = self.held, False
                _HELD.discard(self)
                try:
                    if fd >= 0 and held:
                        self._retire(fd)
                except Exception as e:  # release must not raise
                    log.warning("tardigrade: releasing the lock of %s: %s", self.directory, e)
                finally:
                    self.generation = None
                    if fd >= 0:
                        try:
                            os.close(fd)  # drops the flock
                        except OSError:
                            pass

    def _retire(self, fd: int) -> None:
        """Mark our record released and remove the file, if it is still ours."""
        if not _same_file(fd, self.path):
            return
        rec = _parse(_pread(fd))
        if not (self._ours(rec) or (rec is None and self._unwritten)):
            return  # taken over: the record belongs to someone else now
        # Released first: if the unlink fails, or a host whose locks do not reach us reads the
        # file meanwhile, the record says it is free. Removing it while we still hold the flock
        # is safe: a contender that opened it meanwhile finds it gone after its flock, and
        # competes for the file at the path instead.
        try:
            self._write(fd, self._record(released=True), sync=False)
        except OSError:
            pass
        os.unlink(self.path)
