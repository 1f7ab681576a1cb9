"""``tg.Checkpoint``: the public reader the CLI and users' tools share.

Opening reads the manifest only and gives it as typed values; ``tree()`` puts a ``TensorRef``
in place of each tensor; ``read``/``read_into``/``verify`` read bytes and check them. Each is
the same code path as ``tg.load``/``tg.verify``/``tg.read_manifest``, so the results agree.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

import tardigrade as tg


def _state() -> dict[str, object]:
    base = torch.arange(12, dtype=torch.float32)
    return {
        "model": torch.nn.Linear(3, 2),
        "view": base[2:8].view(2, 3),  # a view of a larger tensor, saved as such
        "base": base,
        "c": torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64),
        "arr": np.arange(4, dtype=np.int32),
        "sp": torch.eye(3).to_sparse(),
        "step": 7,
        "nested": {"lr": 0.5, "list": [torch.ones(2, dtype=torch.bfloat16)]},
    }


@pytest.fixture(params=["local", "memory"])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "step-000000007")
    return f"memory://reader-{uuid.uuid4().hex}/ckpts/step-000000007"


def test_open_gives_the_manifest_as_typed_values(location: str) -> None:
    state = _state()
    tg.save(location, state, step=7, epoch=2, metadata={"run": "a"}, metrics={"loss": 0.25})
    ckpt = tg.Checkpoint.open(location, storage_options={})
    raw = tg.read_manifest(location)
    assert ckpt.manifest.raw == raw  # read_manifest stays the same dict
    assert ckpt.url.endswith("step-000000007")
    assert (ckpt.format_version, ckpt.step, ckpt.epoch) == (4, 7, 2)
    assert ckpt.metadata == {"run": "a"} and ckpt.metrics == {"loss": 0.25}
    assert ckpt.created == raw["created"] and ckpt.versions["tardigrade"] == tg.__version__
    assert ckpt.world_size == 1 and ckpt.per_rank == 0
    assert [(f.name, f.nbytes, f.header_checksum) for f in ckpt.files] == [
        (f["name"], f["size"], f["header_checksum"]) for f in raw["files"]
    ]
    assert ckpt.nbytes == sum(f["size"] for f in raw["files"]) > 0
    assert ckpt.manifest_nbytes() > 0 and len(ckpt.tensors) == len(raw["tensors"])
    assert "step=7" in repr(ckpt)


def test_tree_has_a_tensor_ref_per_tensor_and_reads_nothing(location: str) -> None:
    tg.save(location, _state())
    ckpt = tg.Checkpoint.open(location)
    refs = ckpt.tensor_refs()
    assert list(refs) == [
        "model/weight", "model/bias", "view", "base", "c", "arr", "sp", "nested/list/0",
    ]  # fmt: skip
    w, view, c, arr, sp = refs["model/weight"], refs["view"], refs["c"], refs["arr"], refs["sp"]
    assert isinstance(w, tg.TensorRef) and (w.dtype, w.shape, w.ndarray) == ("F32", (2, 3), False)
    assert w.torch_dtype is torch.float32 and w.nbytes == 24 and w.view is None
    assert isinstance(view, tg.TensorRef) and view.entry == refs["base"].entry  # type: ignore[union-attr]
    assert view.view is not None and (view.view.offset, view.view.shape) == (2, (2, 3))
    assert isinstance(c, tg.TensorRef) and (c.dtype, c.shape, c.complex) == ("C64", (2,), True)
    assert c.torch_dtype is torch.complex64 and c.nbytes == 16
    assert isinstance(arr, tg.TensorRef) and arr.ndarray and arr.dtype == "I32"
    assert isinstance(sp, tg.SparseRef) and (sp.layout, sp.size) == ("coo", (3, 3))
    assert all(isinstance(p, tg.TensorRef) for p in sp.parts)
    tree = ckpt.tree(["nested"])
    assert list(tree) == ["nested"] and tree["nested"]["lr"] == 0.5


def test_read_is_load_and_read_into_fills_the_callers_buffers(location: str) -> None:
    state = _state()
    tg.save(location, state)
    ckpt = tg.Checkpoint.open(location)
    got = ckpt.read(keys=["model", "view"])
    want = tg.load(location, keys=["model", "view"])
    assert list(got) == ["model", "view"]
    assert torch.equal(got["view"], want["view"]) and torch.equal(got["view"], state["view"])
    assert torch.equal(got["model"]["weight"], state["model"].weight.detach())  # type: ignore[attr-defined]
    whole = ckpt.read()
    assert torch.equal(whole["c"], state["c"]) and whole["nested"]["lr"] == 0.5

    ref = ckpt.tensor_refs()["base"]
    assert isinstance(ref, tg.TensorRef)
    buf = torch.empty(ref.shape, dtype=ref.torch_dtype)
    assert ckpt.read_into({ref.entry: buf}) > 0
    assert torch.equal(buf, state["base"])
    with pytest.raises(tg.InvalidArgumentError, match=r"stored as torch.float32\[12\]"):
        ckpt.read_into({ref.entry: torch.empty(3)})
    with pytest.raises(tg.InvalidArgumentError, match="no stored tensor #99"):
        ckpt.read_into({99: buf})


def test_verify_and_a_damaged_file(tmp_path: Path) -> None:
    path = tmp_path / "step-000000001"
    tg.save(path, {"w": torch.ones(256)})
    ckpt = tg.Checkpoint.open(path)
    report = ckpt.verify()
    assert (report.files, report.tensors, report.nbytes) == (1, 1, ckpt.nbytes)
    total = tg.VerifyReport.total(str(tmp_path), [report, report])
    assert (total.files, total.nbytes, total.step) == (2, 2 * report.nbytes, None)
    data = next(path.glob("data-*"))
    raw = bytearray(data.read_bytes())
    raw[-10] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(tg.ChecksumMismatchError):
        ckpt.verify()
    with pytest.raises(tg.ChecksumMismatchError):
        ckpt.read()


def test_what_is_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(tg.CheckpointNotFoundError, match="nothing exists at this path"):
        tg.Checkpoint.open(tmp_path / "missing")
    (tmp_path / "half").mkdir()
    with pytest.raises(tg.CheckpointNotFoundError, match="never committed"):
        tg.Checkpoint.open(tmp_path / "half")
    assert not tg.Catalog.is_checkpoint(tmp_path / "half")
    assert not tg.Catalog.is_checkpoint("nope://x/y")
    tg.save(tmp_path / "whole", {"x": 1})
    assert tg.Catalog.is_checkpoint(tmp_path / "whole")
    with pytest.raises(tg.InvalidArgumentError, match="per_rank_fallback"):
        tg.Checkpoint.open(tmp_path / "whole").read(per_rank_fallback="nope")


def test_tensor_paths_that_would_collide_are_refused(tmp_path: Path) -> None:
    tg.save(tmp_path / "c", {"a/b": torch.ones(1), "a": {"b": torch.zeros(1)}})
    ckpt = tg.Checkpoint.open(tmp_path / "c")
    with pytest.raises(tg.InvalidArgumentError, match="both at 'a/b'"):
        ckpt.tensor_refs()
    assert set(ckpt.tree()) == {"a/b", "a"}
