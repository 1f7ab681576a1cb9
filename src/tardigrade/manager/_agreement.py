"""How the manager's decisions come out the same on every rank of a distributed job.

The manager asks its :class:`Agreement` wherever ranks could disagree: what a listing shows,
whether a step saves or stops, whether a background save counted. How the work of a save or
a copy is split between the processes is its :class:`~._split.Split`'s (``split``). In
a single process that is :class:`SingleProcess`, the null agreement: every decision is this
process's own and nothing talks to another process. In a distributed job it is
:class:`RankGroup`, over the manager's process group: rank 0 lists and cleans up, one tiny
all-reduce per ``step()`` agrees on the rest, and saves and loads are collective.
"""

from __future__ import annotations

import abc
import functools
import json
import logging
from collections.abc import Callable
from typing import Any

from .._tiers import file_rank
from ..distributed._collectives import Ranks
from ..errors import DistributedError, SaveError, TardigradeError
from ._split import ByRank, Split, Whole

log = logging.getLogger("tardigrade")

# What one step() agrees on, as a level: the largest any rank reports wins. A signal on any
# rank outranks the clock, which only rank 0 reads (ranks' clocks and save times differ).
NOTHING, DUE, PREEMPTED = 0, 1, 2


class Agreement(abc.ABC):
    """The manager's decisions, made the same on every rank (see the module docstring).

    ``what`` names the manager's public call in the error a rank left waiting raises.
    """

    coordinator: bool
    """Whether this process does the directory's housekeeping (rank 0, or the only one)."""

    collective: dict[str, Any]
    """The arguments that make ``tg.save``/``tg.load`` collective over the manager's ranks."""

    rank: int | None
    """This process's rank in a distributed job; None in a single process."""

    share: Callable[[str], bool] | None
    """Which data files of this job's saves this rank wrote (None: all of them): its share
    of a checkpoint in the RAM tier."""

    split: Split
    """How a save's or a copy's work is split between the job's processes (``_split``)."""

    ranks: Ranks | None
    """The ranks of the manager's process group (None in a single process)."""

    @abc.abstractmethod
    def shared(self, what: str, here: Callable[[], Any]) -> Any:
        """``here()`` (a JSON value) as rank 0 computes it, on every rank; its error everywhere.

        Ranks reading a shared directory can see it at different moments (a network file
        system's attribute cache): a decision taken from what each rank sees would differ.
        """

    @abc.abstractmethod
    def on_coordinator(
        self,
        what: str,
        work: Callable[[], None],
        describe: Callable[[OSError], TardigradeError] | None = None,
    ) -> None:
        """Run ``work`` on rank 0; raise its error on every rank.

        ``describe`` turns a plain OSError into the error the other ranks raise (without it,
        the ``StorageError`` of that OSError's class).
        """

    @abc.abstractmethod
    def level(self, mine: int, running: Callable[[], bool], call: str) -> tuple[int, bool]:
        """The level (``NOTHING``, ``DUE``, ``PREEMPTED``) agreed from this rank's ``mine``,
        and whether every rank may record its finished background saves now (no rank's save
        still ``running``, nothing else happening at this call). ``call`` is the manager's
        public call (``".step(5)"``)."""

    @abc.abstractmethod
    def record_finished(self, drain: Callable[..., None]) -> None:
        """At the start of ``step()``/``save()``: record the background saves finished so far
        (``drain(wait=False)``), or leave them to the point where every rank records them
        together."""

    @abc.abstractmethod
    def before_save(self, drain: Callable[..., None]) -> None:
        """Before a save starts: wait for and record the save in flight (``drain(wait=True)``)
        where saves cannot overlap."""

    @abc.abstractmethod
    def outcome(
        self,
        exc: BaseException | None,
        *,
        path: str,
        step: int,
        forget_forks: Callable[[], None],
    ) -> BaseException | None:
        """The agreed outcome of this rank's background save of ``step`` (``exc``: its error,
        None if it committed): a failure wherever it failed on any rank."""

    @abc.abstractmethod
    def live_touched(self, e: BaseException, what: str) -> bool:
        """Whether a failed restore of one candidate changed the live state (on any rank).

        Tardigrade's own errors say whether bytes landed; any other error might have come
        after they did, so it counts as touched.
        """

    @abc.abstractmethod
    def barrier(self, what: str) -> None:
        """Wait until every rank is here."""

    @abc.abstractmethod
    def everywhere(self, mine: bool, what: str) -> bool:
        """Whether ``mine`` is true on every rank."""


class SingleProcess(Agreement):
    """One process: every decision is its own; nothing is sent anywhere."""

    coordinator = True
    rank = None
    share = None
    ranks = None

    def __init__(self) -> None:
        self.collective: dict[str, Any] = {}
        self.split: Split = Whole()

    def shared(self, what: str, here: Callable[[], Any]) -> Any:
        return here()

    def on_coordinator(
        self,
        what: str,
        work: Callable[[], None],
        describe: Callable[[OSError], TardigradeError] | None = None,
    ) -> None:
        work()

    def level(self, mine: int, running: Callable[[], bool], call: str) -> tuple[int, bool]:
        # Its saves were recorded as they finished (record_finished).
        return mine, False

    def record_finished(self, drain: Callable[..., None]) -> None:
        drain(wait=False)

    def before_save(self, drain: Callable[..., None]) -> None:
        pass  # a save in flight goes on; the next one queues behind it

    def outcome(
        self,
        exc: BaseException | None,
        *,
        path: str,
        step: int,
        forget_forks: Callable[[], None],
    ) -> BaseException | None:
        return exc

    def live_touched(self, e: BaseException, what: str) -> bool:
        return bool(getattr(e, "live_overwritten", not isinstance(e, TardigradeError)))

    def barrier(self, what: str) -> None:
        pass

    def everywhere(self, mine: bool, what: str) -> bool:
        return mine


