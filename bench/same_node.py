"""Restore right after a save on the same node: the RAM tier, the disk, DCP's page cache.

A job saves, is killed (SIGKILL), and restarts on the same node. Three ways back, each on the
same state (fp32 tensors), side by side in one run:

- ``ram_tier``: a job runs ``CheckpointManager(dir, state, ram_tier=True)``, saves (async),
  waits for the commit and crashes (leaves its ``with`` block by an exception: the RAM tier stays,
  as after a SIGKILL, which tests/storage/test_ram_tier.py does for real); ``restore()`` of a new
  manager on the same directory is measured, and must read ``/dev/shm`` (``restored_from``).
- ``disk``: the same without the RAM tier. The save wrote its data with O_DIRECT, so nothing is
  in the page cache: the restore reads the disk cold (today's same-node restart).
- ``dcp``: ``torch.distributed.checkpoint.save`` (buffered writes, left in the page cache), then
  ``dcp.load`` into the live tensors: DCP's restore right after its save.

Both Tardigrade restores verify every byte (``restore()`` always does). Also measured: the
training thread's blocking in a manager's async save with and without the RAM tier (the RAM
copy is written from the staging copy in the background, so it should add nothing there).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

import torch

import tardigrade as tg
from tardigrade._ramtier import namespace

from .measure import measure, settle
from .report import Target, _grid

TENSORS = 16
KINDS = ("ram_tier", "disk", "dcp")
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


@dataclass(frozen=True)
class SameNodeOptions:
    nbytes: int
    repeats: int
    settle_s: float
    dir: Path


def make_state(nbytes: int, *, fill: bool = True) -> dict[str, torch.Tensor]:
    """``TENSORS`` fp32 tensors of ``nbytes`` in all; each filled with a cheap pattern."""
    per = max(1, nbytes // TENSORS // 4)
    out = {}
    for i in range(TENSORS):
        t = torch.empty(per)
        if fill:
            torch.arange(per, out=t)
            t.add_(i * 0.5)
        out[f"t{i:02d}"] = t
    return out


class _Crash(Exception):
    """The saving job dies right after its save committed."""


def _save_and_crash(directory: Path, state: dict[str, torch.Tensor], ram_tier: bool) -> None:
    """Save once through a manager, then leave its ``with`` block by an exception: what a
    crash leaves (the directory lock released, the RAM tier kept), without the minutes that
    starting a fresh interpreter per sample costs on this machine."""
    try:
        with tg.CheckpointManager(directory, state, ram_tier=ram_tier, save_on_signals=()) as mgr:
            mgr.save(1)
            mgr.wait()
            raise _Crash
    except _Crash:
        pass


def _blocking(directory: Path, state: dict[str, torch.Tensor], ram_tier: bool) -> float:
    """The training thread's blocking in a manager's second async save (staging reused)."""
    with tg.CheckpointManager(directory, state, ram_tier=ram_tier) as mgr:
        mgr.save(1)
        mgr.wait()
        mgr.save(2)
        mgr.wait()
        if ram_tier:
            stats = mgr.ram_tier_stats
            assert stats is not None and stats.failed == 0, stats
        return mgr.stats[-1].blocking_seconds


def _warm_up(work: Path, dcp: Any) -> None:
    """Each restore's code paths once, on a tiny state (first-call costs out of the numbers)."""
    tiny = make_state(1 << 16)
    dcp.save(tiny, checkpoint_id=work / "warm-dcp")
    dcp.load(tiny, checkpoint_id=work / "warm-dcp")
    with tg.CheckpointManager(work / "warm-tg", tiny, ram_tier=True) as mgr:
        mgr.save(1)
        mgr.wait()
        mgr.restore()
    shutil.rmtree(work / "warm-dcp", ignore_errors=True)
    shutil.rmtree(work / "warm-tg", ignore_errors=True)


