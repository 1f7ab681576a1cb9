"""``CheckpointManager.restore()``: the candidates, the loop over them, and the fallback.

Rank 0 cleans up and lists the root; every rank then tries the same candidates, newest
first, each read once from the fastest tier that holds it on every rank (the root last).
A candidate that fails is skipped, and the next older one is restored over whatever bytes
the failed one left in the live state; what cannot be, raises.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

from .._catalog import Catalog, step_name
from ..errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StateMismatchError,
    StorageError,
    TardigradeError,
)
from ._agreement import Agreement
from ._preflight import RunLock
from ._tiers import Tier, Tiers
from ._timeline import Timeline

log = logging.getLogger("tardigrade")


@dataclass
class Restored:
    """What ``restore()`` read: the step, its epoch, where its bytes came from."""

    step: int
    epoch: int | None
    source: str
    tier: Tier


@dataclass
class _Trouble:
    """What the candidates that failed left behind."""

    damaged: str | None = None  # a candidate that failed after bytes reached the live state
    unread: StorageError | None = None  # the last candidate storage failed to read


class Restorer:
    """Restores the root's checkpoints into ``state`` through ``tiers`` (see the module)."""

    def __init__(
        self,
        state: Any,
        *,
        catalog: Catalog,
        ranks: Agreement,
        tiers: Tiers,
        lock: RunLock,
        timeline: Timeline,
        loading: set[int],
    ) -> None:
        self.state = state
        self.catalog = catalog
        self.ranks = ranks
        self.tiers = tiers
        self.lock = lock
        self.timeline = timeline
        self.loading = loading  # steps being read: retention spares them
        self.what = f"CheckpointManager({catalog.root!r}).restore"

    def restore(self, step: int | None) -> Restored | None:
        """Restore ``step`` (None: the newest that verifies); None when there is none."""
        memory = self.tiers.steps()  # saved to the faster tiers alone (persist_every)
        if step is None:
            # A fresh machine: the remote tier's newest, if newer than what memory holds too.
            self.tiers.fetch_newer(above=max(memory, default=None))
        found = self.ranks.shared(
            f"{self.what}({step!r})", lambda: self._candidates(step, sorted(memory))
        )
        committed, candidates = found["steps"], found["candidates"]
        trouble = _Trouble()
        for s in candidates:
            restored = self._try(s, trouble, exact=step is not None, epoch=memory.get(s, ...))
            if restored is None:
                continue
            self.tiers.forget_after(s)  # later copies in memory: a timeline left behind
            # Checkpoints above an explicit restore(step) leave the listing, so that after a
            # crash this timeline's newest is restored, not theirs. Newer ones restore()
            # skipped stay in place as evidence (a crash skips them again) and are replaced
            # as this run saves their steps.
            self.timeline.abandoned = {x for x in committed if x > s}
            if step is not None and self.timeline.abandoned:
                self.timeline.abandoned = set(
                    self.ranks.shared(
                        f"{self.what}({s}): setting the later checkpoints aside",
                        functools.partial(self.timeline.abandon_after, s, committed),
                    )
                )
            if self.ranks.coordinator:
                where = self.catalog.path(step_name(s))
                if restored.source == where:
                    log.info("tardigrade: restored %s", where)
                else:
                    what = restored.tier.where
                    log.info("tardigrade: restored %s from %s (%s)", where, what, restored.source)
            return restored
        _give_up(self.catalog, committed, trouble)
        return None

    def _candidates(self, step: int | None, memory: list[int]) -> dict[str, list[int]]:
        """Clean up, then the committed steps and those ``restore(step)`` tries, newest first
        (``memory``: the steps held whole in the faster tiers alone)."""
        self.tidy()
        committed, uncommitted, recorded, fenced = self.catalog.scan()
        if fenced and self.lock.may_delete("removing commits of a zombie"):
            self.catalog.retire_fenced(fenced)  # passed over by the scan in any case
        if step is not None:
            if step not in committed and step not in memory:
                raise CheckpointNotFoundError(
                    f"{self.catalog.path(step_name(step))}: no committed checkpoint for step "
                    f"{step}; available: {sorted({*committed, *memory})}"
                )
            return {"steps": committed, "candidates": [step]}
        for n in uncommitted:
            log.warning(
                "tardigrade: skipping checkpoint %s: it has no manifest.json (a save that never "
                "committed, or a copy still in progress); kept for inspection, and moved aside "
                "if this run saves that step again",
                self.catalog.path(n),
            )
        skip = self.timeline.passed_over(committed) if recorded else set()
        steps = sorted({*committed, *memory}, reverse=True)
        return {"steps": committed, "candidates": [s for s in steps if s not in skip]}

    def tidy(self) -> None:
        """Remove what dead writers left (fencing: only while the lock is still ours)."""
        if self.lock.may_delete("cleaning up leftovers"):
            self.catalog.tidy(fenced=False)  # fenced ones: from the listing that follows

    def _try(self, s: int, trouble: _Trouble, *, exact: bool, epoch: Any) -> Restored | None:
        """Restore candidate ``s``; None when it failed and an older one may be tried.
        ``epoch``: its epoch when the faster tiers alone hold it, else ``...`` (the root's
        manifest says)."""
        path = self.catalog.path(step_name(s))
        self.loading.add(s)
        loading = False
        try:
            in_root = epoch is ...
            if in_root:
                epoch = self.ranks.shared(
                    f"{self.what}(): manifest of step {s}",
                    lambda: self.catalog.manifest(step_name(s)).epoch,
                )
            loading = True
            # One pass: each byte is read once, into the live state, and every byte of the
            # checkpoint (unread tensors and headers included) is checked on the way.
            return Restored(s, epoch, *self._load(step_name(s), in_root))
        except StateMismatchError:
            raise  # the live state does not fit: an older checkpoint would not fit either
        except Exception as e:
            # Damaged, or unreadable here (permissions, a socket or device in place of a
            # file, an I/O error), or failing in a way no check foresaw (a reader's bug):
            # either way this one cannot be restored; an older may. Damage found before a
            # byte lands (manifest, structure, sizes) leaves the live state untouched; damage
            # in tensor bytes is found as they are read, so some live tensors may hold them:
            # the next older checkpoint rewrites every live tensor (a full checkpoint of this
            # state covers them all) and calls each load_state_dict(), or restore raises
            # rather than train from a mix.
            if loading and self.ranks.live_touched(e, f"{self.what}() (after a failed candidate)"):
                trouble.damaged = path
            if isinstance(e, StorageError):
                trouble.unread = e
            if exact:
                raise
            log.warning(
                "tardigrade: skipping checkpoint %s: %s (kept on disk; trying the next older one)",
                path,
                e if isinstance(e, TardigradeError) else f"{type(e).__name__}: {e}",
            )
            return None
        finally:
            self.loading.discard(s)

    def _load(self, name: str, in_root: bool) -> tuple[str, Tier]:
        """Read ``name`` into the live state from the fastest tier that holds this very save
        on every rank (each rank its own share), falling back to the next; the root last
        (``in_root``: it holds ``name``). Returns where."""
        sources = self.tiers.sources()
        touched = False  # whether a failed faster tier left bytes in the live state
        for tier in sources[:-1]:
            if not self._held_everywhere(tier, name):
                continue
            try:
                return tier.restore(name, self.state), tier
            except StateMismatchError:
                raise
            except Exception as e:
                touched = touched or self.ranks.live_touched(
                    e, f"{self.what}() (from {tier.where})"
                )
                log.warning(
                    "tardigrade: restoring %s from %s failed (%s); reading it from the next tier",
                    name,
                    tier.where,
                    e,
                )
        try:
            if not in_root:
                raise CheckpointNotFoundError(
                    f"{name} was saved to the faster tiers alone, and none could restore it"
                )
            return sources[-1].restore(name, self.state), sources[-1]
        except TardigradeError as e:
            if touched:
                e.live_overwritten = True  # type: ignore[attr-defined]  # read by _try's check
            raise

    def _held_everywhere(self, tier: Tier, name: str) -> bool:
        """Whether every rank holds its share of ``name`` in ``tier`` (a rank restarted on
        another node, or whose copy failed, holds none: then nobody reads from it)."""
        mine = tier.holds(name)
        held = self.ranks.everywhere(mine, f"{self.what}(): {name} in every {tier.where}")
        if mine and not held:
            log.info("tardigrade: not every rank holds %s in %s; reading on", name, tier.where)
        return held


def _give_up(catalog: Catalog, committed: list[int], trouble: _Trouble) -> None:
    """No candidate restored: raise when the live state or the storage says so."""
    if trouble.damaged is not None:
        raise CorruptCheckpointError(
            f"{trouble.damaged}: damaged tensor bytes were found while restoring it, after some "
            "had been read into the live state, and no older checkpoint could be restored over "
            "them: the live state is no longer as it was built. Rebuild it (restart the "
            "process) and restore again, or delete the damaged checkpoints "
            "(`tardigrade verify` names them) to start from scratch."
        )
    if trouble.unread is not None:
        # Not None ("nothing to resume"): training would start from scratch and its saves
        # would retire the checkpoints that only could not be read just now.
        raise StorageError(
            trouble.unread.errno,
            f"{catalog.root}: no checkpoint could be restored, and storage failed reading at "
            f"least one of them ({trouble.unread}); committed steps: {committed}. Nothing was "
            "restored and nothing was deleted: fix the storage (or wait for it) and restore "
            "again.",
        )
