"""Real training layouts on gloo: DTensors on a 2-D mesh resharded onto other meshes and world
sizes, FSDP2 (``fully_shard``) + Adam resumed bit for bit, DDP with dropout resumed after a
SIGKILL on 2 ranks and on 1 process, and embedding-table rows read on their own.

Spawning ranks dominates the wall time, so each spawned run checks as much as it can.
"""

from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import tardigrade as tg
from tardigrade import _read

from ._harness import manifest_of, run_ranks

pytestmark = pytest.mark.distributed

ROWS, COLS = 11, 7  # uneven over 2, 3 and 4 ranks, in both dimensions
EMB_ROWS, DIM = 1000, 8
EMB_EDGES = [0, 100, 450, 700, 1000]  # rows per saving rank: 100, 350, 250, 300


def full(name: str, shape: tuple[int, ...] = (ROWS, COLS)) -> torch.Tensor:
    """A tensor whose values are a function of the global index, so any piece can be checked."""
    base = sum(map(ord, name)) * 10_000
    return torch.arange(base, base + torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)


def split(n: int, parts: int, k: int) -> tuple[int, int]:
    edges = [round(i * n / parts) for i in range(parts + 1)]
    return edges[k], edges[k + 1]


# ----------------------------------------------------------------------------------------------
# DTensors on a 2x2 mesh, resharded


def mesh_state(rank: int, world: int, *, fill: bool) -> dict[str, Any]:
    """The 2-D layout on 4 ranks, a 1-D ``Shard(1)`` one on 2 and ``Shard(0)`` on 3."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if world == 4:
        mesh = init_device_mesh("cpu", (2, 2))
        layouts = {"ss": [Shard(0), Shard(1)], "sr": [Shard(0), Replicate()]}
        lo, hi = EMB_EDGES[rank], EMB_EDGES[rank + 1]
    else:
        mesh = init_device_mesh("cpu", (world,))
        one = [Shard(1)] if world == 2 else [Shard(0)]
        layouts = {"ss": one, "sr": one}
        lo, hi = split(EMB_ROWS, world, rank)
    emb = full("emb", (EMB_ROWS, DIM))[lo:hi].clone()
    state: dict[str, Any] = {
        k: distribute_tensor(full(k) if fill else torch.zeros(ROWS, COLS), mesh, p)
        for k, p in layouts.items()
    }
    state["emb"] = tg.Sharded(emb if fill else torch.zeros_like(emb), (lo, 0), (EMB_ROWS, DIM))
    state["step"] = 5 if fill else 0
    return state


def check_mesh_state(state: dict[str, Any], rank: int, world: int) -> None:
    from torch.distributed.tensor import distribute_tensor

    for k in ("ss", "sr"):
        dt = state[k]
        want = distribute_tensor(full(k), dt.device_mesh, dt.placements).to_local()
        assert torch.equal(dt.to_local(), want), (k, rank)  # this rank's own box, exactly
        assert torch.equal(dt.full_tensor(), full(k)), k
    emb = state["emb"]
    assert torch.equal(emb.local, full("emb", (EMB_ROWS, DIM))[emb.offsets[0] :][: len(emb.local)])
    assert state["step"] == 5


def mesh_save_rank(rank: int, world: int, ckpt: str) -> Any:
    tg.save(ckpt, mesh_state(rank, world, fill=True))
    state = mesh_state(rank, world, fill=False)
    tg.load(ckpt, into=state)  # 4 -> 4, the same 2x2 layout
    check_mesh_state(state, rank, world)
    return "ok"


def mesh_load_rank(rank: int, world: int, ckpt: str) -> Any:
    state = mesh_state(rank, world, fill=False)
    tg.load(ckpt, into=state)
    check_mesh_state(state, rank, world)
    return "ok"


@pytest.fixture(scope="module")
def mesh_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Saved by 4 ranks on a 2x2 mesh (and reloaded there)."""
    ckpt = tmp_path_factory.mktemp("mesh") / "ckpt"
    assert run_ranks(mesh_save_rank, 4, str(ckpt), timeout=120) == ["ok"] * 4
    return ckpt


