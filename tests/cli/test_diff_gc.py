"""``tardigrade diff`` and ``tardigrade gc``: output, exit status, and what they touch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tardigrade as tg
from tardigrade.cli import main
from tardigrade.storage import local


def cli(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(64, 8, generator=g), "b": torch.zeros(8)},
        "step": 10,
        "lr": 0.5,
        "tags": ("a", "b"),
        "nan": float("nan"),
    }


# --- diff -------------------------------------------------------------------------------------


def test_diff_of_identical_states_exits_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tg.save(tmp_path / "a", state())
    tg.save(tmp_path / "b", state())
    rc, out, _ = cli(capsys, "diff", tmp_path / "a", tmp_path / "b")
    assert rc == 0, out
    assert "identical" in out and "bit for bit" in out and "both checkpoints verified" in out
    rc, out, _ = cli(capsys, "diff", "--json", tmp_path / "a", tmp_path / "b")
    assert rc == 0 and json.loads(out)["verified"] is True


def test_diff_lists_every_kind_of_difference(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = state(), state()
    b["model"]["w"][3, 2] += 1  # same dtype and shape, other bytes
    b["model"]["b"] = torch.zeros(9)  # other shape
    b["step"] = 11  # other value
    b["tags"] = ["a", "b"]  # tuple -> list
    del b["lr"]  # only in A
    b["extra"] = {"x": 1}  # only in B (reported once, at the top of the subtree)
    tg.save(tmp_path / "a", a)
    tg.save(tmp_path / "b", b)
    rc, out, _ = cli(capsys, "diff", "--json", tmp_path / "a", tmp_path / "b")
    assert rc == 1
    report = json.loads(out)
    assert not report["identical"]
    got = {(d["kind"], d["path"]) for d in report["diffs"]}
    assert got == {
        ("values", "state['model']['w']"),
        ("type", "state['model']['b']"),
        ("value", "state['step']"),
        ("type", "state['tags']"),
        ("only in A", "state['lr']"),
        ("only in B", "state['extra']"),
    }, report["diffs"]
    rc, out, _ = cli(capsys, "diff", tmp_path / "a", tmp_path / "b")
    assert rc == 1
    assert "10 -> 11" in out and "6 difference(s)" in out


def test_diff_is_bitwise_for_floats(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = state(), state()
    b["lr"] = -0.0
    a["lr"] = 0.0
    tg.save(tmp_path / "a", a)
    tg.save(tmp_path / "b", b)
    rc, out, _ = cli(capsys, "diff", tmp_path / "a", tmp_path / "b")
    assert rc == 1 and "state['lr']" in out  # 0.0 == -0.0 in Python, but not bit for bit


def test_diff_reads_bytes_when_the_layouts_differ(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    big = {"t": torch.randn(40, 1024, 1024 // 4)}  # 40 MiB of fp32
    tg.save(tmp_path / "one", big)  # one file
    import tardigrade._plan as plan

    monkeypatch.setattr(plan, "MIN_FILE_BYTES", 1024 * 1024)
    from tardigrade import _save_job

    real_plan = _save_job.global_plan
    monkeypatch.setattr(
        _save_job, "global_plan", lambda p, max_files, **kw: real_plan(p, max_files=4, **kw)
    )
    tg.save(tmp_path / "split", big)  # split by rows across files
    assert len(list((tmp_path / "split").glob("data-*"))) > 1
    rc, out, _ = cli(capsys, "diff", tmp_path / "one", tmp_path / "split")
    assert rc == 0, out

    big["t"][39, 0, 0] += 1
    tg.save(tmp_path / "changed", big)  # split like "split", unlike "one"
    reads: list[str] = []
    real_reader = local.LocalReader.__init__

    def counting(self: local.LocalReader, path: str) -> None:
        reads.append(path)
        real_reader(self, path)

    monkeypatch.setattr(local.LocalReader, "__init__", counting)
    rc, out, _ = cli(capsys, "diff", tmp_path / "one", tmp_path / "changed")
    assert rc == 1 and "state['t']" in out and "bytes differ" in out
    assert any(".safetensors" in r for r in reads)  # the bytes were compared

    # Same layout on both sides: the checksums decide, once the bytes are verified against
    # them (both sides read in full) ...
    reads.clear()
    rc, out, _ = cli(capsys, "diff", tmp_path / "split", tmp_path / "changed")
    assert rc == 1 and "bytes differ" in out and "both checkpoints verified" in out
    files = {r for r in reads if r.endswith(".safetensors")}
    assert len(files) == 2 * len(list((tmp_path / "split").glob("data-*"))), reads

    # ... or, with --checksums-only, as recorded: no tensor byte is read, and the output says so.
    reads.clear()
    rc, out, _ = cli(capsys, "diff", "--checksums-only", tmp_path / "split", tmp_path / "changed")
    assert rc == 1 and "bytes differ" in out and "not verified" in out
    assert not [r for r in reads if r.endswith(".safetensors")]


def _damage(ckpt: Path) -> None:
    (data,) = ckpt.glob("data-*.safetensors")
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0x01  # one bit of the last tensor's bytes
    data.write_bytes(bytes(raw))


def test_diff_of_a_damaged_copy_is_an_error_not_identical(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tg.save(tmp_path / "a", state())
    shutil.copytree(tmp_path / "a", tmp_path / "copy")
    _damage(tmp_path / "copy")
    for a, b in ((tmp_path / "a", tmp_path / "copy"), (tmp_path / "copy", tmp_path / "a")):
        rc, out, err = cli(capsys, "diff", a, b)
        assert rc == 2, (out, err)
        assert "identical" not in out
        assert "copy" in err and "fails its checksum" in err, err
        rc, out, err = cli(capsys, "diff", "--json", a, b)
        assert rc == 2 and out == "", out

    # --checksums-only compares what the manifests recorded, and says that is all it did.
    rc, out, _ = cli(capsys, "diff", "--checksums-only", tmp_path / "a", tmp_path / "copy")
    assert rc == 0
    assert "bit for bit" not in out and "recorded checksums" in out and "not verified" in out
    rc, out, _ = cli(
        capsys, "diff", "--json", "--checksums-only", tmp_path / "a", tmp_path / "copy"
    )
    report = json.loads(out)
    assert rc == 0 and report["identical"] and report["verified"] is False


def test_diff_help_describes_verification_and_exit_status(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rc, out, _ = cli(capsys, "diff", "--help")
    assert rc == 0
    text = " ".join(out.split())
    assert "--checksums-only" in text and "verified first" in text
    assert "0 when the states are identical, 1 when they differ, 2 on errors" in text


def test_diff_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tg.save(tmp_path / "a", state())
    rc, _, err = cli(capsys, "diff", tmp_path / "a", tmp_path / "missing")
    assert rc == 2 and "missing" in err  # an error, not "the states differ" (1)
    rc, _, err = cli(capsys, "diff", tmp_path / "a")
    assert rc == 2


# --- gc ---------------------------------------------------------------------------------------


def _leftovers(root: Path) -> None:
    tg.save(root / "step-000000001", state(), step=1)
    tg.save(root / "step-000000002", state(), step=2)
    dead = root / ".tmp-step-000000003-deadbeef"
    dead.mkdir()
    (dead / "data-00000-of-00001.safetensors").write_bytes(b"x" * 5000)
    # A crashed replace moved step 4 aside and never put the new one in place.
    tg.save(root / ".tmp-step-000000004-replaced-cafe", state(), step=4)


def test_gc_removes_tmp_dirs_and_recovers_a_moved_aside_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _leftovers(tmp_path)
    rc, out, _ = cli(capsys, "gc", "--dry-run", tmp_path)
    assert rc == 0
    assert "would remove" in out and "would recover" in out
    assert (tmp_path / ".tmp-step-000000003-deadbeef").exists()  # dry run changed nothing

    rc, out, _ = cli(capsys, "gc", tmp_path)
    assert rc == 0, out
    assert not (tmp_path / ".tmp-step-000000003-deadbeef").exists()
    assert "freed" in out
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["step-000000001", "step-000000002", "step-000000004"]
    assert tg.load(tmp_path / "step-000000004")["step"] == 10
    assert not (tmp_path / ".lock").exists()  # the lock was released

    rc, out, _ = cli(capsys, "gc", tmp_path)
    assert rc == 0 and "nothing to clean" in out


def test_gc_refuses_while_a_live_job_holds_the_lock(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _leftovers(tmp_path)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from tardigrade.storage.local_lease import DirectoryLock; "
            f"DirectoryLock({str(tmp_path / '.lock')!r}).acquire(); print('locked', flush=True); "
            "time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")},
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        rc, _, err = cli(capsys, "gc", tmp_path)
        assert rc == 1
        assert "another job is writing checkpoints here" in err and str(holder.pid) in err
        assert (tmp_path / ".tmp-step-000000003-deadbeef").exists()
    finally:
        holder.kill()
        holder.wait()
    # Its owner is dead now: the lock is stale and gc takes it over.
    rc, _, _ = cli(capsys, "gc", tmp_path)
    assert rc == 0
    assert not (tmp_path / ".tmp-step-000000003-deadbeef").exists()


def test_gc_of_a_missing_directory_fails_clearly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, _, err = cli(capsys, "gc", tmp_path / "nope")
    assert rc == 1 and "does not exist" in err
    assert not (tmp_path / "nope").exists()  # gc does not create it


def test_tidy_reports_each_leftover_to_progress_on_an_object_store() -> None:
    # memory:// commits like a store (data objects, then the manifest): what a dead save left
    # under a name without a manifest goes, and gc's bar hears of each item as it goes.
    from tardigrade import Catalog
    from tardigrade.storage import open_root

    root = "memory://tidy-progress"
    tg.save(f"{root}/step-000000001", state())
    storage = open_root(root)
    for step, save_id in ((2, "0123456789abcdef"), (3, "fedcba9876543210")):
        storage.put(f"step-00000000{step}/{save_id}.data-0", b"x" * 100)
    seen: list = []
    done = Catalog(storage).tidy(progress=seen.append)
    assert seen == done and [t.name for t in done] == ["step-000000002", "step-000000003"]
    assert storage.list() == ["step-000000001"]


def test_gc_and_ls_size_a_leftover_alike(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One definition of a checkpoint's size (``_commit.size_of``): what ``ls`` shows of a dead
    save's staging is what ``gc`` says it frees; files in subdirectories count, a symbolic
    link counts as nothing (its target is not the save's)."""
    _leftovers(tmp_path)
    dead = tmp_path / ".tmp-step-000000003-deadbeef"
    (dead / "sub").mkdir()
    (dead / "sub" / "part").write_bytes(b"y" * 700)
    outside = tmp_path.parent / f"{tmp_path.name}-big"
    outside.write_bytes(b"z" * 100_000)
    (dead / "link").symlink_to(outside)
    rc, out, _ = cli(capsys, "ls", "--json", tmp_path)
    assert rc == 0
    listed = {e["name"]: e["nbytes"] for e in json.loads(out)}
    rc, out, _ = cli(capsys, "gc", "--dry-run", "--json", tmp_path)
    assert rc == 0
    planned = {t["name"]: t["nbytes"] for t in json.loads(out)["leftovers"]}
    assert planned[dead.name] == listed[dead.name] == 5000 + 700
    moved = ".tmp-step-000000004-replaced-cafe"
    assert planned["step-000000004"] == listed[moved] > 0  # recovered: the same bytes
