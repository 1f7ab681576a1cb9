"""Collective async saves on real gloo process groups: the caller returns once its tensors are
staged, the protocol runs in the background on a forked group while training runs its own
collectives, bytes are the values at ``save`` time, errors reach every rank.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tardigrade as tg

from ._harness import run_ranks

pytestmark = pytest.mark.distributed

ROWS, COLS = 64, 32


def full(name: str, shape: tuple[int, ...] = (ROWS, COLS)) -> torch.Tensor:
    base = sum(map(ord, name)) * 10_000
    return torch.arange(base, base + torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)


def state_on(rank: int, world: int, *, fill: bool) -> dict[str, Any]:
    """Sharded tables (tg.Sharded, DTensor), a replicated (DDP) tensor, plain and per-rank values."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    lo, hi = rank * ROWS // world, (rank + 1) * ROWS // world
    make = (lambda t: t.clone()) if fill else torch.zeros_like
    mesh = init_device_mesh("cpu", (world,))
    return {
        "emb": tg.Sharded(make(full("emb")[lo:hi]), (lo, 0), (ROWS, COLS)),
        "dt": distribute_tensor(make(full("dt")), mesh, [Shard(1)]),
        "ddp": make(full("ddp")),
        "step": 7 if fill else 0,
        "mine": tg.PerRank({"rank": rank if fill else -1, "t": make(torch.full((5,), rank * 1.0))}),
    }


def tensors(state: dict[str, Any]) -> list[torch.Tensor]:
    return [state["emb"].local, state["dt"].to_local(), state["ddp"], state["mine"].value["t"]]


def gate_writes() -> threading.Event:
    """Hold every rank's background writers until the returned event is set."""
    from tardigrade.distributed import _save as dsave

    gate = threading.Event()
    real = dsave.write_files

    def gated(*a: Any, **kw: Any) -> Any:
        assert gate.wait(30), "the test never opened the gate"
        return real(*a, **kw)

    dsave.write_files = gated
    return gate


def in_flight_rank(rank: int, world: int, root: str) -> Any:
    gate = gate_writes()
    state = state_on(rank, world, fill=True)
    before = [t.clone() for t in tensors(state)]
    fut = tg.save(f"{root}/a", state, async_=True, step=1)
    assert isinstance(fut, tg.SaveFuture) and fut.staged()
    # Training goes on: it mutates the state and runs its own collectives on the default
    # group while every rank's save is held between its "begin" and "write" exchanges.
    for t in tensors(state):
        t.add_(1000)
    for i in range(30):
        x = torch.tensor([float(rank + i)])
        dist.all_reduce(x)
        assert x.item() == sum(r + i for r in range(world))
    dist.barrier()
    assert not fut.done()
    gate.set()
    result = fut.result(timeout=30)
    assert result.blocking_seconds is not None and result.blocking_seconds <= result.total_seconds

    # Two saves back to back: the second waits for the first to commit before staging.
    fut_b = tg.save(f"{root}/b", state, async_=True, step=2)
    fut_c = tg.save(f"{root}/c", {"n": tg.PerRank(rank)}, async_=True)
    assert fut_b.done() and fut_b.result().step == 2
    fut_c.result(timeout=30)

    loaded = state_on(rank, world, fill=False)
    tg.load(f"{root}/a", into=loaded)
    assert loaded["step"] == 7 and loaded["mine"].value["rank"] == rank
    assert all(torch.equal(x, y) for x, y in zip(tensors(loaded), before, strict=True))
    tg.load(f"{root}/b", into=loaded)
    assert all(torch.equal(x, y + 1000) for x, y in zip(tensors(loaded), before, strict=True))
    return result.step


def test_async_collective_save_snapshots_state_while_training_runs_collectives(
    tmp_path: Path,
) -> None:
    assert run_ranks(in_flight_rank, 2, str(tmp_path)) == [1, 1]
    tree = tg.load(tmp_path / "a")
    for k in ("emb", "dt", "ddp"):
        assert torch.equal(tree[k], full(k)), k
    assert tg.verify(tmp_path / "b").files == len(tg.read_manifest(tmp_path / "b")["files"])
    assert tg.load(tmp_path / "c", per_rank_fallback="rank0")["n"] == 0


def error(e: BaseException) -> dict[str, str]:
    return {"error": type(e).__name__, "message": str(e)}


