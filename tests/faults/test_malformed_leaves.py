"""Forged (re-sealed) leaves the tree refers to: every one is refused with a TardigradeError
by ``load`` (plain and ``into=``) and by ``verify``, before a byte lands in live state."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

import tardigrade as tg
from tardigrade.errors import CorruptCheckpointError

from .test_malformed import edit_manifest, raises_exactly


def sparse_state(layout: str) -> dict[str, Any]:
    eye = torch.eye(3)
    return {
        "w": torch.arange(4.0),
        "s": eye.to_sparse() if layout == "coo" else eye.to_sparse_csr(),
        "z": torch.tensor(5.0),  # a 0-d tensor
        "i": torch.arange(5),  # int64, one entry too many for 3 rows' crow_indices
    }


def item(doc: dict[str, Any], key: str) -> dict[str, Any]:
    return next(v for k, v in doc["tree"]["v"] if k["v"] == key)


def assert_refused_before_reading(ckpt: Path, layout: str, pattern: str) -> None:
    with raises_exactly(CorruptCheckpointError, pattern):
        tg.load(ckpt)
    live = sparse_state(layout)
    live["w"].zero_()
    with raises_exactly(CorruptCheckpointError, pattern):
        tg.load(ckpt, into=live)
    assert torch.equal(live["w"], torch.zeros(4)), "a byte landed in live state"
    with raises_exactly(CorruptCheckpointError, pattern):
        tg.verify(ckpt)


@pytest.mark.parametrize(
    ("layout", "part", "target", "pattern"),
    [
        # Was an IndexError from torch.sparse_coo_tensor (load(into=) builds meta stand-ins).
        ("coo", 0, "z", r"a sparse coo tensor whose indices are F32\[\], not I64"),
        ("coo", 0, "i", r"a sparse coo tensor whose indices are I64\[5\], not I64"),
        ("coo", 1, "i", r"values \[5\] do not hold one entry per index \(3\)"),
        # Meta stand-ins skip torch's checks of compressed layouts: the load read every
        # byte into live tensors before the real parts were refused.
        ("csr", 0, "i", r"compressed indices \[5\] do not hold 3 \+ 1 entries"),
        ("csr", 1, "z", r"a sparse csr tensor whose index parts are I64\[4\] and F32\[\]"),
        ("csr", 2, "z", r"parts \[4\], \[3\] and \[\] do not agree"),
    ],
)
def test_sparse_part_of_the_wrong_shape_is_refused(
    tmp_path: Path, layout: str, part: int, target: str, pattern: str
) -> None:
    ckpt = tmp_path / "ckpt"
    tg.save(ckpt, sparse_state(layout))

    def forge(doc: dict[str, Any]) -> None:
        item(doc, "s")["v"][part]["e"] = item(doc, target)["e"]

    edit_manifest(ckpt, forge)
    assert_refused_before_reading(ckpt, layout, pattern)


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_sparse_size_that_does_not_fit_its_parts_is_refused(tmp_path: Path, layout: str) -> None:
    ckpt = tmp_path / "ckpt"
    tg.save(ckpt, sparse_state(layout))
    edit_manifest(ckpt, lambda d: item(d, "s").update(size=[3, 3, 1]))
    assert_refused_before_reading(ckpt, layout, r"size \[3, 3, 1\] does not fit")


# ----------------------------------------------------------------------------------------------
# views


def test_view_claiming_more_elements_than_its_storage_is_refused(tmp_path: Path) -> None:
    """Stride 0 keeps a view's extent inside one element: it loaded as a tensor of 2**40
    elements (4 TiB to any copy of it) over a 12-element storage."""
    ckpt = tmp_path / "ckpt"
    buf = torch.arange(12.0)
    tg.save(ckpt, {"a": buf[:8], "b": buf[4:]})  # overlapping views: a span and two views
    edit_manifest(
        ckpt, lambda d: item(d, "b").update(view={"offset": 0, "shape": [2**40], "stride": [0]})
    )
    pattern = r"a tensor view .* does not fit its storage of \[12\] elements"
    for verify in (True, False):
        with raises_exactly(CorruptCheckpointError, pattern):
            tg.load(ckpt, verify=verify)
    with raises_exactly(CorruptCheckpointError, pattern):
        tg.verify(ckpt)


def test_self_overlapping_views_are_saved_by_value(tmp_path: Path) -> None:
    """What the reader refuses the writer never writes: an expand()ed tensor that shares memory
    with others is stored as its own values, not as a view of more elements than the span."""
    ckpt = tmp_path / "ckpt"
    buf = torch.arange(4.0)
    state = {
        "x": buf,
        "e": buf[:1].expand(100),
        "f": buf[1:3].unsqueeze(1).expand(2, 50),
        "x2": buf[2:],
    }
    tg.save(ckpt, state)
    doc = tg.read_manifest(ckpt)
    for _, node in doc["tree"]["v"]:
        if "view" in node:
            stored = doc["tensors"][node["e"]]["shape"]
            assert math.prod(node["view"]["shape"]) <= math.prod(stored), node
    loaded = tg.load(ckpt)
    for k, v in state.items():
        assert torch.equal(loaded[k], v), k
    # The views that share elements without overlapping themselves still come back sharing.
    assert loaded["x2"].data_ptr() == loaded["x"].data_ptr() + 2 * 4
