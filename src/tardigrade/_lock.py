"""One writer per checkpoint directory: a lock file with a heartbeat lease.

The lock is ``DIR/.lock``, a small JSON record (owner id, host, pid, heartbeat time, lease).
It is created with O_EXCL; a holder refreshes the heartbeat every ``lease / 3`` seconds. A lock
is stale when its heartbeat is older than the lease, or when its owner was on this host and
that process no longer exists; a stale lock is taken over by renaming it aside first, which
only one contender can do.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

from .errors import CheckpointLockedError

log = logging.getLogger("tardigrade")
LOCK = ".lock"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class DirectoryLock:
    """Exclusive ownership of a checkpoint directory while a manager writes into it."""

    def __init__(self, directory: str, *, lease_seconds: float = 30.0) -> None:
        self.directory = directory
        self.path = os.path.join(directory, LOCK)
        self.lease = lease_seconds
        self.owner = uuid.uuid4().hex
        self.held = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self) -> bytes:
        return json.dumps(
            {
                "owner": self.owner,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "heartbeat": time.time(),
                "lease_seconds": self.lease,
            }
        ).encode()

    def read(self) -> dict[str, Any] | None:
        try:
            with open(self.path, "rb") as f:
                rec = json.loads(f.read(4096) or b"{}")
            return rec if isinstance(rec, dict) else {}
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # unreadable or half-written: judged by its mtime below

    def _stale(self, rec: dict[str, Any]) -> str | None:
        """Why the lock in ``rec`` may be taken over, or None while its owner is alive."""
        now = time.time()
        beat = rec.get("heartbeat")
        if not isinstance(beat, (int, float)):
            try:
                beat = os.stat(self.path).st_mtime
            except FileNotFoundError:
                return "it disappeared"
        lease = rec.get("lease_seconds", self.lease)
        lease = lease if isinstance(lease, (int, float)) else self.lease
        if now - beat > lease:
            return f"its heartbeat is {now - beat:.0f} s old (lease {lease:.0f} s)"
        pid = rec.get("pid")
        same_host = rec.get("host") == socket.gethostname()
        if same_host and isinstance(pid, int) and pid != os.getpid() and not _pid_alive(pid):
            return f"its owner pid {pid} on this host has exited"
        return None

    def acquire(self) -> None:
        """Take the lock or raise CheckpointLockedError naming the live owner."""
        os.makedirs(self.directory, exist_ok=True)
        for _ in range(10):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                rec = self.read()
                if rec is None:
                    continue
                why = self._stale(rec)
                if why is None:
                    raise CheckpointLockedError(
                        f"{self.directory}: another job is writing checkpoints here (owner "
                        f"host {rec.get('host')!r}, pid {rec.get('pid')}, heartbeat "
                        f"{time.time() - float(rec.get('heartbeat', 0)):.0f} s ago). Stop it, "
                        f"use another directory, or wait {self.lease:.0f} s after it dies."
                    ) from None
                aside = f"{self.path}.stale-{self.owner}"
                try:
                    os.rename(self.path, aside)
                except FileNotFoundError:
                    continue  # someone else took it over first; compete again
                os.unlink(aside)
                log.warning("tardigrade: took over the lock of %s: %s", self.directory, why)
                continue
            try:
                os.write(fd, self._record())
                os.fsync(fd)
            finally:
                os.close(fd)
            self.held = True
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._heartbeat, name="tardigrade-lock", daemon=True
            )
            self._thread.start()
            return
        raise CheckpointLockedError(f"{self.directory}: could not take the lock (contended)")

    def check(self) -> None:
        """Raise if another process has taken the lock from us (e.g. after a long stall)."""
        rec = self.read()
        if not self.held or rec is None or rec.get("owner") != self.owner:
            self.held = False
            raise CheckpointLockedError(
                f"{self.directory}: this manager no longer holds the directory lock (another "
                "job took it over, probably after this process stalled past the lease)."
            )

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.lease / 3):
            try:
                rec = self.read()
                if rec is None or rec.get("owner") != self.owner:
                    self.held = False
                    return
                tmp = f"{self.path}.{self.owner}"
                with open(tmp, "wb") as f:
                    f.write(self._record())
                os.replace(tmp, self.path)
            except OSError as e:
                log.warning("tardigrade: lock heartbeat for %s failed: %s", self.directory, e)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.held:
            rec = self.read()
            if rec is not None and rec.get("owner") == self.owner:
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass
            self.held = False
