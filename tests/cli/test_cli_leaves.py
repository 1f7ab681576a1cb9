"""``inspect``, ``diff`` and ``export`` on checkpoints holding the leaf kinds of format v3."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import tardigrade as tg
from tardigrade.cli import main

NAN32 = np.frombuffer(bytes.fromhex("2301c0ff"), dtype=np.float32)[0]
OTHER_NAN32 = np.frombuffer(bytes.fromhex("0000c07f"), dtype=np.float32)[0]


def cli(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def leaves(scale: float = 1.0, nan: np.float32 = NAN32) -> dict[str, Any]:
    dense = torch.tensor([[0.0, 1.5, 0.0], [2.0, 0.0, -3.0]]) * scale
    return {
        "size": torch.Size([3, 4]),
        "device": torch.device("cuda:1"),
        "counter": Counter({"a": 2, "b": 1}),
        "set": {1, "x", (2, 3)},
        "frozen": frozenset({2.5}),
        "z": complex(1.0, -0.0),
        "metric": np.float32(0.25 * scale),
        "nan_metric": nan,
        "spectrum": torch.arange(8, dtype=torch.float32).reshape(4, 2).mul(scale).contiguous(),
        "coo": dense.to_sparse(),
        "csr": dense.to_sparse_csr(),
    }


def save(path: Path, state: dict[str, Any]) -> Path:
    state = dict(state)
    state["spectrum"] = torch.view_as_complex(state["spectrum"])  # complex64[4]
    tg.save(path, state)
    return path


def test_inspect_shows_every_new_leaf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = save(tmp_path / "a", leaves())
    rc, out, err = cli(capsys, "inspect", ckpt)
    assert rc == 0, err
    lines = out.splitlines()
    assert "size: torch.Size([3, 4])" in lines
    assert "device: device(type='cuda', index=1)" in lines
    assert "counter: Counter[2]" in lines and "  a: 2" in lines
    set_line = next(ln for ln in lines if ln.startswith("set: "))
    assert set_line == "set: {1, 'x', (2, 3)}"  # elements in their stored (sorted) order
    assert "frozen: frozenset({2.5})" in lines
    assert "z: (1-0j)" in lines
    assert "metric: np.float32(0.25)" in lines
    assert any(ln.startswith("spectrum: C64[4]") for ln in lines), out
    assert any(ln.startswith("coo: sparse coo F32[2, 3]  nnz=3") for ln in lines), out
    assert any(ln.startswith("csr: sparse csr F32[2, 3]  nnz=3") for ln in lines), out


def test_diff_of_identical_new_leaves_is_empty(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = save(tmp_path / "a", leaves())
    b = save(tmp_path / "b", leaves())
    rc, out, err = cli(capsys, "diff", a, b)
    assert rc == 0, out + err  # NaN scalars with the same bits are equal
    assert out.startswith("identical")


def test_diff_reports_changed_new_leaves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = save(tmp_path / "a", leaves())
    b = save(tmp_path / "b", leaves(scale=2.0, nan=OTHER_NAN32))
    rc, out, err = cli(capsys, "diff", a, b, "--json")
    assert rc == 1, err
    diffs = {d["path"]: d for d in json.loads(out)["diffs"]}
    assert set(diffs) == {
        "state['metric']",
        "state['nan_metric']",  # another NaN payload: bits differ
        "state['spectrum']",
        "state['coo']",
        "state['csr']",
    }
    assert diffs["state['spectrum']"]["detail"] == "tensor C64[4]: bytes differ"
    assert diffs["state['coo']"]["kind"] == "values"
    assert "sparse coo" in diffs["state['coo']"]["detail"]


def test_diff_reports_a_layout_change(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = save(tmp_path / "a", leaves())
    other = leaves()
    other["csr"] = other["csr"].to_sparse_csc()
    other["size"] = (3, 4)  # a tuple now, not a torch.Size
    b = save(tmp_path / "b", other)
    rc, out, err = cli(capsys, "diff", a, b, "--json")
    assert rc == 1, err
    diffs = {d["path"]: d for d in json.loads(out)["diffs"]}
    assert set(diffs) == {"state['csr']", "state['size']"}
    assert diffs["state['csr']"]["kind"] == "type"
    assert "sparse csr" in diffs["state['csr']"]["detail"]
    assert "sparse csc" in diffs["state['csr']"]["detail"]
    assert diffs["state['size']"]["detail"] == "Size -> tuple"


def test_export_writes_complex_tensors_and_names_sparse_ones_left_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = save(tmp_path / "a", leaves())
    out_file = tmp_path / "out.safetensors"
    rc, out, err = cli(capsys, "export", ckpt, out_file)
    assert rc == 0, err
    exported = load_file(str(out_file))
    assert list(exported) == ["spectrum"]
    want = torch.view_as_complex(leaves()["spectrum"])
    assert exported["spectrum"].dtype == torch.complex64 and torch.equal(exported["spectrum"], want)
    assert "sparse tensors left out" in out and "coo, csr" in out
