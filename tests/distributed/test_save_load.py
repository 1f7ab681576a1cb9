"""Collective saves and loads on real gloo process groups: N -> M resharding, per-rank values,
replicated bytes written once, errors and dead ranks on every rank, nothing partially committed.

Every tensor's values are a function of its global index, so any rank on any world size can
compute what its piece must hold.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tardigrade as tg

from ._harness import caught, manifest_of, run_ranks

pytestmark = pytest.mark.distributed

ROWS, COLS = 11, 6  # uneven over 2, 3 and 4 ranks


def full(name: str, shape: tuple[int, ...] = (ROWS, COLS)) -> torch.Tensor:
    base = sum(map(ord, name)) * 1000
    return torch.arange(base, base + torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)


def split(n: int, parts: int, k: int) -> tuple[int, int]:
    """Rows [start, stop) of part k when n rows are cut into ``parts`` uneven parts."""
    edges = [round(i * n / parts) for i in range(parts + 1)]
    return edges[k], edges[k + 1]


def mesh_1d(world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def dtensor(name: str, mesh: Any, placements: list[Any]) -> Any:
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full(name), mesh, placements)


def state_on(rank: int, world: int, *, fill: bool) -> dict[str, Any]:
    """Each leaf class; live pieces hold the right values (``fill``) or zeros (to load into)."""
    from torch.distributed.tensor import Replicate, Shard

    mesh = mesh_1d(world)
    lo, hi = split(ROWS, world, rank)
    rows = full("emb")[lo:hi].clone() if fill else torch.zeros(hi - lo, COLS)
    state = {
        "emb": tg.Sharded(rows, (lo, 0), (ROWS, COLS)),
        "dt0": dtensor("dt0", mesh, [Shard(0)]),
        "dt1": dtensor("dt1", mesh, [Shard(1)]),
        "rep": dtensor("rep", mesh, [Replicate()]),
        "ddp": full("ddp").clone(),
        "step": 7,
        "mine": tg.PerRank({"rank": rank, "t": torch.full((3,), float(rank))}),
    }
    if not fill:
        for k in ("dt0", "dt1", "rep"):
            state[k].to_local().zero_()
        state["ddp"].zero_()
        state["step"] = 0
        state["mine"] = tg.PerRank({"rank": -1, "t": torch.zeros(3)})
    return state


def check_state(state: dict[str, Any], rank: int, world: int, saved_world: int) -> None:
    lo, hi = split(ROWS, world, rank)
    assert torch.equal(state["emb"].local, full("emb")[lo:hi])
    for k in ("dt0", "dt1", "rep"):
        assert torch.equal(state[k].full_tensor(), full(k)), k
    assert torch.equal(state["ddp"], full("ddp"))
    assert state["step"] == 7
    owner = rank if rank < saved_world else 0
    assert state["mine"].value["rank"] == owner
    assert torch.equal(state["mine"].value["t"], torch.full((3,), float(owner)))


def count_reads() -> dict[str, int]:
    """Count the bytes this process reads from data files."""
    from tardigrade import _read

    counted = {"bytes": 0}
    real = _read.st.read_range

    def counting(src: Any, begin: int, out: Any, hasher: Any) -> Any:
        counted["bytes"] += len(out)
        return real(src, begin, out, hasher)

    _read.st.read_range = counting
    return counted


def save_rank(rank: int, world: int, ckpt: str) -> Any:
    tg.save(ckpt, state_on(rank, world, fill=True), step=1)
    return json.loads((Path(ckpt) / "manifest.json").read_text())["world_size"]


def load_rank(rank: int, world: int, ckpt: str, saved_world: int) -> Any:
    counted = count_reads()
    state = state_on(rank, world, fill=False)
    tg.load(ckpt, into=state)
    check_state(state, rank, world, saved_world)
    return counted["bytes"]


def fallback_error_rank(rank: int, world: int, ckpt: str) -> Any:
    state = state_on(rank, world, fill=False)
    tg.load(ckpt, into=state, per_rank_fallback="error")


# Fewer ranks and more, neither a divisor nor a multiple of the saved world (the hardest
# slicing), and one rank: 4 -> 3, 2 -> 3, 3 -> 1.
@pytest.mark.parametrize(("saved", "loads"), [(4, (3,)), (2, (3,)), (3, (1,))])
def test_save_on_n_ranks_load_on_m(tmp_path: Path, saved: int, loads: tuple[int, ...]) -> None:
    ckpt = str(tmp_path / "ckpt")
    assert run_ranks(save_rank, saved, ckpt) == [saved] * saved
    m = tg.read_manifest(ckpt)
    layouts = {t.get("layout", "replicated") for t in m["tensors"]}
    assert layouts == {"replicated", "sharded", "per_rank"}
    assert len(m["per_rank"]) == saved
    data = sum(f["size"] for f in m["files"])
    for world in loads:
        read = run_ranks(load_rank, world, ckpt, saved, timeout=120)
        assert all(isinstance(b, int) for b in read), read
        # Each rank reads its pieces, the replicated tensors and its per-rank values, plus at
        # most the rest of the chunks that straddle its boxes: never the whole checkpoint.
        if world > 1:
            assert max(read) < data, (read, data)
    # One process without torch.distributed: whole tensors, rank 0's per-rank values.
    tree = tg.load(ckpt)
    for k in ("emb", "dt0", "dt1", "rep", "ddp"):
        assert torch.equal(tree[k], full(k)), k
    assert tree["mine"]["rank"] == 0
    assert tg.verify(ckpt).files == len(m["files"])


def test_per_rank_fallback_error_names_the_rank(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    run_ranks(save_rank, 2, ckpt)
    out = run_ranks(fallback_error_rank, 3, ckpt)
    # Only rank 2 lacks values, but the load is collective: every rank raises.
    assert all(o["error"] == "StateMismatchError" for o in out), out
    assert all("rank 2" in o["message"] and "per_rank_fallback" in o["message"] for o in out)


def replicated_rank(rank: int, world: int, ckpt: str) -> Any:
    torch.manual_seed(0)  # DDP: the same values everywhere
    state = {f"layer{i}": torch.randn(256, 1024) for i in range(8)}  # 8 MiB
    tg.save(ckpt, {"model": state, "step": 3})
    return sum(v.numel() * 4 for v in state.values())


def test_replicated_tensors_are_written_once_balanced_across_ranks(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    nbytes = run_ranks(replicated_rank, 2, str(ckpt))[0]
    m = manifest_of(ckpt)
    chunk_bytes = sum(c.numel * 4 for t in m.tensors for c in t.chunks)
    assert chunk_bytes == nbytes  # one copy in total, not one per rank
    per_rank = {r: 0 for r in range(2)}
    for name, size in m.files.items():
        per_rank[int(name.split("-r")[1][:5])] += size
    assert min(per_rank.values()) > 0.4 * nbytes, per_rank  # both ranks wrote about half


def diverging_rank(rank: int, world: int, ckpt: str) -> Any:
    tg.save(ckpt, {"w": torch.ones(4), "opt": {"lr": 0.1, "step": 10 + rank}})


def test_ranks_that_disagree_on_a_plain_value_fail_naming_the_key(tmp_path: Path) -> None:
    out = run_ranks(diverging_rank, 2, str(tmp_path / "ckpt"))
    for o in out:
        assert o["error"] == "InvalidArgumentError", o
        assert "state['opt']['step']" in o["message"] and "tg.PerRank" in o["message"]
    assert not (tmp_path / "ckpt").exists()


def disagreeing_target_rank(rank: int, world: int, root: str) -> Any:
    from tardigrade.distributed import _collectives

    state = {"w": torch.full((4, 4), 1.0), "step": 1}
    tg.save(f"{root}/step-1", state)
    new = {"w": torch.full((4, 4), 2.0), "step": 1}
    out = {
        "path": caught(lambda: tg.save(f"{root}/step-{2 + rank}", state)),
        "overwrite": caught(lambda: tg.save(f"{root}/step-1", new, overwrite=rank == 0)),
        "step": caught(lambda: tg.save(f"{root}/s", state, step=7 + rank)),
        "epoch": caught(lambda: tg.save(f"{root}/s", state, epoch=None if rank else 3)),
        "metadata": caught(lambda: tg.save(f"{root}/s", state, metadata={"run": f"r{rank}"})),
        "async path": caught(
            lambda: tg.save(f"{root}/async-{rank}", state, async_=True).result(timeout=60)  # type: ignore[union-attr]
        ),
    }
    # Metrics are often each rank's own (a local loss): they may differ, rank 0's are kept.
    tg.save(f"{root}/metrics", state, step=5, metrics={"loss": float(rank)})
    _collectives.Ranks.current().barrier("test: every rank has saved")  # type: ignore[union-attr]
    return out


def test_ranks_that_disagree_on_the_target_fail_on_every_rank_naming_the_ranks(
    tmp_path: Path,
) -> None:
    out = run_ranks(disagreeing_target_rank, 2, str(tmp_path), timeout=120)
    assert out[0] == out[1], out  # the same error on every rank
    for arg, got in out[0].items():
        assert got["type"] == "InvalidArgumentError", (arg, got)
        msg = got["message"]
        assert arg.split()[-1] in msg and "rank(s) [1]" in msg, (arg, msg)
        assert "the ranks disagree on what to save" in msg and "Nothing was written" in msg
    assert "step-2'" in out[0]["path"]["message"] and "step-3'" in out[0]["path"]["message"]
    assert "overwrite=True on rank 0 but False on rank(s) [1]" in out[0]["overwrite"]["message"]
    assert "step=7 on rank 0 but 8 on rank(s) [1]" in out[0]["step"]["message"]
    assert "epoch=3 on rank 0 but None on rank(s) [1]" in out[0]["epoch"]["message"]
    assert "metadata differs between rank 0 and rank(s) [1]" in out[0]["metadata"]["message"]
    # Nothing was committed or left behind; step-1 is the first save's.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics", "step-1"]
    assert torch.equal(tg.load(tmp_path / "step-1")["w"], torch.full((4, 4), 1.0))
    assert tg.read_manifest(tmp_path / "metrics")["metrics"] == {"loss": 0.0}


def failing_writer_rank(rank: int, world: int, root: str) -> Any:
    from tardigrade.storage import local

    good = {"w": torch.full((64, 64), 1.0), "mine": tg.PerRank(rank)}
    tg.save(f"{root}/ckpt", good)
    if rank == 1:
        real = local.LocalStorage.open_writer

        def failing(self: Any, name: str, **kw: Any) -> Any:
            if name.endswith(".safetensors"):
                raise OSError(28, "No space left on device")
            return real(self, name, **kw)

        local.LocalStorage.open_writer = failing  # type: ignore[method-assign]
    try:
        tg.save(f"{root}/ckpt", {"w": torch.full((64, 64), 2.0), "mine": tg.PerRank(rank)},
                overwrite=True)  # fmt: skip
    except tg.TardigradeError as e:
        return {"error": type(e).__name__, "message": str(e)}
    return "saved"


def test_a_writer_error_on_one_rank_fails_every_rank_and_keeps_the_previous(
    tmp_path: Path,
) -> None:
    out = run_ranks(failing_writer_rank, 2, str(tmp_path))
    for o in out:
        assert o["error"] == "SaveError", o
        assert "rank 1" in o["message"] and "No space left" in o["message"]
    assert torch.equal(tg.load(tmp_path / "ckpt")["w"], torch.full((64, 64), 1.0))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def dying_rank(rank: int, world: int, root: str) -> Any:
    from tardigrade import _write

    tg.save(f"{root}/ckpt", {"w": torch.full((64, 64), 1.0)})
    if rank == 1:

        def die(*a: Any, **kw: Any) -> Any:
            os.kill(os.getpid(), signal.SIGKILL)

        _write.write_file = die  # type: ignore[assignment]
    try:
        tg.save(f"{root}/ckpt", {"w": torch.full((64, 64), 2.0)}, overwrite=True, timeout=10)
    except tg.TardigradeError as e:
        return {"error": type(e).__name__, "message": str(e)}
    return "saved"


def test_a_rank_killed_mid_save_fails_the_others_and_commits_nothing(tmp_path: Path) -> None:
    out = run_ranks(dying_rank, 2, str(tmp_path), timeout=90)
    assert out[1] == {"died": -signal.SIGKILL}, out
    assert out[0]["error"] == "DistributedError", out
    assert torch.equal(tg.load(tmp_path / "ckpt")["w"], torch.full((64, 64), 1.0))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def plan_cache_rank(rank: int, world: int, root: str) -> Any:
    from tardigrade.distributed import _save as dsave

    calls = {"plans": 0}
    real = dsave.global_plan_from_wire

    def counting(*a: Any, **kw: Any) -> Any:
        calls["plans"] += 1
        return real(*a, **kw)

    dsave.global_plan_from_wire = counting
    w = torch.ones(32, 8)
    for i in range(3):
        tg.save(f"{root}/s{i}", {"w": w * i, "mine": tg.PerRank(rank * 10 + i)})
    tg.save(f"{root}/s3", {"w": torch.ones(64, 8), "mine": tg.PerRank(0)})  # layout changed
    assert dist.get_world_size() == world
    return calls["plans"]


def test_the_global_plan_is_cached_while_the_layout_is_unchanged(tmp_path: Path) -> None:
    # Only the coordinator plans: once for the first save, again when a shape changes.
    assert run_ranks(plan_cache_rank, 2, str(tmp_path)) == [2, 0]
    assert tg.load(tmp_path / "s2")["mine"] == 2
    assert tg.load(tmp_path / "s2", per_rank_fallback="rank0")["w"].sum() == 2 * 32 * 8


def verify_rank(rank: int, world: int, ckpt: str) -> Any:
    try:
        report = tg.verify(ckpt)
    except tg.TardigradeError as e:
        return {"error": type(e).__name__, "message": str(e)}
    return [report.files, report.nbytes]


def test_verify_is_collective_and_every_rank_sees_damage(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    run_ranks(save_rank, 2, str(ckpt))
    whole = tg.verify(ckpt)
    assert run_ranks(verify_rank, 2, str(ckpt)) == [[whole.files, whole.nbytes]] * 2
    victim = sorted(ckpt.glob("data-r00001-*"))[-1]
    raw = bytearray(victim.read_bytes())
    raw[-1] ^= 0xFF
    victim.write_bytes(bytes(raw))
    out = run_ranks(verify_rank, 2, str(ckpt))
    # One rank checks the damaged file; both raise, naming it.
    assert all(o["error"] == "ChecksumMismatchError" for o in out), out
    assert all(victim.name in o["message"] for o in out)
