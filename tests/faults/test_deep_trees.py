"""Deep state trees: what a save commits at the depth limit loads, and what no reader accepts is
refused at save time, in every format (v4 from one process, v5 from several).

A ``tg.PerRank`` part is stored apart from the tree (``per_rank``) and takes its place's depth
on load; walks over trees near the limit must not recurse once per container (a tree nested
200 levels is ~600 JSON containers).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import tardigrade as tg
from tardigrade.errors import CorruptCheckpointError, UnsupportedTypeError
from tardigrade.format import limits

from .test_malformed import assert_rejected, edit_manifest

GOLDEN_V5 = Path(__file__).resolve().parents[1] / "compat" / "v5" / "ckpt"
MAX = limits.MAX_TREE_DEPTH


def nest(depth: int, leaf: Any) -> Any:
    for _ in range(depth):
        leaf = {"k": leaf}
    return leaf


def state(outer: int, inner: int) -> dict[str, Any]:
    """A per-rank part at level ``outer + 1`` whose own tree is ``inner`` levels deep."""
    return {"w": torch.ones(3), "deep": nest(outer, tg.PerRank(nest(inner, torch.arange(4.0))))}


@pytest.mark.parametrize(("outer", "inner"), [(170, 0), (100, MAX - 101), (0, MAX - 1)])
def test_per_rank_part_at_the_depth_limit_round_trips(
    tmp_path: Path, outer: int, inner: int
) -> None:
    """Was a bare RecursionError on load: ``tree_for`` recursed three frames per level."""
    path = tmp_path / "ckpt"
    tg.save(path, state(outer, inner))
    leaf = _dig(_dig(tg.load(path)["deep"], outer), inner)
    assert torch.equal(leaf, torch.arange(4.0))
    live = state(outer, inner)
    tg.load(path, into=live)
    assert torch.equal(_dig(_dig(live["deep"], outer).value, inner), torch.arange(4.0))
    assert tg.verify(path).files == 1


def _dig(tree: Any, depth: int) -> Any:
    for _ in range(depth):
        tree = tree["k"]
    return tree


def test_per_rank_part_past_the_depth_limit_is_refused_at_save(tmp_path: Path) -> None:
    """The part's depth counts from its place: 100 + 1 + 150 levels is past the limit, though
    each half alone is not. It used to commit, verify, and fail every load."""
    path = tmp_path / "ckpt"
    with pytest.raises(UnsupportedTypeError, match=rf"nested more than {MAX} levels deep"):
        tg.save(path, state(100, 150))
    assert not path.exists()


@pytest.mark.parametrize("kind", ["complex", "sparse"])
def test_leaf_with_parts_at_the_limit_is_refused_at_save(tmp_path: Path, kind: str) -> None:
    """A complex number or a sparse tensor stores its parts one level below it."""
    leaf = 1 + 2j if kind == "complex" else torch.eye(2).to_sparse()
    with pytest.raises(UnsupportedTypeError, match=rf"nested more than {MAX} levels deep"):
        tg.save(tmp_path / "ckpt", nest(MAX, leaf))
    tg.save(tmp_path / "ok", nest(MAX - 1, leaf))
    tg.load(tmp_path / "ok")


@pytest.fixture
def v5(tmp_path: Path) -> Path:
    return Path(shutil.copytree(GOLDEN_V5, tmp_path / "ckpt"))


def _sink_places(doc: dict[str, Any], depth: int) -> None:
    """Move every item of the tree ``depth`` levels down (re-sealed by edit_manifest)."""
    items = doc["tree"]["v"]
    for item in items:
        for _ in range(depth):
            item[1] = {"t": "dict", "v": [[{"t": "str", "v": "k"}, item[1]]]}


def test_v5_per_rank_places_deep_in_the_tree_load(v5: Path) -> None:
    edit_manifest(v5, lambda d: _sink_places(d, 170))
    loaded = tg.load(v5)
    assert set(loaded) == set(tg.load(GOLDEN_V5))
    assert tg.verify(v5).files == 2


def test_v5_per_rank_part_past_the_limit_is_refused_by_verify_too(v5: Path) -> None:
    # The golden parts are dicts of tensors (two levels): placed at MAX they end past it.
    edit_manifest(v5, lambda d: _sink_places(d, MAX - 1))
    assert_rejected(v5, CorruptCheckpointError, rf"nested more than {MAX} levels deep")


def test_a_place_for_a_part_some_rank_lacks_is_refused_by_verify(v5: Path) -> None:
    edit_manifest(v5, lambda d: d["per_rank"][1].pop())
    assert_rejected(v5, CorruptCheckpointError, "which not every one of the 2 ranks lists")
