"""Forged (re-sealed) leaves the tree refers to: every one is refused with a TardigradeError
by ``load`` (plain and ``into=``) and by ``verify``, before a byte lands in live state."""

from __future__ import annotations

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