class RankGroup(Agreement):
    """The ranks of the manager's process group (every call is a collective)."""

    # What a rank's background save ended with, as agreed: the largest any rank reports wins.
    _SAVED, _FAILED, _LOST = 0, 1, 2

    def __init__(self, name: str, ranks: Ranks, process_group: Any, timeout: float) -> None:
        self.name = name  # the manager, as errors and logs name it
        self.ranks: Ranks = ranks
        self.coordinator = ranks.coordinator
        self.collective = {"process_group": process_group, "timeout": timeout}
        self.rank: int | None = ranks.rank
        self.share = functools.partial(_written_by, rank=ranks.rank, size=ranks.size)
        self.split: Split = ByRank(ranks)

    def shared(self, what: str, here: Callable[[], Any]) -> Any:
        return json.loads(self.ranks.broadcast(what, lambda: json.dumps(here()).encode()))

    def on_coordinator(
        self,
        what: str,
        work: Callable[[], None],
        describe: Callable[[OSError], TardigradeError] | None = None,
    ) -> None:
        def run() -> bytes:
            try:
                work()
            except OSError as e:
                if describe is None or isinstance(e, TardigradeError):
                    raise
                raise describe(e) from e
            return b""

        self.ranks.broadcast(what, run)

    def level(self, mine: int, running: Callable[[], bool], call: str) -> tuple[int, bool]:
        # One tiny all-reduce, whatever the level: every rank calls it at the same point. It
        # also tells whether any rank's background save is still running: a rank cannot go by
        # its own saves' state (the ranks finish a collective save moments apart). The low bit
        # is "a save still runs here"; its max is exact among the ranks at the agreed level,
        # which is all of them at NOTHING, the only level where it is used (a save or a stop
        # waits for every save in flight anyway).
        agreed = self.ranks.agree_max(mine << 1 | running(), self.name + call)
        level = agreed >> 1
        return level, level == NOTHING and not agreed & 1

    def record_finished(self, drain: Callable[..., None]) -> None:
        pass  # recorded at an agreed point: see level()

    def before_save(self, drain: Callable[..., None]) -> None:
        # Every rank is here (the save was agreed): the save in flight commits and is recorded
        # on every rank alike before this one starts, as the ranks' one fork carries one save
        # at a time.
        drain(wait=True)

    def outcome(
        self,
        exc: BaseException | None,
        *,
        path: str,
        step: int,
        forget_forks: Callable[[], None],
    ) -> BaseException | None:
        """The ranks learn a collective save's outcome together, so they normally agree
        already; a rank that lost the others after rank 0 committed does not. Without this,
        rank 0 could count a save (and delete older checkpoints for it) that another rank
        reports failed. A save that lost the ranks on the forked group (a DistributedError: a
        timeout, a dead peer) leaves that group in an unknown state: every rank drops it
        (``forget_forks``), and the next async save forks a new one.
        """
        mine = self._SAVED
        if exc is not None:
            mine = self._LOST if isinstance(exc, DistributedError) else self._FAILED
        try:
            worst = self.ranks.agree_max(
                mine,
                f"{self.name} (agreeing a background save's outcome)",
            )
        except TardigradeError as e:
            # The job's own group is gone too; the next collective call raises again.
            return exc if exc is not None else e
        if worst == self._LOST:
            forget_forks()
        if worst != self._SAVED:
            # Failed somewhere, yet perhaps after rank 0 committed: rank 0 knows, and a rank
            # that could not tell (it lost rank 0) learns it here. A committed save counts as
            # saved on every rank, failed or not.
            committed = exc is None or getattr(exc, "committed", False) is True
            try:
                anywhere = self.ranks.agree_max(
                    int(committed),
                    f"{self.name} (agreeing whether a failed background save committed)",
                )
            except TardigradeError:
                anywhere = int(committed)
            if anywhere:
                if isinstance(exc, TardigradeError) and exc.committed is not True:
                    exc.committed = True
                    exc.args = (f"{exc} Another rank found it committed: it counts as saved.",)
                return exc
        if worst != self._SAVED and exc is None:
            return SaveError(
                f"{path}: the save of step {step} failed on another rank of the job (its log "
                "names the cause); it is not counted as saved on any rank. Earlier checkpoints "
                "are intact."
            )
        return exc

    def live_touched(self, e: BaseException, what: str) -> bool:
        # The same error reaches every rank: a rank it names failed, after bytes landed only
        # when its own error says so; a rank it does not name restored the whole candidate.
        mine = self.ranks.rank not in getattr(e, "causes", {}) or bool(
            getattr(e.__cause__, "live_overwritten", False)
        )
        return bool(self.ranks.agree_max(int(mine), what))

    def barrier(self, what: str) -> None:
        self.ranks.barrier(what)

    def everywhere(self, mine: bool, what: str) -> bool:
        return not self.ranks.agree_max(int(not mine), what)


def _written_by(file: str, *, rank: int, size: int) -> bool:
    return file_rank(file) % size == rank


def agreement(name: str, process_group: Any, timeout: float) -> Agreement:
    """The agreement of manager ``name``: over ``process_group`` in a distributed job (the
    default group when None), else a single process's."""
    ranks = Ranks.current(process_group, timeout)
    if ranks is None:
        return SingleProcess()
    return RankGroup(name, ranks, process_group, timeout)
