"""Retention: which committed checkpoints to keep, and so which to retire after a save.

Pure: the caller says which steps exist, which of them a restore can read and their metrics;
nothing here lists or deletes.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Retention:
    """Keep the union of the last ``keep_last``, every ``keep_every_steps``-th step and the
    ``keep_best`` best by ``best_metric`` (lowest first with ``best_mode="min"``).

    With all three None every checkpoint is kept. Whatever the knobs, the newest checkpoint
    and the newest one a restore can read are kept.

    >>> r = Retention(keep_last=2)
    >>> r.retire([1, 2, 3, 4], readable=lambda s: s != 4, metric=lambda s: None)
    [1]
    """

    keep_last: int | None = None
    keep_every_steps: int | None = None
    keep_best: int | None = None
    best_metric: str | None = None
    best_mode: str = "min"

    @property
    def active(self) -> bool:
        """Whether any checkpoint can ever be retired (False: everything is kept)."""
        return self.keep_last is not None or bool(self.keep_every_steps) or bool(self.keep_best)

    def keep(
        self,
        steps: Sequence[int],
        *,
        readable: Callable[[int], bool],
        metric: Callable[[int], float | None],
        abandoned: Collection[int] = (),
    ) -> set[int]:
        """Which of ``steps`` (committed, ascending) to keep.

        ``readable(step)``: whether a restore can read it (asked newest first, until one can);
        ``metric(step)``: its ``best_metric`` (None: not ranked), asked only with ``keep_best``.
        Steps in ``abandoned`` (a timeline given up by ``restore(step)``) are kept and neither
        ranked nor counted: the run replaces them as it saves those steps again.
        """
        kept_aside = [s for s in steps if s in abandoned]
        steps = [s for s in steps if s not in abandoned]
        if not steps:
            return set(kept_aside)
        # The newest checkpoint a restore can read is never deleted because of newer ones that
        # it cannot (damaged since, or written by a reader-incompatible writer).
        keep = {steps[-1], next((s for s in reversed(steps) if readable(s)), steps[-1])}
        if self.keep_last is not None:
            keep.update(steps[-self.keep_last :])
        if self.keep_every_steps is not None:
            keep.update(s for s in steps if s % self.keep_every_steps == 0)
        if self.keep_best is not None:
            ranked = [(m, s) for s in steps if (m := metric(s)) is not None]
            ranked.sort(reverse=self.best_mode == "max")
            keep.update(s for _, s in ranked[: self.keep_best])
        return keep | set(kept_aside)

    def retire(
        self,
        steps: Sequence[int],
        *,
        readable: Callable[[int], bool],
        metric: Callable[[int], float | None],
        abandoned: Collection[int] = (),
        busy: Collection[int] = (),
    ) -> list[int]:
        """The steps to delete, ascending: those ``keep`` drops, less the ``busy`` ones (being
        read, written or uploaded)."""
        keep = self.keep(steps, readable=readable, metric=metric, abandoned=abandoned)
        return [s for s in steps if s not in keep and s not in busy]
