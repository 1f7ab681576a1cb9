"""CheckpointManager and JobRunner on real gloo process groups: every decision is the same on
every rank (policies, rank 0's clock, a signal that reached one rank, restore's choice, stop()),
and the directory's housekeeping (lock, retention) happens on rank 0 only.

Each test spawns its ranks once and checks several things in that run: starting ranks is the
slow part.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tardigrade as tg
from tardigrade import _probes
from tardigrade._catalog import Catalog
from tardigrade.distributed._collectives import Ranks

from ._harness import run_ranks

pytestmark = pytest.mark.distributed

ROWS, COLS = 11, 6


def rows_of(rank: int, world: int) -> tuple[int, int]:
    edges = [round(i * ROWS / world) for i in range(world + 1)]
    return edges[rank], edges[rank + 1]


def make_state(rank: int, world: int, value: float) -> dict[str, Any]:
    """A sharded table, a replicated tensor, a per-rank value and a plain one, all from ``value``."""
    lo, hi = rows_of(rank, world)
    return {
        "emb": tg.Sharded(torch.full((hi - lo, COLS), value), (lo, 0), (ROWS, COLS)),
        "w": torch.full((32, 8), value),
        "mine": tg.PerRank({"rank": rank, "value": value}),
        "step": int(value),
    }


def set_state(state: dict[str, Any], rank: int, value: float) -> None:
    state["emb"].local.fill_(value)
    state["w"].fill_(value)
    state["mine"] = tg.PerRank({"rank": rank, "value": value})
    state["step"] = int(value)


def state_value(state: dict[str, Any], rank: int) -> float | None:
    """The one value the whole state holds on this rank, or None when its parts differ."""
    v = float(state["w"][0, 0])
    same = (
        bool((state["emb"].local == v).all())
        and bool((state["w"] == v).all())
        and state["mine"].value == {"rank": rank, "value": v}
        and state["step"] == int(v)
    )
    return v if same else None


def policies_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    import logging

    out: dict[str, Any] = {}
    notes: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: notes.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("tardigrade").addHandler(handler)
    logging.getLogger("tardigrade").setLevel(logging.INFO)
    removed: list[str] = []
    real_retire = Catalog.retire

    def counting_retire(self: Catalog, name: str) -> None:
        removed.append(name)
        real_retire(self, name)

    Catalog.retire = counting_retire  # type: ignore[method-assign]

    # 1. Step policy, rank 0's clock and retention.
    state = make_state(rank, world, 0.0)
    mgr = tg.CheckpointManager(
        f"{root}/policies", state, every_steps=3, every_seconds=3600.0, keep_last=2
    )
    saved = []
    for step in range(8):
        set_state(state, rank, float(step))
        if step == 4 and rank == 0:
            mgr._cadence.last_save -= 7200.0  # only rank 0's clock says the interval has passed
        if mgr.step(step):
            saved.append(step)
    mgr.wait()  # the last save may still run in the background
    out["saved"] = saved
    out["steps"] = mgr.steps()
    out["latest"] = mgr.latest()
    out["exists"] = [mgr.exists(3), mgr.exists(4)]
    out["removed"] = sorted(removed)
    out["async"] = mgr._async is not None
    mgr.close()

    # 7. What step() costs when no save is due: one agree_max.
    ranks = Ranks.current()
    assert ranks is not None
    n = 500
    start = time.perf_counter()
    for _ in range(n):
        ranks.agree_max(0)
    out["agree_max_ms"] = (time.perf_counter() - start) / n * 1e3
    mgr = tg.CheckpointManager(f"{root}/cost", state)
    collectives: list[str] = []
    _probes.phase_hook = collectives.append  # every collective this rank enters
    start = time.perf_counter()
    try:
        for step in range(n):
            mgr.step(step)
    finally:
        _probes.phase_hook = None
    out["step_ms"] = (time.perf_counter() - start) / n * 1e3
    out["step_collectives"] = [c.rsplit(".", 1)[1] for c in collectives]

    # 2. SIGTERM on rank 1 only: both ranks save that step and stop.
    stopped_at = None
    for step in range(n, n + 100):
        set_state(state, rank, float(step))
        if rank == 1 and step == n + 42:
            os.kill(os.getpid(), signal.SIGTERM)
        out.setdefault("preempt_saved", []).extend([step] if mgr.step(step) else [])
        if mgr.should_stop:
            stopped_at = step
            break
    out["stopped_at"] = stopped_at
    out["preempt_steps"] = mgr.steps()
    mgr.close()
    out["fallback_notes"] = sum("falls back to synchronous" in n for n in notes)
    # A staging cap does not apply to collective saves: synchronous saves, said once by rank 0.
    with tg.CheckpointManager(f"{root}/capped", state, max_staging_bytes=1 << 24) as mgr:
        out["capped_async"] = mgr._async is not None
    with tg.CheckpointManager(f"{root}/capped2", state, max_staging_bytes=1 << 24):
        pass
    out["capped_notes"] = sum("falls back to synchronous" in n for n in notes)
    return out


def test_decisions_are_the_same_on_every_rank_and_retention_runs_on_rank_0(
    tmp_path: Path,
) -> None:
    out = run_ranks(policies_rank, 2, str(tmp_path), timeout=120)
    assert all("error" not in o and "died" not in o for o in out), out
    for o in out:
        # Every 3 steps, plus step 4 that rank 0's clock made due.
        assert o["saved"] == [0, 3, 4, 6], o
        assert o["steps"] == [4, 6] and o["latest"] == 6 and o["exists"] == [False, True], o
        assert o["async"] is True  # async_save=True (the default) saves in the background
        assert o["stopped_at"] == 542 and o["preempt_saved"] == [542], o
        assert o["preempt_steps"] == [542], o
    assert out[0]["removed"] and out[1]["removed"] == [], out  # retention on rank 0 only
    assert [o["fallback_notes"] for o in out] == [0, 0], out
    assert [o["capped_async"] for o in out] == [False, False], out
    assert [o["capped_notes"] for o in out] == [1, 0], out
    ckpt = tmp_path / "policies" / "step-000000006"
    assert tg.load(ckpt)["w"].eq(6.0).all()
    assert tg.verify(tmp_path / "cost" / "step-000000542").files > 0
    step_ms = max(o["step_ms"] for o in out)
    print(
        f"\nmgr.step() with no save due, 2 gloo ranks: {step_ms:.3f} ms/step "
        f"(agree_max alone: {max(o['agree_max_ms'] for o in out):.3f} ms)"
    )
    # Its cost as work, not seconds (those are `make bench`'s): one agreement a step.
    for o in out:
        assert o["step_collectives"] == [f"step({s})" for s in range(500)], o["step_collectives"]


def faults_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    from tardigrade.storage import local

    out: dict[str, Any] = {}
    # 4. A save that fails on rank 1 only fails on both, both go on, the next save succeeds.
    state = make_state(rank, world, 0.0)
    # Synchronous saves (the async flavour is in test_manager_async_distributed.py).
    mgr = tg.CheckpointManager(
        f"{root}/faults", state, every_steps=1, on_save_error="warn", async_save=False
    )
    real = local.LocalStorage.open_writer

    def failing(self: Any, name: str, **kw: Any) -> Any:
        if name.endswith(".safetensors"):
            raise OSError(28, "No space left on device")
        return real(self, name, **kw)

    saved = []
    for step in range(3):
        set_state(state, rank, float(step))
        if rank == 1:
            local.LocalStorage.open_writer = failing if step == 1 else real  # type: ignore[method-assign]
        saved.append(mgr.step(step))
    out["saved"] = saved
    out["failed"] = mgr.stats.failed
    out["error"] = mgr.stats[1].error
    out["steps"] = mgr.steps()

    # 5. A second job on the same directory: CheckpointLockedError on every rank.
    try:
        tg.CheckpointManager(f"{root}/faults", make_state(rank, world, 0.0))
        out["second"] = "opened"
    except tg.TardigradeError as e:
        out["second"] = type(e).__name__
    mgr.close()

    # 3. restore() skips the newest checkpoint when one of rank 1's files is damaged.
    with tg.CheckpointManager(f"{root}/restore", state) as mgr:
        for step in (1, 2, 3):
            set_state(state, rank, float(step))
            mgr.save(step)
    dist.barrier()
    if rank == 0:
        ckpt = Path(root) / "restore" / "step-000000003"
        data = sorted(ckpt.glob("data-r00001-*"))[0]
        raw = bytearray(data.read_bytes())
        raw[-1] ^= 0xFF  # the last byte of the file: tensor bytes, not its header
        data.write_bytes(bytes(raw))
    dist.barrier()
    state = make_state(rank, world, -1.0)
    with tg.CheckpointManager(f"{root}/restore", state, every_steps=1) as mgr:
        out["restored"] = mgr.restore()
        out["restored_value"] = state_value(state, rank)
        out["restore_steps"] = mgr.steps()
        set_state(state, rank, 3.0)
        out["resaved"] = mgr.step(3)  # replaces the damaged step 3 (an abandoned timeline)
    return out


def test_save_errors_locks_and_restore_agree_on_every_rank(tmp_path: Path) -> None:
    out = run_ranks(faults_rank, 2, str(tmp_path), timeout=120)
    assert all("died" not in o and "saved" in o for o in out), out
    for o in out:
        assert o["saved"] == [True, False, True] and o["failed"] == 1, o
        assert "rank 1" in o["error"] and "No space left" in o["error"], o
        assert o["steps"] == [0, 2], o
        assert o["second"] == "CheckpointLockedError", o
        assert o["restored"] == 2 and o["restored_value"] == 2.0, o
        assert o["restore_steps"] == [1, 2, 3], o
        assert o["resaved"] is True, o
    tg.verify(tmp_path / "restore" / "step-000000003")
    assert tg.load(tmp_path / "restore" / "step-000000003")["w"].eq(3.0).all()


def job_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}

    def run(name: str, last_epoch: int) -> None:
        state = {"w": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(0)]), "epoch": 0}
        calls: list[str] = []
        gathered: dict[str, torch.Tensor] = {}

        def init() -> None:
            calls.append("init")
            state["w"].to_local().fill_(100.0)

        def epoch(e: int) -> None:
            calls.append(f"epoch {e}")
            state["w"].to_local().add_(float(e))
            state["epoch"] = e

        def download() -> None:
            calls.append("download")
            gathered["w"] = state["w"].full_tensor()  # a collective: every rank calls it

        def exit_() -> None:
            calls.append("exit")
            if rank == 0:
                save_file({"w": gathered["w"].contiguous()}, f"{root}/{name}.safetensors")

        job = tg.Job(
            init=init,
            epoch=epoch,
            stop=lambda: state["epoch"] >= last_epoch,
            download=download,
            exit=exit_,
        )
        with tg.CheckpointManager(f"{root}/job", state, keep_last=2) as mgr:
            out[name] = {"last": tg.JobRunner(job, mgr).run(), "calls": calls}
            out[name]["steps"] = mgr.steps()

    run("first", 2)
    # The restarted job resumes after epoch 2; rank 1's stop() is true one epoch before rank
    # 0's: both stop together.
    run("second", 4 if rank == 0 else 3)
    return out


def test_jobrunner_runs_every_phase_on_every_rank_and_resumes(tmp_path: Path) -> None:
    out = run_ranks(job_rank, 2, str(tmp_path), timeout=120)
    assert all("first" in o for o in out), out
    for o in out:
        assert o["first"] == {
            "last": 2,
            "calls": ["init", "epoch 1", "epoch 2", "download", "exit"],
            "steps": [1, 2],
        }, o
        assert o["second"] == {
            "last": 3,
            "calls": ["epoch 3", "download", "exit"],
            "steps": [2, 3],
        }, o
    from safetensors.torch import load_file

    for name, value in (("first", 103.0), ("second", 106.0)):
        exported = load_file(str(tmp_path / f"{name}.safetensors"))["w"]
        assert torch.equal(exported, torch.full((ROWS, COLS), value)), name
