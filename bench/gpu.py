"""``python -m bench.gpu`` (``make gpu-check``): async saves of a CUDA training state.

On one CUDA device, an MLP and its Adam state (``--params`` parameters, default 250M: ~3 GB
with the moments). Each round, after a settled step: one save with each mode, then the next
training step (forward, backward, ``optimizer.step()``) timed against a step without a save.

- ``tg_async``: ``tg.AsyncCheckpointer.save`` (returns once the state is in pinned host slabs).
- ``tg_overlap``: the same with ``overlap=True`` (returns at once; the copy runs beside the
  next forward and backward, ``optimizer.step()`` waiting for it).
- ``dcp_async``: ``torch.distributed.checkpoint.async_save`` with its ``DefaultStager``
  (pinned memory, asynchronous staging, non-blocking copies), waited for as its docs ask.

Blocking is the save call (and, for a staging that runs on, the wait before the step's update:
``wait_staged``, or DCP's ``staging_completion``); "next step" is the step right after a save.
Without a CUDA device it says so and exits 0 (nothing to measure).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import tardigrade as tg

WIDTH = 4096


def _state(params: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    layers = max(1, params // (WIDTH * WIDTH))
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)]).cuda()
    optim = torch.optim.Adam(model.parameters(), lr=1e-4)
    return model, optim


def _step(model: torch.nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    model(x).square().mean().backward()
    optim.step()
    optim.zero_grad(set_to_none=False)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def run(params: int, rounds: int, work: Path) -> dict[str, Any]:
    model, optim = _state(params)
    x = torch.randn(256, WIDTH, device="cuda")
    for _ in range(3):
        _step(model, optim, x)
    nbytes = sum(p.nbytes for p in model.parameters()) * 3
    plain = [_step(model, optim, x) for _ in range(5)]
    out: dict[str, Any] = {"state_bytes": nbytes, "step_s": statistics.median(plain)}
    ckpt = tg.AsyncCheckpointer()
    ckpt.reserve({"model": model, "optim": optim})
    ckpt.wait_reserved()
    stager = dcp.staging.DefaultStager(dcp.staging.StagingOptions(True, False, True, True))
    try:
        for mode in ("tg_async", "tg_overlap", "dcp_async"):
            blocking, after = [], []
            for r in range(rounds + 1):  # round 0: warm-up
                path = work / f"{mode}-{r}"
                state = {"model": model, "optim": optim}
                t = time.perf_counter()
                if mode == "dcp_async":
                    sd = {"model": model.state_dict(), "optim": optim.state_dict()}
                    resp = dcp.async_save(sd, checkpoint_id=str(path), async_stager=stager)
                    resp.staging_completion.result()  # before the update, as DCP asks
                    block = time.perf_counter() - t
                    step = _step(model, optim, x)
                    resp.upload_completion.result()
                else:
                    fut = ckpt.save(path, state, overlap=mode == "tg_overlap")
                    assert fut is not None
                    block = time.perf_counter() - t
                    step = _step(model, optim, x)  # the fence is in optimizer.step()
                    block = fut.result().blocking_seconds
                if r:
                    blocking.append(block)
                    after.append(step)
                shutil.rmtree(path, ignore_errors=True)
            out[mode] = {
                "blocking_s": statistics.median(blocking),
                "next_step_s": statistics.median(after),
            }
    finally:
        ckpt.close()
        stager.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__)
    parser.add_argument("--params", type=float, default=250e6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.gpu: no CUDA device here; nothing to measure")
        return 0
    work = Path(tempfile.mkdtemp(prefix="tardigrade-gpu-bench-"))
    try:
        out = run(int(args.params), args.rounds, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out["device"] = torch.cuda.get_device_name()
    step = out["step_s"]
    print(f"{out['device']}: state {out['state_bytes'] / 1e9:.2f} GB, a step {step:.3f} s")
    for mode in ("tg_async", "tg_overlap", "dcp_async"):
        m = out[mode]
        print(
            f"  {mode:<11} blocking {m['blocking_s']:.3f} s   next step "
            f"{m['next_step_s']:.3f} s ({m['next_step_s'] / step:.2f}x a step without a save)"
        )
    dcp_block = out["dcp_async"]["blocking_s"]
    for mode in ("tg_async", "tg_overlap"):
        ratio = out[mode]["blocking_s"] / dcp_block if dcp_block else float("nan")
        print(f"  {mode} blocking / dcp_async blocking: {ratio:.2f}x")
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