def test_2d_mesh_dtensors_reshard_onto_other_meshes_and_world_sizes(mesh_ckpt: Path) -> None:
    m = manifest_of(mesh_ckpt)
    assert m.world_size == 4
    # Pieces held by two ranks (the Replicate mesh dimension) are written once: the chunks add
    # up to exactly one copy of each global tensor.
    chunk_bytes = sum(c.numel * 4 for t in m.tensors for c in t.chunks)
    assert chunk_bytes == (2 * ROWS * COLS + EMB_ROWS * DIM) * 4
    assert run_ranks(mesh_load_rank, 2, str(mesh_ckpt), timeout=120) == ["ok"] * 2
    assert run_ranks(mesh_load_rank, 3, str(mesh_ckpt), timeout=120) == ["ok"] * 3
    tree = tg.load(mesh_ckpt)  # one process, no torch.distributed: whole tensors
    for k in ("ss", "sr"):
        assert torch.equal(tree[k], full(k)), k
    assert torch.equal(tree["emb"], full("emb", (EMB_ROWS, DIM)))


# ----------------------------------------------------------------------------------------------
# Embedding rows on their own: a live tg.Sharded of just those rows


def count_reads() -> tuple[dict[str, int], Any]:
    """A byte counter and a ``read_range`` that counts into it."""
    counted = {"bytes": 0}
    real = _read.st.read_range

    def counting(src: Any, begin: int, out: Any, hasher: Any) -> Any:
        counted["bytes"] += len(out)
        return real(src, begin, out, hasher)

    return counted, counting


@pytest.mark.parametrize(("a", "b"), [(120, 180), (430, 470), (0, 1000)])
def test_rows_of_an_embedding_table_read_only_the_chunks_they_meet(
    mesh_ckpt: Path, monkeypatch: pytest.MonkeyPatch, a: int, b: int
) -> None:
    counted, counting = count_reads()
    monkeypatch.setattr(_read.st, "read_range", counting)
    rows = tg.Sharded(torch.empty(b - a, DIM), (a, 0), (EMB_ROWS, DIM))
    tg.load(mesh_ckpt, into={"emb": rows}, keys=["emb"])
    assert torch.equal(rows.local, full("emb", (EMB_ROWS, DIM))[a:b])
    emb = next(t for t in manifest_of(mesh_ckpt).tensors if t.shape == (EMB_ROWS, DIM))
    met = [c for c in emb.chunks if c.offsets[0] < b and a < c.offsets[0] + c.shape[0]]
    # Whole chunks are read (a checksum covers a chunk), only those that meet the rows.
    assert counted["bytes"] == sum(c.shape[0] * DIM * 4 for c in met)
    assert len(met) == (1 if (a, b) == (120, 180) else 2 if a == 430 else 4)


# ----------------------------------------------------------------------------------------------
# FSDP2 + Adam


