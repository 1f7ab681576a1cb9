"""What a checkpoint directory holds, for the commands: the catalog's listing, by location.

Reads only manifests and directory entries, never tensor bytes, so listing is cheap however
large the checkpoints are. Locations are paths or URLs (``memory://``, ``s3://``), each with
the ``options`` for its backend (``--storage-option``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import Catalog
from ..errors import CheckpointNotFoundError, TardigradeError
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


Options = Mapping[str, Any] | None


def _is_checkpoint(location: Any, options: Options = None) -> bool:
    """Whether ``location`` itself is a checkpoint (holds a manifest)."""
    return Catalog.is_checkpoint(location, options)


def is_directory_of_checkpoints(location: Any, options: Options = None) -> bool:
    """Whether ``location`` is a directory (or prefix) rather than one checkpoint."""
    if _is_checkpoint(location, options):
        return False
    try:
        return Catalog(location, options).storage.is_dir("")
    except TardigradeError:
        return False


def location_text(location: Any, options: Options = None) -> str:
    """``location`` as messages name it: an absolute path, or the URL."""
    try:
        storage, name = storage_for(location, options)
    except TardigradeError:
        return str(location)
    return storage.url(name)


def list_checkpoints(location: Any, options: Options = None) -> list[Listed]:
    """Every checkpoint-like entry of ``location``, sorted by step, then name.

    A ``location`` that is itself a checkpoint lists as itself.
    """
    if _is_checkpoint(location, options):
        storage, name = storage_for(location, options)
        return [Catalog(storage).describe(name)]
    catalog = Catalog(location, options)
    st = catalog.storage.stat("")
    if st is None or not st.is_dir:
        what = "is not a directory" if st is not None else "does not exist"
        raise CheckpointNotFoundError(
            f"{location}: {what}. Pass the directory that holds the checkpoints "
            "(e.g. ckpt/, which holds ckpt/step-000000100/)."
        )
    return catalog.listing()


def committed(location: Any, options: Options = None) -> list[Listed]:
    """The committed checkpoints in ``location``, oldest step first."""
    return [c for c in list_checkpoints(location, options) if c.status == COMMITTED]


def require_single(location: Any, options: Options = None) -> None:
    """Explain, instead of "no manifest", when ``location`` holds checkpoints rather than being
    one."""
    if _is_checkpoint(location, options):
        return
    try:
        found = committed(location, options)
    except CheckpointNotFoundError:
        return
    if found:
        raise CheckpointNotFoundError(
            f"{location}: is a directory of {len(found)} checkpoint(s), not a checkpoint; name "
            f"one, e.g. {found[-1].path} (`tardigrade ls {location}` lists them)"
        )
