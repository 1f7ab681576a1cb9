"""The ``CheckpointManager`` facade: its public calls, over this package's collaborators.

Restore with fallback, save dispatch and set-aside, and uploads live here; the decisions (save
policy, retention, agreement between ranks, ...) are made by the collaborators that the package
docstring lists.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import nullcontext
from typing import Any

from .._async import AsyncCheckpointer, StagingReservation
from .._catalog import (
    ABANDONED,
    ABANDONED_NAME,
    ABANDONED_RECORD,
    INCOMPLETE,
    Catalog,
    step_in_name,
    step_name,
)
from .._load import load
from .._match import Key
from .._open import open_manifest
from .._ramtier import RamTier, RamTierStats, open_ram_tier
from .._save import save_with
from .._save_job import SaveOptions, SaveResult
from .._tiers import Uploader, UploadStats, warn_of_another_run
from ..distributed._collectives import DEFAULT_TIMEOUT
from ..errors import (
    CheckpointExistsError,
    CheckpointLockedError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DistributedError,
    InvalidArgumentError,
    SaveError,
    StateMismatchError,
    StorageError,
    TardigradeError,
    UnsupportedTypeError,
)
from ..storage import open_root
from ..storage.lease import Lease
from ._agreement import DUE, NOTHING, PREEMPTED, agreement
from ._options import (
    check_best_metric,
    check_directory,
    check_flag,
    check_non_negative,
    check_one_of,
    check_positive,
    check_run_directory,
    check_signals,
    check_step,
)
from ._pending import Failure, PendingSaves, failure_of
from ._policy import SavePolicy
from ._preflight import DirectoryLock
from ._retention import Retention
from ._signals import Preemption
from ._stats import ManagerStats, SaveStats

log = logging.getLogger("tardigrade")


def _run_to_end(part: Callable[[], None], errors: list[BaseException], tries: int = 3) -> None:
    """Run ``part``; on an exception, record it and run it again (each part is idempotent).

    An exception raised asynchronously (by a signal handler) can interrupt any statement of
    ``part``; a second run completes what the first left undone. A part that fails on its own
    fails every time and is given up after ``tries``.
    """
    for _ in range(tries):
        try:
            part()
            return
        except BaseException as e:  # re-raised by the caller, after the cleanup
            errors.append(e)


class _Knob:
    """A public setting of the manager kept in one of its frozen policies: setting it (as
    ``mgr.keep_last = 1``) replaces that policy with one that differs in this field only."""

    def __init__(self, policy: str) -> None:
        self._policy = policy

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, mgr: Any, owner: type | None = None) -> Any:
        if mgr is None:
            return self
        return getattr(getattr(mgr, self._policy), self._name)

    def __set__(self, mgr: Any, value: Any) -> None:
        policy = getattr(mgr, self._policy)
        setattr(mgr, self._policy, dataclasses.replace(policy, **{self._name: value}))


class CheckpointManager:
    """Saves ``state`` into numbered checkpoints under ``directory`` by policy, keeps what the
    retention policy says, and restores the newest complete, verified one.

    >>> mgr = tg.CheckpointManager("ckpt", state, every_steps=500, keep_last=3)  # doctest: +SKIP
    >>> start = mgr.restore()            # None on a fresh directory               # doctest: +SKIP
    >>> for step in range(0 if start is None else start + 1, total):             # doctest: +SKIP
    ...     train_one_step()
    ...     mgr.step(step, metrics={"loss": loss})
    ...     if mgr.should_stop:
    ...         break
    >>> mgr.close()                                                               # doctest: +SKIP

    Policies: a save happens when any of ``every_steps`` (step % N == 0), ``every_epochs``
    (the epoch passed to ``step`` changed and epoch % N == 0) or ``every_seconds`` fires.
    Retention keeps the union of the last ``keep_last``, every ``keep_every_steps``-th step
    and the ``keep_best`` best by ``best_metric``; the newest committed checkpoint is always
    kept; with all three None everything is kept. Old checkpoints are deleted only after a new
    one commits. ``on_save_error="warn"`` logs a failed save, counts it in ``stats`` and lets
    training go on; ``"raise"`` raises it. A directory that can never hold a checkpoint
    (read-only filesystem, permission denied, a regular file in the way) raises
    ``StorageError`` here, in both modes. A signal in ``save_on_signals`` makes the next
    ``step()`` or ``save()`` save synchronously and set ``should_stop``.

    Parameters:
        ``directory``: where the numbered checkpoints (``step-NNNNNNNNN``) live; created if
            missing; one job per directory (a lock; a second job gets CheckpointLockedError).
        ``state``: the live training state, saved by ``step``/``save`` and restored in place
            by ``restore`` (see ``tg.save`` for what it may hold).
        ``every_steps``, ``every_epochs``, ``every_seconds``: save policies (None: off).
        ``keep_last``, ``keep_every_steps``, ``keep_best``: retention (None everywhere: keep
            every checkpoint, the default).
        ``best_metric``: the metric (passed to ``step``/``save``) that ``keep_best`` ranks by;
            ``best_mode``: ``"min"`` (default) or ``"max"``.
        ``async_save``: write checkpoints in the background (default ``True``); training
            blocks only for a copy of the state to host memory.
        ``on_save_error``: ``"warn"`` (default) logs a failed save and keeps training;
            ``"raise"`` raises it.
        ``save_on_signals``: signals that request a final save at the next step boundary and
            set ``should_stop`` (default SIGTERM, what schedulers send before a kill).
        ``max_staging_bytes``: cap on host memory used to stage async saves (None: enough
            for the whole state, kept for reuse).
        ``lock_lease_seconds``: how long a lock whose holder runs on another machine stays
            valid without a heartbeat (a holder on this machine frees it when it dies: a
            directory's at once, a store's as soon as its process is gone).
        ``lock_timeout``: seconds the constructor waits for a lock whose holder may be dead
            (another machine's, until its lease expires), logging who holds it, before it
            raises ``CheckpointLockedError`` (default None: one lease, so that a restarted job
            whose previous process died anywhere starts; 0: fail at once). A holder that waiting
            cannot help (a directory's flock held on this machine, another manager of this
            process) is refused at once.
        ``process_group``: in a distributed job (``torch.distributed`` initialized) the group
            whose ranks share this manager (default: the whole job); ignored otherwise.
        ``timeout``: seconds any rank waits for the others in one of the manager's collectives
            (its saves and loads included) before every rank raises ``DistributedError``.
        ``upload_to``: a second, remote tier (e.g. ``"s3://bucket/run"``): each checkpoint
            committed in ``directory`` is then copied there in the background, off the
            training thread; it counts as uploaded once its remote manifest is committed. A
            failed upload is logged, counted in ``uploads`` and retried, never raised.
            ``restore()`` first downloads the remote tier's newest checkpoint when it is newer
            than the newest here (a fresh machine with an empty ``directory``). In a
            distributed job each rank uploads the data files it wrote and rank 0 commits the
            remote manifest once every rank's are there; a download is shared the same way.
        ``keep_last_remote``: retention of the remote tier (None: keep every upload).
        ``upload_timeout``: seconds ``close()`` waits for pending uploads (default 600).
        ``storage_options``: options for the backend of a URL ``directory`` (for ``s3://``:
            ``endpoint``, ``region``, ``access_key_id``, ``secret_access_key``, ...; for an
            fsspec URL, its filesystem's arguments); a local directory takes none.
        ``upload_storage_options``: the same for ``upload_to`` (each location has its own:
            a local ``directory`` and an ``s3://`` tier is the usual pair).
        ``ram_tier``: ``True`` keeps a copy of the newest checkpoint in host shared memory
            (``/dev/shm``), a path keeps it in that directory (a tmpfs); ``False`` (default)
            does not. A process killed and restarted on the same node then restores from
            memory (``restore()`` prefers it when it is the same save as the newest
            checkpoint here; ``restored_from`` tells which copy was read). An async save
            writes it from its staging copy (nothing more is copied while training waits).
            It holds the newest checkpoint only, is namespaced by this directory's path (a
            restart finds it, another job does not), and is removed by ``close()`` (not on a
            crash, nor on a ``with`` block left by an exception). A failed copy (a full
            ``/dev/shm``) is logged and counted in ``ram_tier_stats``, never raised. In a
            distributed job each rank keeps its own files of the newest checkpoint (copied
            from ``directory`` in the background), and a restart reads from memory only when
            every rank holds that save. See docs/storage.md.

    In a distributed job the constructor, ``step``, ``save``, ``stop_at_boundary``,
    ``restore``, ``steps``, ``latest``, ``exists``, ``load``, ``wait`` and ``close`` are
    collective: every rank of the group calls them, in the same order. Each decision (whether this step saves, whether to stop
    after a signal that reached any rank, which checkpoint ``restore`` picks, when a background
    save is recorded and whether it succeeded) is the same on every rank; the directory checks,
    the lock, retention and the cleanup run on the group's rank 0 only. With ``async_save``
    each rank copies its own tensors to host memory and returns; the collective save runs in
    the background on a gloo group forked from the manager's group at its first async save, so
    it never meets training's own collectives. A background save is recorded on every rank at
    the same call (the first ``step`` that finds every rank's save finished, or the next save,
    ``wait``, ``restore`` or ``close``), as failed on every rank if it failed on any, and
    retention follows only a save that every rank knows committed. ``max_staging_bytes`` does
    not apply to collective saves: with it, saves there are synchronous (said once, in a
    warning).
    """

    every_steps = _Knob("_policy")
    every_epochs = _Knob("_policy")
    every_seconds = _Knob("_policy")
    keep_last = _Knob("_retention")
    keep_every_steps = _Knob("_retention")
    keep_best = _Knob("_retention")
    best_metric = _Knob("_retention")
    best_mode = _Knob("_retention")

    def __init__(
        self,
        directory: str | os.PathLike[str],
        state: Any,
        *,
        every_steps: int | None = None,
        every_epochs: int | None = None,
        every_seconds: float | None = None,
        keep_last: int | None = None,
        keep_every_steps: int | None = None,
        keep_best: int | None = None,
        best_metric: str | None = None,
        best_mode: str = "min",
        async_save: bool = True,
        on_save_error: str = "warn",
        save_on_signals: Iterable[int] = (signal.SIGTERM,),
        max_staging_bytes: int | None = None,
        lock_lease_seconds: float = 30.0,
        lock_timeout: float | None = None,
        process_group: Any = None,
        timeout: float = DEFAULT_TIMEOUT,
        upload_to: str | os.PathLike[str] | None = None,
        keep_last_remote: int | None = None,
        upload_timeout: float = 600.0,
        storage_options: Mapping[str, Any] | None = None,
        upload_storage_options: Mapping[str, Any] | None = None,
        ram_tier: bool | str | os.PathLike[str] = False,
    ) -> None:
        # Every byte, listing and delete goes through the catalog over the storage contract.
        self._storage_options = storage_options
        self._upload_storage_options = upload_storage_options
        self._catalog = check_run_directory(Catalog(check_directory(directory), storage_options))
        self.directory = self._catalog.root
        self.state = state
        self._policy = SavePolicy(
            every_steps=check_positive("every_steps", every_steps),
            every_epochs=check_positive("every_epochs", every_epochs),
            every_seconds=check_positive("every_seconds", every_seconds, float),
        )
        self._retention = Retention(
            keep_last=check_positive("keep_last", keep_last),
            keep_every_steps=check_positive("keep_every_steps", keep_every_steps),
            keep_best=check_positive("keep_best", keep_best),
            best_mode=check_one_of("best_mode", best_mode, ("min", "max")),
            best_metric=check_best_metric(keep_best, best_metric),
        )
        self.on_save_error = check_one_of("on_save_error", on_save_error, ("warn", "raise"))
        check_flag("async_save", async_save)
        self.stats = ManagerStats()
        self.should_stop = False
        self._closed = False
        self._last_step: int | None = None
        self._last_epoch: int | None = None
        self._last_save_time = time.monotonic()
        self._restored_step: int | None = None
        # Steps above a restored older step that could not be moved aside (restore(step) moves
        # them to step-N.abandoned-*); each is replaced (once) when this run saves that step
        # again, and none of them counts for retention.
        self._abandoned: set[int] = set()
        # On a store: whether its record of abandoned checkpoints may list some (read or
        # written by this manager's restore), to update as this run saves past them.
        self._recorded = False
        self._pending = PendingSaves()
        self._loading: set[int] = set()
        self._metric_cache: dict[int, float | None] = {}
        self._readable_cache: dict[int, bool] = {}
        self._preemption = Preemption()
        self._async: AsyncCheckpointer | None = None
        self._uploader: Uploader | None = None
        self._upload_stats: UploadStats | None = None  # the final figures, once closed
        self._remote_lock: Any = None
        self._ram: RamTier | None = None
        self._ram_keep = False  # leave the RAM tier in place at close (left by an exception)
        self.restored_from: str | None = None  # where restore() read its checkpoint
        self.keep_last_remote = check_positive("keep_last_remote", keep_last_remote)
        self.upload_timeout = check_positive("upload_timeout", upload_timeout, float)
        self._staging: StagingReservation | None = None  # with async saves
        signals = check_signals(save_on_signals)
        # In a single process, the null agreement: nothing talks to other ranks.
        self._ranks = agreement(f"CheckpointManager({self.directory!r})", process_group, timeout)
        self._directory_lock = DirectoryLock(
            self._catalog,
            self.directory,
            lease_seconds=lock_lease_seconds,
            timeout=check_non_negative("lock_timeout", lock_timeout),
        )
        self._open()
        async_save = self._ranks.async_saves(async_save, max_staging_bytes)
        try:
            self._preemption.listen(signals)
            self._async = (
                AsyncCheckpointer(max_staging_bytes=max_staging_bytes) if async_save else None
            )
        except BaseException:
            self._preemption.stop_listening()
            self._lock.release()
            raise
        if self._async is not None:
            self._staging = StagingReservation(self._async, self.state, self._ranks.staging_need)
            self._staging.restart()
        if upload_to is not None:
            self._start_uploads(upload_to)
        if ram_tier is not False:
            self._open_ram_tier(ram_tier)

    def _open(self) -> None:
        """Check the directory and take its lock (on rank 0); raise its error on every rank."""

        def check_and_lock() -> None:
            self._directory_lock.open(raising=self.on_save_error == "raise")

        # A directory another job holds raises CheckpointLockedError on every rank; a rank
        # that passed another directory makes a different call, a DistributedError everywhere.
        try:
            self._ranks.on_coordinator(f"CheckpointManager({self.directory!r})", check_and_lock)
        except BaseException:
            self._lock.release()  # perhaps taken here, but another rank failed: not ours to keep
            raise

    @property
    def _coordinating(self) -> bool:
        """Whether this process does the directory's housekeeping (rank 0, or the only one)."""
        return self._ranks.coordinator

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def _lock(self) -> Lease:
        """The directory's lease (one job per directory)."""
        return self._directory_lock.lease

    def _close_async(self) -> None:
        if self._async is not None:
            self._async.close()

    def _start_uploads(self, upload_to: str | os.PathLike[str]) -> None:
        try:
            remote = open_root(upload_to, self._upload_storage_options)

            def check_and_lock() -> None:
                try:
                    remote.preflight()
                except TardigradeError as e:
                    log.error("tardigrade: uploads to %s will fail: %s", remote.root, e)
                # One job uploads into a remote root, as one job saves into a directory.
                self._remote_lock = remote.lease(lease_seconds=self._lock.lease)
                self._remote_lock.acquire()
                warn_of_another_run(self._catalog, Catalog(remote))

            # Rank 0's lease stands for the job; its error is raised on every rank.
            self._ranks.on_coordinator(
                f"CheckpointManager({self.directory!r}): upload_to={remote.root!r}",
                check_and_lock,
            )
            # In a distributed job the upload threads agree over a group of their own.
            ranks = self._ranks.fork()
        except BaseException:
            self._close(meet=False)
            raise
        self._uploader = Uploader(
            self._catalog.storage,
            remote,
            keep_last_remote=self.keep_last_remote,
            lease=self._remote_lock,
            ranks=ranks,
        )

    def _open_ram_tier(self, ram_tier: Any) -> None:
        error: BaseException | None = None
        try:
            self._ram = open_ram_tier(self.directory, ram_tier, rank=self._ranks.rank)
        except BaseException as e:
            error = e
        try:
            # Every rank has one, or none goes on: a restore agrees over all of them.
            everywhere = self._ranks.everywhere(
                error is None, f"CheckpointManager({self.directory!r}): ram_tier={ram_tier!r}"
            )
        except BaseException as e:
            error = error or e
            everywhere = False
        if error is None and not everywhere:
            error = InvalidArgumentError(
                f"ram_tier={ram_tier!r}: another rank of the job could not open its RAM tier "
                "(its error says why); fix it there, or pass ram_tier=False"
            )
        if error is not None:
            self._close(meet=False)
            raise error

    @property
    def ram_tier_stats(self) -> RamTierStats | None:
        """What the RAM tier did so far (None without ``ram_tier``)."""
        return None if self._ram is None else self._ram.stats

    def _close_ram(self) -> None:
        ram, self._ram = self._ram, None
        if ram is not None:
            ram.close(clean=not self._ram_keep)

    def _load_candidate(self, s: int) -> str:
        """Restore step ``s`` into the live state: from the RAM tier's copy when it holds this
        very save (fastest tier first; on every rank, in a distributed job), else (or when
        that copy fails) from the directory. Returns where it was read."""
        name = step_name(s)
        ram = self._ram.copy_of(name, self._catalog.storage) if self._ram is not None else None
        if self._ram is not None:
            # In a job each rank holds its own share: read from memory only when every rank
            # holds this save there (a rank restarted elsewhere, or whose copy failed, has none).
            held = self._ranks.everywhere(
                ram is not None,
                f"CheckpointManager({self.directory!r}).restore(): {name} in every RAM tier",
            )
            if ram is not None and not held:
                log.info(
                    "tardigrade: not every rank holds %s in its RAM tier; reading %s",
                    name,
                    self.path(s),
                )
            ram = ram if held else None
        touched = False  # whether a failed read of the RAM copy left bytes in the live state
        if ram is not None:
            assert self._ram is not None
            try:
                return self._ram.restore(
                    name, self._catalog.storage, self.state, self._ranks.collective
                )
            except StateMismatchError:
                raise
            except Exception as e:
                touched = self._ranks.live_touched(
                    e, f"CheckpointManager({self.directory!r}).restore() (from the RAM tier)"
                )
                log.warning(
                    "tardigrade: restoring %s from the RAM tier failed (%s); reading %s instead",
                    name,
                    e,
                    self.path(s),
                )
        try:
            load(self.path(s), into=self.state, verify="all", **self._collective)
        except TardigradeError as e:
            if touched:
                e.live_overwritten = True  # type: ignore[attr-defined]  # restore() reads this
            raise
        return self.path(s)

    @property
    def uploads(self) -> UploadStats | None:
        """What the uploads to ``upload_to`` did so far: ``uploaded`` (the checkpoints'
        names, in order), ``failed`` attempts, ``last_error``, ``pending``; after ``close()``
        the final figures (None without ``upload_to``)."""
        return self._upload_stats if self._uploader is None else self._uploader.stats

    def _close_uploads(self) -> None:
        try:
            self._finish_uploads()
        finally:
            lock, self._remote_lock = self._remote_lock, None
            if lock is not None:
                lock.release()

    def _finish_uploads(self) -> None:
        uploader = self._uploader
        if uploader is None:
            return
        self._upload_stats = uploader.stats  # still readable after close()
        if uploader.close(self.upload_timeout):
            self._uploader = None
            # Retention spared what was still uploading; it catches up now.
            if self._retention.active and self._coordinating:
                self._retain()
        else:
            self._uploader = None
            log.error(
                "tardigrade: %d upload(s) to %s still pending after %.0f s (upload_timeout); "
                "abandoned: nothing half-uploaded is visible there, and the checkpoints are "
                "intact in %s",
                uploader.stats.pending,
                uploader.remote.root,
                self.upload_timeout,
                self.directory,
            )

    def _download_newer(self) -> None:
        """Copy the remote tier's newest checkpoint here when it is newer than ours (rank 0
        decides; in a distributed job every rank downloads its share into the directory)."""
        if self._uploader is None:
            return
        remote = Catalog(self._uploader.remote)

        def newer() -> str | None:
            try:
                theirs = remote.steps()
            except TardigradeError as e:
                log.warning("tardigrade: cannot list %s: %s", remote.root, e)
                return None
            ours = self._steps_here()
            if not theirs or (ours and ours[-1] >= theirs[-1]):
                return None
            return step_name(theirs[-1])

        name = self._agreed(
            f"CheckpointManager({self.directory!r}).restore(): the remote tier's newest", newer
        )
        if name is None:
            return
        try:
            self._ranks.copy(remote.storage, name, self._catalog.storage)
            if self._coordinating:
                log.info("tardigrade: downloaded %s from %s", name, remote.root)
        except Exception as e:  # the local tier still restores what it has
            log.warning("tardigrade: downloading %s from %s failed: %s", name, remote.root, e)

    def close(self) -> None:
        """Wait for in-flight saves, apply retention, release the lock and signal handlers.

        Idempotent; also called on ``with`` exit. Every step runs even when an earlier one
        raises (a failed save in "raise" mode, or an exception delivered asynchronously, such
        as PyTorch's "DataLoader worker killed" from its SIGCHLD handler): the directory lock
        is always released. The first error is raised at the end.

        In a distributed job every rank calls it: rank 0 releases the lock only once every rank
        has reached ``close()``, so no rank is still saving into a directory no job holds.
        """
        self._close(meet=True)

    def _close(self, *, meet: bool) -> None:
        if self._closed:
            return
        self._closed = True
        errors: list[BaseException] = []
        # Leaving alone (meet=False), this rank records its saves as it sees them: the others
        # may never make another collective call.
        _run_to_end(lambda: self._drain(wait=True, agree=meet), errors)
        if meet:
            try:
                # Once, not retried as the parts below are: each try may wait the timeout.
                self._ranks.barrier(f"CheckpointManager({self.directory!r}).close()")
            except Exception as e:
                errors.append(e)
        for part in (
            self._close_async,
            self._close_uploads,
            self._close_ram,
            self._preemption.stop_listening,
            self._lock.release,
        ):
            _run_to_end(part, errors)
        if errors:
            raise errors[0]

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # Leaving on an exception, this rank may be the only one here: waiting for the others
        # in close() would hold it (and its error) for the whole timeout, while the others
        # find it gone at their next collective.
        if exc_type is not None:
            self._ram_keep = True  # likely a crash, and a restart on this node: keep it
        self._close(meet=exc_type is None)

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise InvalidArgumentError(f"CheckpointManager.{what}() called after close()")

    # -- listing ---------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Steps of the committed checkpoints on disk, ascending (rank 0's listing everywhere)."""
        return self._agreed(f"CheckpointManager({self.directory!r}).steps()", self._steps_here)

    def _agreed(self, what: str, here: Callable[[], Any]) -> Any:
        """``here()`` (a JSON value), computed by rank 0 and sent to every rank in a distributed
        job; its error, if it raises there, is raised on every rank.

        Ranks reading a shared directory can see it at different moments (a network file
        system's attribute cache): a decision taken from what each rank sees would differ.
        """
        return self._ranks.shared(what, here)

    def _steps_here(self) -> list[int]:
        return self._catalog.steps()

    def latest(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def exists(self, step: int) -> bool:
        """Whether a committed checkpoint for ``step`` exists (rank 0's answer everywhere)."""
        return bool(
            self._agreed(
                f"CheckpointManager({self.directory!r}).exists({step!r})",
                lambda: self._exists_here(step),
            )
        )

    def _exists_here(self, step: int) -> bool:
        return self._catalog.visible(step_name(step))

    def path(self, step: int) -> str:
        """The directory of the checkpoint for ``step``."""
        return self._catalog.path(step_name(step))

    def load(self, step: int | None = None, *, keys: Sequence[Key] | None = None) -> Any:
        """Load a checkpoint (the latest by default) as a plain tree, e.g. weights only."""
        self._check_open("load")
        step = self.latest() if step is None else step
        if step is None or not self.exists(step):
            raise CheckpointNotFoundError(
                f"{self.directory}: no committed checkpoint for step {step}"
            )
        self._loading.add(step)
        try:
            return load(self.path(step), keys=keys, **self._collective)
        finally:
            self._loading.discard(step)

    @property
    def _collective(self) -> dict[str, Any]:
        """The arguments of every ``save``/``load`` of this manager: its storage options, and
        what makes them collective over its group."""
        return {**self._ranks.collective, "storage_options": self._storage_options}

    # -- restore ---------------------------------------------------------------------------

    def _still_ours(self, what: str) -> bool:
        """Fencing: delete nothing unless the directory lock is still this manager's."""
        return self._directory_lock.still_ours(what)

    def _remove_leftovers(self) -> None:
        """Remove tmp dirs of dead writers; put back a checkpoint a crashed replace moved aside."""
        if self._lock.held and self._still_ours("cleaning up leftovers"):
            self._catalog.tidy(fenced=False)  # those: from the listing that follows

    def _candidates_here(self, step: int | None) -> dict[str, list[int]]:
        """Clean up, then the committed steps and those ``restore(step)`` tries, newest first."""
        self._remove_leftovers()
        committed, uncommitted, recorded, fenced = self._catalog.scan()
        if fenced and self._lock.held and self._still_ours("removing commits of a zombie"):
            self._catalog.retire_fenced(fenced)  # passed over by the scan in any case
        if step is not None:
            if step not in committed:
                raise CheckpointNotFoundError(
                    f"{self.path(step)}: no committed checkpoint for step {step}; available: "
                    f"{committed}"
                )
            return {"steps": committed, "candidates": [step]}
        for n in uncommitted:
            log.warning(
                "tardigrade: skipping checkpoint %s: it has no manifest.json (a save that never "
                "committed, or a copy still in progress); kept for inspection, and moved aside "
                "if this run saves that step again",
                self._catalog.path(n),
            )
        skip = self._recorded_here(committed) if recorded else set()
        return {"steps": committed, "candidates": [s for s in committed[::-1] if s not in skip]}

    def _live_touched(self, e: BaseException) -> bool:
        """Whether a failed restore of one candidate changed the live state (on any rank).

        Tardigrade's own errors say whether bytes landed; any other error might have come
        after they did, so it counts as touched.
        """
        what = f"CheckpointManager({self.directory!r}).restore() (after a failed candidate)"
        return self._ranks.live_touched(e, what)

    def restore(self, step: int | None = None) -> int | None:
        """Restore the newest committed checkpoint that verifies into ``state``; return its step.

        Each candidate is read once: its bytes go into the live state and every byte of it is
        checked against its checksums in the same pass. A corrupt, incomplete or unreadable
        newer checkpoint is skipped with a warning (and kept on disk as evidence). Damage
        found before any byte lands (manifest, structure, file sizes) leaves the live state
        untouched; damaged tensor bytes are found as they are read, after which the next
        older checkpoint is restored over everything (it rewrites every live tensor and calls
        each ``load_state_dict()``: exact when it covers the same tensors, as checkpoints of
        one run of this state do). If none is left to restore over damaged bytes, this raises
        CorruptCheckpointError instead of returning None. Saves of this manager still in
        flight are waited for first (a failure among them is reported as ``step`` would).
        With ``step`` given, restore exactly that one; later checkpoints then belong to an
        abandoned timeline: each is moved aside to ``step-N.abandoned-<time>``, so that a crash
        before this run saves again resumes from this timeline, and is deleted once this run
        commits step N or later. Returns None when the directory holds no checkpoint.
        """
        self._check_open("restore")
        # Our own async save still in flight has a .tmp-* staging directory that the cleanup
        # below would take for a dead writer's leftover: let it commit (or fail) first.
        self._drain(wait=True)
        if step is None:
            self._download_newer()
        # Rank 0 cleans up and lists; every rank then tries the same candidates in order.
        found = self._agreed(
            f"CheckpointManager({self.directory!r}).restore({step!r})",
            lambda: self._candidates_here(step),
        )
        committed, candidates = found["steps"], found["candidates"]
        damaged: str | None = None  # a candidate that failed after bytes reached the live state
        unread: StorageError | None = None  # the last candidate storage failed to read
        for s in candidates:
            self._loading.add(s)
            loading = False
            try:
                epoch = self._agreed(
                    f"CheckpointManager({self.directory!r}).restore(): manifest of step {s}",
                    lambda s=s: open_manifest(self.path(s), self._storage_options)[2].epoch,
                )
                loading = True
                # One pass: each byte is read once, into the live state, and every byte of the
                # checkpoint (unread tensors and headers included) is checked on the way.
                source = self._load_candidate(s)
            except StateMismatchError:
                raise  # the live state does not fit: an older checkpoint would not fit either
            except Exception as e:
                # Damaged, or unreadable here (permissions, a socket or device in place of a
                # file, an I/O error), or failing in a way no check foresaw (a reader's bug):
                # either way this one cannot be restored; an older may.
                # Damage found before a byte lands (manifest, structure, sizes) leaves the
                # live state untouched; damage in tensor bytes is found as they are read, so
                # some live tensors may hold them: the next older checkpoint rewrites every
                # live tensor (a full checkpoint of this state covers them all) and calls each
                # load_state_dict(), or restore raises rather than train from a mix.
                if loading and self._live_touched(e):
                    damaged = self.path(s)
                if isinstance(e, StorageError):
                    unread = e
                if step is not None:
                    raise
                log.warning(
                    "tardigrade: skipping checkpoint %s: %s (kept on disk; trying the next "
                    "older one)",
                    self.path(s),
                    e if isinstance(e, TardigradeError) else f"{type(e).__name__}: {e}",
                )
                continue
            finally:
                self._loading.discard(s)
            self._restored_step = s
            self.restored_from = source
            # Checkpoints above an explicit restore(step) leave the listing, so that after a
            # crash this timeline's newest is restored, not theirs. Newer ones restore() skipped
            # stay in place as evidence (a crash skips them again) and are replaced as this
            # run saves their steps.
            self._abandoned = {x for x in committed if x > s}
            if step is not None and self._abandoned:
                self._abandoned = set(
                    self._agreed(
                        f"CheckpointManager({self.directory!r}).restore({s}): setting the "
                        "later checkpoints aside",
                        lambda s=s: self._abandon_after(s, committed),
                    )
                )
            self._last_step = s
            self._last_epoch = epoch
            self._last_save_time = time.monotonic()
            if self._coordinating:
                if source == self.path(s):
                    log.info("tardigrade: restored %s", source)
                else:
                    log.info("tardigrade: restored %s from the RAM tier (%s)", self.path(s), source)
            if self._staging is not None:
                self._staging.restart()  # the restored state may have grown (moments)
            return s
        if damaged is not None:
            raise CorruptCheckpointError(
                f"{damaged}: damaged tensor bytes were found while restoring it, after some had "
                "been read into the live state, and no older checkpoint could be restored over "
                "them: the live state is no longer as it was built. Rebuild it (restart the "
                "process) and restore again, or delete the damaged checkpoints "
                "(`tardigrade verify` names them) to start from scratch."
            )
        if unread is not None:
            # Not None ("nothing to resume"): training would start from scratch and its saves
            # would retire the checkpoints that only could not be read just now.
            raise StorageError(
                unread.errno,
                f"{self.directory}: no checkpoint could be restored, and storage failed reading "
                f"at least one of them ({unread}); committed steps: {committed}. Nothing was "
                "restored and nothing was deleted: fix the storage (or wait for it) and restore "
                "again.",
            )
        return None

    # -- saving ----------------------------------------------------------------------------

    def _agree(self, call: str, doing: str, mine: int = 0) -> int:
        """Consume a pending preemption signal; the level agreed for this call on every rank.

        ``call`` names the public call (``".step(5)"``) in the error of a rank left waiting;
        ``mine`` is this rank's other reason (``DUE``). One tiny all-reduce in a distributed
        job, whatever the level: every rank calls it at the same point. It also tells whether
        any rank's background save is still running; when none is and nothing else happens
        here, every rank records its finished saves now (a rank cannot go by its own saves'
        state: the ranks finish a collective save moments apart).
        """
        if self._take_signal(doing):
            mine = PREEMPTED
        level, settled = self._ranks.level(mine, self._pending.running, call)
        if level == PREEMPTED and mine != PREEMPTED:
            log.warning(
                "tardigrade: another rank received a preemption signal: %s and stopping", doing
            )
        if settled:
            self._drain(wait=True)
        return level

    def step(
        self, step: int, *, epoch: int | None = None, metrics: Mapping[str, float] | None = None
    ) -> bool:
        """Report a finished training step; save if a policy says so. Returns whether it saved.

        Steps must increase. After a preemption signal this saves synchronously and sets
        ``should_stop``. In a distributed job every rank calls it with the same step: it saves
        on every rank or on none, and a signal that reached any rank stops them all here.
        """
        self._check_open("step")
        check_step(step)
        if self._last_step is not None and step <= self._last_step:
            raise InvalidArgumentError(
                f"step {step} is not after the previous step {self._last_step}; steps must "
                "increase (did you forget start = mgr.restore() + 1?)"
            )
        self._ranks.record_finished(self._drain)
        # time.monotonic looked up here: tests put a clock of their own in its place.
        timed = self._coordinating and self._policy.due_by_time(
            time.monotonic, self._last_save_time
        )
        level = self._agree(f".step({step})", f"saving step {step}", DUE if timed else NOTHING)
        if level == PREEMPTED:
            try:
                saved = self._save(step, epoch, metrics, sync=True, from_step=True)
            finally:
                self.should_stop = True  # even if the save raised: the signal is consumed
            self._advance(step, epoch)
            return saved
        due = level == DUE or self._policy.due_by_count(step, epoch, self._last_epoch)
        saved = due and self._save(step, epoch, metrics, sync=False, from_step=True)
        if not saved and self._staging is not None:
            self._staging.tick()
        self._advance(step, epoch)
        return saved

    def _take_signal(self, doing: str) -> bool:
        """Consume a pending preemption signal; log what the manager does about it."""
        signum = self._preemption.take()
        if signum is None:
            return False
        log.warning("tardigrade: signal %s received: %s and stopping", signum, doing)
        return True

    def stop_at_boundary(self, finished: bool = False) -> bool:
        """Whether to stop at a point where the latest state is already saved (e.g. between
        epochs, after ``save``): the same answer on every rank.

        After a preemption signal on any rank it commits what is in flight, sets
        ``should_stop`` and returns True. Otherwise it returns True when ``finished`` is true
        on any rank (a rank that stopped alone would leave the others waiting in their next
        collective), else False. ``JobRunner`` calls it between epochs; in a distributed job
        every rank calls it, as ``step``.

        >>> mgr.save(epoch, epoch=epoch)                                          # doctest: +SKIP
        >>> if mgr.stop_at_boundary(finished=epoch >= epochs):                    # doctest: +SKIP
        ...     break
        """
        self._check_open("stop_at_boundary")
        level = self._agree(
            ".stop_at_boundary()",
            "the latest state is saved already: committing any save in flight",
            DUE if finished else NOTHING,
        )
        if level == PREEMPTED:
            self._drain(wait=True)
            self.should_stop = True
        return level != NOTHING

    def _advance(self, step: int, epoch: int | None) -> None:
        self._last_step = step
        if epoch is not None:
            self._last_epoch = epoch

    def save(
        self,
        step: int,
        *,
        epoch: int | None = None,
        metrics: Mapping[str, float] | None = None,
        force: bool = False,
    ) -> bool:
        """Save ``step`` now, whatever the policy. Returns False if it failed to start (warn mode).

        With ``async_save`` a failure in the background is reported (logged, counted in
        ``stats``, or raised in "raise" mode) at the next ``step``/``save``/``wait``/``close``;
        retention for a save also runs then. In a distributed job that is the first ``step``
        at which no rank's save still runs, or the next ``save``/``wait``/``restore``/``close``,
        the same call on every rank; a new save waits for the one in flight there.

        ``force=True`` replaces an existing checkpoint for this step. After a preemption signal
        this saves synchronously and sets ``should_stop``, as ``step`` does.
        """
        self._check_open("save")
        check_step(step)
        self._ranks.record_finished(self._drain)
        preempted = self._agree(f".save({step})", f"saving step {step}") == PREEMPTED
        try:
            ok = self._save(step, epoch, metrics, sync=preempted, force=force)
        finally:
            if preempted:
                self.should_stop = True  # even if the save raised: the signal is consumed
        self._advance(max(step, self._last_step or 0), epoch)
        return ok

    def _save(
        self,
        step: int,
        epoch: int | None,
        metrics: Mapping[str, float] | None,
        *,
        sync: bool,
        force: bool = False,
        from_step: bool = False,
    ) -> bool:
        # Outside the try below: the failure of a save in flight is not this one's.
        self._ranks.before_save(self._drain)
        started = time.perf_counter()
        if (
            self.best_metric is not None
            and self.keep_best is not None
            and (metrics is None or self.best_metric not in metrics)
        ):
            log.warning(
                "tardigrade: step %d saved without metric %r; it will not rank as a best "
                "checkpoint",
                step,
                self.best_metric,
            )
        # A committed checkpoint is replaced only when asked (force) or when it belongs to the
        # timeline abandoned by restore(step); repeating a step otherwise is a programming error.
        try:
            occupant = self._agreed(
                f"CheckpointManager({self.directory!r}): is step {step} there",
                lambda: self._catalog.occupant(step_name(step)),
            )
        except (StorageError, CheckpointLockedError, CorruptCheckpointError) as e:
            # Storage failed before the save began (a transient error, a full disk): a failed
            # save like any other, never an error out of step() in "warn" mode.
            self._record_failure(step, e, time.perf_counter() - started)
            return False
        replace = occupant != ""
        if occupant == "run" and not force and step not in self._abandoned:
            e = CheckpointExistsError(
                f"{self.path(step)}: a checkpoint for step {step} already exists; "
                "steps must not repeat (pass force=True to replace it)."
            )
            if from_step and self.on_save_error == "warn":
                # Training goes on (the checkpoint there is kept): reported like a failed save.
                self._record_failure(step, e, time.perf_counter() - started)
                return False
            raise e
        if occupant == "fenced":
            log.warning(
                "tardigrade: replacing %s: it was committed by a writer after it lost the lease",
                self.path(step),
            )
        try:
            self._prepare(step, replace)
            options = SaveOptions(
                overwrite=replace,
                step=step,
                epoch=epoch,
                metrics=metrics,
                storage_options=self._storage_options,
                lease_generation=self._lock.generation,
            )
            held = self._uploader.held() if self._uploader is not None else nullcontext()
            if self._async is not None and not sync:
                mirror = self._ram.mirror() if self._ram is not None else None
                with held:  # training waits on the staging copy: uploads wait too
                    fut = self._ranks.submit(
                        self._async, self.path(step), self.state, options, mirror=mirror
                    )
                fut.observed = True  # the manager reports the outcome itself
                self._pending.add(step, fut)
            else:
                if self._async is not None:
                    self._drain(wait=True)
                with held:  # training waits on the whole save: uploads wait too
                    res = save_with(self.path(step), self.state, options, **self._ranks.collective)
                self._record_ok(step, res)
        except (InvalidArgumentError, UnsupportedTypeError):
            raise  # a programming error, not a storage failure: never swallowed
        except Exception as e:
            if getattr(e, "committed", False) is True:
                # The failure came after the commit point: the checkpoint is there and
                # complete. Counted as saved (retention, stats), so nobody saves it again.
                self._record_ok(step, None, time.perf_counter() - started, e)
                if isinstance(e, DistributedError):
                    raise  # the group is in an unknown state: never swallowed
            elif isinstance(e, (SaveError, StorageError, CheckpointLockedError, OSError)):
                # OSError includes CheckpointExistsError here: something else put a checkpoint
                # at this step's name after the check above (a user copying one in). Nothing
                # was overwritten; report it like any failed save.
                self._record_failure(step, e, time.perf_counter() - started)
                return False
            else:
                raise
        self._last_save_time = time.monotonic()
        return True

    def _prepare(self, step: int, replace: bool) -> None:
        """Before saving ``step``: hold the lock, move an uncommitted ``step-N`` aside.

        Rank 0's work in a distributed job; its failure raises on every rank, as the same error
        (an OSError there arrives as a SaveError).
        """

        def prepare_here() -> None:
            self._directory_lock.ready(raising=self.on_save_error == "raise")
            if not replace:
                self._set_aside(step)

        self._ranks.on_coordinator(
            f"CheckpointManager({self.directory!r}): prepare step {step}",
            prepare_here,
            lambda e: SaveError(f"{self.path(step)}: cannot prepare the save: {e}"),
        )

    def _set_aside(self, step: int) -> None:
        """Move an uncommitted ``step-N`` (no manifest) out of the way of saving step N.

        It is what a save that died before this format's commit, a foreign tool or a user
        copying a checkpoint in left there; ``restore()`` skipped it. It is never deleted: it
        may be the half-copied checkpoint someone is restoring. It is renamed to a visible
        ``step-N.incomplete-<time>`` that ``steps()`` ignores, and the new path is logged.
        """
        path, name = self.path(step), step_name(step)
        storage = self._catalog.storage
        # On a store a prefix without a manifest is no checkpoint and nothing in the way: the
        # save writes under its own names and creates the manifest.
        if not storage.can_move or not storage.exists(name) or self._exists_here(step):
            return
        aside = self._catalog.path(self._catalog.set_aside(name, INCOMPLETE))
        log.warning(
            "tardigrade: %s had no manifest.json (an uncommitted save, or a copy still in "
            "progress); moved it aside to %s to save step %d. Nothing was deleted: inspect it "
            "and remove it yourself when it is not needed.",
            path,
            aside,
            step,
        )

    def _abandon_after(self, step: int, committed: list[int]) -> list[int]:
        """Move the checkpoints above ``step`` aside: ``restore(step)`` began a new timeline.

        On disk, so that a crash before this run saves again resumes from the new timeline,
        not from the newest checkpoint of the abandoned one. Each ``step-N.abandoned-*`` is
        deleted once this run commits a step at or above N (as saving step N again would
        replace it). Returns the steps that could not be moved (kept in memory instead). An
        object store cannot rename: there they stay in place, recorded by save id in the
        store's ``.abandoned.json``, which ``restore()`` reads (``_record_abandoned``).
        """
        later = [x for x in committed if x > step]
        if not self._lock.held or not self._still_ours("setting abandoned checkpoints aside"):
            return later
        if not self._catalog.storage.can_move:
            self._record_abandoned(step, later)
            return later  # they stay in place: still this run's to replace or pass over
        left = []
        for x in later:
            try:
                aside = self._catalog.set_aside(step_name(x), ABANDONED)
            except OSError as e:
                log.warning(
                    "tardigrade: could not set %s aside (%s); a crash before this run saves "
                    "step %d again would resume from it",
                    self.path(x),
                    e,
                    x,
                )
                left.append(x)
                continue
            log.warning(
                "tardigrade: restore(%d) began a new timeline: moved %s to %s (deleted once "
                "this run saves step %d or later)",
                step,
                step_name(x),
                aside,
                x,
            )
        return left

    def _record_abandoned(self, step: int, later: list[int]) -> None:
        """On a store: record ``later`` (above the restored ``step``) as abandoned, each with
        the save id it holds, so that a restore after a crash passes over them."""
        names = [step_name(x) for x in later]
        try:
            saves = self._catalog.abandoned()
            saves.update({n: self._catalog.save_id(n) or "" for n in names})
            self._catalog.record_abandoned(saves)
        except (OSError, TardigradeError) as e:
            log.warning(
                "tardigrade: could not record %s as abandoned in %s (%s); a crash before this "
                "run saves step %d again would resume from it",
                names,
                self.directory,
                e,
                later[-1],
            )
            return
        self._recorded = True
        log.warning(
            "tardigrade: restore(%d) began a new timeline: recorded %s as abandoned in %s "
            "(each deleted once this run saves its step or a later one)",
            step,
            names,
            self._catalog.path(ABANDONED_RECORD),
        )

    def _recorded_here(self, committed: list[int]) -> set[int]:
        """On a store whose listing shows a record of abandoned checkpoints: the committed
        steps it says ``restore(step)`` abandoned (still holding the save then recorded);
        ``restore()`` passes over them."""
        if self._catalog.storage.can_move:
            return set()
        try:
            saves = self._catalog.abandoned()
            skip = set()
            for name, save_id in saves.items():
                s = step_in_name(name)
                if s in committed and self._catalog.save_id(name) == save_id:
                    skip.add(s)
        except (OSError, TardigradeError) as e:
            log.warning(
                "tardigrade: could not read which checkpoints of %s a restore(step) abandoned "
                "(%s); restoring the newest of any timeline",
                self.directory,
                e,
            )
            return set()
        self._recorded = bool(saves)
        for s in sorted(skip, reverse=True):
            log.warning(
                "tardigrade: skipping checkpoint %s: an earlier run's restore(step) abandoned "
                "its timeline (recorded in %s); deleted once this run saves past it",
                self.path(s),
                self._catalog.path(ABANDONED_RECORD),
            )
        return skip

    def _drop_recorded(self, step: int) -> None:
        """On a store: delete the recorded abandoned checkpoints that this run has now saved
        past (``step`` committed) and drop them from the record; a step saved again holds
        this run's save, which stays."""
        try:
            saves = self._catalog.abandoned()
            left = {}
            for name, save_id in saves.items():
                s = step_in_name(name)
                if s is not None and s > step:
                    left[name] = save_id
                    continue
                theirs = self._catalog.committed(name) and self._catalog.save_id(name) == save_id
                if theirs and not (
                    self._still_ours("removing " + name)
                    and self._remove(
                        name, "a step of an abandoned timeline, saved past by this run"
                    )
                ):
                    left[name] = save_id
            if left != saves:
                self._catalog.record_abandoned(left)
            self._recorded = bool(left)
        except (OSError, TardigradeError) as e:
            log.warning(
                "tardigrade: could not remove the abandoned checkpoints that step %d passed in "
                "%s (tried again after the next save): %s",
                step,
                self.directory,
                e,
            )

    def _drop_abandoned(self, step: int) -> None:
        """Delete the abandoned checkpoints this run has now saved past (``step`` committed)."""
        if not self._catalog.storage.can_move:
            if self._recorded:
                self._drop_recorded(step)
            return
        try:
            names = self._catalog.names()
        except OSError as e:
            log.warning(
                "tardigrade: could not list %s to remove the abandoned checkpoints that step %d "
                "replaced (tried again after the next save): %s",
                self.directory,
                step,
                e,
            )
            return
        for n in names:
            m = ABANDONED_NAME.match(n)
            if m and int(m.group(1)) <= step and self._still_ours("removing " + n):
                self._remove(n, "a step of an abandoned timeline, saved again by this run")

    def _remove(self, name: str, why: str) -> bool:
        """Retire checkpoint ``name`` (out of view first, then deleted); False if it failed."""
        try:
            self._catalog.retire(name)
        except OSError as e:
            log.warning("tardigrade: could not remove %s: %s", self._catalog.path(name), e)
            return False
        log.info("tardigrade: removed %s (%s)", name, why)
        return True

    def _record_ok(
        self,
        step: int,
        res: SaveResult | None,
        seconds: float = 0.0,
        error: BaseException | None = None,
    ) -> None:
        """Count a committed save; ``res`` None: one that raised ``error`` after committing."""
        self._metric_cache.pop(step, None)  # a replaced checkpoint has a new metric
        self._readable_cache.pop(step, None)
        self._abandoned.discard(step)
        if res is None:
            self.stats.append(SaveStats(step, 0, seconds, seconds, True, str(error)))
            log.warning(
                "tardigrade: step %d was committed in %s, but its save then failed; it counts "
                "as saved. Cause: %s",
                step,
                self.directory,
                error,
            )
        else:
            s = SaveStats(step, res.nbytes, res.blocking_seconds, res.total_seconds, True)
            self.stats.append(s)
            log.info(
                "tardigrade: saved step %d: %.1f MB, blocked %.3f s, total %.3f s, %.2f GB/s",
                step,
                s.nbytes / 1e6,
                s.blocking_seconds,
                s.total_seconds,
                s.throughput_gbps,
            )
        if self._ram is not None:
            # Every rank records the save here, once committed: each keeps its own files.
            self._ram.saved(
                self._catalog.storage,
                step_name(step),
                files=self._ranks.share,
                teed=self._async is not None,
            )
        if self._uploader is not None:
            self._uploader.submit(step_name(step))
        if self._coordinating:
            self._drop_abandoned(step)
        if self._coordinating and self._retention.active:
            self._retain()

    def _record_failure(self, step: int, e: BaseException, seconds: float) -> None:
        self.stats.append(SaveStats(step, 0, seconds, seconds, False, str(e)))
        if self.on_save_error == "raise":
            if isinstance(e, TardigradeError):
                raise e
            raise SaveError(f"{self.path(step)}: save of step {step} failed: {e}") from e
        log.error(
            "tardigrade: SAVE FAILED for step %d in %s (%d failed so far); training continues, "
            "earlier checkpoints are intact. Cause: %s",
            step,
            self.directory,
            self.stats.failed,
            e,
        )

    def _drain(self, *, wait: bool, agree: bool = True) -> None:
        """Record the outcome of finished async saves (all of them when ``wait``).

        In a distributed job every rank calls it at the same point with ``wait=True`` (the
        pending saves are the same on every rank), and each outcome is agreed there unless
        ``agree`` is False (a rank leaving alone).
        """
        for step, fut in self._pending.finished(wait=wait):
            exc = fut.exception()
            if agree:
                exc = self._ranks.outcome(
                    exc, path=self.path(step), step=step, forget_forks=self._forget_forks
                )
            if exc is None:
                self._record_ok(step, fut.result())
                continue
            failure = failure_of(exc)
            if failure is Failure.COMMITTED:
                self._record_ok(step, None, fut.blocking_seconds, exc)
            elif failure is Failure.MISUSE:
                # A collective save learns only in the background that a rank cannot flatten
                # its state, or that the ranks' states differ.
                seconds = fut.blocking_seconds
                self.stats.append(SaveStats(step, 0, seconds, seconds, False, str(exc)))
                raise exc
            else:
                self._record_failure(step, exc, fut.blocking_seconds)

    def _forget_forks(self) -> None:
        """Drop the gloo groups forked for background saves (a lost save left them unusable)."""
        if self._async is not None:
            self._async.forget_forks()

    def wait(self) -> None:
        """Block until in-flight saves are committed (or failed and reported).

        In a distributed job every rank calls it (it agrees on each save's outcome).
        """
        self._check_open("wait")
        self._drain(wait=True)

    # -- retention -------------------------------------------------------------------------

    def _metric(self, step: int) -> float | None:
        if step not in self._metric_cache:
            value = None
            try:
                metrics = (
                    open_manifest(self.path(step), self._storage_options)[2].raw.get("metrics")
                    or {}
                )
                v = metrics.get(self.best_metric)
                value = float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None
            except TardigradeError:
                value = None
            self._metric_cache[step] = value
        return self._metric_cache[step]

    def _readable(self, step: int) -> bool:
        """Whether the manifest of ``step`` reads and validates (remembered per step)."""
        if step not in self._readable_cache:
            try:
                open_manifest(self.path(step), self._storage_options)
                self._readable_cache[step] = True
            except Exception as e:
                log.warning("tardigrade: %s cannot be restored: %s", self.path(step), e)
                self._readable_cache[step] = False
        return self._readable_cache[step]

    def keep(self, steps: Sequence[int]) -> set[int]:
        """Which of ``steps`` (committed, ascending) the retention policy keeps.

        Checkpoints of an abandoned timeline (above a step restored explicitly) are neither
        ranked nor deleted here; this run replaces them as it saves those steps again.
        """
        return self._retention.keep(
            steps, readable=self._readable, metric=self._metric, abandoned=self._abandoned
        )

    def _retain(self) -> None:
        try:
            steps = self._steps_here()
        except OSError as e:
            # The save is committed and counted; the old checkpoints go at the next save.
            log.warning(
                "tardigrade: could not list %s to apply retention (tried again after the next "
                "save): %s",
                self.directory,
                e,
            )
            return
        # A step being loaded, or with a save of ours in flight (a replace: force=True or an
        # abandoned step), is not deleted under that reader or writer.
        busy = self._loading | self._pending.steps()
        if self._uploader is not None:  # not retired before it reached the remote tier
            busy |= {s for n in self._uploader.pinned() if (s := step_in_name(n)) is not None}
        doomed_steps = self._retention.retire(
            steps,
            readable=self._readable,
            metric=self._metric,
            abandoned=self._abandoned,
            busy=busy,
        )
        if not doomed_steps or not self._still_ours("removing old checkpoints"):
            return
        for s in doomed_steps:
            if self._remove(step_name(s), "retention"):
                self._metric_cache.pop(s, None)
                self._readable_cache.pop(s, None)