def fsdp_build(seed: int, world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    mesh = init_device_mesh("cpu", (world,))
    model = nn.Sequential(nn.Linear(8, 13), nn.ReLU(), nn.Linear(13, 5))  # 13: uneven shards
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def fsdp_train(model: nn.Module, optim: Any, rank: int, world: int, steps: range) -> list[float]:
    losses = []
    for s in steps:
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1000 * s + rank))
        loss = model(x).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def locals_of(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a state dict, DTensors as this rank's local piece."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in locals_of(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in locals_of(v)]
    if isinstance(obj, DTensor):
        return [obj.to_local()]
    return [obj] if isinstance(obj, torch.Tensor) else []


def fsdp_rank(rank: int, world: int, ckpt: str) -> Any:
    from torch.distributed.tensor import DTensor

    model, optim = fsdp_build(0, world)
    reference = fsdp_train(model, optim, rank, world, range(6))

    first, first_optim = fsdp_build(0, world)
    losses = fsdp_train(first, first_optim, rank, world, range(3))
    sd, osd = first.state_dict(), first_optim.state_dict()
    assert all(isinstance(v, DTensor) for v in sd.values())
    assert all(isinstance(s["exp_avg"], DTensor) for s in osd["state"].values())
    tg.save(ckpt, {"model": first, "optim": first_optim, "step": 3})

    # A restart: another seed, and an optimizer that has not created its moments yet.
    resumed, resumed_optim = fsdp_build(1, world)
    state = {"model": resumed, "optim": resumed_optim, "step": 0}
    counted, _read.st.read_range = count_reads()
    tg.load(ckpt, into=state)
    assert state["step"] == 3
    losses += fsdp_train(resumed, resumed_optim, rank, world, range(3, 6))
    assert losses == reference
    for a, b in [(model.state_dict(), resumed.state_dict()), (optim.state_dict(), resumed_optim.state_dict())]:  # fmt: skip
        pairs = list(zip(locals_of(a), locals_of(b), strict=True))
        assert pairs and all(torch.equal(x, y) for x, y in pairs)
    return {"losses": losses, "read": counted["bytes"]}


def test_fsdp2_adam_resumes_bit_identically(tmp_path: Path) -> None:
    out = run_ranks(fsdp_rank, 2, str(tmp_path / "ckpt"), timeout=120)
    assert all("losses" in o for o in out), out
    m = tg.read_manifest(tmp_path / "ckpt")
    assert {t.get("layout", "replicated") for t in m["tensors"]} == {"sharded", "replicated"}
    # Parameters and moments are sharded: each rank reads its half (the moments the fresh
    # optimizer had not created are read as its pieces too, not as whole tensors).
    data = sum(f["size"] for f in m["files"])
    assert all(o["read"] < 0.6 * data for o in out), (out, data)


# ----------------------------------------------------------------------------------------------
# DDP with dropout: SIGKILLed after a save, resumed on 2 ranks and on 1 process

DDP_LEN, DDP_BATCH, DDP_K = 40, 4, 3  # 2 ranks x 4 = 8 samples a step: epoch 1 starts at step 5


def ddp_dataset() -> Any:
    g = torch.Generator().manual_seed(7)
    return torch.utils.data.TensorDataset(
        torch.randn(DDP_LEN, 8, generator=g), torch.arange(DDP_LEN)
    )


def ddp_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, 1))


def ddp_state(rank: int, world: int, model: nn.Module, seed: int) -> dict[str, Any]:
    torch.manual_seed(seed + rank)  # each rank's own dropout stream
    sampler = tg.ResumableSampler(DDP_LEN, seed=3, rank=rank, world_size=world)
    return {
        "model": model,
        "optim": torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        "data": sampler,
        "rng": tg.PerRank(tg.RNGState()),
        "step": 0,
    }


def ddp_train(net: nn.Module, state: dict[str, Any], batch: int, steps: int) -> dict[str, Any]:
    """``steps`` steps from the state's position; the losses and sample indices of each."""
    sampler = state["data"]
    loader = torch.utils.data.DataLoader(
        ddp_dataset(), batch_size=batch, sampler=sampler, generator=sampler.generator
    )
    out: dict[str, Any] = {"losses": [], "indices": []}
    it = iter(loader)
    for _ in range(steps):
        try:
            x, idx = next(it)
        except StopIteration:  # the epoch ended; the sampler has moved to the next one
            it = iter(loader)
            x, idx = next(it)
        loss = net(x).square().mean()
        loss.backward()
        state["optim"].step()
        state["optim"].zero_grad()
        state["step"] += 1
        out["losses"].append(loss.item())
        out["indices"].append(idx.tolist())
    return out


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """Parameters, momentum buffers and the data position, exactly (float32 survives JSON)."""
    moments = state["optim"].state_dict()["state"]
    return {
        "params": [p.flatten().tolist() for p in state["model"].parameters()],
        "momentum": [moments[i]["momentum_buffer"].flatten().tolist() for i in sorted(moments)],
        "data": state["data"].state_dict(),
    }


def ddp_first_rank(rank: int, world: int, root: str) -> Any:
    from torch.nn.parallel import DistributedDataParallel

    ref = ddp_state(rank, world, ddp_model(0), seed=100)
    reference = ddp_train(DistributedDataParallel(ref["model"]), ref, DDP_BATCH, 2 * DDP_K)
    reference.update(snapshot(ref))

    state = ddp_state(rank, world, ddp_model(0), seed=100)
    ddp = DistributedDataParallel(state["model"])
    # DDP's own keys carry its "module." prefix; the wrapped module's are the model's.
    assert all(k.startswith("module.") for k in ddp.state_dict())
    assert list(ddp.module.state_dict()) == ["0.weight", "0.bias", "3.weight", "3.bias"]
    run = ddp_train(ddp, state, DDP_BATCH, DDP_K)
    reference["at_save"] = {**run, **snapshot(state)}
    tg.save(f"{root}/ckpt", state)  # state["model"] is ddp.module
    reference["at_save"]["next_draw"] = torch.rand(4).tolist()  # what the saved RNG gives next
    Path(root, f"reference-{rank}.json").write_text(json.dumps(reference))
    os.kill(os.getpid(), signal.SIGKILL)  # the job dies right after the save


