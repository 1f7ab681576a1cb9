"""Nothing committed is ever unloadable, and nothing loadable is lost because of it.

A save commits only what every reader of its format accepts, checked by the reader's own code;
retention never deletes the newest loadable checkpoint because of newer ones it cannot read;
``restore()`` falls back past a candidate whatever it fails with; and after ``restore(step)``
a crash resumes from the new timeline, not from the abandoned one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tardigrade as tg
import tardigrade._write as write_mod
import tardigrade.manager._tiers as manager_mod
from tardigrade.errors import SaveError
from tardigrade.format import limits
from tardigrade.format.jsonio import dumps
from tardigrade.storage import open_root

CHILD_TIMEOUT = 60


def make_state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {"model": nn.Linear(4, 3), "step": 0, "table": {}}


def mark(state: dict[str, Any], value: int) -> None:
    with torch.no_grad():
        state["model"].weight.fill_(float(value))
    state["step"] = value


def weight(mgr: tg.CheckpointManager, step: int) -> float:
    return float(mgr.load(step, keys=["model"])["model"]["weight"][0, 0])


@pytest.mark.s3
def test_a_crash_after_restore_step_resumes_the_new_timeline_on_a_store(s3_env: Any) -> None:
    """A store cannot rename the abandoned checkpoints aside: restore(step) records them (by
    save id) in the store, and a restore after a crash passes over them."""
    url = f"s3://{s3_env.bucket}/timeline-{uuid.uuid4().hex[:12]}"
    crash_after_branch(url)
    root = open_root(url)
    assert ".abandoned.json" in root.list()
    state = make_state()
    # The dead writer ran on this machine: its lease is taken over at once, no wait.
    with tg.CheckpointManager(url, state, every_steps=50, lock_timeout=0) as mgr:
        assert mgr.restore() == 150
        assert state["step"] == 150
        assert mgr.steps() == [100, 150, 200, 300]  # in place, passed over
        mark(state, 200)
        assert mgr.step(200) is True  # replaces the abandoned step 200, no force needed
        mgr.wait()
        assert weight(mgr, 200) == 200.0
        mark(state, 350)
        assert mgr.step(350) is True  # past the abandoned step 300: it is deleted
        mgr.wait()
        assert mgr.steps() == [100, 150, 200, 350]
    assert ".abandoned.json" not in root.list()  # nothing is abandoned any more
    state = make_state()
    with tg.CheckpointManager(url, state) as mgr:
        assert mgr.restore() == 350
    root.delete("")


@pytest.mark.parametrize("record", [b"{not json", b'{"abandoned": {"../x": 1}}'])
def test_a_damaged_record_of_abandoned_checkpoints_is_reported_and_the_newest_restored(
    record: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"memory://timeline-{uuid.uuid4().hex[:12]}/run"
    state = make_state()
    with tg.CheckpointManager(url, state) as mgr:
        for s in (1, 2):
            mark(state, s)
            mgr.save(s)
    root = open_root(url)
    root.put(".abandoned.json", record, mode="overwrite")
    state = make_state()
    with tg.CheckpointManager(url, state) as mgr:
        assert mgr.restore() == 2 and state["step"] == 2
    assert any(
        f"{url}/.abandoned.json" in r.getMessage() and "restoring the newest" in r.getMessage()
        for r in caplog.records
    ), [r.getMessage() for r in caplog.records]
    root.delete("")


def dense_table(n: int) -> dict[str, list[int]]:
    """Many tiny containers: the JSON a reader's parse-cost guard exists to refuse."""
    return {f"k{i}": [i] for i in range(n)}


@pytest.fixture
def small_parse_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    # Readers and writers read the same limit: lowered, a small state is "too dense".
    monkeypatch.setattr(limits, "MAX_PARSE_BYTES", 1 << 20)


def test_a_save_is_refused_when_readers_would_refuse_its_manifest(
    tmp_path: Path, small_parse_budget: None
) -> None:
    with pytest.raises(
        SaveError, match=r"so many small values.*MiB to parse.*nothing was committed"
    ):
        tg.save(tmp_path / "c", {"table": dense_table(20_000)})
    assert os.listdir(tmp_path) == []  # no checkpoint, no staging left


