"""The generic fsspec backend beyond the conformance suite: how a scheme is found, what a
missing package says, storage options reaching the filesystem, and the single-writer mode of
a filesystem that cannot create only-if-absent.

The filesystems here are fsspec's memory filesystem registered under test-only schemes (see
``conftest.py``); each has a store of its own.
"""

from __future__ import annotations

import errno
import gc
import logging
import sys
import uuid
from typing import Any

import fsspec
import pytest
import torch
from fsspec.spec import AbstractFileSystem

import tardigrade as tg
from tardigrade.cli import main
from tardigrade.errors import InvalidArgumentError, StorageError, TardigradeError
from tardigrade.storage import FsspecStorage, PreconditionFailed, open_root

from .conftest import FSSPEC_SCHEME, TestFileSystem


class GenericCreateFileSystem(TestFileSystem):
    """Creates only through fsspec's generic ``pipe_file``: it checks, then writes."""

    protocol = ("tgfs1w",)
    store: dict[str, Any] = {}
    pseudo_dirs = [""]
    pipe_file = AbstractFileSystem.pipe_file

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        return TestFileSystem._strip_protocol(str(path).removeprefix("tgfs1w://"))


class KeyedFileSystem(TestFileSystem):
    """Refuses every call unless it was opened with ``key="right"`` (credentials) and, if
    given, ``strict`` as a bool."""

    protocol = ("tgfskey",)
    store: dict[str, Any] = {}
    pseudo_dirs = [""]

    def __init__(self, *args: Any, key: str | None = None, strict: bool = True, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.key = key
        self.strict = strict

    def _check(self) -> None:
        if self.key != "right" or not isinstance(self.strict, bool):
            raise PermissionError(13, f"the key was refused ({self.key!r}, {self.strict!r})")

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        self._check()
        return super().info(path, **kwargs)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        self._check()
        return super()._open(path, mode, **kwargs)

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        return TestFileSystem._strip_protocol(str(path).removeprefix("tgfskey://"))


fsspec.register_implementation("tgfs1w", GenericCreateFileSystem, clobber=True)
fsspec.register_implementation("tgfskey", KeyedFileSystem, clobber=True)


def fresh(scheme: str = FSSPEC_SCHEME) -> str:
    return f"{scheme}://b-{uuid.uuid4().hex[:12]}/run"


def state(v: float) -> dict[str, Any]:
    return {"w": torch.full((32,), v), "step": int(v)}


def test_a_scheme_fsspec_serves_goes_to_the_fsspec_backend() -> None:
    root = fresh()
    assert isinstance(open_root(root), FsspecStorage)
    with tg.CheckpointManager(root, state(0.0), async_save=False, keep_last=1) as mgr:
        for step in (1, 2):
            mgr.state.update(state(float(step)))
            mgr.save(step)
        assert mgr.steps() == [2]
    assert tg.load(f"{root}/step-000000002")["step"] == 2
    # Nothing but the checkpoint and the lease record is left in the store.
    assert sorted(n for n in open_root(root).list()) == [".lock", "step-000000002"]


def test_storage_options_reach_the_filesystem() -> None:
    root = fresh("tgfskey")
    tg.save(f"{root}/ckpt", state(3.0), storage_options={"key": "right"})
    assert tg.load(f"{root}/ckpt", storage_options={"key": "right"})["step"] == 3
    with pytest.raises(StorageError) as e:
        tg.load(f"{root}/ckpt", storage_options={"key": "wrong"})
    assert f"{root}/ckpt" in str(e.value) and "refused" in str(e.value)
    assert e.value.errno == errno.EACCES


def test_a_missing_filesystem_package_names_the_url_and_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fsspec.registry import known_implementations

    monkeypatch.setitem(
        known_implementations,
        "tgnone",
        {"class": "tgnonefs.core.NoneFileSystem", "err": "Install tgnonefs to use tgnone://"},
    )
    with pytest.raises(TardigradeError, match=r"tgnone://b/c/d: .*pip install tgnonefs"):
        tg.load("tgnone://b/c/d")


def test_a_missing_fsspec_names_the_url_and_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fsspec", None)  # import fsspec raises ImportError
    with pytest.raises(TardigradeError, match=r"gs://b/c: .*tardigrade-ckpt\[fsspec\]"):
        tg.save("gs://b/c", state(1.0))
    with pytest.raises(InvalidArgumentError):  # the built-in schemes need no fsspec
        tg.load("memory://b/c", storage_options={"x": 1})


def test_create_only_is_probed_and_trusted_where_enforced(
    caplog: pytest.LogCaptureFixture,
) -> None:
    storage = open_root(fresh())
    with caplog.at_level(logging.WARNING, logger="tardigrade"):
        storage.preflight()
        storage.put("rec", b"1", mode="create")
        with pytest.raises(PreconditionFailed):
            storage.put("rec", b"2", mode="create")
    assert "single-writer" not in caplog.text


def test_without_create_only_it_runs_single_writer_and_says_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    root = fresh("tgfs1w")
    with caplog.at_level(logging.WARNING, logger="tardigrade"):
        tg.save(f"{root}/a", state(1.0))
        tg.save(f"{root}/b", state(2.0))
        with pytest.raises(tg.CheckpointExistsError):
            tg.save(f"{root}/a", state(3.0))
    warned = [r for r in caplog.records if "single-writer" in r.getMessage()]
    assert len(warned) == 1, caplog.text
    assert "two jobs saving under this root at once are not detected" in warned[0].getMessage()
    assert tg.load(f"{root}/a")["step"] == 1  # the refused save changed nothing
    storage = open_root(root)
    storage.put("rec", b"1", mode="create")  # checked, then written: still refused in turn
    with pytest.raises(PreconditionFailed):
        storage.put("rec", b"2", mode="create")


def test_a_writer_that_fails_mid_object_leaves_nothing_even_after_collection() -> None:
    storage = open_root(fresh())
    w = storage.open_writer("obj")
    w.write(b"half of it")
    w.abort()  # the save failed mid-object
    del w
    gc.collect()  # a file object's finaliser must not complete the object either
    assert storage.stat("obj") is None and storage.list() == []


def test_the_commands_give_fsspec_typed_options(capsys: pytest.CaptureFixture[str]) -> None:
    """``--storage-option`` values reach an fsspec filesystem as JSON where they read as JSON
    (``strict=false`` is False, not the text "false"), as fsspec reads its FSSPEC_* variables."""
    root = fresh("tgfskey")
    tg.save(f"{root}/step-000000001", state(1.0), storage_options={"key": "right"})
    rc = main(["ls", root, "--storage-option", "key=right", "--storage-option", "strict=false"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "step-000000001" in out and "1 committed" in out
    rc = main(["ls", root, "--storage-option", "key=wrong"])
    assert rc == 1 and root in capsys.readouterr().err


def test_faulty_storage_takes_storage_options() -> None:
    """``tardigrade.testing.FaultyStorage`` wraps a URL with its options, and fails on cue."""
    from tardigrade.testing import FaultyStorage

    root = fresh("tgfskey")
    faulty = FaultyStorage(root, storage_options={"key": "right"})
    tg.save(f"{faulty.root}/a", state(1.0))
    faulty.fail("put", error="EIO")
    with pytest.raises(TardigradeError, match="injected EIO"):
        tg.save(f"{faulty.root}/b", state(2.0))
    assert tg.load(f"{root}/a", storage_options={"key": "right"})["step"] == 1
    assert not open_root(root, {"key": "right"}).exists("b/manifest.json")
