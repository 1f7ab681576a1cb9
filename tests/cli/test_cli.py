"""The ``tardigrade`` command line: every command, its output and its exit status."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import tardigrade as tg
from tardigrade.cli import main
from tardigrade.cli._output import ProgressBar, human_bytes
from tardigrade.cli.demo import first_difference, identical
from tardigrade.format.jsonio import dumps
from tardigrade.format.manifest import PACKED_VERSION, seal

SRC = str(Path(__file__).resolve().parents[2] / "src")


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def run_module(
    *argv: str, cwd: Path | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-m", "tardigrade.cli", *map(str, argv)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=timeout,
    )


def make_state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    optim.step()
    return {
        "model": model,
        "optim": optim,
        "rng": tg.RNGState(),
        "step": 0,
        "lr": 0.001,
        "name": "run-a",
        "history": [1.5, 1.25, 1.0],
    }


def save_step(directory: Path, step: int, state: dict | None = None) -> Path:
    state = state or make_state(step)
    state["step"] = step
    path = directory / f"step-{step:09d}"
    tg.save(path, state, step=step, epoch=step // 10, metrics={"loss": 1.0 / (step + 1)})
    return path


def data_files(ckpt: Path) -> list[Path]:
    return sorted(ckpt.glob("data-*.safetensors"))


def flip_byte(path: Path, offset_from_end: int = 1) -> None:
    with open(path, "r+b") as f:
        f.seek(-offset_from_end, os.SEEK_END)
        b = f.read(1)
        f.seek(-offset_from_end, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.fixture
def ckpts(tmp_path: Path) -> Path:
    """A checkpoint directory: steps 10, 20, 30 (saved out of order), an abandoned save, a lock."""
    d = tmp_path / "ckpt"
    for step in (30, 10, 20):
        save_step(d, step)
    tmp = d / ".tmp-step-000000040-0123456789abcdef"
    tmp.mkdir()
    (tmp / "data-00000-of-00001.safetensors").write_bytes(b"\0" * 100)
    (d / ".lock").write_text("{}")
    return d


# ----------------------------------------------------------------------------------------------
# ls


def test_ls_lists_steps_in_order_and_flags_tmp_dirs(
    ckpts: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = cli(capsys, "ls", ckpts)
    assert rc == 0, err
    rows = [line.split() for line in out.splitlines()]
    assert rows[0][:3] == ["NAME", "STEP", "EPOCH"]
    names = [r[0] for r in rows[1:5]]
    assert names == [
        "step-000000010",
        "step-000000020",
        "step-000000030",
        ".tmp-step-000000040-0123456789abcdef",
    ]
    assert [r[1] for r in rows[1:5]] == ["10", "20", "30", "40"]
    assert [r[2] for r in rows[1:4]] == ["1", "2", "3"]
    assert all(r[-1] == "committed" for r in rows[1:4])
    assert rows[4][-1] == "incomplete-tmp"
    assert ".lock" not in out
    assert "3 committed, 1 incomplete" in out


def test_ls_json(ckpts: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = cli(capsys, "ls", ckpts, "--json")
    assert rc == 0
    entries = json.loads(out)
    assert [(e["step"], e["status"]) for e in entries] == [
        (10, "committed"),
        (20, "committed"),
        (30, "committed"),
        (40, "incomplete-tmp"),
    ]
    on_disk = sum(p.stat().st_size for p in (ckpts / "step-000000010").iterdir())
    assert entries[0]["nbytes"] == on_disk
    assert entries[0]["created"].endswith("Z")


def test_ls_empty_and_missing_dirs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = cli(capsys, "ls", tmp_path)
    assert rc == 0
    assert "no checkpoints" in out
    rc, out, err = cli(capsys, "ls", tmp_path / "nope")
    assert rc == 1
    assert err.startswith("tardigrade: error: ")
    assert "does not exist" in err


def test_ls_flags_unreadable_manifest(ckpts: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (ckpts / "step-000000020" / "manifest.json").write_text("{not json")
    rc, out, _ = cli(capsys, "ls", ckpts)
    assert rc == 0
    row = next(line for line in out.splitlines() if line.startswith("step-000000020"))
    assert row.split()[-1] == "unreadable"
    assert "not valid JSON" in out


# ----------------------------------------------------------------------------------------------
# inspect


def test_inspect_does_not_read_data_files(ckpts: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = ckpts / "step-000000020"
    manifest = tg.read_manifest(ckpt)
    for f in data_files(ckpt):
        f.unlink()
    rc, out, err = cli(capsys, "inspect", ckpt)
    assert rc == 0, err
    # the state's RNGState holds Python's 625-int RNG state: a packed tuple, format 6
    assert f"tardigrade v{PACKED_VERSION}" in out
    assert f"torch {torch.__version__}" in out
    assert "step          20" in out
    assert "epoch         2" in out
    assert "loss=0.047619" in out
    assert "data-00000-of-00001.safetensors" in out
    lines = [line.strip() for line in out.splitlines()]
    assert "0.weight: F32[8, 4]  128 B" in lines
    assert "2.bias: F32[2]  8 B" in lines
    assert "exp_avg_sq: F32[8, 4]  128 B" in lines
    assert "step: 20" in lines
    assert "lr: 0.001" in lines
    assert "name: 'run-a'" in lines
    assert "history: [1.5, 1.25, 1.0]" in lines
    assert "betas: (0.9, 0.999)" in lines
    assert any(line.startswith("model: <torch.nn.modules.container.Sequential>") for line in lines)
    total = sum(f["size"] for f in manifest["files"])
    assert str(total + (ckpt / "manifest.json").stat().st_size) + " bytes" in out

    rc, out, _ = cli(capsys, "inspect", ckpt, "--json")
    assert rc == 0
    assert json.loads(out) == manifest


def test_inspect_depth_and_long_lists(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = {"losses": [float(i) / 4 for i in range(100)], "deep": {"a": {"b": {"c": 1}}}}
    tg.save(tmp_path / "c", state)
    rc, out, _ = cli(capsys, "inspect", tmp_path / "c", "--depth", "2")
    assert rc == 0
    lines = [line.strip() for line in out.splitlines()]
    assert "losses: list[100] of float: [0, 0.25, 0.5, ..., 24.75]" in lines
    assert "a: dict[1]" in lines
    assert "b: dict[1]" not in lines


def test_inspect_errors(ckpts: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = cli(capsys, "inspect", ckpts)
    assert rc == 1
    assert "is a directory of 3 checkpoint(s)" in err
    assert "step-000000030" in err
    rc, _, err = cli(capsys, "inspect", ckpts / ".tmp-step-000000040-0123456789abcdef")
    assert rc == 1
    assert "no manifest.json" in err
    rc, _, err = cli(capsys, "inspect", ckpts / "step-000000010", "--depth", "0")
    assert rc == 2


def test_inspect_rejects_a_malformed_tree(ckpts: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = ckpts / "step-000000010"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["tree"] = {"t": "dict", "v": [[{"t": "str", "v": "x"}, {"t": "bogus"}]]}
    del manifest["manifest_checksum"]  # forged consistently, so the tree rule is what fires
    (ckpt / "manifest.json").write_bytes(seal(dumps(manifest)))
    rc, out, err = cli(capsys, "inspect", ckpt)
    assert rc == 1
    assert out == ""
    assert err.startswith("tardigrade: error: ") and "bogus" in err


# ----------------------------------------------------------------------------------------------
# verify


def test_verify_ok(ckpts: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = cli(capsys, "verify", ckpts / "step-000000010")
    assert rc == 0, err
    assert out.startswith("OK      step-000000010  step 10:")
    assert "GB/s" in out


def test_verify_corrupted_checkpoint_names_the_file(
    ckpts: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = ckpts / "step-000000020"
    data = data_files(ckpt)[0]
    flip_byte(data)
    rc, _, err = cli(capsys, "verify", ckpt)
    assert rc == 1
    assert err.startswith("tardigrade: error: ")
    assert str(data) in err
    assert "fails its checksum" in err
    assert "Traceback" not in err


def test_verify_dir_checks_every_committed_checkpoint(
    ckpts: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = cli(capsys, "verify", ckpts)
    assert rc == 0, err
    assert [line.split()[1] for line in out.splitlines() if line.startswith("OK")] == [
        "step-000000010",
        "step-000000020",
        "step-000000030",
    ]
    assert "skip    .tmp-step-000000040" in out
    assert "3 of 3 checkpoint(s) OK" in out

    flip_byte(data_files(ckpts / "step-000000020")[0], offset_from_end=5)
    rc, out, err = cli(capsys, "verify", ckpts)
    assert rc == 1
    assert "FAILED  step-000000020" in out
    assert "2 of 3 checkpoint(s) OK" in out
    assert str(data_files(ckpts / "step-000000020")[0]) in err
    assert "1 checkpoint(s) failed verification: step-000000020" in err


def test_verify_truncated_and_missing(ckpts: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = data_files(ckpts / "step-000000030")[0]
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size - 4)
    rc, _, err = cli(capsys, "verify", ckpts / "step-000000030")
    assert rc == 1
    assert "truncated" in err
    rc, _, err = cli(capsys, "verify", ckpts / "step-000000099")
    assert rc == 1
    assert "no committed checkpoint" in err


# ----------------------------------------------------------------------------------------------
# export


def test_export_model_weights(
    ckpts: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = ckpts / "step-000000010"
    out_file = tmp_path / "model.safetensors"
    rc, out, err = cli(capsys, "export", ckpt, out_file, "--keys", "model")
    assert rc == 0, err
    assert "wrote" in out and "4 tensors" in out
    expected = make_state(10)["model"].state_dict()
    with safe_open(str(out_file), "pt") as f:
        assert sorted(f.keys()) == sorted(f"model.{k}" for k in expected)
        for k, v in expected.items():
            assert torch.equal(f.get_tensor(f"model.{k}"), v)
        assert f.metadata()["tardigrade_step"] == "10"
        assert f.metadata()["format"] == "pt"


def test_export_no_prefix_loads_into_a_module(
    ckpts: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "m.safetensors"
    rc, _, err = cli(
        capsys, "export", ckpts / "step-000000020", out_file, "--keys", "model", "--no-prefix"
    )
    assert rc == 0, err
    fresh = make_state(99)["model"]
    fresh.load_state_dict(load_file(str(out_file)))  # strict: names match exactly
    assert torch.equal(fresh[0].weight, make_state(20)["model"][0].weight)


def test_export_everything_nested_keys_and_shared_tensors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shared = torch.arange(6.0)
    state = {**make_state(1), "tied": {"a": shared, "b": shared, "view": shared[2:4]}}
    tg.save(tmp_path / "c", state)
    rc, out, err = cli(capsys, "export", tmp_path / "c", tmp_path / "all.safetensors")
    assert rc == 0, err
    tensors = load_file(str(tmp_path / "all.safetensors"))
    assert torch.equal(tensors["tied.a"], shared)
    assert torch.equal(tensors["tied.b"], shared)
    assert torch.equal(tensors["tied.view"], shared[2:4])
    assert "optim.state.0.exp_avg" in tensors
    assert "rng.torch" in tensors
    assert "non-tensor value(s) left out" in out

    rc, _, err = cli(
        capsys,
        "export",
        tmp_path / "c",
        tmp_path / "o.safetensors",
        "--keys",
        "optim/state/0,tied/a",
    )
    assert rc == 0, err
    assert sorted(load_file(str(tmp_path / "o.safetensors"))) == [
        "optim.state.0.exp_avg",
        "optim.state.0.exp_avg_sq",
        "optim.state.0.step",
        "tied.a",
    ]


def test_export_refuses_to_overwrite(
    ckpts: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "model.safetensors"
    out_file.write_bytes(b"precious")
    rc, _, err = cli(capsys, "export", ckpts / "step-000000010", out_file)
    assert rc == 1
    assert "already exists" in err and "--force" in err
    assert out_file.read_bytes() == b"precious"
    rc, _, err = cli(capsys, "export", ckpts / "step-000000010", out_file, "--force")
    assert rc == 0, err
    assert "model.0.weight" in load_file(str(out_file))
    assert not list(tmp_path.glob(".tardigrade-export-*"))


def test_export_usage_errors(
    ckpts: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = ckpts / "step-000000010"
    rc, _, err = cli(capsys, "export", ckpt, tmp_path / "x.safetensors", "--keys", "nope")
    assert rc == 2
    assert "no key 'nope'" in err and "'model'" in err
    rc, _, err = cli(capsys, "export", ckpt, tmp_path / "x.safetensors", "--keys", "step")
    assert rc == 2
    assert "no tensors under step" in err
    rc, _, err = cli(
        capsys, "export", ckpt, tmp_path / "x.safetensors", "--keys", "model,optim", "--no-prefix"
    )
    assert rc == 2
    (tmp_path / "afile").write_text("")  # a missing folder is created; a file in the way is not
    rc, _, err = cli(capsys, "export", ckpt, tmp_path / "afile" / "x.safetensors")
    assert rc == 2 and "a file is in the way" in err
    assert not (tmp_path / "x.safetensors").exists()


def test_export_corrupted_checkpoint_fails(
    ckpts: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = ckpts / "step-000000010"
    flip_byte(data_files(ckpt)[0])
    rc, _, err = cli(capsys, "export", ckpt, tmp_path / "x.safetensors")
    assert rc == 1
    assert "checksum" in err
    assert not (tmp_path / "x.safetensors").exists()


# ----------------------------------------------------------------------------------------------
# the command as a process


def test_module_entry_point_exit_codes(ckpts: Path) -> None:
    r = run_module()
    assert r.returncode == 2
    assert "usage: tardigrade" in r.stderr

    flip_byte(data_files(ckpts / "step-000000010")[0])
    r = run_module("verify", ckpts / "step-000000010")
    assert r.returncode == 1
    assert r.stderr.startswith("tardigrade: error: ")
    assert "data-00000-of-00001.safetensors" in r.stderr
    assert "Traceback" not in r.stderr


def test_version_and_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = cli(capsys, "--version")
    assert rc == 0
    assert out.strip() == f"tardigrade {tg.__version__}"
    rc, _, err = cli(capsys, "verify")
    assert rc == 2
    assert "required: CKPT|DIR" in err
    rc, _, err = cli(capsys, "frobnicate")
    assert rc == 2
    assert "invalid choice" in err


# ----------------------------------------------------------------------------------------------
# demo


@pytest.mark.slow
@pytest.mark.crash
def test_demo_kill_resume_is_bit_identical(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # As `make demo` runs it, with the JSON report written beside the text one (--report).
    d, report_file = tmp_path / "run" / "ckpt", tmp_path / "ci" / "demo.json"
    r = run_module("demo", "--dir", d, "--report", report_file, timeout=110)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "bit-identical: yes" in out
    for what in ("final parameters", "optimizer state", "loss curve (300 steps)"):
        line = next(ln for ln in out.splitlines() if ln.startswith(what))
        assert line.split()[-1] == "yes", line
    assert "keep_last=4, async_save=True)" in out
    assert "killed at step       175 (in the middle of its async save" in out
    # restore(): the killed run's lock taken over, its incomplete save skipped, 150 restored.
    assert "start = mgr.restore() -> 150" in out
    assert "took over the lock of" in out
    assert "skipped the incomplete save .tmp-step-000000175-" in out
    assert "verified step-000000150 and restored it" in out
    assert "data position (epoch 4, 832 of 1000 samples consumed)" in out
    assert (
        "resumed from step    150 (step-000000150; restore() skipped the incomplete save of "
        "step 175)" in out
    )
    # Retention: 6 + 6 saves, the last 4 kept; after the kill, 75..150 were on disk.
    assert "4 committed checkpoints (step-000000075 to step-000000150" in out
    assert "keep_last=4: 12 checkpoints saved (6 by run 1, 6 by run 2), 4 on disk" in out
    # The manager's stats: one row per committed save, all ok.
    assert "12 async saves, 0 failed. Training was blocked" in out
    header = next(
        i for i, ln in enumerate(out.splitlines()) if ln.split()[:3] == ["STEP", "RUN", "SIZE"]
    )
    rows = [ln.split() for ln in out.splitlines()[header + 1 : header + 13]]
    assert [int(r[0]) for r in rows] == list(range(25, 301, 25))
    assert [r[1] for r in rows] == ["1"] * 6 + ["2"] * 6
    assert all(r[-1] == "yes" for r in rows)
    # restore() removed the killed save's staging dir; retention left the newest 4; close()
    # released the lock.
    assert main(["ls", str(d), "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert [(e["step"], e["status"]) for e in listing] == [
        (step, "committed") for step in (225, 250, 275, 300)
    ]
    assert not (d / ".lock").exists()
    assert main(["verify", str(d)]) == 0
    capsys.readouterr()

    # The JSON report says the same.
    report = json.loads(report_file.read_text())
    assert report["bit_identical"] is True
    assert [c["what"] for c in report["checks"]] == [
        "final parameters",
        "optimizer state",
        "loss curve (300 steps)",
        "LR schedule, RNGs, data position, counters",
    ]
    assert all(c["identical"] for c in report["checks"])
    assert report["first_differing_loss_step"] is None
    assert (report["ranks"], report["steps"], report["every"], report["keep_last"]) == (
        1,
        300,
        25,
        4,
    )
    killed = report["killed"]  # while the async save of step 175 was being written
    assert killed["step"] == 175 and killed["training_step"] > 175
    assert killed["staging_file"].startswith(".tmp-step-000000175-")
    assert [(c["name"], c["status"]) for c in killed["on_disk_after"]] == [
        *((f"step-{step:09d}", "committed") for step in (75, 100, 125, 150)),
        (killed["staging_file"].split("/")[0], "incomplete-tmp"),
    ]
    assert report["resumed_from_step"] == 150
    assert report["restored"]["name"] == "step-000000150"
    assert report["restored"]["removed"] == [killed["on_disk_after"][-1]["name"]]
    assert [r["returncode"] for r in report["runs"]] == [-9, 0, 0]
    assert [(s["run"], s["step"], s["ok"]) for s in report["saves"]] == [
        (1 if step <= 150 else 2, step, True) for step in range(25, 301, 25)
    ]
    assert (report["stats"]["succeeded"], report["stats"]["failed"]) == (6, 0)
    assert [c["step"] for c in report["checkpoints"]] == [225, 250, 275, 300]


def test_demo_refuses_to_clear_a_directory_it_did_not_make(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "mine.txt").write_text("keep me")
    rc, _, err = cli(capsys, "demo", "--dir", tmp_path)
    assert rc == 2
    assert "refusing to clear" in err
    assert (tmp_path / "mine.txt").read_text() == "keep me"


def test_demo_rejects_a_kill_step_that_does_not_save(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, _, err = cli(capsys, "demo", "--dir", tmp_path / "d", "--kill-at", "33")
    assert rc == 2
    assert "--kill-at 33" in err
    assert not (tmp_path / "d").exists()


def test_demo_keep_last_must_be_positive(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, _, err = cli(capsys, "demo", "--dir", tmp_path / "d", "--keep-last", "0")
    assert rc == 2
    assert "--keep-last" in err
    assert not (tmp_path / "d").exists()


def events(out: str) -> list[tuple[str, dict]]:
    """The worker's ``@tg <event> <json>`` lines."""
    found = []
    for line in out.splitlines():
        if line.startswith("@tg "):
            event, _, payload = line[4:].partition(" ")
            found.append((event, json.loads(payload)))
    return found


