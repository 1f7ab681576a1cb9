"""What a checkpoint directory holds, for the commands: the catalog's listing, by location.

Reads only manifests and directory entries, never tensor bytes, so listing is cheap however
large the checkpoints are. Locations are paths or URLs (``memory://``).
"""

from __future__ import annotations

from typing import Any

from .. import Catalog
from ..errors import CheckpointNotFoundError, TardigradeError
from ..format.manifest import MANIFEST
from ..storage import storage_for

__all__ = [
    "COMMITTED",
    "INCOMPLETE_TMP",
    "NO_MANIFEST",
    "UNREADABLE",
    "Listed",
    "committed",
    "is_directory_of_checkpoints",
    "list_checkpoints",
    "location_text",
    "require_single",
    "step_from_name",
]

COMMITTED = Catalog.COMMITTED
INCOMPLETE_TMP = Catalog.INCOMPLETE_TMP
NO_MANIFEST = Catalog.NO_MANIFEST
UNREADABLE = Catalog.UNREADABLE
Listed = Catalog.Listed
step_from_name = Catalog.step_in_name


def _is_checkpoint(location: Any) -> bool:
    """Whether ``location`` itself is a checkpoint (holds a manifest)."""
    try:
        storage, name = storage_for(location)
    except TardigradeError:  # not a location at all (a bad URL): not a checkpoint either
        return False
    return storage.exists(f"{name}/{MANIFEST}")


def is_directory_of_checkpoints(location: Any) -> bool:
    """Whether ``location`` is a directory (or prefix) rather than one checkpoint."""
    if _is_checkpoint(location):
        return False
    try:
        return Catalog(location).storage.is_dir("")
    except TardigradeError:
        return False


def location_text(location: Any) -> str:
    """``location`` as messages name it: an absolute path, or the URL."""
    try:
        storage, name = storage_for(location)
    except TardigradeError:
        return str(location)
    return storage.url(name)


def list_checkpoints(location: Any) -> list[Listed]:
    """Every checkpoint-like entry of ``location``, sorted by step, then name.

    A ``location`` that is itself a checkpoint lists as itself.
    """
    if _is_checkpoint(location):
        storage, name = storage_for(location)
        return [Catalog(storage).describe(name)]
    catalog = Catalog(location)
    st = catalog.storage.stat("")
    if st is None or not st.is_dir:
        what = "is not a directory" if st is not None else "does not exist"
        raise CheckpointNotFoundError(
            f"{location}: {what}. Pass the directory that holds the checkpoints "
            "(e.g. ckpt/, which holds ckpt/step-000000100/)."
        )
    return catalog.listing()


def committed(location: Any) -> list[Listed]:
    """The committed checkpoints in ``location``, oldest step first."""
    return [c for c in list_checkpoints(location) if c.status == COMMITTED]


def require_single(location: Any) -> None:
    """Explain, instead of "no manifest", when ``location`` holds checkpoints rather than being
    one."""
    if _is_checkpoint(location):
        return
    try:
        found = committed(location)
    except CheckpointNotFoundError:
        return
    if found:
        raise CheckpointNotFoundError(
            f"{location}: is a directory of {len(found)} checkpoint(s), not a checkpoint; name "
            f"one, e.g. {found[-1].path} (`tardigrade ls {location}` lists them)"
        )
