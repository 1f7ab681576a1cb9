"""Tardigrade: PyTorch training state that survives anything.

>>> import tardigrade as tg
>>> tg.save("ckpt/step-100", {"model": model, "optim": optim, "rng": tg.RNGState()})  # doctest: +SKIP
>>> tg.load("ckpt/step-100", into=state)                                               # doctest: +SKIP
"""

from ._async import AsyncCheckpointer, SaveFuture
from ._job import SaveResult
from ._load import load
from ._open import read_manifest
from ._rng import RNGState
from ._save import save
from ._sharding import PerRank, Sharded
from ._tree import Stateful
from ._verify import VerifyReport, verify
from ._version import __version__
from .data import ResumableSampler, SampleIndex, SeededDataset, seed_sample
from .errors import (
    CheckpointExistsError,
    CheckpointLockedError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    DistributedError,
    InsufficientMemoryError,
    InvalidArgumentError,
    SaveError,
    StateMismatchError,
    StorageError,
    TardigradeError,
    UnsupportedFormatError,
    UnsupportedTypeError,
)
from .job import Job, JobRunner
from .manager import CheckpointManager, SaveStats

__all__ = [
    "AsyncCheckpointer",
    "CheckpointExistsError",
    "CheckpointLockedError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "ChecksumMismatchError",
    "CorruptCheckpointError",
    "DistributedError",
    "InsufficientMemoryError",
    "InvalidArgumentError",
    "Job",
    "JobRunner",
    "PerRank",
    "RNGState",
    "ResumableSampler",
    "SampleIndex",
    "SaveError",
    "SaveFuture",
    "SaveResult",
    "SaveStats",
    "SeededDataset",
    "Sharded",
    "StateMismatchError",
    "Stateful",
    "StorageError",
    "TardigradeError",
    "UnsupportedFormatError",
    "UnsupportedTypeError",
    "VerifyReport",
    "__version__",
    "load",
    "read_manifest",
    "save",
    "seed_sample",
    "verify",
]
