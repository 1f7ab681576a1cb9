"""What needs a CUDA device (``make gpu-check`` runs these on a GPU machine; without one each
test skips, saying why): async saves staged from device memory into pinned host slabs, the
overlap fence on CUDA tensors, every device's RNG, and a DTensor state over NCCL where there
is more than one GPU. The async consistency test of CUDA state is ``tests/unit/test_async.py``
(``test_cuda_state_is_staged_consistently``).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import tardigrade as tg

from ..distributed._harness import run_ranks
from ..unit.test_overlap import _same

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.BatchNorm1d(4096), nn.Linear(4096, 1024))
    model = model.cuda()
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(64, 1024, device="cuda")).square().mean().backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def test_async_staging_uses_pinned_slabs_and_saves_call_time_values(tmp_path: Path) -> None:
    model, optim = _model()
    state = {"model": model, "optim": optim}
    expected = copy.deepcopy({"model": model.state_dict(), "optim": optim.state_dict()})
    with tg.AsyncCheckpointer() as ckpt:
        fut = ckpt.save(tmp_path / "step-1", state)
        assert fut is not None
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        fut.result(timeout=120)
        assert ckpt.staging.allocations >= 1
    got = tg.load(str(tmp_path / "step-1"))
    assert _same(got["model"], expected["model"])
    # Staged into page-locked memory: the device-to-host copies run asynchronously.
    assert ckpt.pool._free and all(slab.buf.is_pinned() for slab in ckpt.pool._free)


def test_the_overlap_fence_holds_cuda_updates_until_the_copy_is_done(tmp_path: Path) -> None:
    model, optim = _model()
    state = {"model": model, "optim": optim}
    expected = copy.deepcopy({"model": model.state_dict(), "optim": optim.state_dict()})
    with tg.AsyncCheckpointer() as ckpt:
        fut = ckpt.save(tmp_path / "step-1", state, overlap=True)
        assert fut is not None
        for _ in range(3):  # forward and backward beside the copy; the step waits first
            model(torch.randn(64, 1024, device="cuda")).square().mean().backward()
            optim.step()
            optim.zero_grad()
        result = fut.result(timeout=120)
    got_model, got_optim = _model()
    tg.load(str(tmp_path / "step-1"), into={"model": got_model, "optim": got_optim})
    assert _same(got_model.state_dict(), expected["model"])
    assert _same(got_optim.state_dict()["state"], expected["optim"]["state"])
    assert result.blocking_seconds >= 0


def test_every_devices_rng_resumes_exactly(tmp_path: Path) -> None:
    devices = range(torch.cuda.device_count())
    state = {"rng": tg.RNGState()}
    for d in devices:
        torch.randn(3, device=f"cuda:{d}")  # move every device's generator along
    tg.save(tmp_path / "rng", state)
    after = [torch.randn(5, device=f"cuda:{d}").cpu() for d in devices]
    tg.load(str(tmp_path / "rng"), into=state)
    again = [torch.randn(5, device=f"cuda:{d}").cpu() for d in devices]
    assert all(torch.equal(a, b) for a, b in zip(after, again, strict=True))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_dtensor_state_saves_and_loads_over_nccl(tmp_path: Path) -> None:
    out = run_ranks(_nccl_rank, 2, str(tmp_path), timeout=180)
    assert out == [True, True], out


def _nccl_rank(rank: int, world: int, root: str) -> bool:
    """A rank of the harness's gloo job, with an NCCL group over the same ranks for the
    DTensor; Tardigrade's own collectives go over gloo (its sibling group for CPU bytes)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.cuda.set_device(rank)
    nccl = dist.new_group(list(range(world)), backend="nccl")
    mesh = DeviceMesh.from_group(nccl, "cuda")
    torch.manual_seed(0)
    full = torch.randn(1024, 256, device="cuda")
    state = {"w": distribute_tensor(full, mesh, [Shard(0)])}
    tg.save(os.path.join(root, "step-1"), state)
    back = {"w": distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)])}
    tg.load(os.path.join(root, "step-1"), into=back)
    return bool(torch.equal(back["w"].full_tensor(), full))
