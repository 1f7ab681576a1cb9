"""The one-writer rule as a lease: who may write and delete checkpoints in a directory.

A :class:`Lease` is taken by ``acquire()`` (or CheckpointLockedError names the live holder),
proved by ``check()`` before anything is deleted (fencing: it raises once someone else took it),
kept alive by a heartbeat while held, and given up by ``release()`` (idempotent, never raises).
Each tenure has a ``generation`` one above its predecessor's.

Two implementations, chosen by the backend (``Storage.lease``): ``DirectoryLock``
(``local_lease.py``: a kernel ``flock`` plus a lease record, for POSIX directories) and
:class:`ObjectLease` here, for stores: a small record object written only with conditional
puts, so of two contenders exactly one takes it, and a holder that lost it finds out at its
next heartbeat or ``check()``. Holders on other machines are judged by their heartbeat, so
clocks are assumed to agree to well within the lease (30 s by default).
"""

from __future__ import annotations

import abc
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, NamedTuple

from ..errors import CheckpointLockedError, CorruptCheckpointError, StorageError
from .base import PreconditionFailed

if TYPE_CHECKING:
    from .base import Storage

__all__ = [
    "BOOT_ID",
    "PID_NAMESPACE",
    "Lease",
    "ObjectLease",
    "Takeover",
    "local_pid",
]

log = logging.getLogger("tardigrade")

_MAX_RECORD = 64 * 1024
# Puts a release tries before leaving the record to expire.
_RELEASE_TRIES = 3


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip() or None
    except (OSError, ValueError):
        return None


def _pid_namespace() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


# The kernel we run on: two processes with the same boot id share one kernel (hence one flock
# table), whatever their PID namespaces or host names; a pid means something only within one
# kernel and one PID namespace.
BOOT_ID = _read_text("/proc/sys/kernel/random/boot_id")
PID_NAMESPACE = _pid_namespace()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Takeover(NamedTuple):
    """Why a lease record does not stop a new holder, and whether its holder may still live
    (stalled past its lease, not known gone): then it may yet commit what it began."""

    why: str
    may_live: bool


# Owners (of this process) whose release could not be written: their records read as held, but
# this process knows they were let go, so its next holder need not wait for them to expire.
_let_go: set[str] = set()


def local_pid(rec: dict[str, Any]) -> int | None:
    """The pid a lease record names, when it names a process of this kernel and this PID
    namespace (where a pid means something here), else None."""
    pid = rec.get("pid")
    if (
        BOOT_ID is None
        or rec.get("boot_id") != BOOT_ID
        or rec.get("pid_namespace") != PID_NAMESPACE
        or type(pid) is not int
        or pid <= 0
    ):
        return None
    return pid


def _this_process(rec: dict[str, Any]) -> bool:
    """Whether a record names this very process (another manager of ours holds the lease:
    waiting for it cannot help). Another live process may yet stall past its lease, or exit."""
    return local_pid(rec) == os.getpid()


class Lease(abc.ABC):
    """Exclusive ownership of a checkpoint directory while a manager writes into it."""

    held: bool
    generation: int | None
    lease: float  # seconds a holder keeps it without a heartbeat
    # The generation of the holder this one took the lease from while that holder may still
    # live (its heartbeat expired: a stalled process, a partitioned machine), else None. Such a
    # holder may still commit a save it had begun: the catalog fences those (Catalog.fence).
    superseded: int | None = None

    @abc.abstractmethod
    def acquire(self) -> None:
        """Take the lease, or raise CheckpointLockedError naming the live holder."""

    @abc.abstractmethod
    def check(self) -> None:
        """Raise CheckpointLockedError unless this holder still has the lease."""

    @abc.abstractmethod
    def release(self) -> None:
        """Give the lease up; idempotent and never raises."""

    @abc.abstractmethod
    def read(self) -> dict[str, Any] | None:
        """The current record (None when nobody holds or held it, {} when unreadable)."""


