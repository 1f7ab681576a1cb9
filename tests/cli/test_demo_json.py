"""``tardigrade demo --json`` / ``--report FILE``: the demo's whole report as one JSON object, on
stdout or in a file beside the text report (the whole runs are checked in test_cli.py and
test_demo_ranks.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tardigrade.cli import main


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
        (["--json"], False),  # stdout is the JSON object: no bar, even on a terminal
        (["--report", str(tmp_path / "r.json")], True),
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
    # With --report the same object goes to the file, and stdout stays free of it.
    report = tmp_path / "report.json"
    argv = ["demo", "--report", str(report), "--dir", str(tmp_path / "c"), "--steps", "20"]
    assert main([*argv, "--every", "5"]) == 1
    out, err = capsys.readouterr()
    assert "{" not in out and "run 1 was not killed" in err
    assert json.loads(report.read_text())["error"] == (
        "run 1 was not killed in the middle of a save as planned"
    )
