"""Retention carried out: which committed checkpoints of the root the policy retires, deleted.

``Retention`` (``_retention``) decides, purely; the :class:`Retainer` lists the root, reads
what the policy ranks by (each checkpoint's metric, whether a restore can read it; both
remembered per step), spares the busy ones (being read, written, or copied by another tier)
and deletes the rest while the run's lock is still this manager's.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from .._catalog import Catalog, step_in_name, step_name
from ..errors import TardigradeError
from ._pending import PendingSaves
from ._preflight import RunLock
from ._retention import Retention
from ._tiers import Tiers
from ._timeline import Timeline

log = logging.getLogger("tardigrade")


class Retainer:
    """Applies ``policy`` to the root of ``catalog`` after each committed save (on the
    coordinator only: rank 0 deletes, the other ranks' retainers do nothing)."""

    def __init__(
        self,
        policy: Retention,
        *,
        catalog: Catalog,
        lock: RunLock,
        timeline: Timeline,
        pending: PendingSaves,
        loading: set[int],
        tiers: Tiers,
        coordinator: bool,
    ) -> None:
        self.policy = policy
        self.catalog = catalog
        self.lock = lock
        self.timeline = timeline
        self.pending = pending
        self.loading = loading  # steps being read: never deleted under their reader
        self.tiers = tiers
        self.coordinator = coordinator
        self._metrics: dict[int, float | None] = {}
        self._readable: dict[int, bool] = {}

    def forget(self, step: int) -> None:
        """``step`` was saved again or removed: its metric and readability are read anew."""
        self._metrics.pop(step, None)
        self._readable.pop(step, None)

    def metric(self, step: int) -> float | None:
        """The policy's ``best_metric`` that checkpoint ``step`` recorded (None: not ranked)."""
        if step not in self._metrics:
            value = None
            try:
                metrics = self.catalog.manifest(step_name(step)).raw.get("metrics") or {}
                v = metrics.get(self.policy.best_metric)
                value = float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None
            except TardigradeError:
                value = None
            self._metrics[step] = value
        return self._metrics[step]

    def readable(self, step: int) -> bool:
        """Whether the manifest of ``step`` reads and validates."""
        if step not in self._readable:
            try:
                self.catalog.manifest(step_name(step))
                self._readable[step] = True
            except Exception as e:
                log.warning(
                    "tardigrade: %s cannot be restored: %s", self.catalog.path(step_name(step)), e
                )
                self._readable[step] = False
        return self._readable[step]

    def keep(self, steps: Sequence[int]) -> set[int]:
        """Which of ``steps`` (committed, ascending) the policy keeps; the abandoned timeline's
        are neither ranked nor deleted (the run replaces them as it saves those steps)."""
        return self.policy.keep(
            steps, readable=self.readable, metric=self.metric, abandoned=self.timeline.abandoned
        )

    def retain(self) -> None:
        """Retire what the policy no longer keeps (nothing unless it is active)."""
        if not self.coordinator or not self.policy.active:
            return
        try:
            steps = self.catalog.steps()
        except OSError as e:
            # The save is committed and counted; the old checkpoints go at the next save.
            log.warning(
                "tardigrade: could not list %s to apply retention (tried again after the next "
                "save): %s",
                self.catalog.root,
                e,
            )
            return
        # A step being loaded, written (a replace), or not yet copied by another tier.
        busy = self.loading | self.pending.steps()
        busy |= {s for n in self.tiers.pinned() if (s := step_in_name(n)) is not None}
        doomed = self.policy.retire(
            steps,
            readable=self.readable,
            metric=self.metric,
            abandoned=self.timeline.abandoned,
            busy=busy,
        )
        if not doomed or not self.lock.still_ours("removing old checkpoints"):
            return
        for s in doomed:
            if self.catalog.remove(step_name(s), "retention"):
                self.forget(s)
        try:  # the shared data only the removed checkpoints referenced
            self.catalog.sweep_shared(grace=False)
        except (OSError, TardigradeError) as e:
            log.warning("tardigrade: removing unreferenced shared data: %s", e)