class ObjectLease(Lease):
    """A lease record object (``.lock``) under a store root, changed only conditionally."""

    def __init__(self, storage: Storage, name: str, *, lease_seconds: float = 30.0) -> None:
        """The lease of ``storage``'s root, kept in its object ``name``."""
        self.storage = storage
        self.name = name
        self.lease = lease_seconds
        self.owner = uuid.uuid4().hex
        self.generation: int | None = None
        self.held = False
        self._version: str | None = None  # the record's version we last wrote
        self._mutex = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return self.storage.url(self.name)

    def _record(self, *, released: bool = False) -> bytes:
        return json.dumps(
            {
                "owner": self.owner,
                "generation": self.generation,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "pid_namespace": PID_NAMESPACE,
                "boot_id": BOOT_ID,
                "heartbeat": time.time(),
                "lease_seconds": self.lease,
                "released": released,
            }
        ).encode()

    def _read(self) -> tuple[dict[str, Any] | None, str | None]:
        """(record, version): (None, None) when there is none, ({}, version) when its bytes
        are not a record. A failure to read it raises StorageError: a record that could not be
        read says nothing about its holder, who may be alive (taking the lease over on a
        transient read error would make two writers)."""
        st = self.storage.stat(self.name)
        if st is None:
            return None, None
        try:
            raw = self.storage.read_bytes(self.name, _MAX_RECORD)
        except CorruptCheckpointError:
            return {}, st.version  # larger than any record, or gone since the stat
        try:
            rec = json.loads(raw)
        except ValueError:
            return {}, st.version
        if not isinstance(rec, dict):
            return {}, st.version
        # The version stated before the bytes were read: a put conditional on it fails if
        # the record changed since, whichever bytes were read. (A version stated after the
        # read could name a newer record, another contender's, and a put on it would
        # overwrite that record with a decision taken on the old one: two holders.)
        return rec, st.version

    def read(self) -> dict[str, Any] | None:
        return self._read()[0]

    def acquire(self) -> None:
        if self.held:
            return
        rec, version = self._read()
        taken = None
        if rec is not None:
            taken = self._free(rec)
            if taken is None:
                raise self._locked(rec)
        previous = rec.get("generation") if rec else None
        previous = previous if type(previous) is int and previous >= 0 else 0
        self.generation = previous + 1
        self.superseded = previous if taken is not None and taken.may_live else None
        try:
            if version is None:
                self._version = self.storage.put(self.name, self._record(), mode="create")
            else:
                self._version = self.storage.put(
                    self.name, self._record(), mode="if_match", expect=version
                )
        except PreconditionFailed:
            self.generation = None
            raise self._locked(self.read()) from None
        except StorageError as e:
            # The put may have taken effect with its reply lost (a store's request that timed
            # out): then the record is ours and so is the lease.
            if not self._adopt():
                _let_go.add(self.owner)  # if it did take effect later, this process let go
                self.generation = None
                raise
            log.warning(
                "tardigrade: taking the lease of %s failed (%s), but it had taken effect: the "
                "lease is held",
                self.url,
                e,
            )
        if taken is not None and taken.why:
            log.warning("tardigrade: took over the lease of %s: %s", self.url, taken.why)
        if rec:
            _let_go.discard(str(rec.get("owner")))
        self.held = True
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._heartbeat, name="tardigrade-lease", daemon=True
        )
        self._thread.start()

    def _free(self, rec: dict[str, Any]) -> Takeover | None:
        """Why the lease in ``rec`` may be taken (released, expired, unreadable), or None."""
        if not rec:
            return Takeover("its record was unreadable", may_live=True)
        if rec.get("released") is True:
            return Takeover("", may_live=False)
        if rec.get("owner") in _let_go:
            return Takeover("this process released it, but could not record that", False)
        pid = local_pid(rec)
        if pid is not None and pid != os.getpid() and not _pid_alive(pid):
            # Its holder ran on this kernel, in this PID namespace, and is gone (a crash a
            # restarter follows at once): nothing of it can still write. A pid reused since
            # reads as alive, and then the lease is waited out as for any other holder.
            return Takeover(f"its owner (pid {pid} on this machine) has exited", may_live=False)
        beat, lease = rec.get("heartbeat"), rec.get("lease_seconds")
        if not isinstance(beat, (int, float)) or not isinstance(lease, (int, float)):
            return Takeover("its record had no heartbeat", may_live=True)
        if time.time() - beat > lease:
            age = time.time() - beat
            return Takeover(f"its holder's heartbeat is {age:.0f} s old (lease {lease} s)", True)
        return None

    def _locked(self, rec: dict[str, Any] | None) -> CheckpointLockedError:
        who = "owner unknown"
        wait = self.lease
        if rec:
            beat = rec.get("heartbeat")
            ago = f"{time.time() - beat:.0f} s ago" if isinstance(beat, (int, float)) else "never"
            who = f"owner host {rec.get('host')!r}, pid {rec.get('pid')}, heartbeat {ago}"
            lease = rec.get("lease_seconds")
            wait = lease if isinstance(lease, (int, float)) else wait
        err = CheckpointLockedError(
            f"{self.storage.root}: another job is writing checkpoints here ({who}). Stop it, "
            f"use another location, or wait {wait:.0f} s after it dies (its lease)."
        )
        err.alive = rec is not None and bool(rec) and _this_process(rec)
        return err

    def _ours(self) -> bool:
        """Whether the record is still this holder's (owner and generation): a takeover
        writes another owner. A version other than the one we last wrote is adopted: one of
        our own puts whose reply was lost."""
        rec, version = self._read()
        if (
            rec is None
            or rec.get("owner") != self.owner
            or rec.get("generation") != self.generation
        ):
            return False
        self._version = version
        return True

    def _adopt(self) -> bool:
        """After a put of ours failed: whether it took effect nonetheless (then the record is
        ours, and its version is adopted). False also when the record cannot be read."""
        try:
            return self._ours()
        except StorageError:
            return False

    def check(self) -> None:
        """Raise CheckpointLockedError unless this holder still has the lease; StorageError
        when the record cannot be read now (the lease is not proved, nor given up)."""
        with self._mutex:
            if self.held and self._ours():
                return
            self.held, self.generation = False, None
        raise CheckpointLockedError(
            f"{self.storage.root}: this manager no longer holds the lease (another job took "
            "it over, probably after this process stalled past the lease). Nothing more is "
            "written or deleted here by this manager."
        )

    def _heartbeat(self) -> None:
        stop = self._stop
        while not stop.wait(self.lease / 3):
            with self._mutex:
                if not self.held:
                    return
                try:
                    self._version = self.storage.put(
                        self.name, self._record(), mode="if_match", expect=self._version
                    )
                except PreconditionFailed:
                    if self._adopt():
                        continue  # an earlier beat took effect, its reply lost: still ours
                    log.error("tardigrade: lost the lease of %s: another job took it", self.url)
                    self.held, self.generation = False, None
                    return
                except StorageError as e:
                    log.warning("tardigrade: lease heartbeat for %s failed: %s", self.url, e)

    def release(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._mutex:
            if not self.held:
                return
            self.held = False
            try:
                # A store's request fails now and then: the next one usually works, and a
                # record left unreleased blocks the next job for the whole lease.
                for attempt in range(1, _RELEASE_TRIES + 1):
                    try:
                        self.storage.put(
                            self.name,
                            self._record(released=True),
                            mode="if_match",
                            expect=self._version,
                        )
                        return
                    except PreconditionFailed as e:
                        log.warning("tardigrade: releasing the lease of %s: %s", self.url, e)
                        return
                    except StorageError as e:
                        left = "trying again"
                        if attempt == _RELEASE_TRIES:
                            _let_go.add(self.owner)
                            left = (
                                "the next holder in this process takes it over; elsewhere it "
                                f"expires {self.lease:.0f} s after its last heartbeat"
                            )
                        log.warning(
                            "tardigrade: releasing the lease of %s: %s (%s)", self.url, e, left
                        )
            finally:
                self.generation = None
