"""One process: a save whose storage fails right after the commit point (after the rename, as
an fsync of the parent directory would; after a store's manifest create) committed, says so,
and loses nothing; the manager counts it as saved. (The distributed
cases are in tests/distributed/test_commit_outcome.py: the same mechanism.)
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tardigrade as tg
from tardigrade._commit import ManifestLastCommit, RenameCommit
from tardigrade.storage import open_root

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def fail_after_rename(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """While the returned flag is set, a commit commits (the rename; the manifest's
    conditional create on a store), then raises EIO."""
    armed = [False]
    for cls in (RenameCommit, ManifestLastCommit):
        real = cls.commit

        def commit(self: Any, *args: Any, _real: Any = real, **kw: Any) -> None:
            _real(self, *args, **kw)
            if armed[0]:
                raise OSError(5, "Input/output error (fsync of the parent directory)")

        monkeypatch.setattr(cls, "commit", commit)
    return armed


@pytest.fixture(params=["local", "memory"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "local":
        yield str(tmp_path)
    else:
        url = f"memory://commit-outcome-{uuid.uuid4().hex}/root"
        yield url
        open_root(url).delete("")


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_save_failing_after_the_commit_says_committed(
    root: str, fail_after_rename: list[bool], async_: bool
) -> None:
    fail_after_rename[0] = True
    path = f"{root}/ckpt"
    with pytest.raises(tg.SaveError) as info:
        out = tg.save(path, {"w": torch.ones(3), "step": 1}, async_=async_)
        if async_:
            out.result(timeout=60)  # type: ignore[union-attr]
    err = info.value
    assert err.committed is True and err.path == path
    assert "Input/output error" in str(err)
    assert f"The checkpoint {path} was committed nonetheless (committed=True)" in str(err)
    # Complete: nothing of it was removed as if the save had not committed (on a store, its
    # data objects are not in a staging directory).
    tg.verify(path)
    assert tg.load(path)["step"] == 1
    # A failure before the commit point still says nothing was committed.
    fail_after_rename[0] = False
    with pytest.raises(tg.CheckpointExistsError) as exists:
        tg.save(path, {"w": torch.ones(3), "step": 2})
    assert exists.value.committed is False


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_manager_counts_a_save_that_committed_before_failing(
    root: str, fail_after_rename: list[bool], async_save: bool
) -> None:
    state = {"w": torch.ones(3), "step": 0}
    with tg.CheckpointManager(root, state, keep_last=1, async_save=async_save) as mgr:
        assert mgr.save(1)
        mgr.wait()
        fail_after_rename[0] = True
        state["step"] = 2
        assert mgr.save(2)
        mgr.wait()
        fail_after_rename[0] = False
        assert [s.ok for s in mgr.stats] == [True, True] and mgr.stats.failed == 0
        assert "committed=True" in (mgr.stats[-1].error or "")
        assert mgr.steps() == [2]  # retention (keep_last=1) counted step 2 and removed step 1
        assert mgr.load(2)["step"] == 2
        tg.verify(mgr.path(2))
        state["step"] = 3
        assert mgr.save(3)  # training goes on
