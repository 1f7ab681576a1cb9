"""Storage backends move bytes; they never decide what the bytes are."""

from .base import Reader, Storage, Writer, check_name
from .local import LocalStorage

__all__ = ["LocalStorage", "Reader", "Storage", "Writer", "check_name", "storage_for"]


def storage_for(location: str) -> tuple[Storage, str]:
    """Split a checkpoint location into (storage rooted at its parent, checkpoint name)."""
    import os

    from ..errors import InvalidArgumentError

    if not isinstance(location, (str, os.PathLike)):
        raise InvalidArgumentError(
            f"checkpoint path must be a str or os.PathLike, got {type(location).__name__}"
        )
    location = os.fspath(location)
    if "://" in location:
        raise InvalidArgumentError(
            f"{location}: URLs are not supported by this build yet; use a local directory path"
        )
    path = os.path.abspath(location)
    parent, name = os.path.split(path.rstrip(os.sep))
    if not name:
        raise InvalidArgumentError(f"{location!r} does not name a checkpoint directory")
    return LocalStorage(parent), name
