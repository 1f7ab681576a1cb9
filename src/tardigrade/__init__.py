"""Tardigrade: PyTorch training state that survives anything.

>>> import tardigrade as tg
>>> tg.save("ckpt/step-100", {"model": model, "optim": optim, "rng": tg.RNGState()})  # doctest: +SKIP
>>> tg.load("ckpt/step-100", into=state)                                               # doctest: +SKIP
"""

from __future__ import annotations

import importlib
import itertools
import os
import sys
from typing import TYPE_CHECKING, Any

from ._version import __version__
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

if TYPE_CHECKING:
    from ._async import AsyncCheckpointer, SaveFuture
    from ._catalog import Catalog
    from ._checkpoint import Checkpoint
    from ._load import load
    from ._open import read_manifest
    from ._rng import RNGState
    from ._save import save
    from ._save_job import SaveResult
    from ._sharding import PerRank, Sharded
    from ._tree import Stateful
    from ._verify import VerifyReport, verify
    from .data import ResumableSampler, SampleIndex, SeededDataset, seed_sample
    from .format.tree import SparseRef, TensorRef
    from .job import Job, JobRunner
    from .manager import (
        AnyOf,
        CheckpointManager,
        Continuous,
        EveryEpochs,
        EverySeconds,
        EverySteps,
        OverheadBudget,
        Policy,
        SaveStats,
        YoungDaly,
    )

# The `tardigrade` command imports these on first use (PEP 562): its --version, --help and
# manifest-only commands then start without importing torch (a second or more). A program
# imports them all at once, as always: tardigrade.distributed must be imported before the
# program creates its process group (see distributed/_collectives.py).
_LAZY = {
    "AnyOf": ".manager",
    "AsyncCheckpointer": "._async",
    "Catalog": "._catalog",
    "Checkpoint": "._checkpoint",
    "CheckpointManager": ".manager",
    "Continuous": ".manager",
    "EveryEpochs": ".manager",
    "EverySeconds": ".manager",
    "EverySteps": ".manager",
    "Job": ".job",
    "JobRunner": ".job",
    "OverheadBudget": ".manager",
    "PerRank": "._sharding",
    "Policy": ".manager",
    "RNGState": "._rng",
    "ResumableSampler": ".data",
    "SampleIndex": ".data",
    "SaveFuture": "._async",
    "SaveResult": "._save_job",
    "SaveStats": ".manager",
    "SeededDataset": ".data",
    "Sharded": "._sharding",
    "SparseRef": ".format.tree",
    "Stateful": "._tree",
    "TensorRef": ".format.tree",
    "VerifyReport": "._verify",
    "YoungDaly": ".manager",
    "load": "._load",
    "read_manifest": "._open",
    "save": "._save",
    "seed_sample": ".data",
    "verify": "._verify",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tardigrade' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # the next access is a plain lookup
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def _started_as_cli() -> bool:
    # The console script is .../bin/tardigrade; `python -m tardigrade.cli` shows in orig_argv.
    argv0 = os.path.basename(sys.argv[0]) if sys.argv else ""
    orig = getattr(sys, "orig_argv", [])
    return argv0 == "tardigrade" or any(
        a == "-m" and b in ("tardigrade.cli", "tardigrade") for a, b in itertools.pairwise(orig)
    )


if not _started_as_cli():
    for _name in _LAZY:
        __getattr__(_name)

if os.environ.get("TARDIGRADE_KILL_POINT"):
    # A child of tardigrade.testing.kill_during: arm its kill point before any storage opens.
    from .testing import _killpoint

    _killpoint.install_from_environment()


__all__ = [
    "AnyOf",
    "AsyncCheckpointer",
    "Catalog",
    "Checkpoint",
    "CheckpointExistsError",
    "CheckpointLockedError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "ChecksumMismatchError",
    "Continuous",
    "CorruptCheckpointError",
    "DistributedError",
    "EveryEpochs",
    "EverySeconds",
    "EverySteps",
    "InsufficientMemoryError",
    "InvalidArgumentError",
    "Job",
    "JobRunner",
    "OverheadBudget",
    "PerRank",
    "Policy",
    "RNGState",
    "ResumableSampler",
    "SampleIndex",
    "SaveError",
    "SaveFuture",
    "SaveResult",
    "SaveStats",
    "SeededDataset",
    "Sharded",
    "SparseRef",
    "StateMismatchError",
    "Stateful",
    "StorageError",
    "TardigradeError",
    "TensorRef",
    "UnsupportedFormatError",
    "UnsupportedTypeError",
    "VerifyReport",
    "YoungDaly",
    "__version__",
    "load",
    "read_manifest",
    "save",
    "seed_sample",
    "verify",
]
