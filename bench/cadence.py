"""Cadence from measured cost: a ``CheckpointManager`` choosing how often to save.

The loop is the training loop's fixed compute step (``loop.ComputeStep``) over a state of
fp32 tensors nudged in place each step, with ``mgr.step(step)`` after each; saves are async.

- ``overhead``: ``policy=tg.OverheadBudget(0.02)``. The time training waited on saves (the
  blocking seconds the manager measured, summed) over the loop's wall time, from the end of the
  first save (which measures what a save costs) to the end; the interval it chose (
  ``mgr.stats.interval``) is printed.
- ``young_daly``: ``policy=tg.YoungDaly(mtbf=M)``, M chosen so that T* = sqrt(2 C M) is about
  ``young_daly_s`` seconds (a tenth of the run) for the blocking cost C the first run measured. For each save after
  the first, the seconds since the save before against sqrt(2 C M) for the C measured when it
  was decided; the median ratio is reported (the loop decides at step boundaries, so a save
  comes at most one step after its interval ran out).
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

import torch

import tardigrade as tg

from .loop import FULL, ComputeStep
from .measure import settle
from .report import Target, _grid

BUDGET = 0.02
TENSORS = 8
EDGE = 1024


@dataclass(frozen=True)
class CadenceOptions:
    nbytes: int  # the state's
    seconds: float  # each run's loop
    settle_s: float
    dir: Path


def _state(nbytes: int) -> dict[str, torch.Tensor]:
    n = max(EDGE * 2, nbytes // 4 // TENSORS)
    g = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(n, generator=g) for i in range(TENSORS)}


def _loop(
    opts: CadenceOptions, root: Path, policy: tg.Policy, state: dict[str, torch.Tensor]
) -> dict[str, Any]:
    compute = ComputeStep(FULL.matrix, FULL.products)
    saves: list[dict[str, float]] = []  # per save: when it was decided, and the C then
    with tg.CheckpointManager(root, state, policy=policy, keep_last=2) as mgr:
        start = time.monotonic()
        step = 0
        while time.monotonic() - start < opts.seconds:
            step += 1
            compute()
            with torch.no_grad():
                for t in state.values():
                    t[:EDGE].add_(1e-3)
            cost = mgr.stats.blocking_cost
            if mgr.step(step):
                saves.append({"at": time.monotonic(), "cost": cost or 0.0})
        mgr.wait()
        end = time.monotonic()
        stats = list(mgr.stats)
        interval = mgr.stats.interval
        blocking, background = mgr.stats.blocking_cost, mgr.stats.background_cost
        expected_loss = mgr.stats.expected_loss_seconds
    steady = sum(s.blocking_seconds for s in stats[1:])  # after the save that measured C
    first_end = saves[0]["at"] if saves else start
    return {
        "steps": step,
        "saves": len(stats),
        "failed": sum(not s.ok for s in stats),
        "wall_s": end - start,
        "steady_wall_s": end - first_end,
        "blocking_s": sum(s.blocking_seconds for s in stats),
        "steady_blocking_s": steady,
        "interval_s": interval,
        "blocking_cost_s": blocking,
        "background_cost_s": background,
        "expected_loss_s": expected_loss,
        "decided": saves,
    }


def run(opts: CadenceOptions, log: Callable[[str], None]) -> dict[str, Any]:
    opts.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="cadence-", dir=opts.dir))
    state = _state(opts.nbytes)
    try:
        log(f"cadence: OverheadBudget({BUDGET}) over a {opts.seconds:.0f} s loop")
        settle(opts.settle_s)
        overhead = _loop(opts, work / "overhead", tg.OverheadBudget(BUDGET), state)
        cost = overhead["blocking_cost_s"] or 0.01
        mtbf = (opts.seconds / 10) ** 2 / (2 * cost)
        log(f"cadence: YoungDaly(mtbf={mtbf:.0f} s) over a {opts.seconds:.0f} s loop")
        settle(opts.settle_s)
        young = _loop(opts, work / "young_daly", tg.YoungDaly(mtbf=mtbf), state)
        young["mtbf_s"] = mtbf
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"nbytes": opts.nbytes, "overhead": overhead, "young_daly": young}


def summarise(results: dict[str, Any]) -> dict[str, Any]:
    if "overhead" not in results:
        return {}
    o, y = results["overhead"], results["young_daly"]
    ratios = []
    for before, this in zip(y["decided"], y["decided"][1:], strict=False):
        target = math.sqrt(2 * this["cost"] * y["mtbf_s"])
        if target > 0:  # a save decided before any was measured aims at no interval
            ratios.append((this["at"] - before["at"]) / target)
    return {
        "overhead_share": o["steady_blocking_s"] / o["steady_wall_s"],
        "overhead_share_all": o["blocking_s"] / o["wall_s"],
        "overhead_interval_s": o["interval_s"],
        "overhead_saves": o["saves"],
        "overhead_failed": o["failed"],
        "young_daly_gap_vs_t": median(ratios) if ratios else None,
        "young_daly_interval_s": y["interval_s"],
        "young_daly_t_s": math.sqrt(2 * (y["blocking_cost_s"] or 0.0) * y["mtbf_s"]),
        "young_daly_saves": y["saves"],
        "young_daly_expected_loss_s": y["expected_loss_s"],
        "blocking_cost_s": o["blocking_cost_s"],
        "background_cost_s": o["background_cost_s"],
    }


def targets(s: dict[str, Any]) -> list[Target]:
    if not s:
        return []
    gap = s.get("young_daly_gap_vs_t")
    return [
        Target(f"cadence: OverheadBudget({BUDGET}) blocking / wall time", s["overhead_share"], "<=", BUDGET, "x"),
        Target("cadence: YoungDaly gap between saves / sqrt(2 C M)", gap, "<=", 1.1, "x"),
        Target("cadence: YoungDaly gap between saves / sqrt(2 C M) (not early)", gap, ">=", 0.9, "x"),
    ]  # fmt: skip


def table(results: dict[str, Any], s: dict[str, Any]) -> str:
    if not s:
        return "CADENCE: skipped"
    gap = s["young_daly_gap_vs_t"]
    rows = [
        ["measured blocking / background cost of a save", f"{s['blocking_cost_s']:.3f} / {s['background_cost_s']:.3f} s"],
        [f"OverheadBudget({BUDGET}): interval chosen", f"{s['overhead_interval_s']:.2f} s ({s['overhead_saves']} saves)"],
        [f"OverheadBudget({BUDGET}): blocking / wall (steady; all)", f"{s['overhead_share']:.4f}; {s['overhead_share_all']:.4f}"],
        ["YoungDaly: interval chosen / sqrt(2 C M)", f"{s['young_daly_interval_s']:.2f} s / {s['young_daly_t_s']:.2f} s ({s['young_daly_saves']} saves)"],
        ["YoungDaly: gap between saves / sqrt(2 C M), median", "-" if gap is None else f"{gap:.3f}x"],
        ["YoungDaly: expected work lost per failure", f"{s['young_daly_expected_loss_s']:.2f} s"],
    ]  # fmt: skip
    return (
        f"CADENCE: a {results['nbytes'] / 1e9:.2f} GB state, async saves, policies of the "
        "measured cost\n" + _grid(["", ""], rows)
    )
