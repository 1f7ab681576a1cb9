"""The manager's saves in flight (``CheckpointManager(max_in_flight=2)``, the default).

A slow save into the directory never stalls the saves a faster tier takes alone: with the RAM
tier and ``persist_every``, the steps between two persisted ones are saved into memory,
committed and recorded while the directory's write still runs; the directory's saves write and
commit one after another, in step order; retention and ``restore()`` see the saves in flight
correctly. The directory's writes of chosen steps are held at a gate (``LocalWriter.write``
blocks) so no outcome depends on the disk's speed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tardigrade as tg
from tardigrade.errors import InvalidArgumentError
from tardigrade.storage.local import LocalWriter

pytestmark = pytest.mark.timeout(300)


def values(step: int) -> torch.Tensor:
    return torch.rand(600_000, generator=torch.Generator().manual_seed(step))


class DiskGate:
    """Holds the writes of one step's save into ``directory`` (not the RAM tier's) until
    opened; ``writing`` is set once one such write waits."""

    def __init__(self, directory: Path, step: int) -> None:
        self.where = f"{directory}/.tmp-step-{step:09d}-"
        self.open = threading.Event()
        self.writing = threading.Event()

    def __call__(self, path: str) -> None:
        if path.startswith(self.where):
            self.writing.set()
            if not self.open.wait(120):
                raise TimeoutError("the test's gate was never opened")


@pytest.fixture
def disk_gates(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[DiskGate]]:
    gates: list[DiskGate] = []
    original = LocalWriter.write

    def write(self: LocalWriter, data: Any) -> None:
        for gate in gates:
            gate(self.path)
        original(self, data)

    monkeypatch.setattr(LocalWriter, "write", write)
    yield gates
    for gate in gates:
        gate.open.set()


def test_ram_tier_saves_go_on_while_the_directory_write_is_held(
    tmp_path: Path, disk_gates: list[DiskGate]
) -> None:
    ckpt, shm = tmp_path / "ckpt", tmp_path / "shm"
    shm.mkdir()
    gate = DiskGate(ckpt, 10)
    disk_gates.append(gate)
    state: dict[str, Any] = {"w": values(0), "step": 0}
    with tg.CheckpointManager(
        ckpt, state, every_steps=1, ram_tier=shm, persist_every=10, keep_last=2
    ) as mgr:
        for step in range(10, 16):
            state["w"].copy_(values(step))
            state["step"] = step
            assert mgr.step(step)
            if step == 10:
                assert gate.writing.wait(60), "the directory's save of step 10 never wrote"
        # Steps 11-15 went into the RAM tier alone, while the directory's save of step 10 is
        # still held: each step found room (the one before it ended), and those that ended
        # before the last step() are committed and recorded already (step 14's may have).
        recorded = [s.step for s in mgr.stats]
        assert recorded in ([11, 12, 13], [11, 12, 13, 14]), recorded
        assert not (ckpt / "step-000000010").exists()
        assert all(s.ok for s in mgr.stats)
        stored = mgr.ram_tier_stats.stored  # type: ignore[union-attr]
        assert "step-000000013" in stored and "step-000000010" not in stored
        gate.open.set()
        mgr.wait()
        assert sorted(s.step for s in mgr.stats) == [10, 11, 12, 13, 14, 15]
        assert mgr.steps() == [10]
        # The newest is in memory alone: restore reads it from there, bit-exact.
        state["w"].zero_()
        assert mgr.restore() == 15
        assert mgr.restored_from is not None and "RAM" in mgr.restored_from.upper()
        assert torch.equal(state["w"], values(15)) and state["step"] == 15
    assert torch.equal(tg.load(ckpt / "step-000000010")["w"], values(10))


def test_saves_into_the_directory_commit_in_step_order_and_restore_waits_for_them(
    tmp_path: Path, disk_gates: list[DiskGate]
) -> None:
    gate = DiskGate(tmp_path, 2)
    disk_gates.append(gate)
    state: dict[str, Any] = {"w": values(0), "step": 0}
    with tg.CheckpointManager(tmp_path, state, every_steps=1, keep_last=1) as mgr:
        for step in range(3):
            state["w"].copy_(values(step))
            state["step"] = step
            mgr.step(step)
            if step == 2:
                assert gate.writing.wait(60)
        mgr.step(3)  # staged while step 2 is held: two in flight, returns at once
        state["w"].copy_(values(99))  # training goes on: neither save may see it
        assert not (tmp_path / "step-000000002").exists()
        assert not (tmp_path / "step-000000003").exists(), "step 3 committed before step 2"
        # restore() waits for both saves in flight, then reads the newest: step 3.
        threading.Timer(0.1, gate.open.set).start()
        assert mgr.restore() == 3
        assert torch.equal(state["w"], values(2)) and state["step"] == 2
        # keep_last=1: only the newest is left, each in flight save having committed whole.
        assert mgr.steps() == [3]
        assert [s.step for s in mgr.stats] == [0, 1, 2, 3]
    assert torch.equal(tg.load(tmp_path / "step-000000003")["w"], values(2))


@pytest.mark.parametrize("bad", [0, -2, 1.0, None, "2"])
def test_invalid_max_in_flight_is_refused_before_anything_is_created(
    tmp_path: Path, bad: Any
) -> None:
    with pytest.raises(InvalidArgumentError, match="max_in_flight"):
        tg.CheckpointManager(tmp_path / "ckpt", {"w": torch.zeros(3)}, max_in_flight=bad)
    assert not (tmp_path / "ckpt").exists()


def test_one_in_flight_makes_the_next_save_wait(tmp_path: Path, disk_gates: list[DiskGate]) -> None:
    """``max_in_flight=1``: a step that saves waits for the save in flight (the seed's way)."""
    gate = DiskGate(tmp_path, 0)
    disk_gates.append(gate)
    state = {"w": values(0)}
    with tg.CheckpointManager(tmp_path, state, every_steps=1, max_in_flight=1) as mgr:
        mgr.step(0)
        assert gate.writing.wait(60)
        second = threading.Thread(target=mgr.step, args=(1,))
        second.start()
        second.join(0.5)
        assert second.is_alive(), "the second save started beside the first"
        gate.open.set()
        second.join(60)
        assert not second.is_alive()
        mgr.wait()
        assert mgr.steps() == [0, 1]


def test_a_ram_only_save_retires_the_older_copies_in_its_own_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unlinking a memory filesystem's pages takes time (about 50 ms a 0.38 GB copy): the
    saves into the RAM tier alone remove the older copies there in their background thread,
    never in the training thread's step()."""
    from tardigrade._ramtier import RamTier

    threads: list[str] = []
    original = RamTier._stored

    def stored(self: RamTier, name: str) -> None:
        threads.append(threading.current_thread().name)
        original(self, name)

    monkeypatch.setattr(RamTier, "_stored", stored)
    shm = tmp_path / "shm"
    shm.mkdir()
    state: dict[str, Any] = {"w": values(0)}
    with tg.CheckpointManager(
        tmp_path / "ckpt", state, every_steps=1, ram_tier=shm, persist_every=10
    ) as mgr:
        for step in range(10, 15):
            state["w"].copy_(values(step))
            mgr.step(step)
        mgr.wait()
        held = sorted(p.name for p in Path(mgr.ram_tier_stats.root).glob("step-*"))  # type: ignore[union-attr]
        assert held == ["step-000000014"], held
    assert len(threads) >= 5 and "MainThread" not in threads, threads
