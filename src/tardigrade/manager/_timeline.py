"""The timeline ``restore(step)`` abandons, and the uncommitted step a save finds in its way.

``restore(step)`` makes the checkpoints above ``step`` a timeline this run gave up: a crash
before the run saves again must resume from ``step``, not from them, and each is deleted
once the run saves its step (or a later one). How that is kept depends on what the storage
can do, so it is a strategy chosen once from its commit strategy (``Commit.renames``):

* :class:`RenameAside` (a POSIX directory): each is renamed to ``step-N.abandoned-<time>``,
  which listings of steps ignore; an uncommitted ``step-N`` in a save's way is renamed to
  ``step-N.incomplete-<time>``.
* :class:`RecordAside` (an object store, which cannot rename): each stays in place, recorded
  by its save id in the root's ``.abandoned.json``, which ``restore()`` reads to pass over
  them; a prefix without a manifest is nothing in a save's way there.

Both keep :attr:`Timeline.abandoned`, the steps this run replaces as it saves them again and
that retention neither ranks nor deletes.
"""

from __future__ import annotations

import abc
import logging

from .._catalog import (
    ABANDONED,
    ABANDONED_NAME,
    ABANDONED_RECORD,
    INCOMPLETE,
    Catalog,
    step_in_name,
    step_name,
)
from ..errors import TardigradeError
from ._preflight import RunLock

log = logging.getLogger("tardigrade")


class Timeline(abc.ABC):
    """The abandoned timeline of one manager's root (see the module docstring)."""

    def __init__(self, catalog: Catalog, lock: RunLock) -> None:
        self.catalog = catalog
        self.lock = lock
        # Steps above a restored older step that are still in view (could not be set aside,
        # or a store's); each is replaced once when this run saves that step again.
        self.abandoned: set[int] = set()

    @staticmethod
    def of(catalog: Catalog, lock: RunLock) -> Timeline:
        """The strategy the storage under ``catalog`` supports."""
        return RenameAside(catalog, lock) if catalog.commit.renames else RecordAside(catalog, lock)

    @abc.abstractmethod
    def set_aside_incomplete(self, step: int) -> None:
        """Before saving ``step``: move an uncommitted ``step-N`` (no manifest) out of its way."""

    @abc.abstractmethod
    def abandon_after(self, step: int, committed: list[int]) -> list[int]:
        """``restore(step)`` began a new timeline: set the ``committed`` steps above ``step``
        aside. Returns the steps still in view (kept in :attr:`abandoned`)."""

    def passed_over(self, committed: list[int]) -> set[int]:
        """The ``committed`` steps an earlier run's ``restore(step)`` abandoned (skipped)."""
        return set()

    @abc.abstractmethod
    def saved_past(self, step: int) -> None:
        """``step`` committed: delete the abandoned checkpoints it replaced or passed."""

    def _remove(self, name: str, why: str) -> bool:
        return self.lock.still_ours("removing " + name) and self.catalog.remove(name, why)

    def _could_not(self, what: str, step: int, e: BaseException) -> None:
        log.warning(
            "tardigrade: could not %s (%s); a crash before this run saves step %d again would "
            "resume from it",
            what,
            e,
            step,
        )


class RenameAside(Timeline):
    """A POSIX directory: set aside by renaming (see the module docstring)."""

    def set_aside_incomplete(self, step: int) -> None:
        """It is what a save that died before this format's commit, a foreign tool or a user
        copying a checkpoint in left there; ``restore()`` skipped it. It is never deleted: it
        may be the half-copied checkpoint someone is restoring. It is renamed to a visible
        ``step-N.incomplete-<time>`` that ``steps()`` ignores, and the new path is logged."""
        name = step_name(step)
        storage = self.catalog.storage
        if not storage.exists(name) or self.catalog.visible(name):
            return
        aside = self.catalog.path(self.catalog.set_aside(name, INCOMPLETE))
        log.warning(
            "tardigrade: %s had no manifest.json (an uncommitted save, or a copy still in "
            "progress); moved it aside to %s to save step %d. Nothing was deleted: inspect it "
            "and remove it yourself when it is not needed.",
            self.catalog.path(name),
            aside,
            step,
        )

    def abandon_after(self, step: int, committed: list[int]) -> list[int]:
        later = [x for x in committed if x > step]
        if not self.lock.may_delete("setting abandoned checkpoints aside"):
            return later
        left = []
        for x in later:
            try:
                aside = self.catalog.set_aside(step_name(x), ABANDONED)
            except OSError as e:
                self._could_not(f"set {self.catalog.path(step_name(x))} aside", x, e)
                left.append(x)
                continue
            log.warning(
                "tardigrade: restore(%d) began a new timeline: moved %s to %s (deleted once "
                "this run saves step %d or later)",
                step,
                step_name(x),
                aside,
                x,
            )
        return left

    def saved_past(self, step: int) -> None:
        try:
            names = self.catalog.names()
        except OSError as e:
            log.warning(
                "tardigrade: could not list %s to remove the abandoned checkpoints that step %d "
                "replaced (tried again after the next save): %s",
                self.catalog.root,
                step,
                e,
            )
            return
        for n in names:
            m = ABANDONED_NAME.match(n)
            if m and int(m.group(1)) <= step:
                self._remove(n, "a step of an abandoned timeline, saved again by this run")


