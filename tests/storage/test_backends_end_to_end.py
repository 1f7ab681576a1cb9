"""Saves, loads and verifies through every backend by URL, and every storage operation of a
save failing in turn (``tardigrade.testing.FaultyStorage``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import tardigrade as tg
from tardigrade.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    InvalidArgumentError,
    SaveError,
    TardigradeError,
)
from tardigrade.storage import open_root, storage_for
from tardigrade.testing import ERRORS, FaultyStorage


def make_state(value: float = 1.0) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    with torch.no_grad():
        model.weight.fill_(value)
    return {"model": model, "big": torch.full((70_000,), value), "ids": list(range(100))}


def test_save_load_verify_by_url(root_url: str) -> None:
    state = make_state(2.0)
    url = f"{root_url}/step-1"
    result = tg.save(url, state, step=1)
    assert result.path == url
    assert tg.read_manifest(url)["step"] == 1
    assert tg.verify(url).files == 1
    out = tg.load(url)
    assert torch.equal(out["big"], state["big"]) and out["ids"] == list(range(100))
    assert tg.load(url, keys=["ids"]) == {"ids": list(range(100))}
    live = make_state(0.0)
    tg.load(url, into=live)
    assert torch.equal(live["model"].weight, state["model"].weight)
    with pytest.raises(CheckpointExistsError):
        tg.save(url, state)
    tg.save(url, make_state(3.0), overwrite=True)
    assert float(tg.load(url)["big"][0]) == 3.0
    fut = tg.save(f"{root_url}/step-2", state, async_=True)
    fut.result(timeout=60)
    assert open_root(root_url).list() == ["step-1", "step-2"]  # nothing else left behind


def test_a_missing_checkpoint_names_the_url(root_url: str) -> None:
    with pytest.raises(CheckpointNotFoundError, match="nothing exists at this path"):
        tg.load(f"{root_url}/nope")


def test_an_unknown_scheme_says_which_ones_work() -> None:
    with pytest.raises(InvalidArgumentError, match=r"gopher://x/y.*unknown storage scheme gopher"):
        storage_for("gopher://x/y")
    with pytest.raises(InvalidArgumentError, match=r"memory://"):
        tg.save("nfs://host/ckpt", {"x": 1})


def run_save(url: str) -> Any:
    return tg.save(url, make_state(5.0), step=5)


@pytest.mark.parametrize("error", [e for e in ERRORS if e not in ("short_write", "lost_reply")])
def test_every_operation_of_a_save_fails_in_turn(root_url: str, error: str) -> None:
    """Fail operation k of a save, for every k: the save raises, commits nothing, leaves
    nothing behind, the committed checkpoint beside it is intact, and the next save works."""
    faulty = FaultyStorage(root_url)
    tg.save(faulty.url("step-1"), make_state(1.0), step=1)
    first = len(faulty.ops)
    run_save(faulty.url("probe"))
    ops = faulty.ops[first:]  # one save's operations, in order
    assert {"begin", "open_writer", "write", "close", "commit"} <= set(ops)
    faulty.inner.delete("probe")
    seen: dict[str, int] = {}
    for op in ops:
        seen[op] = seen.get(op, 0) + 1
        faulty.fail(op, nth=seen[op], error=error)  # this save's k-th operation of its kind
        with pytest.raises(TardigradeError) as info:
            run_save(faulty.url("step-5"))
        assert isinstance(info.value, SaveError) or info.value.errno is not None, info.value
        assert faulty.injected[-1].startswith(f"{op} #"), (op, faulty.injected)
        assert faulty.inner.list() == ["step-1"], (op, seen[op], faulty.inner.list())
        faulty.heal()
    assert tg.verify(faulty.url("step-1")).files == 1
    run_save(faulty.url("step-5"))
    assert float(tg.load(faulty.url("step-5"))["big"][0]) == 5.0
    assert len(faulty.injected) == len(ops)


def test_a_write_that_silently_keeps_half_is_never_committed(root_url: str) -> None:
    faulty = FaultyStorage(root_url)
    before = faulty.count["write"]
    run_save(faulty.url("probe"))
    writes = faulty.count["write"] - before
    faulty.inner.delete("probe")
    for k in range(1, writes + 1):
        faulty.fail("write", nth=k, error="short_write")
        with pytest.raises(TardigradeError, match="the storage holds"):
            run_save(faulty.url("step-5"))
        assert faulty.inner.list() == []
        faulty.heal()


def test_a_read_fault_is_a_storage_error_naming_the_file(root_url: str) -> None:
    faulty = FaultyStorage(root_url)
    run_save(faulty.url("step-5"))
    faulty.fail("read", nth=2, error="EIO")
    with pytest.raises(tg.StorageError, match=r"step-5/.*data-.*injected EIO") as info:
        tg.load(faulty.url("step-5"))
    assert info.value.errno == 5
    assert float(tg.load(faulty.url("step-5"))["big"][0]) == 5.0  # the fault is gone
