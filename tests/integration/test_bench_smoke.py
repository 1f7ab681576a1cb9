"""Smoke test of the benchmark harness: ``python -m bench --quick`` on a tiny state."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOLS = {"tardigrade", "torch", "safetensors", "dcp"}
REFERENCES = {"raw_write", "raw_write_direct", "hot_read", "memcpy"}
LOOP_MODES = {"none", "tardigrade_async", "tardigrade_overlap", "dcp_async"}


@pytest.mark.slow
@pytest.mark.timeout(360)  # a hang guard: ~90-110 s on a loaded 2-core VM
def test_quick_run_measures_every_tool(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    files = tmp_path / "files"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "--quick",
            "--size=20MB",
            "--repeats=1",
            "--no-distributed",  # test_quick_distributed_run covers it
            f"--dir={files}",
            f"--out={out}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=340,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Targets" in proc.stdout
    assert "Distributed" not in proc.stdout

    results = json.loads(out.read_text())
    assert "distributed" not in results
    tools = results["meta"]["tools"]
    assert set(tools["save"]) >= TOOLS
    assert set(tools["load"]) >= TOOLS
    assert 15e6 < results["meta"]["state_bytes"] < 25e6

    summary = results["summary"]
    assert set(results["first_save"]) == {"raw_write", *tools["save"]}
    assert set(summary["save"]) == set(tools["save"])
    assert set(summary["load"]) == set(tools["load"])
    assert set(summary["reference"]) == REFERENCES
    assert set(summary["verify"]) == {"tardigrade"}
    for group in ("first_save", "save", "load", "reference", "verify"):
        for name, s in summary[group].items():
            assert s["median_s"] > 0 and s["gbps"] > 0, (group, name)
            assert s["peak_rss_above_bytes"] >= 0, (group, name)

    # The training loop: every mode in every measured round, overhead vs the no-save baseline.
    assert results["meta"]["loop"]["steps"] > 0
    measured = [r for r in results["rounds"] if not r["warmup"]]
    assert measured and all(set(r["loop"]) == LOOP_MODES for r in measured)
    assert set(summary["loop"]) == LOOP_MODES
    for mode, x in summary["loop"].items():
        assert x["median_s"] > 0 and x["steps_per_s"] > 0, mode
        assert math.isfinite(x["overhead_pct"]) and math.isfinite(x["cpu_overhead_pct"]), mode
        assert x["cpu_s"] > 0, mode
        assert x["saves"] == (0 if mode == "none" else results["meta"]["loop"]["saves"]), mode
        assert x["blocking_s"] >= 0 and x["final_wait_s"] >= 0, mode
    assert summary["loop"]["none"]["overhead_pct"] == 0
    assert "Training loop" in proc.stdout

    # The store part: S3 on a SeaweedFS started for the run.
    store = summary["store"]
    assert {"raw.save", "raw.load", "tardigrade.save", "tardigrade.load"} <= set(store)
    assert "tardigrade_async.save" in store and store["tardigrade_async.save"]["blocking_s"] > 0
    for op, s in store.items():
        assert s["mb_per_s"] > 0 and s["cpu_s_per_gb"] >= 0, op
    assert "STORE (S3" in proc.stdout

    names = [t["name"] for t in results["targets"]]
    assert len(names) == len(set(names))
    # Restore right after a save on the same node: the RAM tier, cold disk, DCP's page cache.
    assert {"ram_tier", "disk", "dcp"} <= set(summary["same_node"])
    assert set(summary["same_node"]["blocking_s"]) == {"without", "with_ram_tier"}
    for needle in (
        "RAM-tier restore vs DCP page-cache restore (same node)",
        "RAM-tier restore vs cold-disk restore (same node)",
    ):
        assert needle in names, (needle, names)
    assert "SAME-NODE RESTORE" in proc.stdout
    # Staging beside training, and a cadence chosen from the measured cost.
    assert {"overlap_blocking_s", "async_blocking_s", "plain_step_s"} <= set(summary["overlap"])
    assert summary["cadence"]["overhead_saves"] >= 2 and summary["cadence"]["young_daly_saves"] >= 2
    assert "OVERLAP:" in proc.stdout and "CADENCE:" in proc.stdout
    # The RAM tier beside the store, with two saves in flight and with one.
    tiers = summary["cadence"]["tiers"]
    assert set(tiers) == {"in_flight_2", "in_flight_1"}, tiers
    assert all(t["saves"] >= 2 and t["failed"] == 0 for t in tiers.values()), tiers
    for needle in ("raw fsync'd write", "DCP save", "hot read", "DCP load", "verify", "async"):
        assert any(needle in n for n in names), (needle, names)
    # The async targets: steady blocking and the first save of a process, both against a
    # memcpy of the same bytes (the first one measured in the same fresh process).
    for needle in (
        "tg async blocking / memcpy of the same bytes (steady)",
        "tg async first save blocking / memcpy (fresh process, 1 sample)",
    ):
        assert needle in names, (needle, names)
    first_async = results["first_save"]["tardigrade_async"]
    assert first_async["memcpy"]["seconds"] > 0 and first_async["reserve_s"] >= 0
    assert first_async["sample"]["extra"]["blocking_s"] > 0
    assert set(summary["first_save_memcpy"]) == {"tardigrade_async"}
    # The steady ratio pairs each round's async save with the memcpy taken right before it.
    ratios = summary["async_blocking_over_memcpy"]["per_round"]
    assert len(ratios) == len(measured) and all(x > 0 for x in ratios)
    # Every target has a value; which one did not, with the run's report, says why.
    unmeasured = [t["name"] for t in results["targets"] if t["pass"] is None]
    assert not unmeasured, (unmeasured, proc.stdout[-4000:], proc.stderr[-2000:])
    # The checkpoints are deleted at the end of the run.
    assert not [p for p in files.rglob("*") if p.is_file()]


DIST_TARGETS = {
    "2-rank tg.save / DCP save",
    "2-rank tg.save / raw O_DIRECT write (same bytes)",
    "2-rank tg.load(into) / DCP load",
    "2 -> 1 resharding tg.load / DCP load",
    "2-rank tg peak RSS per rank above live (worst: save, load, 2->1 load)",
    "2-rank replicated tg.save: bytes on disk / one copy",
    "2-rank agree_max on gloo (mean)",
    "2-rank planning exchanges in saves after the first (plan cache)",
    "coordinator plan + manifest, 1024 simulated ranks x 2000 tensors",
    "manifest growth over 4x the ranks (linear: <= 4x)",
}


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_quick_distributed_run(tmp_path: Path) -> None:
    """``python -m bench --distributed-only``: 2 gloo ranks, every distributed target."""
    out = tmp_path / "results.json"
    files = tmp_path / "files"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "--quick",
            "--distributed-only",
            "--dist-size=4MB",
            f"--dir={files}",
            f"--out={out}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=140,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Distributed: 2 ranks on gloo" in proc.stdout
    assert "Steady-state saves" not in proc.stdout  # the single-process part did not run

    results = json.loads(out.read_text())
    d = results["distributed"]
    assert d["meta"]["world"] == 2
    assert 3e6 < d["meta"]["rank_bytes"] < 5e6
    assert [r["rank"] for r in d["ranks"]] == [0, 1]
    assert all(len(r["rounds"]) == 2 and r["rounds"][0]["warmup"] for r in d["ranks"])
    s = results["summary"]["distributed"]
    assert set(s["save"]) == {"raw_write_direct", "tardigrade", "dcp"}
    assert set(s["load"]) == set(s["reshard"]) == {"tardigrade", "dcp"}
    for group in ("save", "load", "reshard"):
        for name, x in s[group].items():
            assert x["median_s"] > 0 and x["gbps"] > 0 and x["peak_rss_above_bytes"] >= 0, name
    # Replicated tensors are written once in total, not once per rank.
    assert 1.0 <= s["replicated"]["written_over_one_copy"] < 1.5
    assert 0 < s["agree_max_ms"] < 1000
    # Only the first save of an unchanged layout plans.
    assert s["plan_cache"]["planned"] == [True, False, False, False, False]
    # The coordinator of a 1,024-rank job, simulated: about a million chunks.
    assert s["scale"]["ranks"] == 1024 and s["scale"]["coordinator_s"] > 0
    assert 5 < s["scale"]["manifest_mb"] < 128 and 3 < s["scale"]["growth"] <= 4

    assert {t["name"] for t in results["targets"]} == DIST_TARGETS
    # Every target has a value; which one did not, with the run's report, says why.
    unmeasured = [t["name"] for t in results["targets"] if t["pass"] is None]
    assert not unmeasured, (unmeasured, proc.stdout[-4000:], proc.stderr[-2000:])
    for name in DIST_TARGETS:
        assert name in proc.stdout, name
    assert not [p for p in files.rglob("*") if p.is_file()]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("setup", ["manager", "reserved"])
def test_async_probe_measures_the_first_save_of_a_fresh_run(tmp_path: Path, setup: str) -> None:
    """``python -m bench.async_probe``: by default the first save is a manager's, reached as
    in training (manager built before the first optimizer step); every round is reported."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.async_probe",
            "--size=8MB",
            "--rounds=2",
            "--gap=0",
            f"--setup={setup}",
            "--first-save-after=3",
            f"--dir={tmp_path / 'files'}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    if setup == "manager":
        assert "manager created before the first optimizer step" in lines[0], lines
    assert [line.split(" ")[:2] for line in lines[-3:-1]] == [["round", "0"], ["round", "1:"]]
    assert "first save of" in lines[-3] and "async blocked" in lines[-3], lines
    assert lines[-1].startswith("ratio first save"), lines
    # Every checkpoint but the newest is deleted as the run goes (keep_last=1 in manager mode).
    assert len(list((tmp_path / "files").rglob("manifest.json"))) <= 1
