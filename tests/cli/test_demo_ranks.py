"""``tardigrade demo --ranks N``: one rank of a gloo job is SIGKILLed in the middle of a collective
save, N fresh ranks resume from the newest checkpoint, and the result is compared bit for bit
with an uninterrupted N-rank run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tardigrade.cli import _demo_ranks, main

SRC = str(Path(__file__).resolve().parents[2] / "src")

CHECKS = (
    "final parameters",
    "optimizer state",
    "data position",
    "RNG state of each of the 2 ranks",
)


def check_lines(out: str) -> dict[str, str]:
    """The SAME AS RUN 3 table: check -> yes/NO."""
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("SAME AS RUN 3"))
    rows = {}
    for ln in lines[start + 1 :]:
        if not ln.strip():
            break
        what, _, verdict = ln.rstrip().rpartition(" ")
        rows[what.strip()] = verdict
    return rows


@pytest.mark.slow
@pytest.mark.crash
@pytest.mark.timeout(300)  # ~25 s alone; six interpreters importing torch on a busy machine
def test_demo_two_ranks_kill_one_mid_save_and_resume_bit_identical(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "run" / "ckpt"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, env.get("PYTHONPATH")) if p)
    argv = ["demo", "--ranks", "2", "--dir", str(d), "--steps", "40", "--every", "10"]
    r = subprocess.run(
        [sys.executable, "-m", "tardigrade.cli", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=280,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "bit-identical: yes" in out
    assert check_lines(out) == {**dict.fromkeys(CHECKS, "yes"), "loss curve (40 steps)": "yes"}
    # The default kill step is the save nearest 60% of the run: 20 of 40.
    assert "rank 1 was killed (SIGKILL) at step 20 while writing its file" in out
    assert "data-r00001-" in out  # one of rank 1's own data files
    assert "rank(s) 0 raised DistributedError" in out
    assert "nothing of step 20 was committed; rank 0 removed its staging directory" in out
    assert "the previous one, step-000000010, is intact" in out
    assert 'tg.load("' in out and 'step-000000010", into=state) on every rank -> step 10' in out
    assert "trained steps 11 to 40" in out
    # Run 1 committed step 10 only; run 2 saved 20, 30 and 40; nothing half-written is left.
    assert main(["ls", str(d), "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert [(e["step"], e["status"]) for e in listing] == [
        (step, "committed") for step in (10, 20, 30, 40)
    ]
    assert main(["verify", str(d)]) == 0


@pytest.mark.slow
@pytest.mark.crash
@pytest.mark.timeout(300)  # ~25 s alone; six interpreters importing torch on a busy machine
def test_demo_two_ranks_reports_an_inexact_resume_in_text_and_json_and_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Run 2 restores everything but the ranks' RNG states: their dropout masks then differ
    # from the uninterrupted run's, and the demo must say so and fail.
    real = _demo_ranks.resume_args
    monkeypatch.setattr(
        _demo_ranks, "resume_args", lambda newest: [*real(newest), "--skip-restore", "rng"]
    )
    d, report_file = tmp_path / "ckpt", tmp_path / "report.json"
    argv = ["demo", "--ranks", "2", "--dir", str(d), "--steps", "20", "--every", "5"]
    rc = main([*argv, "--no-progress", "--report", str(report_file)])
    out, err = capsys.readouterr()
    assert rc == 1, out + err
    assert "bit-identical: NO" in out
    assert "NOT restored: rng" in out
    checks = check_lines(out)
    assert checks["RNG state of each of the 2 ranks"] == "NO"
    assert checks["final parameters"] == "NO"
    assert checks["loss curve (20 steps)"] == "NO"
    # Killed in the save of step 10, resumed from step 5: the first resumed step differs.
    assert "-> step 5" in out
    assert "first differing loss at step 6" in out

    # The JSON report (--report, as --json prints it) says the same: verdict NO, the checks
    # that failed, the first differing step.
    report = json.loads(report_file.read_text())
    assert report["bit_identical"] is False
    verdicts = {c["what"]: c["identical"] for c in report["checks"]}
    assert verdicts["RNG state of each of the 2 ranks"] is False
    assert verdicts["loss curve (20 steps)"] is False
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


def test_demo_ranks_must_be_positive(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["demo", "--ranks", "0", "--dir", str(tmp_path / "d")])
    assert rc == 2
    assert "--ranks 0: must be at least 1" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()
