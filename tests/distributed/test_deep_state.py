"""A collective save of a deep state (format v5, with a ``tg.PerRank`` part deep in the tree)
loads on every rank, and one no reader accepts is refused on every rank before commit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import tardigrade as tg
from tardigrade.format import limits

from ._harness import caught, manifest_of, run_ranks

pytestmark = pytest.mark.distributed


def nest(depth: int, leaf: Any) -> Any:
    for _ in range(depth):
        leaf = {"k": leaf}
    return leaf


def dig(tree: Any, depth: int) -> Any:
    for _ in range(depth):
        tree = tree["k"]
    return tree


def save_and_load(rank: int, world: int, path: str, outer: int, inner: int) -> Any:
    def live() -> dict[str, Any]:
        part = tg.PerRank(nest(inner, torch.full((2,), float(rank))))
        return {"w": torch.ones(3), "deep": nest(outer, part)}

    saved = caught(lambda: tg.save(path, live()))
    if saved["type"] is not None:
        return saved
    tree = tg.load(path)
    into = live()
    dig(dig(into["deep"], outer).value, inner).zero_()
    tg.load(path, into=into)
    return [
        dig(dig(tree["deep"], outer), inner).tolist(),
        dig(dig(into["deep"], outer).value, inner).tolist(),
    ]


def test_deep_per_rank_state_saved_by_two_ranks_loads_on_each(tmp_path: Path) -> None:
    """The reproducer of issue 18: nested ~170 levels, it committed and every load raised a
    bare RecursionError."""
    path = str(tmp_path / "ckpt")
    got = run_ranks(save_and_load, 2, path, 170, 20)
    assert got == [[[0.0, 0.0], [0.0, 0.0]], [[1.0, 1.0], [1.0, 1.0]]]
    assert manifest_of(path).raw["format_version"] == 5


def test_per_rank_part_past_the_limit_is_refused_on_every_rank(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    got = run_ranks(save_and_load, 2, str(path), 100, 150)
    for r in got:
        assert "TardigradeError" in r["mro"], r
        assert f"nested more than {limits.MAX_TREE_DEPTH} levels deep" in r["message"]
    assert not path.exists()
