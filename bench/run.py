"""The orchestration: first saves in fresh processes, then interleaved rounds in one process.

Phase 1: for each tool (and the raw write), a fresh process (see ``fresh``) builds the state and
saves once. Phase 2: this process builds the state once and runs ``repeats + 1`` rounds; round 0
is a warm-up of the saves (recorded, not summarised), the steady state is the median of the
others. Each round runs, in order: raw write (buffered, then O_DIRECT), every save, then (after
round 0) hot read, every load, verify, and the training loop (``loop``) in each of its
modes; the memcpy reference is taken right before the async save. Before each save the tool's previous output is deleted; before each load the tool's files
are read once (hot cache) and the live state is poisoned, so a load that restores nothing fails
the run. Every save, load, reference and training loop starts after ``settle`` idle seconds, so
each operation and the reference it is compared with start alike.
"""

from __future__ import annotations

import functools
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors
import torch

import tardigrade as tg

from .fresh import RAW_WRITE, first_save_in_fresh_process
from .loop import ComputeStep, LoopSpec, train_all
from .measure import Sample, measure, settle
from .raw import Scratch, hot_read, memcpy, raw_write, raw_write_direct, remove, warm
from .state import TrainState, build_state
from .tools import LOADS, SAVES, async_checkpointer, verify_tardigrade

FRESH_TIMEOUT_S = 300
ASYNC_SAVE = "tardigrade_async"  # measured right after a memcpy of the same bytes

Log = Callable[[str], None]


@dataclass(frozen=True, kw_only=True)
class Options:
    """What one benchmark run does."""

    target_bytes: int
    repeats: int
    settle_s: float
    dir: Path
    loop: LoopSpec
    keep_files: bool = False


def _line(what: str, s: Sample, nbytes: int) -> str:
    line = (
        f"{what:<32} {s.seconds:7.3f} s {nbytes / s.seconds / 1e9:6.2f} GB/s  "
        f"peak RSS +{s.peak_rss_above / 1e9:.2f} GB  CPU {s.cpu_seconds:.2f} s"
    )
    if "blocking_s" in s.extra:
        line += f"  blocked {s.extra['blocking_s']:.3f} s"
        if "blocking_cpu_s" in s.extra:
            line += (
                f" (CPU {s.extra['blocking_cpu_s']:.3f} s, "
                f"{s.extra['blocking_faults']:.0f} page faults)"
            )
    return line


def first_saves(opts: Options, log: Log) -> dict[str, dict[str, Any]]:
    """The first save of a fresh process, per tool, each in its own process."""
    out: dict[str, dict[str, Any]] = {}
    for name in [RAW_WRITE, *SAVES]:
        out[name] = first_save_in_fresh_process(
            name, opts.target_bytes, opts.dir / "first", opts.settle_s, FRESH_TIMEOUT_S
        )
        first = out[name]
        log(_line(f"first save {name}", Sample(**first["sample"]), first["state_bytes"]))
        if "memcpy" in first:
            block = first["sample"]["extra"]["blocking_s"]
            copy = first["memcpy"]["seconds"]
            log(
                f"first save {name}: blocked {block:.3f} s, memcpy {copy:.3f} s "
                f"({block / copy:.2f}x); staging reserved in {first['reserve_s']:.2f} s before"
            )
    return out


