"""The public surface is curated: this pins it so additions and removals are deliberate."""

import tardigrade as tg

EXPECTED = {
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
}


def test_all_is_pinned() -> None:
    assert set(tg.__all__) == EXPECTED


def test_every_exported_name_exists_and_is_public() -> None:
    for name in tg.__all__:
        obj = getattr(tg, name)
        if name != "__version__":
            assert not getattr(obj, "__module__", "tardigrade").startswith("tests")


def test_exported_callables_have_docstrings_with_a_first_line() -> None:
    for name in tg.__all__:
        obj = getattr(tg, name)
        if callable(obj):
            assert obj.__doc__ and obj.__doc__.strip().splitlines()[0], name
