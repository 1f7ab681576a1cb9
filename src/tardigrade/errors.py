"""The one exception tree of Tardigrade.

Every error the library raises on purpose derives from :class:`TardigradeError`, and each
subclass also inherits the built-in exception a caller would naturally catch, so
``except FileNotFoundError`` keeps working for code that does not know about Tardigrade::

    Exception
     └── TardigradeError
          ├── CheckpointNotFoundError   (+ FileNotFoundError)  no committed checkpoint at a path
          ├── CheckpointExistsError     (+ FileExistsError)    refusing to overwrite a checkpoint
          ├── CorruptCheckpointError    (+ ValueError)         bytes on disk are malformed or damaged
          │    └── ChecksumMismatchError                       a chunk's checksum does not match
          ├── UnsupportedFormatError    (+ ValueError)         a format version/dtype this build can't read
          ├── UnsupportedTypeError      (+ TypeError)          a state leaf the format cannot represent
          ├── StateMismatchError        (+ ValueError)         checkpoint and live state disagree
          ├── CheckpointLockedError     (+ BlockingIOError)    another live writer owns the directory
          ├── InvalidArgumentError      (+ ValueError)         a bad argument to a public function
          ├── SaveError                 (+ RuntimeError)       a save failed (often in the background)
          ├── InsufficientMemoryError   (+ MemoryError)        not enough memory to read a checkpoint
          ├── StorageError              (+ OSError)            the storage backend failed
          └── DistributedError          (+ RuntimeError)       ranks of a collective failed or lost each other

Messages name the checkpoint, the key or file, what is wrong and what to do about it.
"""

from __future__ import annotations

__all__ = [
    "CheckpointExistsError",
    "CheckpointLockedError",
    "CheckpointNotFoundError",
    "ChecksumMismatchError",
    "CorruptCheckpointError",
    "DistributedError",
    "InsufficientMemoryError",
    "InvalidArgumentError",
    "SaveError",
    "StateMismatchError",
    "StorageError",
    "TardigradeError",
    "UnsupportedFormatError",
    "UnsupportedTypeError",
]


class TardigradeError(Exception):
    """Base class of every error Tardigrade raises on purpose.

    An error raised by a save also says whether the checkpoint was committed, in its message
    and in ``committed``: ``False`` (the default, and for every error not raised by a save)
    when nothing was; ``True`` when the failure came after the commit point (in a collective
    save, a rank died after rank 0 committed): the checkpoint at ``path`` is complete, so load
    it rather than saving it again; ``None`` when this process cannot know (a rank that lost
    rank 0 while rank 0 was committing). ``path`` is the checkpoint's location, or None.
    """

    committed: bool | None = False
    path: str | None = None


class CheckpointNotFoundError(TardigradeError, FileNotFoundError):
    """No committed checkpoint exists at the given location."""


class CheckpointExistsError(TardigradeError, FileExistsError):
    """A checkpoint already exists where a new one would be written (pass ``overwrite=True``)."""


class CorruptCheckpointError(TardigradeError, ValueError):
    """A checkpoint's bytes are malformed, truncated, unsafe or otherwise damaged."""


class ChecksumMismatchError(CorruptCheckpointError):
    """A chunk's bytes do not match the checksum recorded when it was written."""


class UnsupportedFormatError(TardigradeError, ValueError):
    """The checkpoint uses a format version or dtype this version of Tardigrade cannot read."""


class UnsupportedTypeError(TardigradeError, TypeError):
    """A state leaf cannot be represented in the format (the message gives its path)."""


class StateMismatchError(TardigradeError, ValueError):
    """The live state passed to ``load(into=...)`` does not match the checkpoint."""


class CheckpointLockedError(TardigradeError, BlockingIOError):
    """Another live writer holds the checkpoint directory's lock.

    ``alive`` is True when its holder is known to live on (a flock held on this machine,
    another manager of this process): waiting cannot help; any other holder may be dead or
    stall past its lease.
    """

    alive: bool = False


class InvalidArgumentError(TardigradeError, ValueError):
    """A public function was called with an invalid argument."""


class InsufficientMemoryError(TardigradeError, MemoryError):
    """Reading a checkpoint needed more memory than could be had (free some, or raise limits)."""


class SaveError(TardigradeError, RuntimeError):
    """A save failed (see ``committed``: almost always nothing was). The cause is chained as
    ``__cause__``."""


class StorageError(TardigradeError, OSError):
    """The storage backend failed to read, write or list.

    In a collective operation a plain ``OSError`` raised on one rank reaches every rank as a
    StorageError that is also the same built-in class (``PermissionError``, ...) with the same
    ``errno``.
    """


class DistributedError(TardigradeError, RuntimeError):
    """A collective step failed: a rank raised, died, hung, or did not make the same call.

    Raised on every rank of the group. ``causes`` maps each failing rank to its error
    (``"SaveError: disk full"``); it is empty when the failure was the transport itself (a
    timeout or a lost connection), which this rank cannot attribute to a particular peer.
    """

    causes: dict[int, str]

    def __init__(self, message: str, causes: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.causes = dict(causes or {})