def one_round(
    r: int,
    state: TrainState,
    scratch: Scratch,
    root: Path,
    expected: dict[str, tuple[float, float]],
    compute: ComputeStep,
    opts: Options,
    log: Log,
) -> dict[str, Any]:
    """One interleaved round: every tool once, next to the references."""
    nbytes = scratch.view.nbytes
    tag = f"round {r}" + (" (warm-up)" if r == 0 else "")
    groups: dict[str, dict[str, Sample]] = {"reference": {}, "save": {}, "load": {}, "verify": {}}
    loop: dict[str, dict[str, Any]] = {}

    def timed(kind: str, name: str, op: Callable[[], Any]) -> None:
        groups[kind][name] = measure(op)
        log(_line(f"{tag} {kind} {name}", groups[kind][name], nbytes))

    raw_path = root / "raw_write"
    remove(raw_path)
    settle(opts.settle_s)
    timed("reference", "raw_write", functools.partial(raw_write, scratch, raw_path))
    direct_path = root / "raw_write_direct"
    remove(direct_path)
    settle(opts.settle_s)
    timed(
        "reference", "raw_write_direct", functools.partial(raw_write_direct, scratch, direct_path)
    )
    remove(direct_path)
    for name, save in SAVES.items():
        path = root / name
        remove(path)
        if name == ASYNC_SAVE:
            # The reference of the async save's blocking time, right before it: two single
            # samples taken minutes apart on a shared machine see different loads from other
            # processes; side by side they see the same.
            settle(opts.settle_s)
            timed("reference", "memcpy", functools.partial(memcpy, scratch, state))
        settle(opts.settle_s)
        timed("save", name, functools.partial(save, state, path))

    # The warm-up round only takes each tool's first save in this process out of the steady
    # state (the training loop's saves included); loads have no first-time cost worth a round
    # of their own.
    if r > 0:
        # References start as the operations they measure do: after the same settle.
        since = time.monotonic()
        warm(raw_path)
        settle(opts.settle_s, since=since)
        timed("reference", "hot_read", functools.partial(hot_read, scratch, raw_path))

        for name, load in LOADS.items():
            path = root / name
            since = time.monotonic()
            warm(path)
            state.poison()
            settle(opts.settle_s, since=since)
            timed("load", name, functools.partial(load, state, path))
            state.check(expected, name)

        tg_path = root / "tardigrade"
        warm(tg_path)
        # Verify's GB/s counts the bytes it hashed (headers and manifest included).
        s = measure(functools.partial(verify_tardigrade, tg_path))
        groups["verify"]["tardigrade"] = s
        log(_line(f"{tag} verify tardigrade", s, int(s.extra["verified_bytes"])))

        loop = train_all(
            state,
            opts.loop,
            compute,
            root / "loop" / f"round-{r}",
            functools.partial(settle, opts.settle_s),
            keep_files=opts.keep_files,
        )
        for mode, x in loop.items():
            log(
                f"{tag} loop {mode:<20} {x['seconds']:7.3f} s {x['steps_per_s']:6.2f} steps/s  "
                f"overhead {x['overhead_pct']:+6.1f}% (CPU {x['cpu_overhead_pct']:+6.1f}%)  "
                f"blocked {x['blocking_s']:.3f} s"
            )

    return {
        "round": r,
        "warmup": r == 0,
        **{kind: {k: v.to_json() for k, v in g.items()} for kind, g in groups.items()},
        "loop": loop,
    }


def run(opts: Options, log: Log) -> dict[str, Any]:
    """Run the whole benchmark; return every raw measurement (``report`` summarises them)."""
    started = time.time()
    t0 = time.perf_counter()
    opts.dir.mkdir(parents=True, exist_ok=True)
    log(f"phase 1: first save of a fresh process, one process per tool, in {opts.dir}")
    first = first_saves(opts, log)

    log("phase 2: building the state in this process")
    state = build_state(opts.target_bytes)
    async_checkpointer(state)  # set up as training would: staging reserved in the background
    nbytes = state.nbytes
    scratch = Scratch(nbytes)
    scratch.fill_from(state)  # pre-faults the reference buffer
    expected = state.fingerprint()
    compute = ComputeStep(opts.loop.matrix, opts.loop.products)
    root = opts.dir / "steady"
    root.mkdir(parents=True, exist_ok=True)
    rounds = []
    try:
        for r in range(opts.repeats + 1):
            rounds.append(one_round(r, state, scratch, root, expected, compute, opts, log))
    finally:
        if not opts.keep_files:
            remove(root)
            remove(opts.dir / "first")
    meta = {
        "state_bytes": nbytes,
        "params": state.params,
        "tensors": len(state.tensors()),
        "width": state.width,
        "depth": len(state.model) // 2 + 1,
        "repeats": opts.repeats,
        "settle_s": opts.settle_s,
        "dir": str(opts.dir),
        "cpu_count": os.cpu_count(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "elapsed_s": time.perf_counter() - t0,
        "versions": {
            "tardigrade": tg.__version__,
            "torch": torch.__version__,
            "safetensors": safetensors.__version__,
            "python": platform.python_version(),
        },
        "tools": {"save": list(SAVES), "load": list(LOADS)},
        "loop": opts.loop.to_json(),
    }
    return {"meta": meta, "first_save": first, "rounds": rounds}
