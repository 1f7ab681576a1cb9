"""The backend contract: a handful of primitives over names relative to a root.

Call order for a save (the commit order is the design):
``begin(name)`` -> ``open_writer(tmp/...)``; ``write``...; ``close`` (durable) for each data file
-> ``open_writer(tmp/manifest.json)`` ... ``close`` -> ``commit(tmp, name)``.
After ``commit`` returns, the checkpoint exists and survives power loss; before, it does not.
"""

from __future__ import annotations

import abc

from ..errors import CorruptCheckpointError, TardigradeError
from ..format.checksum import Hasher

# The commit record of a checkpoint, and how every manifest Tardigrade writes begins.
MANIFEST = "manifest.json"
MANIFEST_START = b'{"format":"tardigrade"'
# Everything in flight or left behind starts with this; readers never read it.
TMP_PREFIX = ".tmp-"


def staging_name(name: str, save_id: str) -> str:
    """Where a save of checkpoint ``name`` writes before it commits."""
    return f"{TMP_PREFIX}{name}-{save_id}"


def replaced_name(name: str, tag: str) -> str:
    """Where a replace without atomic swap moves the old checkpoint ``name`` meanwhile."""
    return f"{TMP_PREFIX}{name}-replaced-{tag}"


class Writer(abc.ABC):
    """A file being written. ``close()`` makes its bytes durable."""

    @abc.abstractmethod
    def write(self, data: memoryview | bytes, *, hasher: Hasher | None = None) -> None:
        """Append ``data``.

        With ``hasher``, the writer updates it with exactly the bytes it writes, taken from its
        own copy of ``data``: the caller's memory may change during the call (a synchronous
        save of live tensors) and the checksum still describes the file.
        """

    @abc.abstractmethod
    def close(self) -> None: ...

    @abc.abstractmethod
    def abort(self) -> None:
        """Release resources without making anything durable (used on failure)."""


class Reader(abc.ABC):
    """A file opened for random-access reads."""

    name: str
    size: int

    @abc.abstractmethod
    def readinto(self, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` completely from ``offset``; a short file raises CorruptCheckpointError."""

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Storage(abc.ABC):
    """A root under which checkpoints live. Names use '/' and are relative to the root."""

    root: str

    @abc.abstractmethod
    def open_writer(self, name: str, *, size_hint: int | None = None) -> Writer:
        """Create the file ``name``; ``size_hint`` (its expected size) may pick a faster path."""

    @abc.abstractmethod
    def open_reader(self, name: str) -> Reader: ...

    @abc.abstractmethod
    def list(self, name: str = "") -> list[str]:
        """Entries directly under ``name`` (a directory); empty if it does not exist."""

    @abc.abstractmethod
    def exists(self, name: str) -> bool: ...

    @abc.abstractmethod
    def delete(self, name: str) -> None:
        """Remove a file or a whole directory; missing is not an error."""

    @abc.abstractmethod
    def begin(self, name: str, save_id: str) -> str:
        """Prepare an invisible staging location for checkpoint ``name``; return its name."""

    @abc.abstractmethod
    def commit(self, staging: str, name: str, *, replace: bool) -> None:
        """Make ``staging`` visible as ``name``, durably. ``replace`` swaps out an existing one."""

    def describe(self, name: str) -> str | None:
        """What is at ``name``: None (nothing), ``"checkpoint"`` (a directory whose commit
        record is a Tardigrade manifest), ``"directory"`` or ``"file"`` (anything else)."""
        if not self.exists(name):
            return None
        try:
            with self.open_reader(f"{name}/{MANIFEST}") as r:
                head = bytearray(min(r.size, len(MANIFEST_START)))
                r.readinto(0, memoryview(head))
            if bytes(head) == MANIFEST_START:
                return "checkpoint"
        except (OSError, TardigradeError):
            pass
        return "directory" if self.list(name) or self.is_dir(name) else "file"

    def is_dir(self, name: str) -> bool:
        """Whether ``name`` is a directory (object stores: a prefix with entries)."""
        return bool(self.list(name))

    def read_bytes(self, name: str, limit: int) -> bytes:
        """Read a whole small file, refusing ones larger than ``limit``."""
        with self.open_reader(name) as r:
            if r.size > limit:
                raise CorruptCheckpointError(
                    f"{r.name}: {r.size} bytes exceeds the cap of {limit} bytes for this file"
                )
            buf = bytearray(r.size)
            r.readinto(0, memoryview(buf))
            return bytes(buf)

    def url(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"


def check_name(name: object, where: str) -> str:
    """A data file name from a manifest must be a plain file name inside the checkpoint."""
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\x00" in name
        or ".." in name
        or len(name) > 255
    ):
        raise CorruptCheckpointError(
            f"{where}: data file name {name!r} is not a plain file name inside the checkpoint "
            "(it contains a path separator, '..', NUL or is empty). The manifest is damaged or "
            "hostile; refusing to read it."
        )
    return name
