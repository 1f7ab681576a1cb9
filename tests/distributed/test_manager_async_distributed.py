"""CheckpointManager(async_save=True) on real gloo process groups: ``step()`` returns once the
state is staged and the collective save commits in the background, while training runs its own
collectives; outcomes, failures, retention, preemption and restore agree on every rank.

Each test holds a background save at its write phase (``hold_writes``) to prove that ``step()``
returned before the commit: a synchronous save would wait there instead, and the test fails.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tardigrade as tg
from tardigrade._catalog import Catalog
from tardigrade.distributed._collectives import Ranks

from ._harness import run_ranks

pytestmark = pytest.mark.distributed

ROWS, COLS = 11, 6


def rows_of(rank: int, world: int) -> tuple[int, int]:
    edges = [round(i * ROWS / world) for i in range(world + 1)]
    return edges[rank], edges[rank + 1]


def values(step: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Random-looking values that only ``step`` determines, so a load can be checked bit-exactly."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 + step))


def make_state(rank: int, world: int) -> dict[str, Any]:
    """A sharded table, a replicated tensor, a per-rank tensor and a plain value."""
    lo, hi = rows_of(rank, world)
    return {
        "emb": tg.Sharded(torch.zeros(hi - lo, COLS), (lo, 0), (ROWS, COLS)),
        "w": torch.zeros(32, 8),
        "mine": tg.PerRank({"rank": rank, "t": torch.zeros(5)}),
        "step": -1,
    }


def set_state(state: dict[str, Any], rank: int, world: int, step: int) -> None:
    """The state as training leaves it after ``step`` (mutated in place, as training does)."""
    lo, hi = rows_of(rank, world)
    state["emb"].local.copy_(values(step, (ROWS, COLS))[lo:hi])
    state["w"].copy_(values(step, (32, 8)))
    state["mine"].value["t"].copy_(values(step * 10 + rank, (5,)))
    state["step"] = step


def holds(state: dict[str, Any], rank: int, world: int, step: int) -> bool:
    """Whether ``state`` holds, bit for bit, what ``set_state(..., step)`` put there."""
    want = make_state(rank, world)
    set_state(want, rank, world, step)
    return (
        torch.equal(state["emb"].local, want["emb"].local)
        and torch.equal(state["w"], want["w"])
        and state["mine"].value["rank"] == rank
        and torch.equal(state["mine"].value["t"], want["mine"].value["t"])
        and state["step"] == step
    )


def committed(root: str, step: int) -> bool:
    return os.path.exists(os.path.join(root, f"step-{step:09d}", "manifest.json"))


def hold_writes(steps: set[int]) -> threading.Semaphore:
    """Hold this rank's background write of each save of ``steps`` until the returned
    semaphore is released once for it (a synchronous save would wait here, in ``step()``)."""
    from tardigrade.distributed import _save as dsave

    permits = threading.Semaphore(0)
    real = dsave.write_files

    def held(job: Any, *a: Any, **kw: Any) -> Any:
        if int(job.name.rsplit("-", 1)[1]) in steps:
            assert permits.acquire(timeout=15), f"{job.name}: the test never let the write go"
        return real(job, *a, **kw)

    dsave.write_files = held
    return permits


def count_forks() -> list[int]:
    calls = [0]
    real = Ranks.fork

    def fork(self: Ranks) -> Ranks:
        calls[0] += 1
        return real(self)

    Ranks.fork = fork  # type: ignore[method-assign]
    return calls


def background_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {"saved": [], "before_commit": [], "all_reduce_ok": []}
    removed: list[str] = []
    real_retire = Catalog.retire

    def counting_retire(self: Catalog, name: str) -> None:
        removed.append(name)
        real_retire(self, name)

    Catalog.retire = counting_retire  # type: ignore[method-assign]
    forks = count_forks()
    permits = hold_writes({0, 3, 6, 9})
    state = make_state(rank, world)
    mgr = tg.CheckpointManager(root, state, every_steps=3, keep_last=2, on_save_error="raise")
    assert mgr._async is not None and mgr._async.wait_reserved(30)
    reserved = mgr._async.staging
    for step in range(11):
        set_state(state, rank, world, step)
        started = time.perf_counter()
        if mgr.step(step):
            out["saved"].append(step)
            out.setdefault("step_seconds", []).append(time.perf_counter() - started)
            # step() is back, and this save's write is held: nothing of it is committed yet.
            out["before_commit"].append(not committed(root, step))
            # Training goes on while the save waits in the background: it mutates the state
            # and runs its own collectives on the job's group.
            set_state(state, rank, world, 100 + step)
            ok = True
            for i in range(20):
                x = torch.tensor([float(rank * 7 + i)])
                dist.all_reduce(x)
                ok &= x.item() == sum(r * 7 + i for r in range(world))
            out["all_reduce_ok"].append(ok)
            permits.release()
    # The save of step 9 may still be in flight: close() waits for it and records it.
    mgr.close()
    out["stats"] = [[s.step, s.ok] for s in mgr.stats]
    out["blocked_less"] = all(s.blocking_seconds <= s.total_seconds for s in mgr.stats)
    out["forks"] = forks[0]
    # The manager reserved exactly the slabs the saves staged into: none allocated while saving.
    after = mgr._async.staging
    out["reserved"] = [reserved.allocated_bytes, reserved.allocations] == [
        after.allocated_bytes,
        after.allocations,
    ] and after.peak_in_use_bytes == after.allocated_bytes > 0
    out["removed"] = sorted(removed)
    dist.barrier()
    exact = {}
    for step in out["saved"]:
        if committed(root, step):
            loaded = make_state(rank, world)
            tg.load(os.path.join(root, f"step-{step:09d}"), into=loaded)
            exact[step] = holds(loaded, rank, world, step)
    out["exact"] = exact
    return out


def test_step_returns_before_the_commit_and_training_collectives_run_beside_the_save(
    tmp_path: Path,
) -> None:
    started = time.perf_counter()
    out = run_ranks(background_rank, 2, str(tmp_path), timeout=120)
    elapsed = time.perf_counter() - started
    assert all("error" not in o and "died" not in o for o in out), out
    for o in out:
        assert o["saved"] == [0, 3, 6, 9], o
        assert o["before_commit"] == [True] * 4, o  # every save ran in the background
        assert o["all_reduce_ok"] == [True] * 4, o
        assert o["stats"] == [[0, True], [3, True], [6, True], [9, True]], o
        assert o["blocked_less"], o
        assert o["forks"] == 1, o  # one forked group per manager, not one per save
        assert o["reserved"] is True, o
        assert o["exact"] == {"6": True, "9": True}, o  # the values at step(), not later ones
    # Retention: keep_last=2, run by rank 0 only, after each commit.
    assert out[0]["removed"] and out[1]["removed"] == [], out
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-")) == [
        "step-000000006",
        "step-000000009",
    ]
    tree = tg.load(tmp_path / "step-000000009")
    assert torch.equal(tree["emb"], values(9, (ROWS, COLS)))
    print(
        f"\nasync manager, 2 gloo ranks: step() that saved took "
        f"{max(max(o['step_seconds']) for o in out) * 1e3:.1f} ms at most; run {elapsed:.1f} s"
    )


def error_of(e: BaseException) -> dict[str, str]:
    return {"error": type(e).__name__, "message": str(e)}


def failing_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    import logging

    from tardigrade.distributed import _save as dsave
    from tardigrade.storage import local

    out: dict[str, Any] = {}
    # Rank 1 learns the outcome of the failing saves 1 s after rank 0, and training spends
    # 0.5 s after each of them: a rank that went by its own saves' state would report the
    # failure one step() call before the other.
    real_run = dsave._Save.run

    def late_run(self: Any) -> Any:
        try:
            return real_run(self)
        finally:
            if rank == 1 and str(self.path).endswith(("step-000000002", "step-000000012")):
                time.sleep(1.0)

    dsave._Save.run = late_run  # type: ignore[method-assign]
    logged: list[str] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("tardigrade").addHandler(handler)
    permits = hold_writes({2, 12})
    real = local.LocalStorage.open_writer

    def failing(self: Any, name: str, **kw: Any) -> Any:
        # Rank 1's data files of steps 2 and 12 only, whenever its background writes them.
        if (
            rank == 1
            and name.endswith(".safetensors")
            and ("step-000000002-" in name or "step-000000012-" in name)
        ):
            raise OSError(28, "No space left on device")
        return real(self, name, **kw)

    local.LocalStorage.open_writer = failing  # type: ignore[method-assign]

    # "warn": the save of step 2 starts (step() is True), fails in the background on rank 1;
    # every rank records the failure at the same step() call, and training goes on.
    state = make_state(rank, world)
    # A short timeout: ranks that disagreed on when to report would fail fast, not hang.
    kw: dict[str, Any] = {"timeout": 30.0}
    mgr = tg.CheckpointManager(f"{root}/warn", state, every_steps=2, on_save_error="warn", **kw)
    out["warn_saved"] = []
    for step in range(7):
        set_state(state, rank, world, step)
        out["warn_saved"].append(mgr.step(step))
        if step == 2:
            out["warn_before_commit"] = mgr.stats.failed == 0 and not committed(f"{root}/warn", 2)
            permits.release()
            time.sleep(0.5)
        if mgr.stats.failed and "warn_seen_at" not in out:
            out["warn_seen_at"] = step
    mgr.wait()
    out["warn_steps"] = mgr.steps()
    mgr.close()
    out["warn_stats"] = [[s.step, s.ok] for s in mgr.stats]
    out["warn_error"] = mgr.stats[1].error
    out["warn_logged"] = [m for m in logged if "SAVE FAILED" in m]

    # "raise": the failure of step 12's save is raised on every rank by the same call.
    mgr = tg.CheckpointManager(f"{root}/raise", state, every_steps=4, on_save_error="raise", **kw)
    for step in range(10, 20):
        set_state(state, rank, world, step)
        try:
            if mgr.step(step) and step == 12:
                out["raise_before_commit"] = not committed(f"{root}/raise", 12)
                permits.release()
                time.sleep(0.5)
        except tg.TardigradeError as e:
            out["raised"] = {"at": step, **error_of(e)}
            break
    # Training may go on after catching it: the next save succeeds.
    set_state(state, rank, world, 20)
    out["after"] = mgr.save(20)
    try:
        mgr.wait()
        out["wait"] = "ok"
    except tg.TardigradeError as e:
        out["wait"] = error_of(e)
    mgr.close()
    out["raise_stats"] = [[s.step, s.ok] for s in mgr.stats]
    local.LocalStorage.open_writer = real  # type: ignore[method-assign]

    # A state that differs between the ranks is a programming error: found in the background,
    # it is raised on every rank even under "warn", as a synchronous save raises it.
    with tg.CheckpointManager(f"{root}/diverge", state, on_save_error="warn", **kw) as mgr:
        set_state(state, rank, world, 30)
        state["step"] = 30 + rank  # outside tg.PerRank
        out["diverge_started"] = mgr.save(30)
        try:
            mgr.wait()
            out["diverge"] = "not raised"
        except tg.TardigradeError as e:
            out["diverge"] = error_of(e)
        out["diverge_stats"] = [[s.step, s.ok] for s in mgr.stats]
    return out


def test_a_background_failure_on_one_rank_is_reported_on_every_rank_at_the_same_call(
    tmp_path: Path,
) -> None:
    out = run_ranks(failing_rank, 2, str(tmp_path), timeout=120)
    assert all("error" not in o and "died" not in o for o in out), out
    for o in out:
        # As in one process: step() says it saved (the save started); the failure comes later.
        assert o["warn_saved"] == [True, False, True, False, True, False, True], o
        assert o["warn_before_commit"] is True, o
        assert o["warn_stats"] == [[0, True], [2, False], [4, True], [6, True]], o
        assert "rank 1" in o["warn_error"] and "No space left" in o["warn_error"], o
        assert len(o["warn_logged"]) == 1 and "SAVE FAILED for step 2" in o["warn_logged"][0], o
        assert o["warn_steps"] == [0, 4, 6], o
        assert o["raise_before_commit"] is True, o
        assert o["raised"]["error"] == "SaveError", o
        assert "rank 1" in o["raised"]["message"] and "No space left" in o["raised"]["message"]
        assert o["after"] is True and o["wait"] == "ok", o
        assert o["raise_stats"] == [[12, False], [20, True]], o
    # The same decision on both ranks: where each rank first saw the failure.
    assert out[0]["warn_seen_at"] == out[1]["warn_seen_at"], out
    assert out[0]["raised"]["at"] == out[1]["raised"]["at"], out
    assert not [p for p in (tmp_path / "warn").iterdir() if p.name.startswith(".tmp-")]
    assert not (tmp_path / "raise" / "step-000000012").exists()
    for o in out:
        assert o["diverge_started"] is True and o["diverge_stats"] == [[30, False]], o
        assert o["diverge"]["error"] == "InvalidArgumentError", o
        assert "differs between rank 0 and rank(s) [1]" in o["diverge"]["message"], o
    assert not (tmp_path / "diverge" / "step-000000030").exists()


def preempt_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {"saved": []}
    permits = hold_writes({5})
    state = make_state(rank, world)
    mgr = tg.CheckpointManager(root, state, every_steps=5)
    for step in range(1, 20):
        set_state(state, rank, world, step)
        if step == 7:
            # The save of step 5 is still held in the background; SIGTERM reaches rank 1 only.
            out["in_flight"] = not committed(root, 5)
            if rank == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            # step() waits for the save in flight before the final, synchronous save: let it go.
            threading.Timer(0.3, permits.release).start()
        if mgr.step(step):
            out["saved"].append(step)
            out.setdefault("committed_on_return", []).append(committed(root, step))
        if mgr.should_stop:
            out["stopped_at"] = step
            break
    out["stats"] = [[s.step, s.ok] for s in mgr.stats]
    out["steps"] = mgr.steps()
    mgr.close()
    dist.barrier()
    out["exact"] = {}
    for step in (5, 7):
        loaded = make_state(rank, world)
        tg.load(os.path.join(root, f"step-{step:09d}"), into=loaded)
        out["exact"][step] = holds(loaded, rank, world, step)
    return out


def test_sigterm_on_one_rank_during_a_background_save_saves_the_same_step_and_stops(
    tmp_path: Path,
) -> None:
    out = run_ranks(preempt_rank, 2, str(tmp_path), timeout=120)
    assert all("error" not in o and "died" not in o for o in out), out
    for o in out:
        assert o["in_flight"] is True, o
        assert o["saved"] == [5, 7] and o["stopped_at"] == 7, o
        # Step 5 went to the background; the preemption save of step 7 is synchronous.
        assert o["committed_on_return"] == [False, True], o
        assert o["stats"] == [[5, True], [7, True]] and o["steps"] == [5, 7], o
        assert o["exact"] == {"5": True, "7": True}, o


def killed_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    """Run 1: save steps 0 and 2; die (SIGKILL, every rank) while step 4's save writes."""
    from tardigrade.distributed import _save as dsave

    written = threading.Event()
    real = dsave.write_files

    def write_then_hang(job: Any, *a: Any, **kw: Any) -> Any:
        result = real(job, *a, **kw)
        if job.name == "step-000000004":
            written.set()  # this rank's files are in the staging directory, uncommitted
            time.sleep(20)  # killed before this returns
            raise AssertionError("not killed")
        return result

    dsave.write_files = write_then_hang
    state = make_state(rank, world)
    mgr = tg.CheckpointManager(root, state, every_steps=2)
    for step in range(6):
        set_state(state, rank, world, step)
        if mgr.step(step) and step == 4:
            note = {"returned_before_commit": not committed(root, 4)}
            Path(root, f"rank{rank}.json").write_text(json.dumps(note))
    assert written.wait(15), "the save of step 4 never wrote"
    dist.barrier()  # both ranks' files are written: kill the job mid-save
    os.kill(os.getpid(), signal.SIGKILL)
    return {"not": "killed"}


