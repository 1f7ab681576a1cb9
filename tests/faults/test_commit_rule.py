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
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tardigrade as tg
import tardigrade._write as write_mod
import tardigrade.manager._checkpoint_manager as manager_mod
from tardigrade.errors import SaveError
from tardigrade.format import limits
from tardigrade.format.jsonio import dumps

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
    mgr = tg.CheckpointManager(sys.argv[1], state)
    assert mgr.restore(step=100) == 100
    with torch.no_grad():
        state["model"].weight.fill_(150.0)
    state["step"] = 150
    assert mgr.save(150) is True
    mgr.wait()  # committed
    os.kill(os.getpid(), signal.SIGKILL)  # no close(), no cleanup: a crash
    """
)


def test_a_crash_after_restore_step_resumes_the_new_timeline(tmp_path: Path) -> None:
    state = make_state()
    with tg.CheckpointManager(tmp_path, state) as mgr:
        for s in (100, 200, 300):
            mark(state, s)
            mgr.save(s)
    child = subprocess.run(
        [sys.executable, "-c", CRASH_AFTER_BRANCH, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
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
