"""A manifest edited and relabelled as an older format (whose readers check less: format 1 has
no checksums) is refused wherever what the checkpoint holds shows a newer writer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import tardigrade as tg
from tardigrade.errors import CorruptCheckpointError
from tardigrade.format.jsonio import dumps

from .test_malformed import (
    MANIFEST,
    assert_rejected,
    edit_manifest,
    raises_exactly,
    read_manifest_doc,
)


def save(path: Path, **extra: Any) -> Path:
    tg.save(path, {"w": torch.arange(4.0), "n": 5, **extra})
    return path


def as_format_1(ckpt: Path, *, strip_header_checksums: bool) -> None:
    """The forgery of issue 18: edit a value, drop the seal, claim format 1."""
    doc = read_manifest_doc(ckpt)
    doc.pop("manifest_checksum")
    doc["format_version"] = 1
    doc["tree"]["v"][1][1]["v"] = "6"  # state['n']: 5 -> 6
    if strip_header_checksums:
        for f in doc["files"]:
            f.pop("header_checksum")
    (ckpt / MANIFEST).write_bytes(dumps(doc))


def test_relabelled_format_1_keeping_header_checksums_is_refused(tmp_path: Path) -> None:
    ckpt = save(tmp_path / "ckpt")
    as_format_1(ckpt, strip_header_checksums=False)
    assert_rejected(
        ckpt, CorruptCheckpointError, "claims format_version 1 but holds data file header checksums"
    )


def test_relabelled_format_1_is_refused_by_its_data_files(tmp_path: Path) -> None:
    """Stripped of everything the manifest showed, the data files still show the writer."""
    ckpt = save(tmp_path / "ckpt")
    as_format_1(ckpt, strip_header_checksums=True)
    pattern = "written with a checksummed .* manifest now claims format 1"
    for verify in (True, False):
        with raises_exactly(CorruptCheckpointError, pattern):
            tg.load(ckpt, verify=verify)
    with raises_exactly(CorruptCheckpointError, pattern):
        tg.verify(ckpt)


def test_format_1_manifest_with_a_seal_is_refused(tmp_path: Path) -> None:
    ckpt = save(tmp_path / "ckpt")
    edit_manifest(ckpt, lambda d: d.update(format_version=1))  # re-sealed
    assert_rejected(
        ckpt, CorruptCheckpointError, "claims format_version 1 but holds a manifest checksum"
    )


@pytest.mark.parametrize(
    ("extra", "version", "pattern"),
    [
        ({"s": {1, 2}}, 2, r"state tree at state\['s'\]: a 'set' node"),
        ({"c": torch.ones(2, dtype=torch.complex64)}, 2, "node of a complex tensor"),
        ({"p": tg.PerRank(3)}, 3, "claims format_version 3 but holds parts saved by several ranks"),
    ],
    ids=["set-as-v2", "complex-tensor-as-v2", "per-rank-as-v3"],
)
def test_newer_contents_in_an_older_format_are_refused(
    tmp_path: Path, extra: dict[str, Any], version: int, pattern: str
) -> None:
    ckpt = save(tmp_path / "ckpt", **extra)
    edit_manifest(ckpt, lambda d: d.update(format_version=version))
    assert_rejected(ckpt, CorruptCheckpointError, pattern)


@pytest.mark.parametrize("field", ["files", "tensors"])
def test_an_older_format_with_a_field_of_the_wrong_type_is_refused(
    tmp_path: Path, field: str
) -> None:
    """The relabel check reads ``files`` and ``tensors`` before their own checks run (found by
    the fuzzer: ``"files": 1.5`` in a format-1 manifest was a bare TypeError)."""
    ckpt = save(tmp_path / "ckpt")
    doc = read_manifest_doc(ckpt)
    doc.pop("manifest_checksum")
    for f in doc["files"]:
        f.pop("header_checksum")
    doc.update({"format_version": 1, field: 1.5})
    (ckpt / MANIFEST).write_bytes(dumps(doc))
    assert_rejected(ckpt, CorruptCheckpointError, field)