def ddp_resume_rank(rank: int, world: int, root: str) -> Any:
    from torch.nn.parallel import DistributedDataParallel

    state = ddp_state(rank, world, ddp_model(1), seed=999)  # another init, another RNG
    tg.load(f"{root}/ckpt", into=state)
    assert state["step"] == DDP_K
    out = ddp_train(DistributedDataParallel(state["model"]), state, DDP_BATCH, DDP_K)
    return {**out, **snapshot(state)}


def test_ddp_with_dropout_resumes_after_sigkill_on_2_ranks_and_on_1(tmp_path: Path) -> None:
    assert (
        run_ranks(ddp_first_rank, 2, str(tmp_path), timeout=120) == [{"died": -signal.SIGKILL}] * 2
    )
    refs = [json.loads((tmp_path / f"reference-{r}.json").read_text()) for r in range(2)]
    resumed = run_ranks(ddp_resume_rank, 2, str(tmp_path), timeout=120)
    for ref, res in zip(refs, resumed, strict=True):
        assert ref["losses"][:DDP_K] == ref["at_save"]["losses"]  # the same run up to the save
        assert res["losses"] == ref["losses"][DDP_K:]
        assert res["indices"] == ref["indices"][DDP_K:]
        for k in ("params", "momentum", "data"):
            assert res[k] == ref[k], k
    assert refs[0]["losses"] != refs[1]["losses"]  # the ranks did see different data
    assert refs[0]["data"]["epoch"] == 1  # the resumed steps crossed into the next epoch

    # One process, no DDP: the same checkpoint into a bare model and a 1-rank sampler.
    saved_rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    try:
        state = ddp_state(0, 1, ddp_model(1), seed=999)
        tg.load(tmp_path / "ckpt", into=state)
        at_save = refs[0]["at_save"]
        got = snapshot(state)
        for k in ("params", "momentum", "data"):
            assert got[k] == at_save[k], k
        assert refs[1]["at_save"]["params"] == at_save["params"]  # DDP: the same everywhere
        assert torch.rand(4).tolist() == at_save["next_draw"]  # rank 0's RNG
        assert refs[1]["at_save"]["next_draw"] != at_save["next_draw"]
        # One rank's batch of 2B is what the two ranks' batches of B were, interleaved.
        one = ddp_train(state["model"], state, 2 * DDP_BATCH, DDP_K)
        both = [
            [i for pair in zip(a, b, strict=True) for i in pair]
            for a, b in zip(refs[0]["indices"][DDP_K:], refs[1]["indices"][DDP_K:], strict=True)
        ]
        assert one["indices"] == both
    finally:
        random.setstate(saved_rng[0])
        np.random.set_state(saved_rng[1])
        torch.set_rng_state(saved_rng[2])


# ----------------------------------------------------------------------------------------------
# FSDP2 with empty shards: a 1-row weight on 2 and 3 ranks, a 3-row one on 2 (uneven) and 4


