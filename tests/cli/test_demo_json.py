"""``tardigrade demo --json``: the demo's whole report as one JSON object on stdout, for scripts."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tardigrade.cli import _demo_ranks, main


@pytest.mark.slow
@pytest.mark.crash
@pytest.mark.timeout(240)  # three interpreters importing torch on a busy machine
def test_demo_json_carries_the_verdict_kill_point_restore_and_saves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # a terminal: still no bar
    d = tmp_path / "ckpt"
    rc = main(["demo", "--json", "--dir", str(d), "--steps", "40", "--every", "10"])
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    report = json.loads(out)  # stdout is the JSON object and nothing else
    assert report["bit_identical"] is True
    assert [c["what"] for c in report["checks"]] == [
        "final parameters",
        "optimizer state",
        "loss curve (40 steps)",
        "LR schedule, RNGs, data position, counters",
    ]
    assert all(c["identical"] for c in report["checks"])
    assert report["first_differing_loss_step"] is None
    assert (report["ranks"], report["steps"], report["every"], report["keep_last"]) == (
        1,
        40,
        10,
        4,
    )
    # Killed while the async save of step 20 (the one nearest 60% of 40) was being written.
    killed = report["killed"]
    assert killed["step"] == 20 and killed["training_step"] > 20
    assert killed["staging_file"].startswith(".tmp-step-000000020-")
    assert [(c["name"], c["status"]) for c in killed["on_disk_after"]] == [
        ("step-000000010", "committed"),
        (killed["staging_file"].split("/")[0], "incomplete-tmp"),
    ]
    # Run 2's mgr.restore(): the killed save removed, step 10 restored.
    assert report["resumed_from_step"] == 10
    assert report["restored"]["name"] == "step-000000010"
    assert report["restored"]["removed"] == [killed["on_disk_after"][1]["name"]]
    assert [r["returncode"] for r in report["runs"]] == [-9, 0, 0]
    assert [(s["run"], s["step"], s["ok"]) for s in report["saves"]] == [
        (1, 10, True),
        (2, 20, True),
        (2, 30, True),
        (2, 40, True),
    ]
    assert (report["stats"]["succeeded"], report["stats"]["failed"]) == (3, 0)
    assert [c["step"] for c in report["checkpoints"]] == [10, 20, 30, 40]
    assert "[" not in err  # no progress bar with --json, even on a terminal


@pytest.mark.slow
@pytest.mark.crash
@pytest.mark.timeout(300)  # ~25 s alone; six interpreters importing torch on a busy machine
def test_demo_ranks_json_reports_an_inexact_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Run 2 restores everything but the ranks' RNG states: the JSON verdict must say NO, name
    # the checks that failed and the first differing step, and the exit status must be 1.
    real = _demo_ranks.resume_args
    monkeypatch.setattr(
        _demo_ranks, "resume_args", lambda newest: [*real(newest), "--skip-restore", "rng"]
    )
    argv = ["demo", "--json", "--ranks", "2", "--dir", str(tmp_path / "c")]
    rc = main([*argv, "--steps", "20", "--every", "5"])
    out, err = capsys.readouterr()
    assert rc == 1, out + err
    report = json.loads(out)
    assert report["bit_identical"] is False
    checks = {c["what"]: c["identical"] for c in report["checks"]}
    assert checks["RNG state of each of the 2 ranks"] is False
    assert checks["loss curve (20 steps)"] is False
    assert report["first_differing_loss_step"] == 6
    assert report["ranks"] == 2
    killed = report["killed"]
    assert (killed["rank"], killed["step"], killed["resumed_from"]) == (1, 10, "step-000000005")
    assert "data-r00001-" in killed["file"]
    assert [f["rank"] for f in killed["failures"]] == [0]
    assert killed["failures"][0]["error"] == "DistributedError"
    assert killed["verified"]["tensors"] > 0
    assert report["resumed_from_step"] == 5 and report["restored"]["skipped"] == ["rng"]
    assert [r["returncodes"] for r in report["runs"]][1:] == [[0, 0], [0, 0]]
    assert [s["step"] for s in report["saves"]] == [5, 10, 15, 20]
    assert [c["step"] for c in report["checkpoints"]] == [5, 10, 15, 20]


def test_demo_quiet_turns_its_bars_off(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tardigrade.cli import demo

    shown = []

    def child(argv: list[str], bar: Any, **kw: Any) -> Any:
        shown.append(bar.enabled)
        return demo.ChildRun(returncode=3)  # fails run 1: enough to see the bar's setting

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    monkeypatch.setattr(demo, "run_child", child)
    for flags, enabled in (
        ([], True),
        (["--quiet"], False),
        (["-q"], False),
        (["--no-progress"], False),
    ):
        main(["demo", *flags, "--dir", str(tmp_path / "c"), "--steps", "20", "--every", "5"])
        assert shown.pop() is enabled, flags
    capsys.readouterr()


def test_demo_json_failure_is_json_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tardigrade.cli import demo

    monkeypatch.setattr(
        demo, "run_child", lambda *a, **k: demo.ChildRun(returncode=3, stderr="boom\n")
    )
    rc = main(["demo", "--json", "--dir", str(tmp_path / "c"), "--steps", "20", "--every", "5"])
    out, err = capsys.readouterr()
    assert rc == 1
    assert json.loads(out) == {
        "bit_identical": None,
        "error": "run 1 was not killed in the middle of a save as planned",
        "returncode": 3,
        "stderr_tail": ["boom"],
    }
    assert "run 1 was not killed" in err
