"""CheckpointManager: when to save, what to keep, and resuming from the newest good checkpoint.

It unifies Paddle's ``CheckpointConfig`` (one directory per job, numbered checkpoints, step and
epoch intervals, a maximum kept, automatic restore of the latest), Caffe2's
``CheckpointManager`` (failed saves do not kill the job, per-save timing stats) and CNTK's
"external state" (anything with ``state_dict()`` in the state tree).
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

from ._async import AsyncCheckpointer, SaveFuture
from ._load import Key, load, open_manifest, verify
from ._lock import DirectoryLock
from ._save import SaveResult, save
from .errors import (
    CheckpointExistsError,
    CheckpointLockedError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidArgumentError,
    SaveError,
    StateMismatchError,
    StorageError,
    TardigradeError,
    UnsupportedFormatError,
    UnsupportedTypeError,
)
from .storage.local import fsync_dir, lock_dir

log = logging.getLogger("tardigrade")

_NAME = re.compile(r"^step-(\d{9,})$")
# A committed checkpoint a replace without atomic swap moved aside (storage/local.py).
# Any id is accepted: a checkpoint is put back, never deleted, whoever named it.
_REPLACED = re.compile(r"^\.tmp-(.+)-replaced-[^-]+$")


@dataclass(frozen=True)
class Tidied:
    """One leftover that :func:`tidy` dealt with."""

    name: str
    action: str  # "removed" or "recovered"
    nbytes: int


def tidy(directory: str, *, dry_run: bool = False) -> list[Tidied]:
    """Clean up after writers that died in ``directory``.

    Only ``.tmp-*`` directories are considered, and only those no live process holds: every
    save holds an flock on its staging directory (and on a checkpoint it moves aside) until it
    commits or gives up, so a save in flight, by this process or any other, is skipped. A dead
    save's staging directory (or an interrupted retention delete) is removed. A committed
    checkpoint that a crashed replace had moved aside (``.tmp-NAME-replaced-*``) is put back
    under its name when that name is free, whatever the name; if a committed checkpoint holds
    the name, the replace had finished and the old copy is removed. Committed checkpoints are
    never touched. ``dry_run`` reports without changing anything.
    """
    done = []
    for n in sorted(os.listdir(directory)):
        path = os.path.join(directory, n)
        if not n.startswith(".tmp-") or os.path.islink(path) or not os.path.isdir(path):
            continue
        fd = lock_dir(path, wait=False)
        if fd is None:
            continue  # a live save holds it, or it is already gone
        try:
            done.extend(_tidy_one(directory, n, dry_run))
        finally:
            os.close(fd)
    return done


def _tidy_one(directory: str, n: str, dry_run: bool) -> list[Tidied]:
    path = os.path.join(directory, n)
    m = _REPLACED.match(n)
    if m and os.path.isfile(os.path.join(path, "manifest.json")):
        name = m.group(1)
        target = os.path.join(directory, name)
        if not os.path.lexists(target):
            if not dry_run:
                os.rename(path, target)
                fsync_dir(directory)
                log.warning("tardigrade: recovered %s from an interrupted replace", name)
            return [Tidied(name, "recovered", _tree_bytes(path if dry_run else target))]
        if not os.path.isfile(os.path.join(target, "manifest.json")):
            log.warning(
                "tardigrade: %s holds the checkpoint an interrupted replace moved aside, but %s "
                "is taken by something that is not a checkpoint; leaving both in place",
                path,
                target,
            )
            return []
    nbytes = _tree_bytes(path)
    if not dry_run:
        log.info("tardigrade: removing leftover %s from an interrupted save", n)
        shutil.rmtree(path, ignore_errors=True)
    return [Tidied(n, "removed", nbytes)]


def _tree_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def step_name(step: int) -> str:
    return f"step-{step:09d}"


@dataclass(frozen=True)
class SaveStats:
    """One save attempt: step, bytes, seconds blocked in the caller, total seconds, outcome."""

    step: int
    nbytes: int
    blocking_seconds: float
    total_seconds: float
    ok: bool
    error: str | None = None

    @property
    def throughput_gbps(self) -> float:
        return self.nbytes / self.total_seconds / 1e9 if self.total_seconds > 0 else 0.0


class ManagerStats(list[SaveStats]):
    """Every save attempt, oldest first, plus totals."""

    @property
    def failed(self) -> int:
        return sum(not s.ok for s in self)

    @property
    def succeeded(self) -> int:
        return sum(s.ok for s in self)

    @property
    def blocking_seconds(self) -> float:
        return sum(s.blocking_seconds for s in self)

    @property
    def total_seconds(self) -> float:
        return sum(s.total_seconds for s in self)


def _check_signals(signals: Iterable[int]) -> tuple[int, ...]:
    try:
        out = tuple(signals)
    except TypeError:
        raise InvalidArgumentError(
            f"save_on_signals must be a tuple of signals, got {signals!r}"
        ) from None
    valid = signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}
    for sig in out:
        if sig not in valid:
            raise InvalidArgumentError(
                f"save_on_signals: {sig!r} is not a signal that can be caught (SIGKILL and "
                "SIGSTOP cannot be)"
            )
    return out


def _positive(name: str, v: Any, kind: type = int) -> Any:
    if v is None:
        return None
    ok = (type(v) is int or (kind is float and type(v) is float)) and v > 0
    if not ok:
        raise InvalidArgumentError(f"{name} must be a positive {kind.__name__} or None, got {v!r}")
    return v


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
    training go on; ``"raise"`` raises it. A signal in ``save_on_signals`` makes the next
    ``step()`` save synchronously and set ``should_stop``.
    """

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
    ) -> None:
        if not isinstance(directory, (str, os.PathLike)):
            raise InvalidArgumentError(f"directory must be a path, got {directory!r}")
        if "://" in os.fspath(directory):
            raise InvalidArgumentError(
                f"{directory}: URLs are not supported by this build yet; use a local directory"
            )
        self.directory = os.path.abspath(os.fspath(directory))
        self.state = state
        self.every_steps = _positive("every_steps", every_steps)
        self.every_epochs = _positive("every_epochs", every_epochs)
        self.every_seconds = _positive("every_seconds", every_seconds, float)
        self.keep_last = _positive("keep_last", keep_last)
        self.keep_every_steps = _positive("keep_every_steps", keep_every_steps)
        self.keep_best = _positive("keep_best", keep_best)
        if best_mode not in ("min", "max"):
            raise InvalidArgumentError(f"best_mode must be 'min' or 'max', got {best_mode!r}")
        if keep_best is not None and not isinstance(best_metric, str):
            raise InvalidArgumentError("keep_best needs best_metric: the metric name to rank by")
        self.best_metric = best_metric
        self.best_mode = best_mode
        if on_save_error not in ("warn", "raise"):
            raise InvalidArgumentError(
                f"on_save_error must be 'warn' or 'raise', got {on_save_error!r}"
            )
        self.on_save_error = on_save_error
        if not isinstance(async_save, bool):
            raise InvalidArgumentError(f"async_save must be a bool, got {async_save!r}")
        self.stats = ManagerStats()
        self.should_stop = False
        self._closed = False
        self._last_step: int | None = None
        self._last_epoch: int | None = None
        self._last_save_time = time.monotonic()
        self._restored_step: int | None = None
        self._lock_error: OSError | None = None
        # Steps above a restored older step, from the run that was abandoned; each is replaced
        # (once) when this run saves that step again, and none of them counts for retention.
        self._abandoned: set[int] = set()
        self._pending: list[tuple[int, SaveFuture]] = []
        self._loading: set[int] = set()
        self._metric_cache: dict[int, float | None] = {}
        self._signalled: int | None = None
        self._old_handlers: dict[int, Any] = {}
        self._async = AsyncCheckpointer(max_staging_bytes=max_staging_bytes) if async_save else None
        self._lock = DirectoryLock(self.directory, lease_seconds=lock_lease_seconds)
        signals = _check_signals(save_on_signals)
        self._take_lock()
        try:
            self._install_signals(signals)
        except BaseException:
            self._lock.release()
            raise

    # -- lifecycle -------------------------------------------------------------------------

    def _take_lock(self) -> bool:
        try:
            self._lock.acquire()
            self._lock_error = None
            return True
        except CheckpointLockedError:
            raise
        except OSError as e:
            self._lock_error = e
            if self.on_save_error == "raise":
                raise SaveError(f"{self.directory}: cannot create or lock it: {e}") from e
            log.error(
                "tardigrade: cannot create or lock checkpoint directory %s: %s. Training "
                "continues but checkpoints will FAIL until this is fixed.",
                self.directory,
                e,
            )
            return False

    def _install_signals(self, signals: Sequence[int]) -> None:
        if not signals:
            return
        if threading.current_thread() is not threading.main_thread():
            log.warning("tardigrade: save_on_signals ignored: manager not created in main thread")
            return
        for sig in signals:
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: saving inside a signal handler could interrupt a half-mutated state.
        self._signalled = signum

    def close(self) -> None:
        """Wait for in-flight saves, apply retention, release the lock and signal handlers.

        Idempotent; also called on ``with`` exit.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._drain(wait=True)
        finally:
            if self._async is not None:
                self._async.close()
            for sig, handler in self._old_handlers.items():
                signal.signal(sig, handler)
            self._old_handlers.clear()
            self._lock.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise InvalidArgumentError(f"CheckpointManager.{what}() called after close()")

    # -- listing ---------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Steps of the committed checkpoints on disk, ascending."""
        try:
            names = os.listdir(self.directory)
        except (FileNotFoundError, NotADirectoryError):
            return []
        out = []
        for n in names:
            m = _NAME.match(n)
            if m and os.path.isfile(os.path.join(self.directory, n, "manifest.json")):
                out.append(int(m.group(1)))
        return sorted(out)

    def latest(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def exists(self, step: int) -> bool:
        """Whether a committed checkpoint for ``step`` exists."""
        return os.path.isfile(os.path.join(self.path(step), "manifest.json"))

    def path(self, step: int) -> str:
        """The directory of the checkpoint for ``step``."""
        return os.path.join(self.directory, step_name(step))

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
            return load(self.path(step), keys=keys)
        finally:
            self._loading.discard(step)

    # -- restore ---------------------------------------------------------------------------

    def _remove_leftovers(self) -> None:
        """Remove tmp dirs of dead writers; put back a checkpoint a crashed replace moved aside."""
        if self._lock.held:
            tidy(self.directory)

    def restore(self, step: int | None = None) -> int | None:
        """Restore the newest committed checkpoint that verifies into ``state``; return its step.

        A corrupt or incomplete newer checkpoint is skipped with a warning (and kept on disk as
        evidence). With ``step`` given, restore exactly that one; later checkpoints then belong
        to an abandoned timeline and are replaced as this run saves those steps again. Returns
        None when the directory holds no checkpoint.
        """
        self._check_open("restore")
        if os.path.isdir(self.directory):
            self._remove_leftovers()
        if step is not None:
            if not self.exists(step):
                raise CheckpointNotFoundError(
                    f"{self.path(step)}: no committed checkpoint for step {step}; available: "
                    f"{self.steps()}"
                )
            candidates = [step]
        else:
            candidates = list(reversed(self.steps()))
            for n in sorted(os.listdir(self.directory)) if os.path.isdir(self.directory) else ():
                if _NAME.match(n) and not os.path.isfile(
                    os.path.join(self.directory, n, "manifest.json")
                ):
                    log.warning(
                        "tardigrade: skipping checkpoint %s: it has no manifest.json (the save "
                        "never committed); kept on disk for inspection",
                        os.path.join(self.directory, n),
                    )
        for s in candidates:
            self._loading.add(s)
            try:
                verify(self.path(s))
                m = open_manifest(self.path(s))[2]
                load(self.path(s), into=self.state, verify=False)
            except StateMismatchError:
                raise
            except (CorruptCheckpointError, UnsupportedFormatError, CheckpointNotFoundError) as e:
                if step is not None:
                    raise
                log.warning("tardigrade: skipping checkpoint %s: %s", self.path(s), e)
                continue
            finally:
                self._loading.discard(s)
            self._restored_step = s
            self._abandoned = {x for x in self.steps() if x > s}
            self._last_step = s
            self._last_epoch = m.epoch
            self._last_save_time = time.monotonic()
            log.info("tardigrade: restored %s", self.path(s))
            return s
        return None

    # -- saving ----------------------------------------------------------------------------

    def _due(self, step: int, epoch: int | None) -> bool:
        if self.every_steps is not None and step % self.every_steps == 0:
            return True
        if (
            self.every_epochs is not None
            and epoch is not None
            and epoch != self._last_epoch
            and self._last_epoch is not None
            and epoch % self.every_epochs == 0
        ):
            return True
        return (
            self.every_seconds is not None
            and time.monotonic() - self._last_save_time >= self.every_seconds
        )

    def step(
        self, step: int, *, epoch: int | None = None, metrics: Mapping[str, float] | None = None
    ) -> bool:
        """Report a finished training step; save if a policy says so. Returns whether it saved.

        Steps must increase. After a preemption signal this saves synchronously and sets
        ``should_stop``.
        """
        self._check_open("step")
        if type(step) is not int or step < 0:
            raise InvalidArgumentError(f"step must be a non-negative int, got {step!r}")
        if self._last_step is not None and step <= self._last_step:
            raise InvalidArgumentError(
                f"step {step} is not after the previous step {self._last_step}; steps must "
                "increase (did you forget start = mgr.restore() + 1?)"
            )
        self._drain(wait=False)
        if self._signalled is not None:
            signum, self._signalled = self._signalled, None
            log.warning("tardigrade: signal %s received: saving step %d and stopping", signum, step)
            saved = self._save(step, epoch, metrics, sync=True)
            self.should_stop = True
            self._advance(step, epoch)
            return saved
        saved = self._due(step, epoch) and self._save(step, epoch, metrics, sync=False)
        self._advance(step, epoch)
        return saved

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
        retention for a save also runs then.

        ``force=True`` replaces an existing checkpoint for this step.
        """
        self._check_open("save")
        if type(step) is not int or step < 0:
            raise InvalidArgumentError(f"step must be a non-negative int, got {step!r}")
        self._drain(wait=False)
        ok = self._save(step, epoch, metrics, sync=False, force=force)
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
    ) -> bool:
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
        try:
            if not self._lock.held and not self._take_lock():
                raise SaveError(
                    f"{self.directory}: the checkpoint directory cannot be created or locked: "
                    f"{self._lock_error}"
                )
            self._lock.check()
            replace = force
            if self.exists(step) and not force:
                if step in self._abandoned:
                    replace = True  # an abandoned future after resuming from an older step
                else:
                    raise CheckpointExistsError(
                        f"{self.path(step)}: a checkpoint for step {step} already exists; "
                        "steps must not repeat (pass force=True to replace it)."
                    )
            kw = dict(overwrite=replace, step=step, epoch=epoch, metrics=metrics)
            if self._async is not None and not sync:
                fut = self._async.save(self.path(step), self.state, **kw)  # type: ignore[arg-type]
                assert fut is not None
                fut.observed = True  # the manager reports the outcome itself
                self._pending.append((step, fut))
            else:
                if self._async is not None:
                    self._drain(wait=True)
                res = save(self.path(step), self.state, **kw)  # type: ignore[arg-type]
                self._record_ok(step, res)
        except (InvalidArgumentError, CheckpointExistsError, UnsupportedTypeError):
            raise  # a programming error, not a storage failure: never swallowed
        except (SaveError, StorageError, CheckpointLockedError, OSError) as e:
            self._record_failure(step, e, time.perf_counter() - started)
            return False
        self._last_save_time = time.monotonic()
        return True

    def _record_ok(self, step: int, res: SaveResult) -> None:
        self._metric_cache.pop(step, None)  # a replaced checkpoint has a new metric
        self._abandoned.discard(step)
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
        if self.keep_last is not None or self.keep_every_steps or self.keep_best:
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

    def _drain(self, *, wait: bool) -> None:
        """Record the outcome of finished async saves (all of them when ``wait``)."""
        while self._pending:
            step, fut = self._pending[0]
            if not wait and not fut.done():
                return
            # Off the list before recording: recording may raise (on_save_error="raise"),
            # and a failure must be reported exactly once.
            self._pending.pop(0)
            exc = fut.exception()
            if exc is None:
                self._record_ok(step, fut.result())
            else:
                self._record_failure(step, exc, fut.blocking_seconds)

    def wait(self) -> None:
        """Block until in-flight saves are committed (or failed and reported)."""
        self._check_open("wait")
        self._drain(wait=True)

    # -- retention -------------------------------------------------------------------------

    def _metric(self, step: int) -> float | None:
        if step not in self._metric_cache:
            value = None
            try:
                metrics = open_manifest(self.path(step))[2].raw.get("metrics") or {}
                v = metrics.get(self.best_metric)
                value = float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None
            except TardigradeError:
                value = None
            self._metric_cache[step] = value
        return self._metric_cache[step]

    def keep(self, steps: Sequence[int]) -> set[int]:
        """Which of ``steps`` (committed, ascending) the retention policy keeps.

        Checkpoints of an abandoned timeline (above a step restored explicitly) are neither
        ranked nor deleted here; this run replaces them as it saves those steps again.
        """
        abandoned = [s for s in steps if s in self._abandoned]
        steps = [s for s in steps if s not in self._abandoned]
        if not steps:
            return set(abandoned)
        keep = {steps[-1]}
        if self.keep_last is not None:
            keep.update(steps[-self.keep_last :])
        if self.keep_every_steps is not None:
            keep.update(s for s in steps if s % self.keep_every_steps == 0)
        if self.keep_best is not None:
            ranked = [(m, s) for s in steps if (m := self._metric(s)) is not None]
            ranked.sort(reverse=self.best_mode == "max")
            keep.update(s for _, s in ranked[: self.keep_best])
        return keep | set(abandoned)

    def _retain(self) -> None:
        steps = self.steps()
        keep = self.keep(steps)
        for s in steps:
            if s in keep or s in self._loading:
                continue
            # Rename first so a crash mid-delete never leaves a half-deleted "committed" dir.
            doomed = os.path.join(self.directory, f".tmp-deleting-{step_name(s)}")
            try:
                os.rename(self.path(s), doomed)
            except OSError as e:
                log.warning("tardigrade: could not remove old checkpoint %s: %s", self.path(s), e)
                continue
            shutil.rmtree(doomed, ignore_errors=True)
            self._metric_cache.pop(s, None)
            log.info("tardigrade: removed old checkpoint %s (retention)", step_name(s))
