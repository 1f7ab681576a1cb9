"""``python -m bench``: run the benchmark, print the table, write every number to JSON."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from . import cadence, cli_start, distributed, loop, node_loss, overlap, same_node, shared, store
from .measure import freeze_imports
from .report import Target, summarise, table, targets, targets_table
from .run import Options, run
from .state import DEFAULT_STATE_BYTES, parse_size

RESULTS = Path(__file__).resolve().parent / "results"  # gitignored

DEFAULTS = {"size": "1", "repeats": 3, "settle": 2.5}
QUICK = {"size": "0.02", "repeats": 1, "settle": 0.0}

EPILOG = f"""\
--size is either a fraction of the default state (1 = {DEFAULT_STATE_BYTES / 1e9:.2f} GB:
a 15-layer 4096-wide fp32 MLP, 251.7M parameters, plus Adam's two moments) or a byte count with a
unit (B, kB, MB, GB, KiB, MiB, GiB). Examples: --size 0.05 (5%, ~151 MB), --size 20MB.

The training loop (--loop-every, --loop-saves) repeats a fixed compute step, whatever --size:
{loop.FULL.products} products of {loop.FULL.matrix}x{loop.FULL.matrix} fp32 matrices a step, ~65 ms here ({loop.QUICK.products} of \
{loop.QUICK.matrix}x{loop.QUICK.matrix} with --quick).
It runs without checkpoints, with Tardigrade's AsyncCheckpointer and with DCP's async_save, and
reports each one's wall time over the loop without checkpoints as overhead %.

--settle idles before every save, load and training loop: this VM hands freed memory back to the
host after ~2 s idle, after which fresh allocations fault in at ~0.5 GB/s. Idling gives every
tool the same start, as between two real checkpoints; --settle 0 measures saves back to back.

Then the distributed part (--no-distributed skips it, --distributed-only runs it alone): 2 ranks
on gloo, each holding its rows of a DTensor state (MLP weights + Adam moments, Shard(0)) of
--dist-size per rank (a fraction of {distributed.DEFAULT_RANK_BYTES / 1e9:g} GB or bytes with a unit; by default
the same fraction as --size), save and load with Tardigrade and DCP next to a raw O_DIRECT write,
a 2 -> 1 resharding load in one process, a replicated (DDP-style) save, the per-step agreement
collective and the plan cache.

Then the store part (--no-store skips it): checkpoints on S3, on a SeaweedFS server started on
loopback for the run (the `weed` of the test extra): Tardigrade's save (sync and async) and load
of a {store.DEFAULT_STORE_BYTES / 1e9:g} GB state (times the --size fraction) next to the raw parallel put/get of the same
bytes with the same client (obstore) and DCP's fsspec writer/reader (with s3fs installed).

Then restore right after a save on the same node (a --size state): a job killed after its save
restarts and restores from the RAM tier (/dev/shm), from disk (cold: the O_DIRECT save left
nothing in the page cache), and DCP's load from the page cache after its save; plus a manager's
async-save blocking with and without the RAM tier.

Then shared data (format 7): a LoRA-like state (a frozen base of 2/3 of the --size state and
a ~2% adapter with AdamW) saved with and without sharing, uploaded, a dense state where
everything changes (sharing must cost nothing there), and a load spread over 10 saves.

Then overlap: a 1/4 --size state saved with and without overlap=True before a training step
of at least a memcpy of compute and an Adam step (the fence): blocking and the next step.

Then cadence: a manager choosing its interval from the measured cost of its saves, over a
1/8 --size state and the loop's compute step, 40 s a run (8 s with --quick):
OverheadBudget(0.02) (blocking over wall time) and YoungDaly (the gap between saves against
sqrt(2 C M)).

A default run (3 GB, 3 repeats + 1 warm-up) takes about 7-9 minutes on a 2-core VM, plus a few
minutes for the distributed part (1 GB per rank).
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="Benchmark Tardigrade's save, load and verify against torch.save, "
        "safetensors, DCP and this machine's physical limits.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--size",
        help=f"state size: fraction of the ~3 GB default or bytes with a unit, e.g. 0.05 or "
        f"20MB (default {DEFAULTS['size']}; {QUICK['size']} with --quick)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        help=f"measured rounds after the warm-up round (default {DEFAULTS['repeats']}; "
        f"{QUICK['repeats']} with --quick)",
    )
    p.add_argument(
        "--settle",
        type=float,
        help=f"idle seconds before each save and load (default {DEFAULTS['settle']}; "
        f"{QUICK['settle']:g} with --quick)",
    )
    p.add_argument(
        "--loop-every",
        type=int,
        help=f"training-loop steps between two saves (default {loop.FULL.every}; "
        f"{loop.QUICK.every} with --quick)",
    )
    p.add_argument(
        "--loop-saves",
        type=int,
        help=f"saves per training loop (default {loop.FULL.saves}; {loop.QUICK.saves} with "
        "--quick)",
    )
    p.add_argument(
        "--dir",
        type=Path,
        help="where checkpoints are written (default: a new directory under bench/results/); "
        "the files are deleted at the end unless --keep-files",
    )
    p.add_argument(
        "--out", type=Path, help="JSON results file (default bench/results/<timestamp>.json)"
    )
    p.add_argument(
        "--quick", action="store_true", help="smoke test: small state, 1 repeat, no settle"
    )
    p.add_argument(
        "--keep-files", action="store_true", help="keep the checkpoints written under --dir"
    )
    p.add_argument(
        "--dist-size",
        help="the distributed part's sharded state per rank: a fraction of "
        f"{distributed.DEFAULT_RANK_BYTES / 1e9:g} GB or bytes with a unit (default: the same "
        "fraction as --size)",
    )
    p.add_argument("--no-store", action="store_true", help="skip the S3 store part")
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--no-distributed", action="store_true", help="skip the 2-rank distributed part"
    )
    which.add_argument(
        "--distributed-only", action="store_true", help="run only the 2-rank distributed part"
    )
    args = p.parse_args(argv)
    base = QUICK if args.quick else DEFAULTS
    for key, value in base.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        args.target_bytes = parse_size(args.size)
        args.dist_bytes = (
            round(args.target_bytes / DEFAULT_STATE_BYTES * distributed.DEFAULT_RANK_BYTES)
            if args.dist_size is None
            else parse_size(
                args.dist_size, whole=distributed.DEFAULT_RANK_BYTES, option="--dist-size"
            )
        )
    except ValueError as e:
        p.error(str(e))
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.settle < 0:
        p.error("--settle must be 0 or more seconds")
    spec = loop.QUICK if args.quick else loop.FULL
    args.loop = dataclasses.replace(
        spec,
        every=spec.every if args.loop_every is None else args.loop_every,
        saves=spec.saves if args.loop_saves is None else args.loop_saves,
    )
    if args.loop.every < 1 or args.loop.saves < 1:
        p.error("--loop-every and --loop-saves must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    freeze_imports()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out or RESULTS / f"{stamp}.json"
    opts = Options(
        target_bytes=args.target_bytes,
        repeats=args.repeats,
        settle_s=args.settle,
        dir=args.dir or RESULTS / f"{stamp}-files",
        loop=args.loop,
        keep_files=args.keep_files,
    )
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    if args.repeats < 3:
        log(f"note: {args.repeats} repeat(s); use at least 3 for numbers worth comparing")
    results: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    goals: list[Target] = []
    sections = []
    if not args.distributed_only:
        results = run(opts, log)
        summary = summarise(results)
        goals = targets(summary, results["meta"]["cpu_count"] or 1)
        sections.append(table(results, summary, None))
    if not args.no_distributed:
        dist_opts = distributed.DistOptions(
            rank_bytes=args.dist_bytes,
            repeats=args.repeats,
            settle_s=args.settle,
            dir=opts.dir / "distributed",
            keep_files=args.keep_files,
        )
        results["distributed"] = distributed.run(dist_opts, log)
        summary["distributed"] = distributed.summarise(results["distributed"])
        goals += distributed.targets(summary["distributed"])
        sections.append(distributed.table(results["distributed"], summary["distributed"]))
    if not args.distributed_only and not args.no_store:
        store_opts = store.StoreOptions(
            nbytes=round(args.target_bytes / DEFAULT_STATE_BYTES * store.DEFAULT_STORE_BYTES),
            repeats=args.repeats,
            settle_s=args.settle,
        )
        results["store"] = store.run(store_opts, log)
        summary["store"] = store.summarise(results["store"])
        goals += store.targets(summary["store"])
        sections.append(store.table(results["store"], summary["store"]))
    if not args.distributed_only and not args.no_store:
        loss_opts = node_loss.NodeLossOptions(
            rank_bytes=round(
                args.target_bytes / DEFAULT_STATE_BYTES * node_loss.DEFAULT_RANK_BYTES
            ),
            repeats=args.repeats,
            settle_s=args.settle,
        )
        results["node_loss"] = node_loss.run(loss_opts, log)
        summary["node_loss"] = node_loss.summarise(results["node_loss"])
        goals += node_loss.targets(summary["node_loss"])
        sections.append(node_loss.table(results["node_loss"], summary["node_loss"]))
    if not args.distributed_only:
        same_opts = same_node.SameNodeOptions(
            nbytes=args.target_bytes, repeats=args.repeats, settle_s=args.settle, dir=opts.dir
        )
        results["same_node"] = same_node.run(same_opts, log)
        summary["same_node"] = same_node.summarise(results["same_node"])
        goals += same_node.targets(summary["same_node"])
        sections.append(same_node.table(results["same_node"], summary["same_node"]))
    if not args.distributed_only:
        shared_opts = shared.SharedOptions(
            nbytes=args.target_bytes * 2 // 3,  # the frozen base: ~2 GB at the default size
            repeats=args.repeats,
            settle_s=args.settle,
            dir=opts.dir,
        )
        results["shared"] = shared.run(shared_opts, log)
        summary["shared"] = shared.summarise(results["shared"])
        goals += shared.targets(summary["shared"])
        sections.append(shared.table(results["shared"], summary["shared"]))
    if not args.distributed_only:
        overlap_opts = overlap.OverlapOptions(
            nbytes=args.target_bytes // 4,
            repeats=args.repeats,
            settle_s=args.settle,
            dir=opts.dir,
        )
        results["overlap"] = overlap.run(overlap_opts, log)
        summary["overlap"] = overlap.summarise(results["overlap"])
        goals += overlap.targets(summary["overlap"])
        sections.append(overlap.table(results["overlap"], summary["overlap"]))
    if not args.distributed_only:
        cadence_opts = cadence.CadenceOptions(
            nbytes=args.target_bytes // 8,
            seconds=8.0 if args.quick else 40.0,
            settle_s=args.settle,
            dir=opts.dir,
        )
        results["cadence"] = cadence.run(cadence_opts, log)
        summary["cadence"] = cadence.summarise(results["cadence"])
        goals += cadence.targets(summary["cadence"])
        sections.append(cadence.table(results["cadence"], summary["cadence"]))
    if not args.distributed_only:
        log("CLI start-up (commands that need no torch)")
        # A median of 5 runs per command by default (3 repeats), of 3 with --quick.
        results["cli_start_s"] = cli_start.measure(runs=2 + args.repeats)
        goals += cli_start.targets(results["cli_start_s"])
    if args.dir is None and not args.keep_files:
        try:
            opts.dir.rmdir()  # ours, and empty once the runs removed the checkpoints
        except OSError:
            pass
    results["summary"] = summary
    results["targets"] = [g.to_json() for g in goals]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print("\n\n".join([*sections, targets_table(goals)]))
    print(f"\nall numbers: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
