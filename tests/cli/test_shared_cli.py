"""The commands on checkpoints that share data (format 7): ``ls`` shows what a load reads and
what deleting each checkpoint alone frees; ``copy`` takes a checkpoint out of its root with the
shared objects it references, beside the copy or (``--standalone``) inside it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tardigrade as tg
from tardigrade.cli import main


def cli(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """Steps 1 and 2 share a 4 MiB base; step 2 has a second object of its own."""
    root = tmp_path / "run"
    state = {"base": torch.randn(1024, 1024), "adapter": torch.zeros(4, 4)}
    with tg.CheckpointManager(root, state, every_steps=1) as mgr:
        mgr.step(1)
        mgr.wait()
        state["extra"] = torch.ones(512, 512)
        mgr.step(2)
        mgr.wait()
    return root


def test_ls_shows_logical_and_unique_bytes(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = cli(capsys, "ls", run)
    assert rc == 0
    assert "UNIQUE" in out and "shared data: 2 objects, 5.0 MiB in .shared/" in out
    rc, out, _ = cli(capsys, "ls", run, "--json")
    one, two = json.loads(out)
    assert one["shared_bytes"] > 4 << 20 and one["unique_shared_bytes"] == 0
    assert two["shared_bytes"] > 5 << 20 and 1 << 20 <= two["unique_shared_bytes"] < 2 << 20


@pytest.mark.parametrize("standalone", [False, True])
def test_copy_takes_the_shared_data_along(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], standalone: bool
) -> None:
    dest = tmp_path / "elsewhere" / "kept"
    flags = ["--standalone"] if standalone else []
    rc, out, _ = cli(capsys, "copy", run / "step-000000002", dest, *flags)
    assert rc == 0 and "2 shared objects" in out, out
    assert (dest.parent / ".shared").exists() != standalone
    files = [f["name"] for f in tg.read_manifest(dest)["files"]]
    assert any(f.startswith(".shared/") for f in files) != standalone
    tg.verify(dest)
    rc, out, _ = cli(capsys, "diff", dest, run / "step-000000002")
    assert rc == 0, out
    # The copy loads with the source gone.
    for p in sorted(run.rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    assert torch.equal(tg.load(dest)["extra"], torch.ones(512, 512))


def test_copy_refuses_an_existing_destination(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, _, err = cli(capsys, "copy", run / "step-000000002", run / "step-000000001")
    assert rc == 1 and "another checkpoint" in err