def fsdp_tiny_build(seed: int, world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Rows 1 and 3: every rank but rank 0 holds an empty shard of the 1-row weight and bias."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    mesh = init_device_mesh("cpu", (world,))
    model = nn.Sequential(nn.Linear(8, 1), nn.Linear(1, 3))
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def full_values(model: nn.Module, optim: Any) -> dict[str, list[float]]:
    """Parameters and Adam moments as whole tensors (every rank must call it: a collective)."""
    out = {k: v.full_tensor().flatten().tolist() for k, v in model.state_dict().items()}
    for i, s in optim.state_dict()["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            out[f"{i}.{k}"] = s[k].full_tensor().flatten().tolist()
    return out


def fsdp_empty_save_rank(rank: int, world: int, ckpt: str) -> Any:
    model, optim = fsdp_tiny_build(0, world)
    reference = fsdp_train(model, optim, rank, world, range(4))

    first, first_optim = fsdp_tiny_build(0, world)
    losses = fsdp_train(first, first_optim, rank, world, range(2))
    empty = [k for k, v in first.state_dict().items() if v.to_local().numel() == 0]
    tg.save(ckpt, {"model": first, "optim": first_optim, "step": 2})
    saving = tg.save(f"{ckpt}-async", {"model": first, "optim": first_optim, "step": 2}, async_=True)  # fmt: skip
    saving.result(timeout=60)  # type: ignore[union-attr]
    resumed, resumed_optim = fsdp_tiny_build(1, world)
    tg.load(ckpt, into={"model": resumed, "optim": resumed_optim, "step": 0})
    losses += fsdp_train(resumed, resumed_optim, rank, world, range(2, 4))
    assert losses == reference, (losses, reference)
    assert full_values(resumed, resumed_optim) == full_values(model, optim)

    # Tied pieces stay tied on the rank whose piece is empty, as on the rank whose is not;
    # different empty pieces stay apart.
    rows = torch.arange(4.0).reshape(1, 4)[: 1 - rank]
    tied = tg.Sharded(rows, (0, 0), (1, 4))
    other = tg.Sharded(rows.clone() + 10, (0, 0), (1, 4))
    wrapped = tg.Sharded(rows, (0, 0), (1, 4))  # the same piece in another wrapper
    tg.save(f"{ckpt}-tied", {"a": tied, "b": tied, "b2": wrapped, "c": other})
    return {"empty": empty}


def fsdp_empty_load_rank(rank: int, world: int, ckpt: str) -> Any:
    model, optim = fsdp_tiny_build(1, world)
    fsdp_train(model, optim, rank, world, range(1))  # moments of other values, to be replaced
    tg.load(ckpt, into={"model": model, "optim": optim, "step": 0})
    empty = [k for k, v in model.state_dict().items() if v.to_local().numel() == 0]
    return {"empty": empty, "values": full_values(model, optim)}


def test_fsdp2_empty_and_uneven_shards_save_load_and_reshard(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    out = run_ranks(fsdp_empty_save_rank, 2, ckpt, timeout=120)
    # Rank 1's shards of the 1-row weight and bias are empty, and so are its Adam moments.
    assert out == [{"empty": []}, {"empty": ["0.weight", "0.bias"]}], out

    tree = tg.load(ckpt)  # one process: whole tensors
    saved = {k: v.flatten().tolist() for k, v in tree["model"].items()}
    for i, s in tree["optim"]["state"].items():
        saved.update({f"{i}.{k}": s[k].flatten().tolist() for k in ("exp_avg", "exp_avg_sq")})
    assert [len(saved[k]) for k in ("0.weight", "0.bias", "1.weight", "1.bias")] == [8, 1, 3, 3]
    again = tg.load(f"{ckpt}-async")  # the async save of the same state
    assert all(torch.equal(tree["model"][k], again["model"][k]) for k in tree["model"])
    for i, s in tree["optim"]["state"].items():
        assert all(torch.equal(s[k], again["optim"]["state"][i][k]) for k in ("exp_avg", "exp_avg_sq"))  # fmt: skip
    tied = tg.load(f"{ckpt}-tied")
    assert tied["a"] is tied["b"] is tied["b2"] and tied["c"] is not tied["a"]
    assert tied["a"].tolist() == [[0, 1, 2, 3]] and tied["c"].tolist() == [[10, 11, 12, 13]]

    # Resharded onto 3 ranks (two of them empty for the 1-row tensors) and 4 (one 3-row piece
    # empty too): every rank gets exactly its box.
    for world, empty in [(3, ["0.weight", "0.bias"]), (4, ["0.weight", "0.bias", "1.weight", "1.bias"])]:  # fmt: skip
        loaded = run_ranks(fsdp_empty_load_rank, world, ckpt, timeout=120)
        assert [o["values"] for o in loaded] == [saved] * world
        assert [o["empty"] for o in loaded] == [[], *[empty[:2]] * 2, *[empty] * (world - 3)]
