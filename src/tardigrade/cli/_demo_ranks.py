"""``tardigrade demo --ranks N``: kill -9 one rank of an N-rank job in the middle of a collective
save, resume on N fresh ranks, and show the result is bit-identical to an uninterrupted job.

Each run is N processes (:mod:`tardigrade.cli._demo_rank`) joined into a gloo group through a
store this process serves on 127.0.0.1 only; gloo is told to use the loopback interface too.

1. trains from scratch, saving collectively (``tg.save``) every ``--every`` steps; rank 1 is
   SIGKILLed while it writes its files of the save at ``--kill-at``; the other ranks raise
   ``DistributedError`` within ``timeout`` and the save commits nothing;
2. N fresh ranks restore the newest committed checkpoint (``tg.load(into=state)``, collective)
   and train to the end;
3. N ranks train from scratch to the end without interruption.

The parent compares the final states of runs 2 and 3 (every rank's, per-rank RNG included) and
the loss curves, bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

from .. import Checkpoint, verify
from ..distributed import loopback_store
from ._demo_run import (
    CHILD_TIMEOUT_S,
    EVENT_PREFIX,
    _child_env,
    _prog,
    _span,
    check_args,
    emit_report,
    first_difference,
    identical,
    listed_json,
    prepare_dir,
    print_outcome,
)
from ._listing import COMMITTED, INCOMPLETE_TMP, list_checkpoints
from ._output import ProgressBar, human_bytes, table

# The rank the demo kills: not rank 0, which commits, so the failure is a peer's.
VICTIM = 1
# Seconds a rank waits for the others in a collective save before raising DistributedError.
SAVE_TIMEOUT_S = 10.0
# The loopback interface gloo is told to use, so no rank touches a real network.
LOOPBACK = "lo0" if sys.platform == "darwin" else "lo"


@dataclass
class RanksRun:
    """What the ranks of one run reported."""

    returncodes: list[int | None] = field(default_factory=list)
    killed: dict[str, Any] | None = None  # the victim's "saving" event, once it was killed
    failures: list[dict[str, Any]] = field(default_factory=list)  # "save_failed" events
    restored: dict[str, Any] | None = None
    saves: list[dict[str, Any]] = field(default_factory=list)
    last_step: int = 0
    stderr: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _read_events(rank: int, stream: TextIO, events: queue.Queue[tuple[int, Any]]) -> None:
    for line in stream:
        if line.startswith(EVENT_PREFIX):
            event, _, payload = line[len(EVENT_PREFIX) :].partition(" ")
            events.put((rank, (event, payload)))
    events.put((rank, None))


def run_ranks(
    world: int, argv: list[str], bar: ProgressBar, *, workdir: str, kill_in_save: bool = False
) -> RanksRun:
    """Run ``world`` ranks of the worker with ``argv`` and follow their events.

    With ``kill_in_save`` rank ``VICTIM`` is SIGKILLed as soon as it announces that it has
    written the first bytes of its files of a save (it waits there to be killed); the other
    ranks are then left to notice, fail the save and exit, and are killed if they do not
    within the save timeout and a grace period.
    """
    out = RanksRun()
    events: queue.Queue[tuple[int, Any]] = queue.Queue()
    start = time.perf_counter()
    env = _child_env()
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=LOOPBACK)
    procs: list[subprocess.Popen[str]] = []
    logs = tempfile.mkdtemp(prefix="stderr-", dir=workdir)
    errs = [os.path.join(logs, f"rank-{rank}") for rank in range(world)]
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    try:
        with loopback_store(SAVE_TIMEOUT_S * 6) as port:
            for rank in range(world):
                cmd = [sys.executable, "-m", "tardigrade.cli._demo_rank"]
                cmd += ["--rank", str(rank), "--world", str(world), "--port", str(port)]
                cmd += ["--timeout", str(SAVE_TIMEOUT_S), *argv]
                if kill_in_save and rank != VICTIM:
                    # Only the victim waits in its save to be killed.
                    cmd = _drop_option(cmd, "--hang-in-save")
                with open(errs[rank], "w") as err:  # the child keeps its own descriptor
                    p = subprocess.Popen(
                        cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env
                    )
                procs.append(p)
                assert p.stdout is not None
                threading.Thread(
                    target=_read_events, args=(rank, p.stdout, events), daemon=True
                ).start()
            open_streams = world
            while open_streams:
                try:
                    rank, item = events.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break  # a rank hangs (it should not): all are killed below
                if item is None:
                    open_streams -= 1
                    continue
                event, data = item[0], json.loads(item[1])
                if event == "step":
                    out.last_step = data["step"]
                    bar.update(data["step"])
                elif event == "saving" and kill_in_save and rank == VICTIM and not out.killed:
                    os.kill(procs[rank].pid, signal.SIGKILL)
                    out.killed = data
                    bar.update(out.last_step, f"kill -9 rank {rank} writing step {data['step']}")
                    # The others fail the save within its timeout; past that they are stuck.
                    deadline = min(deadline, time.monotonic() + SAVE_TIMEOUT_S + 30.0)
                elif event == "save_failed":
                    out.failures.append(data)
                elif event == "saved":
                    out.saves.append(data)
                elif event == "restored":
                    out.restored = data
                    bar.update(data["step"], f"restored step {data['step']}")
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            out.returncodes.append(p.returncode)
        for path in errs:
            if os.path.exists(path):
                with open(path) as f:
                    out.stderr.append(f.read())
    out.seconds = time.perf_counter() - start
    bar.close()
    return out


def _drop_option(cmd: list[str], option: str) -> list[str]:
    if option not in cmd:
        return cmd
    i = cmd.index(option)
    return cmd[:i] + cmd[i + 2 :]


def _fail(what: str, run: RanksRun, args: argparse.Namespace) -> int:
    codes = ", ".join(f"rank {r}: {c}" for r, c in enumerate(run.returncodes))
    print(f"tardigrade: error: {what} (exit status {codes})", file=sys.stderr)
    # A script reading the report learns the demo failed, not only the exit status.
    report = {"bit_identical": None, "error": what, "returncodes": run.returncodes}
    tails = [err.strip().splitlines()[-12:] for err in run.stderr]
    emit_report(args, {**report, "stderr_tails": tails})
    for rank, err in enumerate(run.stderr):
        tail = err.strip().splitlines()[-12:]
        if tail:
            print(f"  rank {rank}:\n    " + "\n    ".join(tail), file=sys.stderr)
    return 1


def final_states(path: str, world: int) -> list[Any]:
    """Each rank's view of a final checkpoint: the replicated state and its own per-rank values."""
    ckpt = Checkpoint.open(path)
    return [ckpt.read(rank=r, per_rank_fallback="error") for r in range(world)]


