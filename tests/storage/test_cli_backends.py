"""The commands on every backend: ls, verify, inspect, gc and diff take a path or a URL.

``memory://`` lives in one process, so the commands run in process (``tardigrade.cli.main``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load

import tardigrade as tg
from tardigrade.cli import main
from tardigrade.storage import open_root


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def state(value: float) -> dict[str, Any]:
    return {"w": torch.full((100,), value), "step": int(value)}


@pytest.fixture
def ckpts(root_url: str) -> str:
    with tg.CheckpointManager(root_url, state(0.0), async_save=False) as mgr:
        for step in (10, 20):
            mgr.state.update(state(float(step)))
            mgr.save(step)
    return root_url


def test_ls_verify_inspect_diff(ckpts: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = cli(capsys, "ls", "--json", ckpts)
    assert rc == 0, err
    listed = json.loads(out)
    assert [(e["name"], e["step"], e["status"]) for e in listed] == [
        ("step-000000010", 10, "committed"),
        ("step-000000020", 20, "committed"),
    ]
    assert all(e["nbytes"] > 400 for e in listed)
    rc, out, err = cli(capsys, "verify", ckpts)
    assert rc == 0, err
    assert "2 of 2 checkpoint(s) OK" in out
    rc, out, err = cli(capsys, "inspect", f"{ckpts}/step-000000020")
    assert rc == 0, err
    assert out.splitlines()[0].endswith("step-000000020") and "step: 20" in out
    rc, out, err = cli(capsys, "diff", f"{ckpts}/step-000000010", f"{ckpts}/step-000000020")
    assert rc == 1 and "w" in out  # they differ, and diff says where


def test_export_reads_any_backend(
    ckpts: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "out" / "w.safetensors"
    rc, _, err = cli(capsys, "export", f"{ckpts}/step-000000020", out_file)
    assert rc == 0, err
    with safe_open(str(out_file), "pt") as f:
        assert torch.equal(f.get_tensor("w"), torch.full((100,), 20.0))


def test_export_writes_to_any_backend(
    ckpts: str, root_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """OUT may be a URL too: written through its storage's writer, whole or not at all."""
    out = f"{root_url}/exports/w.safetensors"
    rc, _, err = cli(capsys, "export", f"{ckpts}/step-000000020", out)
    assert rc == 0, err
    storage = open_root(root_url)
    with storage.open_reader("exports/w.safetensors") as r:
        raw = bytearray(r.size)
        r.readinto(0, memoryview(raw))
    assert torch.equal(load(bytes(raw))["w"], torch.full((100,), 20.0))
    rc, _, err = cli(capsys, "export", f"{ckpts}/step-000000010", out)
    assert rc == 1 and "already exists; pass --force" in err  # never overwritten unasked
    rc, _, err = cli(capsys, "export", "--force", f"{ckpts}/step-000000010", out)
    assert rc == 0, err
    with storage.open_reader("exports/w.safetensors") as r:
        raw = bytearray(r.size)
        r.readinto(0, memoryview(raw))
    assert torch.equal(load(bytes(raw))["w"], torch.full((100,), 10.0))


def test_verify_fails_on_a_damaged_checkpoint(ckpts: str, capsys: pytest.CaptureFixture[str]):
    storage = open_root(ckpts)
    data = next(n for n in storage.list("step-000000020") if n.endswith(".safetensors"))
    raw = bytearray(storage.read_bytes(f"step-000000020/{data}", 1 << 20))
    raw[-1] ^= 0xFF
    storage.put(f"step-000000020/{data}", bytes(raw), mode="overwrite")
    rc, out, err = cli(capsys, "verify", ckpts)
    assert rc == 1 and "FAILED  step-000000020" in out and "step-000000020" in err


def test_gc_takes_the_lease_and_cleans_up(ckpts: str, capsys: pytest.CaptureFixture[str]):
    rc, out, err = cli(capsys, "gc", ckpts)
    assert rc == 0, err
    assert "nothing to clean" in out
    with tg.CheckpointManager(ckpts, state(0.0)):  # a live job holds the lease
        rc, out, err = cli(capsys, "gc", ckpts)
        assert rc != 0 and "another job is writing" in err
