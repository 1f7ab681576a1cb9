"""The save policy: whether a finished training step is due for a checkpoint.

Pure: the caller passes what it remembers (the previous epoch, the clock's reading at the last
save) and the clock, so the same calls give the same answer on every rank and in tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class SavePolicy:
    """Save every ``every_steps`` steps, ``every_epochs`` epochs, ``every_seconds`` seconds.

    Each is off when None; a step is due when any one that is on fires.

    >>> p = SavePolicy(every_steps=100)
    >>> p.due_by_count(200, epoch=None, last_epoch=None), p.due_by_count(250, None, None)
    (True, False)
    """

    every_steps: int | None = None
    every_epochs: int | None = None
    every_seconds: float | None = None

    def due_by_count(self, step: int, epoch: int | None, last_epoch: int | None) -> bool:
        """The step and epoch policies for ``step`` in ``epoch`` (the previous step's epoch:
        ``last_epoch``); an epoch fires once, at the first step after it began."""
        if self.every_steps is not None and step % self.every_steps == 0:
            return True
        return (
            self.every_epochs is not None
            and epoch is not None
            and epoch != last_epoch
            and last_epoch is not None
            and epoch % self.every_epochs == 0
        )

    def due_by_time(self, clock: Callable[[], float], last_save: float) -> bool:
        """The time policy: ``every_seconds`` have passed since ``last_save`` (a reading of
        ``clock``); the clock is read only when the policy is on."""
        return self.every_seconds is not None and clock() - last_save >= self.every_seconds
