"""``python -m bench.async_probe``: async save blocking vs memcpy, round by round, quickly.

For iterating on the async save's blocking time without a full ``make bench``: builds the bench
state once, reserves the checkpointer's staging (as training would) unless ``--no-reserve``,
then alternates a memcpy of the state into a pre-faulted buffer and an async save of the same
state, each after ``--gap`` idle seconds (this VM hands freed memory back after ~2 s idle).
Round 0 is the process's first save. Per round it prints both times, their ratio, the page
faults and CPU seconds of the blocking phase (CPU well under 2x the wall time on 2 cores:
other processes had the cores) and the load average.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import tardigrade as tg

from .raw import Scratch, memcpy
from .state import build_state, parse_size


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.async_probe", description=__doc__)
    p.add_argument("--size", default="1.5GB", help="state size (as bench --size; default 1.5GB)")
    p.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    p.add_argument("--gap", type=float, default=3.0, help="idle seconds before each op")
    p.add_argument("--no-reserve", action="store_true", help="do not reserve staging first")
    p.add_argument("--dir", type=Path, help="where to save (default: a temporary directory)")
    args = p.parse_args(argv)

    state = build_state(parse_size(args.size))
    scratch = Scratch(state.nbytes)
    scratch.fill_from(state)
    ckpt = tg.AsyncCheckpointer()
    if not args.no_reserve:
        t = time.perf_counter()
        ckpt.reserve(state.live)
        ckpt.wait_reserved()
        print(f"staging reserved in {time.perf_counter() - t:.2f} s", flush=True)
    root = args.dir or Path(tempfile.mkdtemp(prefix="tg-async-probe-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"state {state.nbytes / 1e9:.2f} GB, saving under {root}", flush=True)

    def idle() -> None:
        gc.collect()
        time.sleep(args.gap)

    ratios = []
    try:
        for r in range(args.rounds):
            idle()
            t = time.perf_counter()
            memcpy(scratch, state)
            copy_s = time.perf_counter() - t
            idle()
            path = root / f"round-{r}"
            faults, cpu, t = _faults(), time.process_time(), time.perf_counter()
            fut = ckpt.save(path, state.live)
            block_s = time.perf_counter() - t
            faults, cpu = _faults() - faults, time.process_time() - cpu
            assert fut is not None
            fut.result()
            shutil.rmtree(path)
            ratios.append(block_s / copy_s)
            print(
                f"round {r}{' (first save)' if r == 0 else ''}: memcpy {copy_s:.3f} s, "
                f"async blocked {block_s:.3f} s ({ratios[-1]:.2f}x; CPU {cpu:.2f} s, "
                f"{faults} page faults), load average {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    finally:
        ckpt.close()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    if ratios:
        print(
            f"ratio median {statistics.median(ratios):.2f}x, min {min(ratios):.2f}x, "
            f"max {max(ratios):.2f}x over {len(ratios)} rounds"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
