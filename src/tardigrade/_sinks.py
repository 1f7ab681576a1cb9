"""Sinks: the destinations an async save feeds from its staged copy besides its own writers.

The state is copied to host memory once per save; every tier that keeps a copy of that save
(the manager's RAM tier today, a peer's memory next) is a :class:`Sink` of it and reads the
same staged blocks. A save's path composes them: a single process's stager puts each block
into ``tee(sinks, queues)``, a collective save's stream maker is ``feed(sinks, make)``, and
the background half runs the save through ``around`` / ``after``, which commit each sink's
copy once the save committed. With no sinks each of these is the save itself.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ._save_job import SaveJob, SaveResult

__all__ = ["Sink", "after", "around", "feed", "tee"]


class Sink(Protocol):
    """One extra destination of one async save (see the module docstring).

    Whatever fails in a sink is its own to log and count: the save's outcome is its writers'.
    """

    def tee(self, streams: list[Any]) -> list[Any]:
        """Queues the stager puts each staged block into: ``streams``' and this sink's."""

    def around(self, job: SaveJob, save: Callable[[], SaveResult]) -> SaveResult:
        """Run ``save`` (a single process's write and commit) with this sink's writer beside
        it; commit this sink's copy once ``save`` committed."""

    def feed(self, make: Callable[[SaveJob], list[list[Any]]]) -> Callable[[SaveJob], Any]:
        """A collective save's stream maker that also starts this sink's writer on them."""

    def after(self, save: Callable[[], SaveResult]) -> SaveResult:
        """Run ``save`` (a collective save fed through ``feed``); then commit this copy."""


def tee(sinks: Sequence[Sink], streams: list[Any]) -> list[Any]:
    for sink in sinks:
        streams = sink.tee(streams)
    return streams


def around(sinks: Sequence[Sink], job: SaveJob, save: Callable[[], SaveResult]) -> SaveResult:
    for sink in sinks:
        save = functools.partial(sink.around, job, save)
    return save()


def feed(
    sinks: Sequence[Sink], make: Callable[[SaveJob], list[list[Any]]]
) -> Callable[[SaveJob], Any]:
    for sink in sinks:
        make = sink.feed(make)
    return make


def after(sinks: Sequence[Sink], save: Callable[[], SaveResult]) -> SaveResult:
    for sink in sinks:
        save = functools.partial(sink.after, save)
    return save()