def run(opts: SameNodeOptions, log: Callable[[str], None]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    if not os.path.isdir("/dev/shm"):
        log("same node: skipped (no /dev/shm)")
        return {"skipped": "no /dev/shm on this machine"}
    opts.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="same-node-", dir=opts.dir))
    nbytes = sum(t.nbytes for t in make_state(opts.nbytes, fill=False).values())
    samples: dict[str, list[dict[str, Any]]] = {}
    blocking: dict[str, list[float]] = {"without": [], "with_ram_tier": []}
    log(f"same node: restore right after a save ({nbytes / 1e6:.0f} MB state)")
    try:
        _warm_up(work, dcp)
        for rnd in range(1, opts.repeats + 1):  # each round starts from fresh saves
            order = KINDS[rnd % len(KINDS) :] + KINDS[: rnd % len(KINDS)]
            for kind in order:
                where = work / f"{kind}-{rnd}"
                saved = make_state(opts.nbytes)
                if kind == "dcp":
                    dcp.save(saved, checkpoint_id=where)
                else:
                    _save_and_crash(where, saved, ram_tier=kind == "ram_tier")
                del saved
                live = make_state(opts.nbytes, fill=False)
                for t in live.values():
                    t.zero_()  # faulted in, as a live model is, and poisoned
                settle(opts.settle_s)
                if kind == "dcp":
                    s = measure(lambda live=live, where=where: dcp.load(live, checkpoint_id=where))
                else:
                    # Synchronous saves: no staging memory reserved after the restore (that
                    # is the next save's, not the restore's).
                    mgr = tg.CheckpointManager(
                        where, live, ram_tier=kind == "ram_tier", async_save=False
                    )
                    try:
                        s = measure(lambda mgr=mgr: {"step": float(mgr.restore() or -1)})
                        from_ram = (mgr.restored_from or "").startswith("/dev/shm/")
                        if from_ram != (kind == "ram_tier"):
                            raise RuntimeError(f"{kind}: restored from {mgr.restored_from}")
                    finally:
                        mgr.close()  # a normal end: the RAM tier is removed
                expected = make_state(opts.nbytes)
                for k, v in expected.items():
                    assert torch.equal(live[k], v), f"{kind} restored wrong bytes ({k})"
                del expected, live
                shutil.rmtree(where, ignore_errors=True)
                samples.setdefault(kind, []).append(s.to_json())
            state = make_state(opts.nbytes)
            pair = [("without", False), ("with_ram_tier", True)]
            for key, ram in pair if rnd % 2 else pair[::-1]:  # alternate which goes first
                settle(opts.settle_s)
                b = _blocking(work / f"blocking-{key}-{rnd}", state, ram)
                shutil.rmtree(work / f"blocking-{key}-{rnd}", ignore_errors=True)
                blocking[key].append(b)
            del state
            log(f"same node: round {rnd} of {opts.repeats} done")
    finally:
        # A run that failed between a "crash" and the restore that removes it leaves RAM tiers.
        for where in work.iterdir():
            shutil.rmtree(Path("/dev/shm") / namespace(str(where.resolve())), ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return {"nbytes": nbytes, "samples": samples, "blocking_s": blocking}


def summarise(results: dict[str, Any]) -> dict[str, Any]:
    if "samples" not in results:
        return {}
    out: dict[str, Any] = {}
    for kind, runs in results["samples"].items():
        secs = median(r["seconds"] for r in runs)
        out[kind] = {
            "seconds": secs,
            "gbps": results["nbytes"] / 1e9 / secs,
            "peak_above_pct": 100 * max(r["peak_rss_above"] for r in runs) / results["nbytes"],
        }
    out["blocking_s"] = {k: median(v) for k, v in results["blocking_s"].items() if v}
    return out


def targets(summary: dict[str, Any]) -> list[Target]:
    def ratio(a: str, b: str) -> float | None:
        if a in summary and b in summary:
            return float(summary[b]["seconds"] / summary[a]["seconds"])
        return None

    return [
        Target("RAM-tier restore vs DCP page-cache restore (same node)", ratio("ram_tier", "dcp"), ">=", 1.0, "x"),
        Target("RAM-tier restore vs cold-disk restore (same node)", ratio("ram_tier", "disk"), ">=", 3.0, "x"),
    ]  # fmt: skip


def table(results: dict[str, Any], summary: dict[str, Any]) -> str:
    if not summary:
        return f"SAME-NODE RESTORE: skipped ({results.get('skipped', 'no results')})"
    names = {
        "ram_tier": "tg restore() from the RAM tier (/dev/shm)",
        "disk": "tg restore() from disk, cold (after an O_DIRECT save)",
        "dcp": "DCP load from the page cache",
    }
    rows = [
        [names[k], f"{s['seconds']:.3f}", f"{s['gbps']:.2f}", f"{s['peak_above_pct']:.1f}"]
        for k, s in summary.items()
        if k in names
    ]
    block = summary.get("blocking_s", {})
    head = f"SAME-NODE RESTORE right after a save ({results['nbytes'] / 1e6:.0f} MB state, medians)"
    foot = (
        "manager async save, training-thread blocking: "
        f"{block.get('without', float('nan')) * 1000:.1f} ms without the RAM tier, "
        f"{block.get('with_ram_tier', float('nan')) * 1000:.1f} ms with it"
    )
    return "\n".join([head, _grid(["restore", "s", "GB/s", "peak above state %"], rows), foot])
