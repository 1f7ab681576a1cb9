"""Pre-flight: the manager's directory checked and locked before anything is saved there.

A directory that can never hold a checkpoint (read-only, permission denied, a file in the way)
raises at once, whatever ``on_save_error`` says; one only failing now (the lock cannot be
created) fails the saves until it works, or raises at once with ``on_save_error="raise"``.
The lock is also what fences deletes: nothing is removed unless it is still this manager's.
"""

from __future__ import annotations

import logging

from ..errors import CheckpointLockedError, SaveError
from ..storage import Storage

log = logging.getLogger("tardigrade")


class DirectoryLock:
    """One job per directory: the lease on ``storage``, taken at open and before each save."""

    def __init__(self, storage: Storage, directory: str, *, lease_seconds: float) -> None:
        self.storage = storage
        self.directory = directory
        self.lease = storage.lease(lease_seconds=lease_seconds)
        self.error: OSError | None = None  # why the lease could not be taken, until it is

    def open(self, *, raising: bool) -> None:
        """Check that the directory can hold checkpoints, then take the lease (``take``)."""
        self.storage.preflight()
        self.take(raising=raising)

    def take(self, *, raising: bool) -> bool:
        """Take the lease; False when storage failed to (logged, or raised with ``raising``).

        ``CheckpointLockedError`` (another job holds it) is always raised.
        """
        try:
            self.lease.acquire()
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

    def ready(self, *, raising: bool) -> None:
        """Before a save: hold the lease (taken now if opening could not), still ours."""
        if not self.lease.held and not self.take(raising=raising):
            raise SaveError(
                f"{self.directory}: the checkpoint directory cannot be created or locked: "
                f"{self.error}"
            )
        self.lease.check()

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
