"""One process: a save whose storage fails right after the rename (as an fsync of the parent
directory would) committed, and says so; the manager counts it as saved. (The distributed
cases are in tests/distributed/test_commit_outcome.py: the same mechanism.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import tardigrade as tg
from tardigrade.storage import local

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def fail_after_rename(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """While the returned flag is set, a commit renames, then raises EIO."""
    armed = [False]
    real = local.LocalStorage.commit

    def commit(self: Any, *args: Any, **kw: Any) -> None:
        real(self, *args, **kw)
        if armed[0]:
            raise OSError(5, "Input/output error (fsync of the parent directory)")

    monkeypatch.setattr(local.LocalStorage, "commit", commit)
    return armed


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_save_failing_after_the_rename_says_committed(
    tmp_path: Path, fail_after_rename: list[bool], async_: bool
) -> None:
    fail_after_rename[0] = True
    path = tmp_path / "ckpt"
    with pytest.raises(tg.SaveError) as info:
        out = tg.save(path, {"w": torch.ones(3), "step": 1}, async_=async_)
        if async_:
            out.result(timeout=60)  # type: ignore[union-attr]
    err = info.value
    assert err.committed is True and err.path == str(path)
    assert "Input/output error" in str(err)
    assert f"The checkpoint {path} was committed nonetheless (committed=True)" in str(err)
    assert tg.load(path)["step"] == 1
    # A failure before the commit point still says nothing was committed.
    fail_after_rename[0] = False
    with pytest.raises(tg.CheckpointExistsError) as exists:
        tg.save(path, {"w": torch.ones(3), "step": 2})
    assert exists.value.committed is False


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_manager_counts_a_save_that_committed_before_failing(
    tmp_path: Path, fail_after_rename: list[bool], async_save: bool
) -> None:
    state = {"w": torch.ones(3), "step": 0}
    with tg.CheckpointManager(tmp_path, state, keep_last=1, async_save=async_save) as mgr:
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
        state["step"] = 3
        assert mgr.save(3)  # training goes on
