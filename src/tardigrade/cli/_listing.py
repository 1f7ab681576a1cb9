"""What a checkpoint directory holds: committed checkpoints, abandoned saves, strays.

Reads only manifests and directory entries, never tensor bytes, so listing is cheap however
large the checkpoints are.
"""

from __future__ import annotations

import math
import os
import re
import stat
from dataclasses import dataclass

from .. import read_manifest
from ..errors import CheckpointNotFoundError, TardigradeError
from ..format.manifest import MANIFEST

COMMITTED = "committed"
INCOMPLETE_TMP = "incomplete-tmp"  # a save in flight or killed: never visible to load
NO_MANIFEST = "no-manifest"  # a directory that never committed (or lost its manifest)
UNREADABLE = "unreadable"  # has a manifest that fails validation

_STEP_IN_NAME = re.compile(r"step-(\d+)")


@dataclass(frozen=True)
class Listed:
    """One entry of a checkpoint directory, as ``tardigrade ls`` shows it."""

    name: str
    path: str
    status: str
    step: int | None
    epoch: int | None
    created: str | None
    nbytes: int  # bytes of the regular files directly inside it, as they are on disk
    error: str | None = None


def dir_bytes(path: str) -> int:
    """Total size of the regular files directly inside ``path`` (symlinks are not followed)."""
    total = 0
    try:
        with os.scandir(path) as it:
            for e in it:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    total += st.st_size
    except OSError:
        pass
    return total


def step_from_name(name: str) -> int | None:
    m = _STEP_IN_NAME.search(name)
    return int(m.group(1)) if m else None


def describe(path: str) -> Listed:
    """Classify one directory: committed checkpoint, abandoned save, or neither."""
    name = os.path.basename(os.path.normpath(path))
    size = dir_bytes(path)
    if name.startswith(".tmp-"):
        return Listed(name, path, INCOMPLETE_TMP, step_from_name(name), None, None, size)
    if not os.path.lexists(os.path.join(path, MANIFEST)):
        return Listed(name, path, NO_MANIFEST, step_from_name(name), None, None, size)
    try:
        m = read_manifest(path)
    except TardigradeError as e:
        return Listed(name, path, UNREADABLE, step_from_name(name), None, None, size, str(e))
    created = m.get("created")
    return Listed(
        name,
        path,
        COMMITTED,
        m.get("step"),
        m.get("epoch"),
        created if isinstance(created, str) else None,
        size,
    )


def list_checkpoints(directory: str) -> list[Listed]:
    """Every checkpoint-like subdirectory of ``directory``, sorted by step, then name.

    Plain files (such as a lock file) and hidden directories other than ``.tmp-*`` staging
    directories are left out. A ``directory`` that is itself a checkpoint lists as itself.
    """
    if not os.path.isdir(directory):
        what = "is not a directory" if os.path.exists(directory) else "does not exist"
        raise CheckpointNotFoundError(
            f"{directory}: {what}. Pass the directory that holds the checkpoints "
            "(e.g. ckpt/, which holds ckpt/step-000000100/)."
        )
    if os.path.lexists(os.path.join(directory, MANIFEST)):
        return [describe(directory)]
    out = []
    with os.scandir(directory) as it:
        for e in it:
            if not e.is_dir(follow_symlinks=False):
                continue
            if e.name.startswith(".") and not e.name.startswith(".tmp-"):
                continue
            out.append(describe(e.path))
    out.sort(key=lambda x: (math.inf if x.step is None else x.step, x.name))
    return out


def committed(directory: str) -> list[Listed]:
    """The committed checkpoints in ``directory``, oldest step first."""
    return [c for c in list_checkpoints(directory) if c.status == COMMITTED]


def require_single(path: str) -> None:
    """Explain, instead of "no manifest", when ``path`` holds checkpoints rather than being one."""
    if not os.path.isdir(path) or os.path.lexists(os.path.join(path, MANIFEST)):
        return
    found = committed(path)
    if found:
        raise CheckpointNotFoundError(
            f"{path}: is a directory of {len(found)} checkpoint(s), not a checkpoint; name one, "
            f"e.g. {os.path.join(path, found[-1].name)} (`tardigrade ls {path}` lists them)"
        )
