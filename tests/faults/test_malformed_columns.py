"""Format 5 (a distributed save's chunk columns): every malformed column is refused.

Each test copies the golden v5 checkpoint (saved by two ranks: a sharded ``emb`` of two
chunks, a replicated ``bias``, two per-rank tensors), forges one thing in its manifest the way
an attacker would (re-sealed, so the checksum does not fire first), and asserts that ``load``
and ``verify`` raise ``CorruptCheckpointError`` naming what is wrong, before reading any data.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import tardigrade as tg
from tardigrade.errors import CorruptCheckpointError

from .test_malformed import assert_rejected, edit_manifest

GOLDEN_V5 = Path(__file__).resolve().parents[1] / "compat" / "v5" / "ckpt"


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return Path(shutil.copytree(GOLDEN_V5, tmp_path / "ckpt"))


def emb(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["tensors"][0]["chunks"]  # the sharded 5x3 table: rows 0-2 and 3-4


def test_the_unforged_copy_loads(ckpt: Path) -> None:
    state = tg.load(ckpt)
    assert torch.equal(state["emb"], (torch.arange(15.0) * 0.5 - 3).reshape(5, 3))
    assert tg.verify(ckpt).files == 2


def bias(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["tensors"][1]["chunks"]  # one chunk of 3 floats, in rank 1's file


Edit = Callable[[dict[str, Any]], None]

CASES: list[tuple[str, Edit, str]] = [
    ("chunks as a list", lambda d: d["tensors"][0].update(chunks=[]), "object of columns"),
    ("no name", lambda d: d["tensors"][0].pop("name"), "has no name"),
    ("checksum not a string", lambda d: emb(d).update(checksum=7), "16 hex digits per chunk"),
    (
        "checksum cut short",
        lambda d: emb(d).update(checksum=emb(d)["checksum"][:-1]),
        "16 hex digits per chunk",
    ),
    ("checksum not hex", lambda d: emb(d).update(checksum="z" * 32), "not hex digits"),
    ("one chunk fewer in 'file'", lambda d: emb(d).update(file=[0]), "need a 'file' column"),
    (
        "a float in 'offsets'",
        lambda d: emb(d)["offsets"].__setitem__(0, [0.0, 3.5]),
        "need a 'file' column",
    ),
    ("a string in 'shape'", lambda d: emb(d)["shape"].__setitem__(1, "3"), "need a 'file' column"),
    ("a dim column missing", lambda d: emb(d)["shape"].pop(), "need a 'file' column"),
    (
        "an int beyond int64",
        lambda d: emb(d)["offsets"].__setitem__(1, 2**70),
        "need a 'file' column",
    ),
    ("a file index past the list", lambda d: emb(d).update(file=[0, 2]), "does not list"),
    ("a negative file index", lambda d: emb(d).update(file=[-1, 1]), "does not list"),
    (
        "a negative offset",
        lambda d: emb(d)["offsets"].__setitem__(0, [-1, 3]),
        "invalid offsets/shape",
    ),
    (
        "a chunk past the tensor",
        lambda d: emb(d)["offsets"].__setitem__(0, [0, 4]),
        r"chunk at \[4, 0\] of shape \[2, 3\] outside \[5, 3\]",
    ),
    (
        "chunks that overlap",
        lambda d: emb(d).update(offsets=[[0, 2], 0], shape=[[3, 2], 3]),
        "two of its chunks overlap",
    ),
    (
        "chunks short of the tensor",
        lambda d: emb(d).update(shape=[[3, 1], 3]),
        "do not cover its shape",
    ),
    # the single chunk of the replicated 'bias' (checked on a faster path)
    ("a single chunk's file past the list", lambda d: bias(d).update(file=2), "does not list"),
    ("a single chunk short of it", lambda d: bias(d).update(shape=[2]), "do not cover its shape"),
    ("a single chunk moved", lambda d: bias(d).update(offsets=[[1]]), "outside"),
    ("a single chunk's checksum not hex", lambda d: bias(d).update(checksum="Z" * 16), "not hex"),
    # Was a ValueError from the read plan: the fast path did not count the columns.
    (
        "a single chunk with an extra offsets column",
        lambda d: bias(d)["offsets"].append(0),
        "1 'offsets' and 'shape' columns",
    ),
    (
        "a single chunk with an extra shape column",
        lambda d: bias(d)["shape"].append(1),
        "1 'offsets' and 'shape' columns",
    ),
    # Was an OverflowError: file sizes are summed as int64 arrays.
    ("a file size past int64", lambda d: d["files"][0].update(size=2**63), r"0 to 2\*\*63-1"),
    (
        "more bytes than the file holds",
        lambda d: d["files"][0].update(size=40),
        "claims more bytes than data file",
    ),
]


@pytest.mark.parametrize(("edit", "pattern"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_malformed_columns_are_refused(ckpt: Path, edit: Edit, pattern: str) -> None:
    edit_manifest(ckpt, edit)
    assert_rejected(ckpt, CorruptCheckpointError, pattern)


def test_column_chunks_in_an_older_format_are_refused(ckpt: Path) -> None:
    edit_manifest(ckpt, lambda d: d.update(format_version=4))
    assert_rejected(ckpt, CorruptCheckpointError, "tensor #0 lists no chunks")


def test_a_key_the_data_file_lacks_is_refused(ckpt: Path) -> None:
    # Keys are derived from the name: a renamed tensor points at keys no file holds.
    edit_manifest(ckpt, lambda d: d["tensors"][0].update(name="other"))
    with pytest.raises(CorruptCheckpointError, match=r"'other@0\.0'"):
        tg.load(ckpt)