def worker_args(args: argparse.Namespace, ckpt_dir: str) -> tuple[list[str], list[str]]:
    common = ["--steps", str(args.steps), "--seed", str(args.seed)]
    managed = [
        *("--ckpt-dir", ckpt_dir, "--every", str(args.every)),
        *("--keep-last", str(args.keep_last)),
    ]
    return common, managed


def resume_args(newest: str) -> list[str]:
    """What run 2 is told to restore (tests widen it to prove an inexact resume is caught)."""
    return ["--resume", newest]


def run(args: argparse.Namespace) -> int:
    kill_at = check_args(args)
    world = args.ranks
    started = time.perf_counter()
    ckpt_dir = prepare_dir(args.dir)
    show = False if args.no_progress or args.json else None
    common, managed = worker_args(args, ckpt_dir)
    say = (lambda *a: None) if args.json else print
    say(
        f"tardigrade demo --ranks {world}: {world} processes (a gloo group on 127.0.0.1) train "
        f"an MLP with dropout data-parallel\nfor {args.steps} steps: each rank draws its share of "
        "every batch from tg.ResumableSampler, its own\ndropout masks (tg.PerRank(tg.RNGState())), "
        f"gradients all-reduced; every {args.every} steps every rank calls\n"
        f'  tg.save(f"{args.dir}/step-{{step:09d}}", state, timeout={SAVE_TIMEOUT_S:g})'
        "   # collective: each rank writes its files, rank 0 commits"
    )
    with tempfile.TemporaryDirectory(prefix="tardigrade-demo-") as tmp:
        first = run_ranks(
            world,
            [*common, *managed, "--hang-in-save", str(kill_at)],
            ProgressBar(args.steps, "run 1: train, kill -9 rank mid-save", enabled=show),
            workdir=tmp,
            kill_in_save=True,
        )
        survivors = [r for r in range(world) if r != VICTIM]
        if (
            first.killed is None
            or first.returncodes[VICTIM] != -signal.SIGKILL
            or sorted(f["rank"] for f in first.failures) != survivors
        ):
            return _fail("run 1 was not killed in the middle of a save as planned", first, args)
        listing = list_checkpoints(ckpt_dir)
        committed_1 = [c for c in listing if c.status == COMMITTED]
        leftovers = [c.name for c in listing if c.status == INCOMPLETE_TMP]
        killed_step = first.killed["step"]
        if not committed_1 or any(c.step == killed_step for c in committed_1):
            return _fail(
                f"run 1 left no usable checkpoint or committed step {killed_step}", first, args
            )
        newest = committed_1[-1]
        intact = verify(os.path.join(ckpt_dir, newest.name))

        resumed_final = os.path.join(tmp, "resumed")
        second = run_ranks(
            world,
            [
                *common,
                *managed,
                *resume_args(os.path.join(ckpt_dir, newest.name)),
                *("--final", resumed_final),
            ],
            ProgressBar(args.steps, "run 2: resume, train to the end   ", enabled=show),
            workdir=tmp,
        )
        if any(second.returncodes) or second.restored is None:
            return _fail("run 2 (resume) failed", second, args)

        reference_final = os.path.join(tmp, "reference")
        third = run_ranks(
            world,
            [*common, "--final", reference_final],
            ProgressBar(args.steps, "run 3: uninterrupted reference    ", enabled=show),
            workdir=tmp,
        )
        if any(third.returncodes):
            return _fail("run 3 (uninterrupted reference) failed", third, args)
        resumed = final_states(resumed_final, world)
        reference = final_states(reference_final, world)

    losses_a, losses_b = resumed[0]["losses"], reference[0]["losses"]
    checks = [
        ("final parameters", identical(resumed[0]["model"], reference[0]["model"])),
        ("optimizer state", identical(resumed[0]["optim"], reference[0]["optim"])),
        (f"loss curve ({len(losses_b)} steps)", identical(losses_a, losses_b)),
        ("data position", identical(resumed[0]["data"], reference[0]["data"])),
        (
            f"RNG state of each of the {world} ranks",
            all(identical(a["rng"], b["rng"]) for a, b in zip(resumed, reference, strict=True)),
        ),
    ]
    failure = first.failures[0]
    if args.json or args.report:
        same = all(ok for _, ok in checks)
        runs = ((1, first), (2, second), (3, third))
        report = {
            "bit_identical": same,
            "checks": [{"what": what, "identical": ok} for what, ok in checks],
            "first_differing_loss_step": first_difference(losses_a, losses_b),
            "ranks": world,
            "dir": args.dir,
            "steps": args.steps,
            "every": args.every,
            "keep_last": args.keep_last,
            "seed": args.seed,
            "killed": {
                "rank": VICTIM,
                "step": killed_step,  # the collective save rank VICTIM was writing
                "file": first.killed["file"],
                "failures": first.failures,  # what the surviving ranks raised
                "on_disk_after": listed_json(listing),
                "resumed_from": newest.name,
                "verified": asdict(intact),
            },
            "restored": second.restored,  # what tg.load(into=state) restored on run 2's ranks
            "resumed_from_step": second.restored["step"],
            "runs": [
                {
                    "run": i,
                    "returncodes": r.returncodes,
                    "last_step": r.last_step,
                    "seconds": r.seconds,
                }
                for i, r in runs
            ],
            "saves": [{"run": i, **s} for i, r in runs[:2] for s in r.saves],
            "checkpoints": listed_json(list_checkpoints(ckpt_dir)),
            "seconds": round(time.perf_counter() - started, 3),
        }
        emit_report(args, report)
        if args.json:
            return 0 if same else 1
    print()
    staging, _, file = first.killed["file"].partition(os.sep)
    print(
        f"run 1  {world} ranks from scratch; rank {VICTIM} was killed (SIGKILL) at step "
        f"{killed_step} while writing its file\n       {file} of the collective save of step "
        f"{killed_step}\n       (in {staging})"
    )
    print(
        f"       rank(s) {', '.join(map(str, survivors))} raised {failure['error']} "
        f"{failure['seconds']:.1f} s into the save:\n         "
        + textwrap.shorten(failure["message"], 180, placeholder=" ...")
        + f"\n       nothing of step {killed_step} was committed"
        + (
            f" (staging left: {', '.join(leftovers)})"
            if leftovers
            else "; rank 0 removed its staging directory"
        )
    )
    print(
        f"       on disk: {len(committed_1)} committed checkpoints ({_span([c.name for c in committed_1])}); "
        f"the previous one, {newest.name}, is intact:\n       tg.verify checked "
        f"{intact.files} files, {intact.tensors} tensors, {human_bytes(intact.nbytes)}"
    )
    restored = second.restored
    print(
        f'run 2  {world} fresh ranks: tg.load("{args.dir}/{newest.name}", into=state) on every '
        f"rank -> step {restored['step']}\n       (data position: epoch {restored['data']['epoch']}, "
        f"{restored['data']['consumed']} of {restored['data']['dataset_len']} samples consumed); "
        f"trained steps {restored['step'] + 1} to {second.last_step}"
        + (f"; NOT restored: {', '.join(restored['skipped'])}" if restored["skipped"] else "")
    )
    print(
        f"run 3  {world} ranks uninterrupted from scratch to step {third.last_step}, no checkpoints"
    )
    print()
    print(
        table([[what, "yes" if ok else "NO"] for what, ok in checks], ["SAME AS RUN 3", "BITWISE"])
    )
    if not identical(losses_a, losses_b):
        print(f"  first differing loss at step {first_difference(losses_a, losses_b)}")
    print()
    saves = first.saves + second.saves
    print(
        f"saves: {len(saves)} committed ({len(first.saves)} by run 1, {len(second.saves)} by run "
        f"2), {human_bytes(saves[-1]['nbytes']) if saves else '0 B'} each in "
        f"{saves[-1]['files'] if saves else 0} files, "
        f"{sum(s['seconds'] for s in saves) / max(1, len(saves)) * 1000:.1f} ms per save"
    )
    listing = list_checkpoints(ckpt_dir)
    same = print_outcome(
        f"checkpoints in {args.dir} (keep_last={args.keep_last}):",
        listing,
        checks,
        time.perf_counter() - started,
        f"{_prog()} inspect {args.dir}/{listing[-1].name if listing else ''}",
    )
    return 0 if same else 1
