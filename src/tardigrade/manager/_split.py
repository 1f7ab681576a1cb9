"""How the work of a manager's saves and tier copies is split between the job's processes.

The :class:`~._agreement.Agreement` decides (the same on every rank); a :class:`Split` does the
work those decisions call for: where a background save is dispatched, how much staging it
reserves, whether it may run in the background at all, how a tier's copy is shared out, and a
group of their own for a background thread's collectives. In a single process that is
:class:`Whole` (this process does everything); in a distributed job :class:`ByRank` (each rank
its share, over the manager's process group).
"""

from __future__ import annotations

import abc
import functools
import logging
from collections.abc import Sequence
from typing import Any

from .._async import AsyncCheckpointer, SaveFuture
from .._save_job import SaveOptions
from .._sinks import Sink
from .._tiers import copy_checkpoint, copy_on_ranks
from .._tree import flatten
from ..distributed._collectives import Ranks
from ..distributed._save import stage_collective
from ..storage import Storage

log = logging.getLogger("tardigrade")

# The line saying that async_save falls back to synchronous saves in a distributed job (under
# max_staging_bytes) is written once per process, not once per manager.
_SYNC_FALLBACK_LOGGED = False


class Split(abc.ABC):
    """The work of saves and copies, split between the job's processes."""

    @abc.abstractmethod
    def copy(self, src: Storage, name: str, dst: Storage, go: Any = None) -> str:
        """Copy checkpoint ``name`` of ``src`` to ``dst`` (``copy_checkpoint``), each rank its
        share of the data files; its error on every rank. ``go``: waited on before each
        piece (it raises to stop the copy, which then commits nothing)."""

    @abc.abstractmethod
    def fork(self) -> Ranks | None:
        """The ranks over a group of their own, for a background thread's collectives (the
        uploads'); None in a single process. Collective: every rank calls it here."""

    @abc.abstractmethod
    def async_saves(self, requested: bool, max_staging_bytes: int | None) -> bool:
        """Whether this manager's saves run in the background, ``requested`` as they were."""

    @abc.abstractmethod
    def staging_need(self, state: Any) -> Any:
        """What ``AsyncCheckpointer.reserve`` gets to reserve for saving ``state``."""

    @abc.abstractmethod
    def submit(
        self,
        saver: AsyncCheckpointer,
        path: str,
        state: Any,
        options: SaveOptions,
        sinks: Sequence[Sink] = (),
    ) -> SaveFuture:
        """Start the background save of ``state`` to ``path`` (``sinks``: the other tiers'
        writers fed from the same staging copy)."""


class Whole(Split):
    """One process does all of it."""

    def copy(self, src: Storage, name: str, dst: Storage, go: Any = None) -> str:
        return copy_checkpoint(src, name, dst, go=go)

    def fork(self) -> Ranks | None:
        return None

    def async_saves(self, requested: bool, max_staging_bytes: int | None) -> bool:
        return requested

    def staging_need(self, state: Any) -> Any:
        return state

    def submit(
        self,
        saver: AsyncCheckpointer,
        path: str,
        state: Any,
        options: SaveOptions,
        sinks: Sequence[Sink] = (),
    ) -> SaveFuture:
        fut = saver.submit(path, state, options, sinks=sinks)
        assert fut is not None
        return fut


class ByRank(Split):
    """Each rank of the manager's process group its share (every call is a collective)."""

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks

    def copy(self, src: Storage, name: str, dst: Storage, go: Any = None) -> str:
        return copy_on_ranks(self.ranks, src, name, dst, go=go)

    def fork(self) -> Ranks | None:
        return self.ranks.fork()

    def async_saves(self, requested: bool, max_staging_bytes: int | None) -> bool:
        if not requested or max_staging_bytes is None:
            return requested
        global _SYNC_FALLBACK_LOGGED
        if not _SYNC_FALLBACK_LOGGED and self.ranks.coordinator:
            _SYNC_FALLBACK_LOGGED = True
            log.warning(
                "tardigrade: async_save falls back to synchronous saves in this distributed "
                "job because max_staging_bytes is set: a collective async save stages each "
                "rank's whole state before the ranks agree on who writes what. Pass "
                "max_staging_bytes=None for async saves"
            )
        return False

    def staging_need(self, state: Any) -> Any:
        # A collective save stages every local tensor back to back in one run of slabs
        # (``stage_entries``), not file by file: reserve that run.
        flat = flatten(state)
        return sum(e.tensor.nbytes for e in [*flat.entries, *flat.own_entries()])

    def submit(
        self,
        saver: AsyncCheckpointer,
        path: str,
        state: Any,
        options: SaveOptions,
        sinks: Sequence[Sink] = (),
    ) -> SaveFuture:
        stage = functools.partial(
            stage_collective, path=path, state=state, options=options, sinks=sinks
        )
        fut = saver.save_collective(self.ranks, path, stage)
        assert fut is not None
        return fut
