"""The layout of a checkpoint directory, in one place.

Names: ``step-NNNNNNNNN`` for a manager's checkpoints; ``.tmp-*`` for everything in flight or
left behind (a save's staging ``.tmp-NAME-ID``, a checkpoint a replace moved aside
``.tmp-NAME-replaced-ID``, a retention delete ``.tmp-deleting-NAME``), which readers never read.
What counts as committed: a directory holding ``manifest.json``. And :func:`tidy`, the cleanup
after writers that died, shared by ``CheckpointManager`` and ``tardigrade gc``.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass

from .format.manifest import MANIFEST
from .storage.base import TMP_PREFIX
from .storage.local import fsync_dir, is_committed, lock_dir

log = logging.getLogger("tardigrade")

STEP_NAME = re.compile(r"^step-(\d{9,})$")
# A committed checkpoint of a timeline that restore(step) abandoned, moved aside by the manager.
ABANDONED = "abandoned"
ABANDONED_NAME = re.compile(rf"^step-(\d{{9,}})\.{ABANDONED}-[0-9T]+(-\d+)?$")
# A committed checkpoint a replace without atomic swap moved aside (storage/local.py).
# Any id is accepted: a checkpoint is put back, never deleted, whoever named it.
_REPLACED = re.compile(rf"^{re.escape(TMP_PREFIX)}(.+)-replaced-[^-]+$")

__all__ = [
    "ABANDONED",
    "ABANDONED_NAME",
    "MANIFEST",
    "STEP_NAME",
    "Tidied",
    "deleting_name",
    "is_committed",
    "step_name",
    "step_of",
    "tidy",
]


def step_name(step: int) -> str:
    return f"step-{step:09d}"


def step_of(name: str) -> int | None:
    """The step of a manager checkpoint's directory name, or None for any other name."""
    m = STEP_NAME.match(name)
    return int(m.group(1)) if m else None


def deleting_name(name: str) -> str:
    """Where retention moves a checkpoint before removing it (never half-deleted in view)."""
    return f"{TMP_PREFIX}deleting-{name}"


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
        if not n.startswith(TMP_PREFIX) or os.path.islink(path) or not os.path.isdir(path):
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
    if m and is_committed(path):
        name = m.group(1)
        target = os.path.join(directory, name)
        if not os.path.lexists(target):
            if not dry_run:
                os.rename(path, target)
                fsync_dir(directory)
                log.warning("tardigrade: recovered %s from an interrupted replace", name)
            return [Tidied(name, "recovered", _tree_bytes(path if dry_run else target))]
        if not is_committed(target):
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
