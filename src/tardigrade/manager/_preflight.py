"""Pre-flight: the manager's directory checked and locked before anything is saved there.

A directory that can never hold a checkpoint (read-only, permission denied, a file in the way)
raises at once, whatever ``on_save_error`` says; one only failing now (the lock cannot be
created) fails the saves until it works, or raises at once with ``on_save_error="raise"``.
The lock is also what fences deletes: nothing is removed unless it is still this manager's.
"""

from __future__ import annotations

import logging
import time

from .._catalog import Catalog
from ..errors import CheckpointLockedError, SaveError
from ..storage.lease import Lease
from ._options import check_non_negative

log = logging.getLogger("tardigrade")


class RunLock:
    """One job per checkpoint root (a directory or a store prefix): the lease on its storage,
    taken at open and before each save, and checked before anything there is deleted."""

    def __init__(
        self, catalog: Catalog, directory: str, *, lease_seconds: float, timeout: float | None
    ) -> None:
        self.catalog = catalog
        self.storage = catalog.storage
        self.directory = directory
        self.lease: Lease = catalog.lease(lease_seconds=lease_seconds)
        self.lease_seconds = lease_seconds
        # How long opening waits for a holder that may be dead (default: one lease, by when a
        # dead holder's lease has expired).
        timeout = check_non_negative("lock_timeout", timeout)
        self.timeout = lease_seconds * 1.1 if timeout is None else timeout
        self.error: OSError | None = None  # why the lease could not be taken, until it is

    def open(self, *, raising: bool) -> None:
        """Check that the directory can hold checkpoints, then take the lease: waiting up to
        ``timeout`` for a holder that may be dead (on another machine; one on this machine
        that died is taken over at once), never for one known to live."""
        self.storage.preflight()
        deadline = time.monotonic() + self.timeout
        said = False
        while True:
            try:
                self.take(raising=raising)
                return
            except CheckpointLockedError as e:
                left = deadline - time.monotonic()
                if e.alive or left <= 0:
                    raise
                if not said:
                    log.warning(
                        "tardigrade: waiting up to %.0f s (lock_timeout) for the lock of %s: %s",
                        left,
                        self.directory,
                        e,
                    )
                    said = True
                time.sleep(min(left, max(0.05, self.lease_seconds / 10)))

    def take(self, *, raising: bool) -> bool:
        """Take the lease; False when storage failed to (logged, or raised with ``raising``).

        ``CheckpointLockedError`` (another job holds it) is always raised.
        """
        try:
            self.lease.acquire()
            if self.lease.superseded is not None:
                self._fence()
            self.error = None
            return True
        except CheckpointLockedError:
            raise
        except OSError as e:
            self.error = e
            if raising:
                raise SaveError(f"{self.directory}: cannot create or lock it: {e}") from e
            log.error(
                "tardigrade: cannot create or lock checkpoint directory %s: %s. Training "
                "continues but checkpoints will FAIL until this is fixed.",
                self.directory,
                e,
            )
            return False

    def _fence(self) -> None:
        """The lease was taken from a holder that may only be stalled: fence the commits it
        may still make (``Catalog.fence``) before anything of this tenure is saved."""
        generation = self.lease.generation
        assert generation is not None
        try:
            self.catalog.fence(generation)
        except BaseException:
            self.lease.release()  # unfenced, this tenure could not tell its checkpoints apart
            raise
        log.warning(
            "tardigrade: %s: the previous writer (lease generation %d) lost its lease without "
            "releasing it and may still be running: a checkpoint it commits from now on is "
            "ignored (fenced) and removed",
            self.directory,
            self.lease.superseded,
        )

    def ready(self, *, raising: bool) -> None:
        """Before a save: hold the lease (taken now if opening could not), still ours."""
        if not self.lease.held and not self.take(raising=raising):
            raise SaveError(
                f"{self.directory}: the checkpoint directory cannot be created or locked: "
                f"{self.error}"
            )
        self.lease.check()

    def may_delete(self, what: str) -> bool:
        """Whether ``what`` (a delete) may go ahead: the lease held by this manager, still."""
        return self.lease.held and self.still_ours(what)

    def still_ours(self, what: str) -> bool:
        """Fencing: whether ``what`` (a delete) may go ahead, the lease being still ours."""
        try:
            self.lease.check()
        except CheckpointLockedError as e:
            log.error("tardigrade: not %s in %s: %s", what, self.directory, e)
            return False
        except OSError as e:
            # The lease record cannot be read now: ownership is not proved, so nothing is
            # deleted this time; the next check may succeed.
            log.warning("tardigrade: not %s in %s now: %s", what, self.directory, e)
            return False
        return True
