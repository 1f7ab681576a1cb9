"""The ``CheckpointManager`` facade: its public calls, over this package's collaborators.

The decisions and the work live in the collaborators the package docstring lists: the save
policy, the tiers (``_tiers``), restore with its fallback (``_restore``), the abandoned
timeline (``_timeline``), outcome recording (``_pending``), retention (``_retainer``) and the
agreement between ranks (``_agreement``). Here they are wired together, once, at construction.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import signal
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .._async import AsyncCheckpointer, StagingReservation
from .._catalog import Catalog, step_name
from .._load import load
from .._match import Key
from .._ramtier import RamTierStats
from .._tiers import UploadStats
from ..distributed._collectives import DEFAULT_TIMEOUT
from ..errors import (
    CheckpointNotFoundError,
    InvalidArgumentError,
)
from ..storage.lease import Lease
from ._agreement import DUE, NOTHING, PREEMPTED, agreement
from ._dispatch import SaveDispatch, SaveModes
from ._options import (
    Uploads,
    check_directory,
    check_one_of,
    check_policy,
    check_positive,
    check_retention,
    check_run_directory,
    check_run_id,
    check_signals,
    check_step,
)
from ._pending import Outcomes, PendingSaves
from ._policy import Cadence, Policy
from ._preflight import RunLock
from ._restore import Restorer
from ._retainer import Retainer
from ._retention import Retention
from ._signals import Preemption
from ._stats import ManagerStats
from ._tiers import (
    MemoryTier,
    RemoteTier,
    RootTier,
    Tiers,
    open_memory_tiers,
    open_remote_tier,
)
from ._timeline import Timeline

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
    """A public setting of the manager kept by one of its collaborators (``path``: the
    attributes leading to it). In a frozen policy, setting it (``mgr.keep_last = 1``) replaces
    that policy with one that differs in this field only."""

    def __init__(self, *path: str) -> None:
        self._path = path

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def _holder(self, mgr: Any) -> tuple[Any, Any]:
        for attr in self._path[:-1]:
            mgr = getattr(mgr, attr)
        return mgr, getattr(mgr, self._path[-1])

    def __get__(self, mgr: Any, owner: type | None = None) -> Any:
        return self if mgr is None else getattr(self._holder(mgr)[1], self._name)

    def __set__(self, mgr: Any, value: Any) -> None:
        parent, holder = self._holder(mgr)
        if dataclasses.is_dataclass(holder) and not isinstance(holder, type):
            setattr(parent, self._path[-1], dataclasses.replace(holder, **{self._name: value}))
        else:
            setattr(holder, self._name, value)


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
    (the epoch passed to ``step`` changed and epoch % N == 0), ``every_seconds`` or
    ``policy`` fires; ``policy=`` takes ``tg.OverheadBudget(0.02)``, ``tg.YoungDaly(mtbf=...)``, others.
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
            blocks only for a copy of the state to host memory. ``overlap``: make that copy
            while the next forward and backward run, an optimizer's ``step()`` waiting for it
            (default ``False``; see docs/manager.md for what else must wait).
        ``max_in_flight``: async saves running at once (default 2, each its own staged copy;
            one in a distributed job): a RAM tier's save goes on beside a slow one to disk.
        ``on_save_error``: ``"warn"`` (default) logs a failed save and keeps training;
            ``"raise"`` raises it.
        ``save_on_signals``: signals that request a final save at the next step boundary and
            set ``should_stop`` (default SIGTERM, what schedulers send before a kill).
        ``preemption_budget``: seconds from such a signal to the stop (default 25, inside
            Kubernetes' 30 s grace): the RAM and peer tiers first, then the directory.
        ``max_staging_bytes``: cap on host memory used to stage async saves (None: enough
            for the whole state, kept for reuse).
        ``lock_lease_seconds``: how long a lock whose holder runs on another machine stays
            valid without a heartbeat (one on this machine is freed when its holder dies).
        ``lock_timeout``: seconds to wait for a lock whose holder may be dead (another
            machine's) before ``CheckpointLockedError`` (None: one lease; 0: fail at once).
        ``process_group``: in a distributed job (``torch.distributed`` initialized) the group
            whose ranks share this manager (default: the whole job); ignored otherwise.
        ``timeout``: seconds any rank waits for the others in one of the manager's collectives
            (its saves and loads included) before every rank raises ``DistributedError``.
        ``upload_to``: a second, remote tier (e.g. ``"s3://bucket/run"``): each checkpoint
            committed in ``directory`` is copied there in the background (a failure logged,
            counted in ``uploads``, retried); ``restore()`` first downloads its newest when it
            is newer than the newest here. See docs/storage.md.
        ``keep_last_remote``: retention of the remote tier (None: keep every upload).
        ``upload_timeout``: seconds ``close()`` waits for pending uploads (default 600).
        ``upload_every``: the remote tier's own cadence: it takes the checkpoints of steps
            that are multiples of it (None: every checkpoint ``directory`` commits).
        ``storage_options``: options for the backend of a URL ``directory`` (``s3://``:
            ``endpoint``, ``region``, credentials, ...; fsspec: its filesystem's arguments).
        ``upload_storage_options``: the same for ``upload_to`` (each location has its own:
            a local ``directory`` and an ``s3://`` tier is the usual pair).
        ``ram_tier``: ``True`` keeps a copy of the newest checkpoint in host shared memory
            (``/dev/shm``), a path in that directory (a tmpfs); ``False`` (default) does not.
            A process restarted on the same node restores from memory the same save as the
            newest checkpoint here (``restored_from`` says which). Removed by ``close()`` (not
            on a crash); a failed copy is logged and counted in ``ram_tier_stats``, never
            raised. See docs/storage.md.
        ``peer_replicas``: with ``ram_tier`` in a distributed job, each rank's share is also
            kept in the memory of this many ranks on other nodes (``$TARDIGRADE_NODE`` or the
            host name): a node's loss restores from memory. See docs/failures.md.
        ``persist_every``: with ``ram_tier``, the directory takes only the saves of steps that
            are multiples of it; the others go to the RAM and peer tiers alone (None: all).
        ``run_id``: the id of this job across its restarts (default: ``TORCHELASTIC_RUN_ID``
            or ``SLURM_JOB_ID`` where set, else the directory alone): a RAM copy is restored
            only in the run that made it; another run's, left on this node, is removed.
        ``dedup``: write only what changed (default ``True``): each chunk of 1 MiB or more
            is an object in ``directory/.shared/`` written once (by the rank that writes it),
            referenced by every checkpoint holding those bytes, deleted once none does; the
            RAM, peer and remote tiers copy only the objects they lack. See docs/format.md.

    In a distributed job the constructor, ``step``, ``save``, ``stop_at_boundary``,
    ``restore``, ``steps``, ``latest``, ``exists``, ``load``, ``wait`` and ``close`` are
    collective: every rank calls them, in the same order. Each decision (whether this step
    saves, whether to stop after a signal that reached any rank, which checkpoint ``restore``
    picks, whether a background save succeeded) is the same on every rank; the directory
    checks, the lock, retention and the cleanup run on rank 0 only. With ``async_save`` each
    rank copies its own tensors to host memory and returns; the collective save runs in the
    background on a gloo group of its own, so it never meets training's own collectives. A
    background save is recorded on every rank at the same call (the first ``step`` that finds
    every rank's save finished, or the next save, ``wait``, ``restore`` or ``close``), as
    failed on every rank if it failed on any. With ``max_staging_bytes``, saves there are
    synchronous (said once, in a warning).
    """

    every_steps = _Knob("_cadence", "shorthand")
    every_epochs = _Knob("_cadence", "shorthand")
    every_seconds = _Knob("_cadence", "shorthand")
    keep_last = _Knob("_retainer", "policy")
    keep_every_steps = _Knob("_retainer", "policy")
    keep_best = _Knob("_retainer", "policy")
    best_metric = _Knob("_retainer", "policy")
    best_mode = _Knob("_retainer", "policy")
    on_save_error = _Knob("_outcomes")
    keep_last_remote, upload_timeout, upload_every = (_Knob("_uploads") for _ in range(3))

    def __init__(
        self,
        directory: str | os.PathLike[str],
        state: Any,
        *,
        every_steps: int | None = None,
        every_epochs: int | None = None,
        every_seconds: float | None = None,
        policy: Policy | None = None,
        keep_last: int | None = None,
        keep_every_steps: int | None = None,
        keep_best: int | None = None,
        best_metric: str | None = None,
        best_mode: str = "min",
        async_save: bool = True,
        on_save_error: str = "warn",
        save_on_signals: Iterable[int] = (signal.SIGTERM,),
        preemption_budget: float = 25.0,
        max_staging_bytes: int | None = None,
        lock_lease_seconds: float = 30.0,
        lock_timeout: float | None = None,
        process_group: Any = None,
        timeout: float = DEFAULT_TIMEOUT,
        upload_to: str | os.PathLike[str] | None = None,
        keep_last_remote: int | None = None,
        upload_timeout: float = 600.0,
        upload_every: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
        upload_storage_options: Mapping[str, Any] | None = None,
        ram_tier: bool | str | os.PathLike[str] = False,
        peer_replicas: int = 0,
        persist_every: int | None = None,
        run_id: str | None = None,
        dedup: bool = True,
        overlap: bool = False,
        max_in_flight: int = 2,
    ) -> None:
        # Every byte, listing and delete goes through the catalog over the storage contract.
        self._storage_options = storage_options
        self._catalog = check_run_directory(Catalog(check_directory(directory), storage_options))
        self.directory, self.state = self._catalog.root, state
        self._cadence = Cadence(check_policy(every_steps, every_epochs, every_seconds))
        retention = check_retention(keep_last, keep_every_steps, keep_best, best_metric, best_mode)
        on_error = check_one_of("on_save_error", on_save_error, ("warn", "raise"))
        modes = SaveModes.check(dedup, overlap, max_in_flight, async_save)
        self.should_stop = self._closed = self._ram_keep = False  # _ram_keep: see __exit__
        self.restored_from: str | None = None  # where restore() read its checkpoint
        self._uploads = Uploads.check(upload_to, keep_last_remote, upload_timeout, upload_every)
        signals, run = check_signals(save_on_signals), check_run_id(run_id)
        self._ranks = agreement(f"CheckpointManager({self.directory!r})", process_group, timeout)
        self._run_lock = RunLock(
            self._catalog, self.directory, lease_seconds=lock_lease_seconds, timeout=lock_timeout
        )
        self._wire(retention, on_error, persist_every, modes, policy)
        self._open()
        self._start(max_staging_bytes, signals, preemption_budget)
        if upload_to is not None:
            self._open_tier(lambda: self._remote_tier(upload_to, upload_storage_options))
        tiers = functools.partial(open_memory_tiers, ram_tier, peer_replicas, self._tiers)
        self._open_tier(lambda: tiers(root=self._catalog, ranks=self._ranks, run=run, state=state))

    def _wire(
        self, retention: Retention, on_error: str, persist_every: Any, modes: SaveModes, policy: Any
    ) -> None:
        """Make the collaborators, each given what it needs (none reaches back in here)."""
        catalog, ranks, lock = self._catalog, self._ranks, self._run_lock
        self._last_step: int | None = None
        self._last_epoch: int | None = None
        self._preemption = Preemption()
        self._staging: StagingReservation | None = None  # with async saves
        self._tiers = Tiers(RootTier(catalog, self._collective, persist_every))
        self._timeline = Timeline.of(catalog, lock)
        self._loading: set[int] = set()
        pending = PendingSaves()
        self._retainer = Retainer(
            retention,
            catalog=catalog,
            lock=lock,
            timeline=self._timeline,
            pending=pending,
            loading=self._loading,
            tiers=self._tiers,
            coordinator=ranks.coordinator,
        )
        self.stats = ManagerStats()
        self._cadence.wire(policy, self.stats)
        self._outcomes = Outcomes(
            catalog=catalog,
            ranks=ranks,
            tiers=self._tiers,
            timeline=self._timeline,
            pending=pending,
            stats=self.stats,
            on_save_error=on_error,
            teed=False,
            forget=self._retainer.forget,
            retain=self._retainer.retain,
        )
        self._restorer = Restorer(
            self.state,
            catalog=catalog,
            ranks=ranks,
            tiers=self._tiers,
            lock=lock,
            timeline=self._timeline,
            loading=self._loading,
        )
        self._dispatch = SaveDispatch(
            self.state,
            catalog=catalog,
            ranks=ranks,
            lock=lock,
            tiers=self._tiers,
            timeline=self._timeline,
            outcomes=self._outcomes,
            retainer=self._retainer,
            storage_options=self._storage_options,
            preemption=self._preemption,
            modes=modes,
        )

    def _open(self) -> None:
        """Check the directory and take its lock (on rank 0); raise its error on every rank."""

        def check_and_lock() -> None:
            self._run_lock.open(raising=self.on_save_error == "raise")

        # A directory another job holds raises CheckpointLockedError on every rank; a rank
        # that passed another directory makes a different call, a DistributedError everywhere.
        try:
            self._ranks.on_coordinator(f"CheckpointManager({self.directory!r})", check_and_lock)
        except BaseException:
            self._lock.release()  # perhaps taken here, but another rank failed: not ours to keep
            raise

    def _start(self, max_staging_bytes: int | None, signals: Any, budget: Any) -> None:
        """Listen for the preemption signals; start the background saver (as asked)."""
        asked = self._dispatch.modes.async_save
        async_save = self._ranks.split.async_saves(asked, max_staging_bytes)
        try:
            self._preemption.budget = check_positive("preemption_budget", budget, float)
            self._preemption.listen(signals)
            if async_save:
                self._dispatch.start_saver(max_staging_bytes)
        except BaseException:
            self._preemption.stop_listening()
            self._lock.release()
            raise
        if self._async is not None:
            self._outcomes.teed = True  # each save's sinks copy it into the faster tiers
            self._staging = StagingReservation(self._async, self.state, self._dispatch.staging_need)
            self._staging.restart()

    def _remote_tier(
        self, upload_to: str | os.PathLike[str], options: Mapping[str, Any] | None
    ) -> RemoteTier:
        return open_remote_tier(
            upload_to,
            options,
            root=self._catalog,
            ranks=self._ranks,
            lease_seconds=self._lock.lease,
            keep_last=self.keep_last_remote,
            timeout=self.upload_timeout,
            every=self.upload_every,
            retain=self._retainer.retain,
        )

    def _open_tier(self, make: Callable[[], Any]) -> None:
        """Add the tier ``make`` opens (None: none); on its error, close and raise."""
        try:
            self._tiers.add(make())
        except BaseException:
            self._close(meet=False)
            raise

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def _async(self) -> AsyncCheckpointer | None:
        """The background saver (None: saves are synchronous)."""
        return self._dispatch.saver

    @property
    def _lock(self) -> Lease:
        """The directory's lease (one job per directory)."""
        return self._run_lock.lease

    @property
    def ram_tier_stats(self) -> RamTierStats | None:
        """What the RAM tier did so far (None without ``ram_tier``)."""
        tier = self._tiers.first(MemoryTier)
        return None if tier is None else tier.stats

    @property
    def exit_code(self) -> int | None:
        """What the process should exit with once stopped by a preemption signal (128 + the
        signal, as a requeue reads it: ``sys.exit(mgr.exit_code)``); None otherwise."""
        return self._preemption.exit_code

    @property
    def uploads(self) -> UploadStats | None:
        """What the uploads to ``upload_to`` did so far: ``uploaded`` (the checkpoints'
        names, in order), ``failed`` attempts, ``last_error``, ``pending``; after ``close()``
        the final figures (None without ``upload_to``)."""
        tier = self._tiers.first(RemoteTier)
        return None if tier is None else tier.stats

    def close(self) -> None:
        """Wait for in-flight saves, apply retention, release the lock and signal handlers.

        Idempotent; also called on ``with`` exit. Every step runs even when an earlier one
        raises (say, an exception a signal handler delivered): the lock is always released,
        the first error raised at the end. In a distributed job every rank calls it; rank 0
        releases the lock once every rank is here."""
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
            self._dispatch.close_saver,
            *self._tiers.closers(clean=lambda: not (self._ram_keep or self.exit_code)),
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

    def steps(self) -> list[int]:
        """Steps of the committed checkpoints on disk, ascending (rank 0's listing everywhere)."""
        return list(
            self._agreed(f"CheckpointManager({self.directory!r}).steps()", self._catalog.steps)
        )

    def _agreed(self, what: str, here: Callable[[], Any]) -> Any:
        """``here()`` (a JSON value), computed by rank 0 and sent to every rank in a distributed
        job (ranks may see a shared directory at different moments); its error everywhere."""
        return self._ranks.shared(what, here)

    def latest(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def exists(self, step: int) -> bool:
        """Whether a committed checkpoint for ``step`` exists (rank 0's answer everywhere)."""
        return bool(
            self._agreed(
                f"CheckpointManager({self.directory!r}).exists({step!r})",
                lambda: self._catalog.visible(step_name(step)),
            )
        )

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

    def restore(self, step: int | None = None) -> int | None:
        """Restore the newest committed checkpoint that verifies into ``state``; return its step.

        Each candidate (the directory's, and those held whole in memory alone) is read once,
        from the fastest tier that holds that very save, every byte checked on the way. A
        corrupt, incomplete or unreadable newer one is skipped with a warning (and kept as
        evidence); damage found after bytes landed is overwritten by the next older one, or
        raises CorruptCheckpointError when none is left. Saves in flight are waited for first.
        With ``step`` given, restore exactly that one; later checkpoints are moved aside to
        ``step-N.abandoned-<time>`` (deleted once this run commits step N or later) and later
        memory copies dropped. Returns None when no tier holds a checkpoint.
        """
        self._check_open("restore")
        # Our own async save still in flight has a .tmp-* staging directory that the cleanup
        # would take for a dead writer's leftover: let it commit (or fail) first.
        self._drain(wait=True)
        restored = self._restorer.restore(step)
        if restored is None:
            return None
        self._last_step = restored.step
        self.restored_from = restored.source
        self._last_epoch = restored.epoch
        self._cadence.saved()
        if self._staging is not None:
            self._staging.restart()  # the restored state may have grown (moments)
        return restored.step

    # -- saving ----------------------------------------------------------------------------

    def _agree(self, call: str, doing: str, mine: int = 0) -> int:
        """Consume a pending preemption signal; the level agreed for this call on every rank.

        ``call`` names the public call (``".step(5)"``) in a waiting rank's error; ``mine``
        is this rank's other reason (``DUE``). One tiny all-reduce in a distributed job, which
        also tells whether any rank's background save still runs; when none does, every rank
        records its finished saves now (the ranks finish a collective save moments apart)."""
        if self._preemption.taken(doing):
            mine = PREEMPTED
        level, settled = self._ranks.level(mine, self._outcomes.pending.running, call)
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
        timed = self._ranks.coordinator and self._cadence.due_by_time(self._dispatch.in_flight)
        level = self._agree(f".step({step})", f"saving step {step}", DUE if timed else NOTHING)
        if level == PREEMPTED:
            try:
                saved = self._save(step, epoch, metrics, sync=True, from_step=True, preempted=True)
            finally:
                self.should_stop = True  # even if the save raised: the signal is consumed
            self._advance(step, epoch)
            return saved
        due = level == DUE or self._cadence.policy.due_by_count(step, epoch, self._last_epoch)
        saved = due and self._save(step, epoch, metrics, sync=False, from_step=True)
        if not saved and self._staging is not None:
            self._staging.tick()
        self._advance(step, epoch)
        return saved

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
            ok = self._save(step, epoch, metrics, sync=preempted, force=force, preempted=preempted)
        finally:
            if preempted:
                self.should_stop = True  # even if the save raised: the signal is consumed
        self._advance(max(step, self._last_step or 0), epoch)
        return ok

    def _save(self, step: int, epoch: int | None, metrics: Any, **how: bool) -> bool:
        saved = self._dispatch.save(step, epoch, metrics, **how)
        if saved:
            self._cadence.saved()
        return saved

    def _drain(self, *, wait: bool, agree: bool = True) -> None:
        """Record the outcome of finished async saves (all of them when ``wait``)."""
        self._dispatch.drain(wait=wait, agree=agree)

    def wait_staged(self) -> None:
        """Block until an async save copying the state beside training (``overlap``) copied
        it: call it before updating the state other than by an optimizer's ``step()``."""
        if self._async is not None:
            self._async.wait_staged()

    def wait(self) -> None:
        """Block until in-flight saves are committed (or failed and reported).

        In a distributed job every rank calls it (it agrees on each save's outcome).
        """
        self._check_open("wait")
        self._drain(wait=True)

    # -- retention -------------------------------------------------------------------------

    def keep(self, steps: Sequence[int]) -> set[int]:
        """Which of ``steps`` (committed, ascending) the retention policy keeps.

        Checkpoints of an abandoned timeline (above a step restored explicitly) are neither
        ranked nor deleted here; this run replaces them as it saves those steps again.
        """
        return self._retainer.keep(steps)