def resumed_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    """Run 2: restore the newest complete checkpoint; restore again with a save in flight."""
    out: dict[str, Any] = {}
    permits = hold_writes({4})
    state = make_state(rank, world)
    mgr = tg.CheckpointManager(root, state, every_steps=2)
    out["restored"] = mgr.restore()
    out["exact"] = holds(state, rank, world, 2)
    out["steps"] = mgr.steps()
    out["leftovers"] = sorted(n for n in os.listdir(root) if n.startswith(".tmp-"))
    for step in (3, 4):
        set_state(state, rank, world, step)
        mgr.step(step)
    out["in_flight"] = not committed(root, 4)
    threading.Timer(0.3, permits.release).start()
    # restore() waits for the save in flight (its staging is no leftover to clean up) and
    # picks it: the newest complete checkpoint.
    set_state(state, rank, world, 99)
    out["restored_again"] = mgr.restore()
    out["exact_again"] = holds(state, rank, world, 4)
    out["stats"] = [[s.step, s.ok] for s in mgr.stats]
    mgr.close()
    return out


def test_restore_after_the_job_died_mid_background_save_picks_the_previous_checkpoint(
    tmp_path: Path,
) -> None:
    root = str(tmp_path)
    assert run_ranks(killed_rank, 2, root, timeout=60) == [{"died": -9}, {"died": -9}]
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == {
            "returned_before_commit": True
        }
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-step-000000004")]
    out = run_ranks(resumed_rank, 2, root, timeout=60)
    assert all("error" not in o and "died" not in o for o in out), out
    for o in out:
        assert o["restored"] == 2 and o["exact"] is True, o
        assert o["steps"] == [0, 2] and o["leftovers"] == [], o
        assert o["in_flight"] is True, o
        assert o["restored_again"] == 4 and o["exact_again"] is True, o
        assert o["stats"] == [[4, True]], o