def test_demo_resume_skips_a_damaged_newest_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tardigrade.cli._demo_worker import Config, make_state, restore

    state = make_state(Config(), total_steps=10)
    with tg.CheckpointManager(tmp_path, state, every_steps=2) as mgr:
        for step in (2, 4):
            state["step"] = step
            state["losses"] = [1.0] * step
            mgr.step(step)
    flip_byte(data_files(tmp_path / "step-000000004")[0])
    leftover = tmp_path / ".tmp-step-000000006-0123456789abcdef"
    leftover.mkdir()
    fresh = make_state(Config(), total_steps=10)
    with tg.CheckpointManager(tmp_path, fresh) as mgr:
        assert restore(mgr) == 2
    assert fresh["step"] == 2
    assert fresh["losses"] == [1.0, 1.0]
    assert not leftover.exists()
    [(event, data)] = events(capsys.readouterr().out)
    assert event == "restored"
    assert (data["step"], data["name"]) == (2, "step-000000002")
    assert data["skipped"] == ["step-000000004"]
    assert data["removed"] == [leftover.name]
    assert data["data"]["epoch"] == 0 and data["loss"] == 1.0
    assert any("skipping checkpoint" in w and "step-000000004" in w for w in data["warnings"])


def test_demo_worker_reports_manager_stats_as_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tardigrade.cli._demo_worker import main as worker

    threads = torch.get_num_threads()
    try:
        args = ["--steps", "10", "--every", "2", "--keep-last", "2"]
        assert worker([*args, "--ckpt-dir", str(tmp_path / "c")]) == 0
    finally:
        torch.set_num_threads(threads)
    found = events(capsys.readouterr().out)
    assert found[0] == (
        "restored",
        {
            "step": None,
            "name": None,
            "skipped": [],
            "removed": [],
            "data": None,
            "loss": None,
            "warnings": [],
        },
    )
    saved = [d for e, d in found if e == "saved"]
    assert [s["step"] for s in saved] == [2, 4, 6, 8, 10]
    for s in saved:
        assert s["ok"] and s["error"] is None and s["nbytes"] > 0
        assert 0 < s["blocking_seconds"] <= s["total_seconds"]
        assert s["throughput_gbps"] == pytest.approx(s["nbytes"] / s["total_seconds"] / 1e9)
    [stats] = [d for e, d in found if e == "stats"]
    assert (stats["succeeded"], stats["failed"]) == (5, 0)
    assert found[-1] == ("done", {"step": 10})
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == [
        "step-000000008",
        "step-000000010",
    ]


def test_identical_is_bitwise() -> None:
    assert identical({"a": [1.0, torch.ones(2)]}, {"a": [1.0, torch.ones(2)]})
    assert not identical(0.0, -0.0)
    assert not identical(1, 1.0)
    assert not identical(torch.ones(2), torch.ones(2, dtype=torch.float64))
    assert not identical((1, 2), [1, 2])
    assert first_difference([1.0, 2.0, 3.0], [1.0, 2.5, 3.0]) == 2
    assert first_difference([1.0], [1.0, 2.0]) == 2
    assert first_difference([1.0], [1.0]) is None


def test_output_helpers() -> None:
    import io

    assert human_bytes(1023) == "1023 B"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(3 * 1024**3) == "3.0 GiB"
    quiet = io.StringIO()
    bar = ProgressBar(10, "x", stream=quiet)  # not a terminal: draws nothing
    bar.update(5)
    bar.close()
    assert quiet.getvalue() == ""
    loud = io.StringIO()
    bar = ProgressBar(10, "train", stream=loud, enabled=True, width=10)
    bar.update(10, "done")
    bar.close()
    assert "\rtrain [##########] 10/10  done" in loud.getvalue()
