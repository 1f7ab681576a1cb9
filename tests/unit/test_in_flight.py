"""Several async saves in flight (``AsyncCheckpointer(max_in_flight=N)``).

The contract: up to N saves run in the background at once, each from its own staged copy (a
staging budget bounds them together); a new save finding N running waits until one ends, or
is skipped with ``if_busy="skip"``; saves into one directory write and commit in the order
they were made (one after another), while a save into another directory (a faster tier) never
waits for them; a failure of one is reported once and does not touch the others.

The background writes of chosen checkpoints are held at gates (``LocalWriter.write`` blocks
while the file belongs to a held checkpoint), so no outcome depends on the disk's speed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tardigrade as tg
from tardigrade._commit import RenameCommit
from tardigrade.errors import InvalidArgumentError, SaveError
from tardigrade.storage.local import LocalWriter

MiB = 1024 * 1024


def state_of(seed: int, mib: int = 2) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(mib * MiB // 4, generator=g), "seed": seed}


def assert_holds(path: Path, seed: int, mib: int = 2) -> None:
    tg.verify(path)
    got = tg.load(path)
    assert got["seed"] == seed
    assert torch.equal(got["w"], state_of(seed, mib)["w"]), f"{path}: wrong bytes"


class Gates:
    """Hold the background writes of the checkpoints named in ``held`` until released."""

    def __init__(self) -> None:
        self._open: dict[str, threading.Event] = {}
        self.writing: dict[str, threading.Event] = {}

    def hold(self, name: str) -> None:
        self._open[name] = threading.Event()
        self.writing[name] = threading.Event()

    def release(self, name: str) -> None:
        self._open[name].set()

    def release_all(self) -> None:
        for e in self._open.values():
            e.set()

    def wait(self, path: str) -> None:
        for name, gate in self._open.items():
            if f".tmp-{name}-" in path:
                self.writing[name].set()
                if not gate.wait(60):
                    raise TimeoutError(f"test gate for {name} was never opened")


@pytest.fixture
def gates(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gates]:
    g = Gates()
    original = LocalWriter.write

    def write(self: LocalWriter, data: Any) -> None:
        g.wait(self.path)
        original(self, data)

    monkeypatch.setattr(LocalWriter, "write", write)
    yield g
    g.release_all()  # never leave a writer thread blocked


@pytest.fixture
def commits(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names committed, in order."""
    order: list[str] = []
    original = RenameCommit.commit

    def commit(self: RenameCommit, staging: str, name: str, *args: Any, **kwargs: Any) -> None:
        original(self, staging, name, *args, **kwargs)
        order.append(name)

    monkeypatch.setattr(RenameCommit, "commit", commit)
    return order


