"""The manager's background saves in flight, and what each one's ending counts as."""

from __future__ import annotations

import enum
from collections.abc import Iterator

from .._async import SaveFuture
from ..errors import InvalidArgumentError, TardigradeError, UnsupportedTypeError


class Failure(enum.Enum):
    """What a background save that raised counts as."""

    COMMITTED = "committed"
    """Failed after its commit point: the checkpoint is complete and counts as saved."""
    MISUSE = "misuse"
    """A programming error found in the background (a leaf the format cannot store, ranks'
    states that differ): raised whatever ``on_save_error`` says, as a synchronous save would."""
    FAILED = "failed"
    """Failed before its commit point: reported as ``on_save_error`` says."""


def failure_of(exc: BaseException) -> Failure:
    """What a save that raised ``exc`` counts as."""
    if isinstance(exc, TardigradeError) and exc.committed is True:
        return Failure.COMMITTED
    if isinstance(exc, (InvalidArgumentError, UnsupportedTypeError)):
        return Failure.MISUSE
    return Failure.FAILED


class PendingSaves:
    """Background saves not yet recorded, oldest first, each with the step it saves."""

    def __init__(self) -> None:
        self._saves: list[tuple[int, SaveFuture]] = []

    def add(self, step: int, fut: SaveFuture) -> None:
        self._saves.append((step, fut))

    def __len__(self) -> int:
        return len(self._saves)

    def steps(self) -> set[int]:
        """The steps being written (not to be deleted under their writer)."""
        return {s for s, _ in self._saves}

    def running(self) -> bool:
        """Whether any of them is still running."""
        return any(not fut.done() for _, fut in self._saves)

    def finished(self, *, wait: bool) -> Iterator[tuple[int, SaveFuture]]:
        """The saves that have finished, oldest first, up to the first still running; with
        ``wait``, all of them, each waited for in turn.

        Each leaves the list before it is yielded: recording it may raise
        (``on_save_error="raise"``), and a failure must be reported exactly once.
        """
        while self._saves:
            step, fut = self._saves[0]
            if not wait and not fut.done():
                return
            self._saves.pop(0)
            yield step, fut