def test_the_manager_keeps_the_good_checkpoint_when_a_save_is_refused(
    tmp_path: Path, small_parse_budget: None
) -> None:
    state = make_state()
    with tg.CheckpointManager(tmp_path, state, keep_last=1) as mgr:
        mark(state, 1)
        assert mgr.save(1) is True
        state["table"] = dense_table(20_000)
        mark(state, 2)
        mgr.save(2)
        mgr.wait()  # warn mode: reported and counted, training continues
        assert mgr.stats.failed == 1 and mgr.steps() == [1]
    state = make_state()
    with tg.CheckpointManager(tmp_path, state) as mgr:
        assert mgr.restore() == 1 and state["step"] == 1


def test_retention_never_deletes_the_newest_loadable_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = make_state()
    with tg.CheckpointManager(tmp_path, state, keep_last=1) as mgr:
        mark(state, 1)
        assert mgr.save(1) is True
        mgr.wait()

        def unreadable(doc: dict[str, Any], where: str) -> bytes:
            # A writer a reader disagrees with: the manifest names a version none reads.
            return dumps({**doc, "format_version": 99})

        monkeypatch.setattr(write_mod, "seal_checked", unreadable)
        mark(state, 2)
        assert mgr.save(2) is True  # committed: the writer believed it was fine
        mgr.wait()
        monkeypatch.undo()
        assert mgr.steps() == [1, 2]  # step 1, the newest loadable one, is kept
        mark(state, 3)
        assert mgr.save(3) is True
        mgr.wait()
        assert mgr.steps() == [3]  # a loadable newer one: retention goes on as configured
    state = make_state()
    with tg.CheckpointManager(tmp_path, state) as mgr:
        assert mgr.restore() == 3


@pytest.mark.parametrize("error", [RecursionError, ValueError, IndexError])
def test_restore_skips_a_candidate_that_fails_with_any_exception(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: type[Exception], caplog: Any
) -> None:
    state = make_state()
    with tg.CheckpointManager(tmp_path, state) as mgr:
        for s in (1, 2):
            mark(state, s)
            mgr.save(s)
    real_load = manager_mod.load

    def failing_load(path: Any, **kw: Any) -> Any:
        if str(path).endswith("step-000000002"):
            raise error("a reader bug")
        return real_load(path, **kw)

    monkeypatch.setattr(manager_mod, "load", failing_load)
    state = make_state()
    with tg.CheckpointManager(tmp_path, state) as mgr:
        assert mgr.restore() == 1
        assert state["step"] == 1 and float(state["model"].weight.detach()[0, 0]) == 1.0
    assert any(
        f"{error.__name__}: a reader bug" in r.getMessage() and "step-000000002" in r.getMessage()
        for r in caplog.records
    )


CRASH_AFTER_BRANCH = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    from torch import nn
    import tardigrade as tg

    torch.manual_seed(0)
    state = {"model": nn.Linear(4, 3), "step": 0, "table": {}}
    lease = {"lock_lease_seconds": float(sys.argv[2])} if len(sys.argv) > 2 else {}
    mgr = tg.CheckpointManager(sys.argv[1], state, **lease)
    assert mgr.restore(step=100) == 100
    with torch.no_grad():
        state["model"].weight.fill_(150.0)
    state["step"] = 150
    assert mgr.save(150) is True
    mgr.wait()  # committed
    os.kill(os.getpid(), signal.SIGKILL)  # no close(), no cleanup: a crash
    """
)


def crash_after_branch(location: str, *args: str) -> None:
    """Steps 100, 200 and 300 saved at ``location``; then a process restores step 100, saves
    step 150 and is killed (``CRASH_AFTER_BRANCH``, given ``args`` after the location)."""
    state = make_state()
    with tg.CheckpointManager(location, state) as mgr:
        for s in (100, 200, 300):
            mark(state, s)
            mgr.save(s)
    child = subprocess.run(
        [sys.executable, "-c", CRASH_AFTER_BRANCH, location, *args],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr


def test_a_crash_after_restore_step_resumes_the_new_timeline(tmp_path: Path) -> None:
    crash_after_branch(str(tmp_path))
    state = make_state()
    with tg.CheckpointManager(tmp_path, state, every_steps=50) as mgr:
        assert mgr.restore() == 150
        assert state["step"] == 150
        assert mgr.steps() == [100, 150]
        aside = sorted(n for n in os.listdir(tmp_path) if ".abandoned-" in n)
        assert [n.split(".")[0] for n in aside] == ["step-000000200", "step-000000300"]
        # The abandoned checkpoints are kept until this run passes them, then deleted.
        mark(state, 200)
        assert mgr.step(200) is True
        mgr.wait()
        assert weight(mgr, 200) == 200.0
        assert [n.split(".")[0] for n in os.listdir(tmp_path) if ".abandoned-" in n] == [
            "step-000000300"
        ]