@pytest.fixture
def bad_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The save of a checkpoint named ``bad`` fails: the fsync of its data file (EIO)."""
    original = LocalWriter.close

    def close(self: LocalWriter) -> None:
        if ".tmp-bad-" in self.path:
            raise OSError(5, "injected I/O error")
        original(self)

    monkeypatch.setattr(LocalWriter, "close", close)


def test_two_saves_run_at_once_and_a_third_waits_for_room(
    tmp_path: Path, gates: Gates, checkpointers: Callable[..., tg.AsyncCheckpointer]
) -> None:
    # Into two directories: the newer one may then commit before the older one.
    (tmp_path / "x").mkdir()
    ckpt = checkpointers(max_in_flight=2)
    gates.hold("a")
    gates.hold("b")
    a = ckpt.save(tmp_path / "a", state_of(1))
    b = ckpt.save(tmp_path / "x" / "b", state_of(2))
    assert a is not None and b is not None
    assert gates.writing["a"].wait(30) and gates.writing["b"].wait(30), "both should be writing"
    assert not a.done() and not b.done()

    third: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: third.update(f=ckpt.save(tmp_path / "c", state_of(3))))
    thread.start()
    thread.join(0.5)
    assert thread.is_alive(), "a third save started while two were in flight"
    gates.release("b")  # the newer one ends first: that makes room as well
    thread.join(30)
    assert not thread.is_alive() and b.done() and not a.done()
    gates.release("a")
    ckpt.wait()
    for name, seed in (("a", 1), ("x/b", 2), ("c", 3)):
        assert_holds(tmp_path / name, seed)


def test_saves_into_one_directory_commit_in_the_order_they_were_made(
    tmp_path: Path,
    gates: Gates,
    commits: list[str],
    checkpointers: Callable[..., tg.AsyncCheckpointer],
) -> None:
    ckpt = checkpointers(max_in_flight=3)
    gates.hold("step-1")
    first = ckpt.save(tmp_path / "step-1", state_of(1))
    second = ckpt.save(tmp_path / "step-2", state_of(2))
    third = ckpt.save(tmp_path / "step-3", state_of(3))
    assert first is not None and second is not None and third is not None
    # The later two are staged (save returned) and wait for the first to end.
    assert not (tmp_path / "step-2").exists() and not (tmp_path / "step-3").exists()
    assert not second.done() and not third.done()
    gates.release("step-1")
    ckpt.wait()
    assert commits == ["step-1", "step-2", "step-3"]
    for n in (1, 2, 3):
        assert_holds(tmp_path / f"step-{n}", n)


def test_a_save_into_another_directory_does_not_wait_for_a_slow_one(
    tmp_path: Path,
    gates: Gates,
    commits: list[str],
    checkpointers: Callable[..., tg.AsyncCheckpointer],
) -> None:
    """The fast tier's saves go on while a slow persistent write is held: several of them in
    turn, each committing while the slow one still runs."""
    (tmp_path / "disk").mkdir()
    (tmp_path / "ram").mkdir()
    ckpt = checkpointers(max_in_flight=2)
    gates.hold("step-10")
    slow = ckpt.save(tmp_path / "disk" / "step-10", state_of(10))
    assert slow is not None
    for step in (11, 12, 13):
        fast = ckpt.save(tmp_path / "ram" / f"step-{step}", state_of(step))
        assert fast is not None
        fast.result(timeout=60)
        assert not slow.done(), "the slow save should still be held"
    assert commits == ["step-11", "step-12", "step-13"]
    gates.release("step-10")
    slow.result(timeout=60)
    assert commits[-1] == "step-10"
    assert_holds(tmp_path / "disk" / "step-10", 10)
    for step in (11, 12, 13):
        assert_holds(tmp_path / "ram" / f"step-{step}", step)


def test_a_save_failing_while_another_is_in_flight_is_reported_once(
    tmp_path: Path,
    gates: Gates,
    bad_fails: None,
    checkpointers: Callable[..., tg.AsyncCheckpointer],
) -> None:
    (tmp_path / "fast").mkdir()
    ckpt = checkpointers(max_in_flight=2)
    gates.hold("good")
    good = ckpt.save(tmp_path / "good", state_of(1))
    bad = ckpt.save(tmp_path / "fast" / "bad", state_of(2))
    assert good is not None and bad is not None
    with pytest.raises(SaveError, match="injected I/O error"):
        bad.result(timeout=60)
    assert not good.done(), "the other save must go on"
    gates.release("good")
    good.result(timeout=60)
    assert_holds(tmp_path / "good", 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fast", "good"]
    assert list((tmp_path / "fast").iterdir()) == [], "the failed save left files"
    ckpt.wait()  # seen already (on result()): not raised again
    ckpt.save(tmp_path / "after", state_of(3)).result(timeout=60)  # type: ignore[union-attr]


def test_an_unseen_failure_surfaces_on_the_next_save_while_another_runs(
    tmp_path: Path,
    gates: Gates,
    bad_fails: None,
    checkpointers: Callable[..., tg.AsyncCheckpointer],
) -> None:
    ckpt = checkpointers(max_in_flight=2)
    gates.hold("bad")  # until the other save is made too
    gates.hold("slow")
    bad = ckpt.save(tmp_path / "bad", state_of(1))
    slow = ckpt.save(tmp_path / "slow", state_of(2))
    assert bad is not None and slow is not None
    gates.release("bad")
    bad.exception(60)  # ended, unseen
    with pytest.raises(SaveError, match="injected I/O error"):
        ckpt.save(tmp_path / "next", state_of(3))
    assert not (tmp_path / "next").exists()
    gates.release("slow")
    assert ckpt.wait() is not None  # raises nothing more: the failure was reported once
    assert_holds(tmp_path / "slow", 2)


def test_saves_in_flight_share_one_staging_budget(
    tmp_path: Path, checkpointers: Callable[..., tg.AsyncCheckpointer]
) -> None:
    budget = 4 * MiB
    ckpt = checkpointers(max_in_flight=2, max_staging_bytes=budget)
    for n in range(4):
        ckpt.save(tmp_path / f"s{n}", state_of(n, mib=6))
    ckpt.wait()
    stats = ckpt.staging
    assert stats.peak_in_use_bytes <= budget and stats.allocated_bytes <= budget
    for n in range(4):
        assert_holds(tmp_path / f"s{n}", n, mib=6)


def test_without_a_budget_each_save_in_flight_stages_its_own_copy(
    tmp_path: Path, gates: Gates, checkpointers: Callable[..., tg.AsyncCheckpointer]
) -> None:
    """Two in flight hold two copies; once both ended, later saves reuse them (no growth)."""
    ckpt = checkpointers(max_in_flight=2)
    gates.hold("a")
    ckpt.save(tmp_path / "a", state_of(1, mib=8))
    ckpt.save(tmp_path / "b", state_of(2, mib=8))
    assert ckpt.pool.in_use_bytes >= 2 * 8 * MiB, "each save in flight holds its own copy"
    gates.release("a")
    ckpt.wait()
    allocated = ckpt.staging.allocated_bytes
    for n in range(3, 7):
        ckpt.save(tmp_path / f"s{n}", state_of(n, mib=8))
    ckpt.wait()
    assert ckpt.staging.allocated_bytes == allocated, "steady state must allocate nothing"


def test_skip_with_several_in_flight_skips_only_when_all_run(
    tmp_path: Path, gates: Gates, checkpointers: Callable[..., tg.AsyncCheckpointer]
) -> None:
    ckpt = checkpointers(max_in_flight=2, if_busy="skip")
    gates.hold("a")
    gates.hold("b")
    assert ckpt.save(tmp_path / "a", state_of(1)) is not None
    assert ckpt.save(tmp_path / "b", state_of(2)) is not None
    with pytest.warns(UserWarning, match="max_in_flight=2"):
        assert ckpt.save(tmp_path / "c", state_of(3)) is None
    gates.release_all()
    ckpt.wait()
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2", None])
def test_invalid_max_in_flight_is_rejected(bad: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="max_in_flight"):
        tg.AsyncCheckpointer(max_in_flight=bad)