class RecordAside(Timeline):
    """An object store: recorded in ``.abandoned.json`` (see the module docstring)."""

    def __init__(self, catalog: Catalog, lock: RunLock) -> None:
        super().__init__(catalog, lock)
        # Whether the record may list some (read or written by this manager's restore), to
        # update as this run saves past them.
        self.recorded = False

    def set_aside_incomplete(self, step: int) -> None:
        pass  # a prefix without a manifest is no checkpoint: the save writes its own names

    def abandon_after(self, step: int, committed: list[int]) -> list[int]:
        """Record the steps above ``step``, each with the save id it holds, so that a restore
        after a crash passes over them; they stay in place, still this run's to replace."""
        later = [x for x in committed if x > step]
        if not later or not self.lock.may_delete("setting abandoned checkpoints aside"):
            return later
        names = [step_name(x) for x in later]
        try:
            saves = self.catalog.abandoned()
            saves.update({n: self.catalog.save_id(n) or "" for n in names})
            self.catalog.record_abandoned(saves)
        except (OSError, TardigradeError) as e:
            self._could_not(f"record {names} as abandoned in {self.catalog.root}", later[-1], e)
            return later
        self.recorded = True
        log.warning(
            "tardigrade: restore(%d) began a new timeline: recorded %s as abandoned in %s "
            "(each deleted once this run saves its step or a later one)",
            step,
            names,
            self.catalog.path(ABANDONED_RECORD),
        )
        return later

    def passed_over(self, committed: list[int]) -> set[int]:
        """Those the record lists, still holding the save then recorded."""
        try:
            saves = self.catalog.abandoned()
            skip = set()
            for name, save_id in saves.items():
                s = step_in_name(name)
                if s in committed and self.catalog.save_id(name) == save_id:
                    skip.add(s)
        except (OSError, TardigradeError) as e:
            log.warning(
                "tardigrade: could not read which checkpoints of %s a restore(step) abandoned "
                "(%s); restoring the newest of any timeline",
                self.catalog.root,
                e,
            )
            return set()
        self.recorded = bool(saves)
        for s in sorted(skip, reverse=True):
            log.warning(
                "tardigrade: skipping checkpoint %s: an earlier run's restore(step) abandoned "
                "its timeline (recorded in %s); deleted once this run saves past it",
                self.catalog.path(step_name(s)),
                self.catalog.path(ABANDONED_RECORD),
            )
        return skip

    def saved_past(self, step: int) -> None:
        """Delete the recorded checkpoints this run has now saved past and drop them from the
        record; a step saved again holds this run's save, which stays."""
        if not self.recorded:
            return
        try:
            saves = self.catalog.abandoned()
            left = {}
            for name, save_id in saves.items():
                s = step_in_name(name)
                if s is not None and s > step:
                    left[name] = save_id
                    continue
                theirs = self.catalog.committed(name) and self.catalog.save_id(name) == save_id
                why = "a step of an abandoned timeline, saved past by this run"
                if theirs and not self._remove(name, why):
                    left[name] = save_id
            if left != saves:
                self.catalog.record_abandoned(left)
            self.recorded = bool(left)
        except (OSError, TardigradeError) as e:
            log.warning(
                "tardigrade: could not remove the abandoned checkpoints that step %d passed in "
                "%s (tried again after the next save): %s",
                step,
                self.catalog.root,
                e,
            )
