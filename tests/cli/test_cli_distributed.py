"""``inspect`` and ``export`` on a checkpoint two ranks saved (the golden v4 fixture, copied).

It holds ``emb`` (a 5x3 tg.Sharded tensor, rows 0-2 from rank 0 and 3-4 from rank 1), ``bias``
(replicated), ``step`` and ``mine`` (tg.PerRank: ``{"rank": r, "seen": [10 r, 10 r + 1]}``);
see ``tests/compat/v4/make_fixture.py``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tardigrade.cli import main

GOLDEN_V4 = Path(__file__).resolve().parents[1] / "compat" / "v4" / "ckpt"
EMB = (torch.arange(15, dtype=torch.float32) * 0.5 - 3).reshape(5, 3)
BIAS = torch.tensor([0.25, -1.0, 3.5])


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return Path(shutil.copytree(GOLDEN_V4, tmp_path / "v4"))


def cli(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_inspect_shows_world_size_layouts_and_each_ranks_values(
    ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = cli(capsys, "inspect", ckpt)
    assert rc == 0, err
    assert "  world size    2\n" in out
    assert "  per rank      1 tg.PerRank value(s) on each of 2 ranks\n" in out
    assert "data-r00000-00000-of-00001.safetensors" in out
    assert "data-r00001-00000-of-00001.safetensors" in out
    state = out.split("\nstate\n")[1].split("\n\nper rank")[0]
    assert state.splitlines() == [
        "emb: F32[5, 3]  60 B  sharded (2 chunk(s) from 2 rank(s))",
        "bias: F32[3]  12 B  replicated",
        "step: 7",
        "mine: tg.PerRank #0 (one value per rank, below)",
    ]
    assert out.split("\n\nper rank")[1].splitlines() == [
        " (2 ranks)",
        "  rank 0",
        "    mine: dict[2]",
        "      rank: 0",
        "      seen: I64[2]  16 B  per rank 0",
        "  rank 1",
        "    mine: dict[2]",
        "      rank: 1",
        "      seen: I64[2]  16 B  per rank 1",
    ]


def test_inspect_one_rank_and_depth(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = cli(capsys, "inspect", ckpt, "--rank", "1", "--depth", "1")
    assert rc == 0, err
    assert out.split("\n\nper rank")[1].splitlines() == [
        " (2 ranks)",
        "  rank 1",
        "    mine: dict[2]",
        "      ...",
    ]
    rc, _, err = cli(capsys, "inspect", ckpt, "--rank", "2")
    assert rc != 0
    assert "--rank 2" in err and "saved by 2 rank(s)" in err


def test_inspect_json_keeps_the_distributed_fields(
    ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = cli(capsys, "inspect", ckpt, "--json")
    assert rc == 0, err
    m = json.loads(out)
    assert m["world_size"] == 2
    assert len(m["per_rank"]) == 2
    assert [t.get("layout") for t in m["tensors"]] == ["sharded", None, "per_rank", "per_rank"]


def test_inspect_refuses_ranks_with_different_part_counts(
    ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tardigrade.format.jsonio import dumps
    from tardigrade.format.manifest import seal

    path = ckpt / "manifest.json"
    m = json.loads(path.read_text())
    del m["manifest_checksum"]
    m["per_rank"][1].append({"t": "int", "v": "3"})
    path.write_bytes(seal(dumps(m)))
    rc, _, err = cli(capsys, "inspect", ckpt)
    assert rc != 0
    assert "rank 1 has 2 tg.PerRank part(s) and rank 0 has 1" in err


def test_export_consolidates_shards_and_leaves_per_rank_values_out(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "full.safetensors"
    rc, out, err = cli(capsys, "export", ckpt, out_file)
    assert rc == 0, err
    got = load_file(str(out_file))
    assert sorted(got) == ["bias", "emb"]
    assert torch.equal(got["emb"], EMB)
    assert torch.equal(got["bias"], BIAS)
    assert "tg.PerRank values left out" in out and "pass --rank R" in out and ": mine" in out


def test_export_rank_adds_that_ranks_values(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "r1.safetensors"
    rc, out, err = cli(capsys, "export", ckpt, out_file, "--rank", "1")
    assert rc == 0, err
    got = load_file(str(out_file))
    assert sorted(got) == ["bias", "emb", "mine.seen"]
    assert torch.equal(got["emb"], EMB)
    assert torch.equal(got["mine.seen"], torch.tensor([10, 11]))
    assert "left out (they differ" not in out

    rc, _, err = cli(
        capsys, "export", ckpt, out_file, "--force", "--keys", "mine", "--rank", "1", "--no-prefix"
    )
    assert rc == 0, err
    assert {k: v.tolist() for k, v in load_file(str(out_file)).items()} == {"seen": [10, 11]}

    rc, _, err = cli(capsys, "export", ckpt, out_file, "--force", "--rank", "2")
    assert rc != 0 and "saved by 2 rank(s)" in err


def test_export_keys_inside_per_rank_values_need_a_rank(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "x.safetensors"
    rc, _, err = cli(capsys, "export", ckpt, out_file, "--keys", "mine/seen")
    assert rc != 0
    assert "no tensors under mine/seen" in err and "pass --rank R" in err
    assert not out_file.exists()
    rc, _, err = cli(capsys, "export", ckpt, out_file, "--keys", "emb,mine")
    assert rc == 0, err
    assert sorted(load_file(str(out_file))) == ["emb"]
