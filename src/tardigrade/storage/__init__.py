"""Storage backends move bytes; they never decide what the bytes are.

``storage_for(location)`` maps a location to its backend: a plain path or ``file://`` URL to
:class:`LocalStorage`, ``memory://`` to :class:`MemoryStorage` (an object store in this
process), ``s3://bucket/prefix`` to :class:`S3Storage` (its client, from the ``s3`` extra, is
imported on first use). Any other scheme that an fsspec filesystem serves (``gs://``,
``az://``, ...) goes to :class:`FsspecStorage` (fsspec imported on first use; a missing package
is an error naming what to install). A scheme nobody serves is refused with a message naming
it. ``storage_options`` go to the backend: s3 settings, an fsspec filesystem's arguments
(and ``gc_grace_seconds``); local directories take none, ``memory://`` only
``gc_grace_seconds``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import InvalidArgumentError
from ._options import secret_option, shown
from .base import Directories, PreconditionFailed, Reader, Stat, Storage, Writer
from .local import LocalStorage
from .memory import MemoryStorage

if TYPE_CHECKING:
    from .fsspec import FsspecStorage
    from .s3 import S3Storage

__all__ = [
    "Directories",
    "FsspecStorage",
    "LocalStorage",
    "MemoryStorage",
    "PreconditionFailed",
    "Reader",
    "S3Storage",
    "Stat",
    "Storage",
    "Writer",
    "open_root",
    "register_scheme",
    "secret_option",
    "shown",
    "storage_for",
    "through_fsspec",
]

# Schemes and the backend that serves each: a root URL (or directory) -> a Storage there.
_BACKENDS: dict[str, Callable[[str, Mapping[str, Any]], Storage]] = {
    "file": lambda root, options: LocalStorage(_no_options(root, options)),
    "memory": lambda root, options: MemoryStorage(root, options),
    "s3": lambda root, options: _s3().S3Storage(root, options),
}


# The store backends are imported on first use: commands that only read a local manifest
# (``tardigrade inspect``, ``ls``) start without them.
def _s3() -> Any:
    from . import s3

    return s3


def _fsspec() -> Any:
    from . import fsspec

    return fsspec


def __getattr__(name: str) -> Any:
    if name == "S3Storage":
        return _s3().S3Storage
    if name == "FsspecStorage":
        return _fsspec().FsspecStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _no_options(root: str, options: Mapping[str, Any]) -> str:
    """``root``, for a backend that takes no options: any given are a mistake (options meant
    for another location, e.g. the S3 tier's credentials given to a local directory), refused
    as pandas does rather than silently ignored."""
    if options:
        raise InvalidArgumentError(
            f"{root}: storage options {sorted(options)} were given, but local directories "
            "take none; "
            "they are for URLs of stores such as s3://. Pass them with the location they "
            "belong to (e.g. upload_storage_options= for CheckpointManager's upload_to)."
        )
    return root.removeprefix("file://")


def register_scheme(scheme: str, backend: Callable[[str, Mapping[str, Any]], Storage]) -> None:
    """Serve ``scheme://`` URLs with ``backend(root_url, storage_options)``."""
    _BACKENDS[scheme] = backend


def _scheme(location: str) -> str:
    scheme, sep, _ = location.partition("://")
    return scheme.lower() if sep else "file"


def _location(location: Any) -> str:
    if not isinstance(location, (str, os.PathLike)):
        raise InvalidArgumentError(
            f"checkpoint path must be a str or os.PathLike, got {type(location).__name__}"
        )
    location = os.fspath(location)
    if not isinstance(location, str):
        raise InvalidArgumentError(f"checkpoint path must be text, got {location!r}")
    scheme = _scheme(location)
    if scheme not in _BACKENDS and not _fsspec().serves(scheme, location):
        raise InvalidArgumentError(
            f"{location}: unknown storage scheme {scheme}://; this build stores checkpoints "
            f"in local directories (a path or file://), in S3 buckets (s3://), in memory:// "
            f"(known: {', '.join(sorted(f'{s}://' for s in _BACKENDS))}) and under any URL "
            "an fsspec filesystem serves (gs://, az://, ...), which this one is not."
        )
    if scheme == "file":
        return os.path.abspath(location.removeprefix("file://"))
    return location


def open_root(location: Any, storage_options: Mapping[str, Any] | None = None) -> Storage:
    """The storage rooted at ``location`` itself (a directory of checkpoints)."""
    location = _location(location)
    return _backend(_scheme(location))(location.rstrip("/"), storage_options or {})


def storage_for(
    location: Any, storage_options: Mapping[str, Any] | None = None
) -> tuple[Storage, str]:
    """Split a checkpoint location into (storage rooted at its parent, checkpoint name)."""
    location = _location(location)
    scheme = _scheme(location)
    if scheme == "file":
        parent, name = os.path.split(location.rstrip(os.sep))
    else:
        head, _, name = location.rstrip("/").rpartition("/")
        parent = head if "://" in head and not head.endswith(":/") else ""
    if not name or not parent:
        raise InvalidArgumentError(f"{location!r} does not name a checkpoint")
    return _backend(scheme)(parent, storage_options or {}), name


def through_fsspec(location: str) -> bool:
    """Whether ``location`` is a URL that the generic fsspec backend serves (a scheme with no
    backend of its own here)."""
    return "://" in location and _scheme(location) not in _BACKENDS


def _backend(scheme: str) -> Callable[[str, Mapping[str, Any]], Storage]:
    backend = _BACKENDS.get(scheme)
    return backend if backend is not None else _fsspec().FsspecStorage
