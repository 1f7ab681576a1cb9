"""A state whose manifest no reader would accept is refused before a byte is written: the
estimate is a lower bound of the manifest the save would commit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tardigrade as tg
from tardigrade import _save_job, _write
from tardigrade._plan import local_plan
from tardigrade._tree import flatten
from tardigrade.errors import SaveError
from tardigrade.format import limits


def low_estimate(state: Any) -> int:
    """The estimate ``make_job`` checks, made to fail so its value can be read."""
    lplan = local_plan(flatten(state))
    entries = [*lplan.shared, *lplan.own]
    named = [len(e.name) for e in entries if 0 not in e.shape]
    return sum(named) + _save_job.MIN_MANIFEST_BYTES_PER_TENSOR * len(named)


STATES = {
    "scalars": {"a": torch.tensor(1, dtype=torch.uint8), "b": torch.tensor(True)},
    "numpy": [np.zeros((), dtype=np.uint8) for _ in range(5)],
    "empty": {"e": torch.zeros(0, 3), "f": torch.zeros(0, dtype=torch.uint8)},
    "nested": {"m": {str(i): torch.ones(i + 1) for i in range(20)}, "t": (torch.ones(2),)},
    "per-rank": {"p": tg.PerRank({"x": torch.ones(1)}), "q": torch.ones(3)},
    "views": {"a": torch.arange(9.0)[:6], "b": torch.arange(9.0)[2:]},
}


@pytest.mark.parametrize("name", STATES)
def test_estimate_is_a_lower_bound_of_the_manifest(tmp_path: Path, name: str) -> None:
    tg.save(tmp_path / "c", STATES[name])
    assert low_estimate(STATES[name]) <= (tmp_path / "c" / "manifest.json").stat().st_size


@pytest.fixture
def no_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*a: Any, **kw: Any) -> None:
        pytest.fail("a data file was written for a save refused by its estimate")

    monkeypatch.setattr(_write, "write_file", refuse)


def test_too_many_tensors_are_refused_before_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_writes: None
) -> None:
    monkeypatch.setattr(limits, "MAX_TENSORS", 10)
    state = {f"t{i}": torch.ones(1) for i in range(11)}
    with pytest.raises(SaveError, match="holds 11 tensors, more than the 10 a manifest may list"):
        tg.save(tmp_path / "c", state)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("async_", [False, True])
def test_manifest_over_the_cap_is_refused_before_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_writes: None, async_: bool
) -> None:
    """A million small tensors wrote every byte for minutes before the cap refused the commit.
    Scaled down: the same refusal with a smaller cap, and no data file written."""
    monkeypatch.setattr(limits, "MAX_MANIFEST_BYTES", 20_000)
    state = {f"layer.{i}.{'x' * 50}": torch.ones(1) for i in range(100)}
    with pytest.raises(
        SaveError,
        match=r"manifest would be at least 0\.\d MiB \(100 tensors\), more than the 0\.0 MiB",
    ):
        tg.save(tmp_path / "c", state, async_=async_)
    assert list(tmp_path.iterdir()) == []
    assert low_estimate(state) > 20_000