def failing_rank(rank: int, world: int, root: str) -> Any:
    from tardigrade.storage import local

    out: dict[str, Any] = {}
    state = state_on(rank, world, fill=True)
    tg.save(f"{root}/ckpt", state, async_=True).result()
    real = local.LocalStorage.open_writer
    if rank == 1:

        def failing(self: Any, name: str, **kw: Any) -> Any:
            if name.endswith(".safetensors"):
                raise OSError(28, "No space left on device")
            return real(self, name, **kw)

        local.LocalStorage.open_writer = failing  # type: ignore[method-assign]
    for t in tensors(state):
        t.add_(1)
    fut = tg.save(f"{root}/ckpt", state, async_=True, overwrite=True)
    try:
        fut.result(timeout=30)
    except tg.TardigradeError as e:
        out["result"] = error(e)
    # A failure nobody looked at is raised by the next save, on every rank alike.
    fut = tg.save(f"{root}/ckpt", state, async_=True, overwrite=True)
    fut.exception()
    try:
        tg.save(f"{root}/other", state, async_=True)
    except tg.TardigradeError as e:
        out["next"] = error(e)
    local.LocalStorage.open_writer = real  # type: ignore[method-assign]
    # A state one rank cannot flatten fails the save on every rank, from result().
    bad = {**state, "x": tg.PerRank(object() if rank == 0 else 1)}
    fut = tg.save(f"{root}/bad", bad, async_=True)
    try:
        fut.result(timeout=30)
    except tg.TardigradeError as e:
        out["bad"] = error(e)
    tg.save(f"{root}/ok", state, async_=True).result(timeout=30)
    return out


def test_a_background_error_on_one_rank_reaches_every_rank_and_commits_nothing(
    tmp_path: Path,
) -> None:
    out = run_ranks(failing_rank, 2, str(tmp_path))
    for o in out:
        for k in ("result", "next"):
            assert o[k]["error"] == "SaveError", o
            assert "rank 1" in o[k]["message"] and "No space left" in o[k]["message"], o
        assert o["bad"]["error"] == "UnsupportedTypeError", o
        assert "rank 0" in o["bad"]["message"], o
    assert torch.equal(tg.load(tmp_path / "ckpt")["ddp"], full("ddp"))  # the first save's
    assert not (tmp_path / "other").exists() and not (tmp_path / "bad").exists()
    assert torch.equal(tg.load(tmp_path / "ok")["ddp"], full("ddp") + 1)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def skip_rank(rank: int, world: int, root: str) -> Any:
    ckpt = tg.AsyncCheckpointer(if_busy="skip")
    from tardigrade.distributed._collectives import Ranks

    try:
        ckpt.save_collective(Ranks.current(), f"{root}/x", lambda ranks, pool: lambda: None)  # type: ignore[arg-type,return-value]
    except tg.InvalidArgumentError as e:
        return error(e)
    return "saved"


def test_skipping_a_busy_collective_save_is_refused_on_every_rank(tmp_path: Path) -> None:
    for o in run_ranks(skip_rank, 2, str(tmp_path)):
        assert o["error"] == "InvalidArgumentError" and "if_busy='wait'" in o["message"], o


LAYERS, LAYER_ROWS = 8, 64  # a DDP model: 8 replicated 64 x 1024 float32 layers (2 MiB)


def ddp_layer(i: int, k: int) -> torch.Tensor:
    return (
        torch.arange(LAYER_ROWS * 1024, dtype=torch.float32).reshape(LAYER_ROWS, 1024) + 100 * i + k
    )


def staging_rank(rank: int, world: int, root: str) -> Any:
    from tardigrade.distributed import _save

    staged: list[int] = []
    real = _save.stage_entries

    def counting(entries: Any, pool: Any, skip: Any = ()) -> Any:
        out = real(entries, pool, skip)
        staged.append(out.nbytes)
        return out

    _save.stage_entries = counting
    for k in range(4):
        state = {f"layer{i}": ddp_layer(i, k) for i in range(LAYERS)}
        # Rank 1's own tensor grows at save 3: its layout changes, rank 0's does not.
        state["mine"] = tg.PerRank(torch.full((2 + (k == 3) * rank,), float(rank)))
        tg.save(f"{root}/s{k}", state, async_=True, step=k).result(timeout=60)
    return staged


def test_async_saves_of_a_ddp_model_stage_only_each_ranks_share_after_the_first(
    tmp_path: Path,
) -> None:
    model = LAYERS * LAYER_ROWS * 1024 * 4
    staged = run_ranks(staging_rank, 2, str(tmp_path))
    for r in (0, 1):
        assert staged[r][0] >= model, staged  # no plan yet: every layer
        for k in (1, 2):  # the plan reused: about half the layers each
            assert model / 4 <= staged[r][k] - 16 <= 3 * model / 4, staged
    assert sum(staged[r][1] for r in (0, 1)) < 1.2 * model
    # Save 3 plans again (rank 1's layout changed): rank 0 still staged only its share and
    # rank 1 everything, and the new plan gives rank 0 only layers it staged.
    assert staged[0][3] == staged[0][2] and staged[1][3] >= model
    for k in range(4):
        back = tg.load(tmp_path / f"s{k}")
        for i in range(LAYERS):
            assert torch.equal(back[f"layer{i}"], ddp_layer(i, k)), (k, i)