def lost_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    from tardigrade.distributed import _save as dsave

    out: dict[str, Any] = {}
    real = dsave.write_files

    def stalled(job: Any, *a: Any, **kw: Any) -> Any:
        if rank == 1 and job.name == "step-000000001":
            time.sleep(7.0)  # longer than the timeout: rank 0 gives up waiting for rank 1
        return real(job, *a, **kw)

    dsave.write_files = stalled
    forks = count_forks()
    state = make_state(rank, world)
    set_state(state, rank, world, 1)
    mgr = tg.CheckpointManager(root, state, timeout=5.0)
    out["started"] = mgr.save(1)
    # Training goes on; every rank records the failure at the same step() call, once no
    # rank's save still runs (rank 1's gives up a timeout after rank 0's).
    for step in range(2, 60):
        mgr.step(step)
        if mgr.stats:
            out["seen_at"] = step
            break
        time.sleep(0.5)
    out["failure"] = mgr.stats[0].error if mgr.stats else None
    # The forked group that lost its ranks is dropped: the next save forks a new one.
    set_state(state, rank, world, 100)
    out["next"] = mgr.save(100)
    mgr.wait()
    out["stats"] = [[s.step, s.ok] for s in mgr.stats]
    out["forks"] = forks[0]
    mgr.close()
    return out


def test_a_background_save_that_loses_the_ranks_fails_everywhere_and_the_next_forks_anew(
    tmp_path: Path,
) -> None:
    out = run_ranks(lost_rank, 2, str(tmp_path), timeout=90)
    assert all("error" not in o and "died" not in o for o in out), out
    for o in out:
        assert o["started"] is True and o["next"] is True, o
        assert o["stats"] == [[1, False], [100, True]], o
        # Rank 0 timed out waiting for rank 1; rank 1 then found rank 0 gone from that group.
        assert "gave up" in o["failure"] or "lost the other ranks" in o["failure"], o
        assert o["forks"] == 2, o  # the next save could not run on the broken fork
    assert out[0]["seen_at"] == out[1]["seen_at"], out
    assert not (tmp_path / "step-000000001").exists()
    tree = tg.load(tmp_path / "step-000000100")
    assert torch.equal(tree["w"], values(100, (32, 8)))
