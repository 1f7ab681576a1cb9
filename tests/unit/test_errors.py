"""The exception tree: one root, and each class also the built-in a caller would catch."""

import pytest

import tardigrade as tg
from tardigrade import errors

BUILTIN = {
    tg.CheckpointNotFoundError: FileNotFoundError,
    tg.CheckpointExistsError: FileExistsError,
    tg.CorruptCheckpointError: ValueError,
    tg.ChecksumMismatchError: tg.CorruptCheckpointError,
    tg.UnsupportedFormatError: ValueError,
    tg.UnsupportedTypeError: TypeError,
    tg.StateMismatchError: ValueError,
    tg.CheckpointLockedError: BlockingIOError,
    tg.InvalidArgumentError: ValueError,
    tg.SaveError: RuntimeError,
    tg.InsufficientMemoryError: MemoryError,
    tg.StorageError: OSError,
    tg.DistributedError: RuntimeError,
}


@pytest.mark.parametrize("cls", sorted(BUILTIN, key=lambda c: c.__name__))
def test_each_error_is_a_tardigrade_error_and_its_builtin(cls: type) -> None:
    assert issubclass(cls, tg.TardigradeError)
    assert issubclass(cls, BUILTIN[cls])


def test_root_is_an_exception_not_a_base_exception_only() -> None:
    assert issubclass(tg.TardigradeError, Exception)


def test_tree_is_drawn_in_the_module_docstring() -> None:
    for name in errors.__all__:
        assert name in errors.__doc__, f"{name} missing from the drawn tree"


def test_every_error_class_is_exported() -> None:
    for name in errors.__all__:
        assert getattr(tg, name) is getattr(errors, name)
