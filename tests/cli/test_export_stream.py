"""``tardigrade export`` writes the safetensors file as a stream: the header from the manifest,
then each tensor read and written in turn, so memory stays near the largest tensor."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import tardigrade as tg
from tardigrade.cli import export, main

SRC = str(Path(__file__).resolve().parents[2] / "src")


def split(path: Path) -> tuple[int, dict, bytes]:
    """A safetensors file as (header length, header, data)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8 : 8 + n]), raw[8 + n :]


def flat(tree: object, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)  # type: ignore[union-attr]
    for k, v in items:
        name = f"{prefix}{k}"
        if isinstance(v, np.ndarray):
            v = torch.from_numpy(v)
        if isinstance(v, torch.Tensor):
            out[name] = v.clone()  # own bytes: save_file refuses shared memory
        elif isinstance(v, (dict, list, tuple)):
            out.update(flat(v, f"{name}."))
    return out


def test_stream_matches_save_file_layout_for_every_dtype(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4, 6, generator=g)
    state = {
        "f32": base,
        "view": base[1:3, ::2],  # a strided view of a saved tensor: written contiguous
        "f64": torch.randn(3, generator=g, dtype=torch.float64),
        "bf16": base.to(torch.bfloat16),
        "f16": base.to(torch.float16),
        "i64": torch.arange(5),
        "i32": torch.arange(7, dtype=torch.int32),
        "i16": torch.arange(2, dtype=torch.int16),
        "i8": torch.arange(-3, 3, dtype=torch.int8),
        "u8": torch.arange(9, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "c64": torch.randn(3, generator=g, dtype=torch.complex64),
        "f8": base.to(torch.float8_e4m3fn),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "np": np.arange(6, dtype=np.float32).reshape(2, 3),
        "list": [torch.ones(2), {"ünï": torch.zeros(1)}],
        "step": 3,
    }
    tg.save(tmp_path / "c", state, step=3)
    out = tmp_path / "out.safetensors"
    assert main(["export", str(tmp_path / "c"), str(out)]) == 0
    assert "18 tensors" in capsys.readouterr().out

    want = flat(tg.load(tmp_path / "c"))
    ref = tmp_path / "ref.safetensors"
    metadata = {"format": "pt", "tardigrade_source": str(tmp_path / "c"), "tardigrade_step": "3"}
    save_file(want, ref, metadata=metadata)
    # The same file as safetensors' own writer makes, byte for byte, but for the order of the
    # metadata keys (safetensors writes them in hash order, which varies per process).
    n, header, data = split(out)
    ref_n, ref_header, ref_data = split(ref)
    assert (n, data) == (ref_n, ref_data)
    assert header == ref_header
    assert list(header) == list(ref_header)  # the tensors in the same order
    got = load_file(str(out))
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


BIG = textwrap.dedent(
    """
    import resource, sys
    from tardigrade.cli import main

    ckpt, small, out = sys.argv[1:]
    # Warm up: import and run every code path on a small checkpoint first.
    assert main(["export", small, out + ".small"]) == 0
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert main(["export", ckpt, out]) == 0
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print("peak-increase-kib", after - before)
    """
)


@pytest.mark.slow
def test_export_memory_is_bounded_by_the_largest_tensor(tmp_path: Path) -> None:
    tensor_mib, count = 10, 20
    g = torch.Generator().manual_seed(1)
    n = tensor_mib * 2**20 // 4
    state = {"model": {f"layer{i:02d}": torch.randn(n, generator=g) for i in range(count)}}
    tg.save(tmp_path / "big", state)
    tg.save(tmp_path / "small", {"model": {"w": torch.ones(3)}})
    out = tmp_path / "big.safetensors"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, env.get("PYTHONPATH")) if p)
    r = subprocess.run(
        [sys.executable, "-c", BIG, str(tmp_path / "big"), str(tmp_path / "small"), str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=110,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    increase_mib = int(r.stdout.split("peak-increase-kib")[1].split()[0]) / 1024
    # 200 MiB of tensors, read a batch of at most BATCH_BYTES (here: one tensor) at a time
    # into one reused buffer; exporting them all at once grew the peak by 200 MiB.
    assert tensor_mib * 2**20 < export.BATCH_BYTES < 2 * tensor_mib * 2**20
    assert increase_mib < 2 * tensor_mib, f"peak RSS grew {increase_mib:.0f} MiB"
    got = load_file(str(out))
    want = tg.load(tmp_path / "big")["model"]
    assert list(got) == [f"model.layer{i:02d}" for i in range(count)]
    for i in range(count):
        assert torch.equal(got[f"model.layer{i:02d}"], want[f"layer{i:02d}"])
