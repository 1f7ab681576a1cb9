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
- ``tiers``: two saves in flight beside each other. A save every ``E`` steps (about every
  ``FAST_S`` seconds) into the RAM tier, every ``PERSIST_EVERY``-th of them also into the
  store (a local SeaweedFS: the slow target, ``dedup=False`` so each writes the whole state),
  run with ``max_in_flight=2`` and then ``1``. Reported: the interval between the RAM tier's
  saves (median), the gap from a persisted save to the next one (median), the interval
  between persisted saves, and how long ``step()`` blocked in the save right after a
  persisted one (median) against the others. With one in flight that save waits for the
  upload; with two it does not (the target: at most half of one in flight's, side by side).
  The wall-time gaps also show the store's server competing with the loop for this
  machine's cores while it ingests (a remote store would not).
"""

from __future__ import annotations

import itertools
import math
import os
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
from tardigrade.testing import S3Server

from .loop import FULL, ComputeStep
from .measure import settle
from .report import Target, _grid

BUDGET = 0.02
FAST_S = 0.5  # seconds between the RAM tier's saves (the tiers run)
PERSIST_EVERY = 8  # every this many saves also goes to the store
# The time step() blocked in the save after a persisted one: two in flight / one in flight.
AFTER_PERSIST_TARGET = 0.5
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


def _tiers_loop(
    opts: CadenceOptions, url: str, shm: Path, every: int, in_flight: int, state: dict[str, Any]
) -> dict[str, Any]:
    """Save every ``every`` steps into the RAM tier, every ``PERSIST_EVERY``-th also into the
    store at ``url``; per save, when ``step()`` returned and whether it was persisted."""
    compute = ComputeStep(FULL.matrix, FULL.products)
    persist = every * PERSIST_EVERY
    saves: list[dict[str, Any]] = []
    with tg.CheckpointManager(
        url,
        state,
        every_steps=every,
        ram_tier=shm,
        persist_every=persist,
        keep_last=2,
        dedup=False,
        max_in_flight=in_flight,
    ) as mgr:
        start = time.monotonic()
        step = 0
        while time.monotonic() - start < opts.seconds / 2:
            step += 1
            compute()
            with torch.no_grad():
                for t in state.values():
                    t[:EDGE].add_(1e-3)
            before = time.monotonic()
            if mgr.step(step):
                now = time.monotonic()
                saves.append({"at": now, "step_s": now - before, "persisted": step % persist == 0})
        mgr.wait()
        failed = sum(not s.ok for s in mgr.stats)
    return {"saves": saves, "steps": step, "failed": failed, "max_in_flight": in_flight}


def _run_tiers(
    opts: CadenceOptions, work: Path, state: dict[str, Any], log: Callable[[str], None]
) -> dict[str, Any]:
    try:
        import obstore  # noqa: F401
    except ImportError:
        return {"skipped": "obstore is not installed"}
    compute = ComputeStep(FULL.matrix, FULL.products)
    compute()
    began = time.perf_counter()
    for _ in range(3):
        compute()
    every = max(1, round(FAST_S / ((time.perf_counter() - began) / 3)))
    (work / "s3").mkdir()
    server = S3Server(work / "s3")
    saved_env = dict(os.environ)
    shm = Path(tempfile.mkdtemp(prefix="tardigrade-bench-tiers-", dir="/dev/shm"))
    out: dict[str, Any] = {"every_steps": every}
    try:
        server.start()
        os.environ.update(server.env())
        for in_flight in (2, 1):
            log(f"cadence: RAM tier every {every} steps, the store every {PERSIST_EVERY} saves, "
                f"max_in_flight={in_flight}")  # fmt: skip
            settle(opts.settle_s)
            url = f"s3://{server.bucket}/tiers-{in_flight}"
            out[f"in_flight_{in_flight}"] = _tiers_loop(opts, url, shm, every, in_flight, state)
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        server.stop(grace=0)
        shutil.rmtree(shm, ignore_errors=True)
    return out


def _gaps(run: dict[str, Any]) -> dict[str, Any]:
    """The gaps between saves: after a persisted save, after a RAM-only one, and between
    persisted saves (medians, seconds)."""
    saves = run["saves"]
    after_persist, after_fast = [], []
    blocked_after_persist, blocked_after_fast = [], []  # in step(), by the save after
    for before, this in itertools.pairwise(saves):
        (after_persist if before["persisted"] else after_fast).append(this["at"] - before["at"])
        blocked = blocked_after_persist if before["persisted"] else blocked_after_fast
        blocked.append(this["step_s"])
    persisted = [s["at"] for s in saves if s["persisted"]]
    between = [b - a for a, b in itertools.pairwise(persisted)]
    fast = median(after_fast) if after_fast else None
    slow = median(after_persist) if after_persist else None
    return {
        "fast_interval_s": fast,
        "after_persist_s": slow,
        "after_persist_ratio": slow / fast if fast and slow is not None else None,
        "persist_interval_s": median(between) if between else None,
        "blocked_after_persist_s": median(blocked_after_persist) if after_persist else None,
        "blocked_after_fast_s": median(blocked_after_fast) if after_fast else None,
        "saves": len(saves),
        "persisted": len(persisted),
        "failed": run["failed"],
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
        tiers = _run_tiers(opts, work, state, log)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"nbytes": opts.nbytes, "overhead": overhead, "young_daly": young, "tiers": tiers}


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
        "tiers": {
            k: _gaps(v) for k, v in results.get("tiers", {}).items() if k.startswith("in_flight")
        },
    }


def targets(s: dict[str, Any]) -> list[Target]:
    if not s:
        return []
    gap = s.get("young_daly_gap_vs_t")
    return [
        Target(f"cadence: OverheadBudget({BUDGET}) blocking / wall time", s["overhead_share"], "<=", BUDGET, "x"),
        Target("cadence: YoungDaly gap between saves / sqrt(2 C M)", gap, "<=", 1.1, "x"),
        Target("cadence: YoungDaly gap between saves / sqrt(2 C M) (not early)", gap, ">=", 0.9, "x"),
        *([Target("cadence: RAM tier beside the store: blocked after a persisted save, 2 in flight / 1", blocked, "<=", AFTER_PERSIST_TARGET, "x")]
          if (blocked := _blocked_ratio(s.get("tiers", {}))) is not None else []),
    ]  # fmt: skip


def _blocked_ratio(tiers: dict[str, Any]) -> float | None:
    two = tiers.get("in_flight_2", {}).get("blocked_after_persist_s")
    one = tiers.get("in_flight_1", {}).get("blocked_after_persist_s")
    return two / one if two is not None and one else None


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
    for key, t in s.get("tiers", {}).items():
        n = key.removeprefix("in_flight_")
        if t["fast_interval_s"] is None or t["after_persist_s"] is None:
            rows.append(
                [f"max_in_flight={n}: RAM tier beside the store", f"too few saves ({t['saves']})"]
            )
            continue
        rows += [
            [f"max_in_flight={n}: RAM tier's interval (after a RAM-only save)", f"{t['fast_interval_s']:.2f} s ({t['saves']} saves, {t['failed']} failed)"],
            [f"max_in_flight={n}: gap after a persisted save", f"{t['after_persist_s']:.2f} s ({t['after_persist_ratio']:.2f}x)"],
            [f"max_in_flight={n}: step() blocked, after a persisted save / others", f"{t['blocked_after_persist_s']:.3f} / {t['blocked_after_fast_s']:.3f} s"],
            [f"max_in_flight={n}: the store's interval", "-" if t["persist_interval_s"] is None else f"{t['persist_interval_s']:.2f} s ({t['persisted']} saves)"],
        ]  # fmt: skip
    return (
        f"CADENCE: a {results['nbytes'] / 1e9:.2f} GB state, async saves, policies of the "
        "measured cost\n" + _grid(["", ""], rows)
    )
