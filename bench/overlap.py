"""Staging beside training (``overlap``): what a save costs the step when forward and backward
take at least a memcpy of the state.

A state of the bench's kind (an MLP and its Adam moments, 1/4 of --size), a training step of
fixed compute (matrix products, sized to take at least 1.2x a memcpy of the state) followed by
the optimizer's real ``step()`` (synthetic gradients). Each round, after ``settle``: a step
without a save, then, per mode, a save followed by the next step:

- ``async``: ``AsyncCheckpointer.save`` (returns once the state is copied);
- ``overlap``: the same with ``overlap=True`` (returns at once; the copy runs beside the
  step's compute and ``optimizer.step()`` waits for what is left of it).

Blocking is what the save's result reports (the call, plus the fence's wait with overlap);
"next step" is the step right after the save, against a step without one.
"""

from __future__ import annotations

import math
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import tardigrade as tg

from .loop import ComputeStep
from .measure import settle
from .report import Target, _grid
from .state import build_state

MATRIX = 1024
MODES = ("async", "overlap")


@dataclass(frozen=True)
class OverlapOptions:
    nbytes: int
    repeats: int
    settle_s: float
    dir: Path


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run(opts: OverlapOptions, log: Callable[[str], None]) -> dict[str, Any]:
    state = build_state(opts.nbytes)
    tensors = list(state.tensors().values())
    scratch = [torch.empty_like(t) for t in tensors]

    def memcpy() -> None:
        for dst, src in zip(scratch, tensors, strict=True):
            dst.copy_(src)

    memcpy()
    copy_s = statistics.median(_timed(memcpy) for _ in range(3))
    scratch.clear()
    one = ComputeStep(MATRIX, 1)
    product_s = statistics.median(_timed(one) for _ in range(5))
    products = max(1, math.ceil(1.2 * copy_s / product_s))
    compute = ComputeStep(MATRIX, products)

    def step() -> None:
        compute()
        state.train_step()

    log(
        f"overlap: a {state.nbytes / 1e9:.2f} GB state (memcpy {copy_s:.3f} s), a step of "
        f"{products} products ({products * product_s:.3f} s) and an Adam step"
    )
    work = Path(tempfile.mkdtemp(prefix="overlap-", dir=opts.dir))
    out: dict[str, Any] = {"nbytes": state.nbytes, "memcpy_s": copy_s, "plain_step_s": []}
    out.update({f"{m}_blocking_s": [] for m in MODES} | {f"{m}_step_s": [] for m in MODES})
    ckpt = tg.AsyncCheckpointer()
    ckpt.reserve(state.live)
    ckpt.wait_reserved()
    try:
        for r in range(opts.repeats + 1):  # round 0: warm-up
            settle(opts.settle_s)
            plain = _timed(step)
            for mode in MODES:
                settle(opts.settle_s)
                path = work / f"{mode}-{r}"
                fut = ckpt.save(path, state.live, overlap=mode == "overlap")
                assert fut is not None
                after = _timed(step)  # with overlap, optimizer.step() is the fence
                blocking = fut.result().blocking_seconds
                if r:
                    out[f"{mode}_blocking_s"].append(blocking)
                    out[f"{mode}_step_s"].append(after)
                shutil.rmtree(path, ignore_errors=True)
            if r:
                out["plain_step_s"].append(plain)
    finally:
        ckpt.close()
        shutil.rmtree(work, ignore_errors=True)
    return out


def summarise(results: dict[str, Any]) -> dict[str, Any]:
    if "memcpy_s" not in results:
        return {}
    out = {
        "memcpy_s": results["memcpy_s"],
        "plain_step_s": statistics.median(results["plain_step_s"]),
    }
    for m in MODES:
        out[f"{m}_blocking_s"] = statistics.median(results[f"{m}_blocking_s"])
        out[f"{m}_step_s"] = statistics.median(results[f"{m}_step_s"])
    return out


def targets(s: dict[str, Any]) -> list[Target]:
    if not s:
        return []
    return [
        Target("overlap: async blocking / memcpy (a step >= a memcpy)", s["overlap_blocking_s"] / s["memcpy_s"], "<=", 0.3, "x"),
        Target("overlap: the step after a save / a step without one", s["overlap_step_s"] / s["plain_step_s"], "<=", 1.1, "x"),
    ]  # fmt: skip


def table(results: dict[str, Any], s: dict[str, Any]) -> str:
    if not s:
        return "OVERLAP: skipped"
    rows = [
        ["memcpy of the state", f"{s['memcpy_s']:.3f}", ""],
        ["a step without a save", f"{s['plain_step_s']:.3f}", ""],
    ]
    for m in MODES:
        rows.append(
            [
                f"{m}: blocking",
                f"{s[f'{m}_blocking_s']:.3f}",
                f"{s[f'{m}_blocking_s'] / s['memcpy_s']:.2f}x memcpy",
            ]
        )
        rows.append(
            [
                f"{m}: the step after a save",
                f"{s[f'{m}_step_s']:.3f}",
                f"{s[f'{m}_step_s'] / s['plain_step_s']:.2f}x a step",
            ]
        )
    return (
        f"OVERLAP: a {results['nbytes'] / 1e9:.2f} GB state, a step of at least a memcpy (medians)\n"
        + _grid(["", "s", ""], rows)
    )  # fmt: skip
