"""The script runner the framework tests share: a run that hangs fails saying where."""

from __future__ import annotations

from pathlib import Path

import pytest

from ._runs import run


def test_a_run_past_its_timeout_fails_with_every_process_stack_and_leaves_none(
    tmp_path: Path,
) -> None:
    pids = tmp_path / "pids"
    with pytest.raises(AssertionError, match="did not end within 10 s") as failed:
        run("_hang_script.py", pids, timeout=10)
    parent, child = map(int, pids.read_text().split())
    message = str(failed.value)
    for pid in (parent, child):
        assert f"--- stacks of pid {pid} " in message
    # Each process's own stack: the parent's and the forked child's.
    assert message.count("in wait_forever") == 2, message
    assert not [pid for pid in (parent, child) if _running(pid)]


def test_processes_a_run_leaves_behind_are_killed(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    run("_hang_script.py", pids, "--orphan")
    _, orphan = map(int, pids.read_text().split())
    assert not _running(orphan)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a killed process no one has reaped yet is not running
