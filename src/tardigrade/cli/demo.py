"""``tardigrade demo``: kill -9 a training run in the middle of a save, resume it, and show that
the result is bit-identical to a run that was never interrupted.

Three child processes run the same training script (:mod:`tardigrade.cli._demo_worker`), the
loop a user writes: a ``tg.CheckpointManager`` saving asynchronously every N steps and keeping
the last K, ``start = mgr.restore()``, and a ``DataLoader`` over a ``tg.ResumableSampler``:

1. trains from scratch and is SIGKILLed while the background writer of one save is writing;
2. restarts; ``mgr.restore()`` skips the killed save, restores the newest complete checkpoint,
   and the run trains to the end;
3. trains from scratch to the end without interruption (and without checkpoints).

The parent then compares the final parameters, optimizer state and loss curve of runs 2 and 3,
and reports what ``restore()`` did, what retention kept and the manager's per-save stats.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .. import Catalog, load
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
from ._listing import COMMITTED, INCOMPLETE_TMP, list_checkpoints, step_from_name
from ._output import ProgressBar, human_bytes, table

HELP = "kill -9 a training run mid-save, resume it, check it is bit-identical"
DEFAULT_DIR = os.path.join("demo-run", "ckpt")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help=HELP,
        description=(
            "Train a small MLP in a child process with a tg.CheckpointManager that saves "
            "asynchronously every --every steps and keeps the last --keep-last, and SIGKILL it "
            "while the background writer of the save at --kill-at is writing. Resume in a new "
            "process with mgr.restore(), train to the end, and compare with an uninterrupted "
            "run: parameters, optimizer state and loss curve must be bit-identical. Exits 1 if "
            "they are not. With --ranks N, N processes train data-parallel and save "
            "collectively with tg.save; rank 1 is killed while it writes its files of a save, "
            "and N fresh ranks resume with tg.load(into=state)."
        ),
    )
    p.add_argument(
        "--dir",
        default=DEFAULT_DIR,
        help=f"checkpoint directory of the run; cleared first (default: {DEFAULT_DIR})",
    )
    p.add_argument("--steps", type=int, default=300, help="training steps (default: 300)")
    p.add_argument("--every", type=int, default=25, help="checkpoint interval (default: 25)")
    p.add_argument(
        "--keep-last",
        type=int,
        default=4,
        metavar="K",
        help="retention: keep the K newest checkpoints (default: 4)",
    )
    p.add_argument(
        "--kill-at",
        type=int,
        default=None,
        metavar="STEP",
        help="kill the run while it saves this step (default: the save nearest 60%% of --steps)",
    )
    p.add_argument(
        "--ranks",
        type=int,
        default=1,
        metavar="N",
        help="train data-parallel on N processes (a gloo group on 127.0.0.1) that save "
        "collectively with tg.save, and kill -9 rank 1 while it writes its files of a save "
        "(default: 1, one process with a tg.CheckpointManager)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of data, model and shuffling")
    p.add_argument(
        "-q",
        "--quiet",
        "--no-progress",
        dest="no_progress",
        action="store_true",
        help="no progress bar (as every command's --quiet; --no-progress is the old name)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print the report as one JSON object (verdict, checks, kill point, restore, saves, "
        "checkpoints left) instead of text; no progress bar",
    )
    p.add_argument(
        "--report",
        metavar="FILE",
        help="also write the JSON report (as --json prints it) to FILE, e.g. for a CI job",
    )
    p.set_defaults(run=run)


@dataclass
class ChildRun:
    """What one child process reported."""

    returncode: int = 0
    killed_in_save: int | None = None
    staging_file: str | None = None
    restored: dict[str, Any] | None = None  # what mgr.restore() found, skipped and restored
    saves: list[dict[str, Any]] = field(default_factory=list)  # mgr.stats entries, as JSON
    stats: dict[str, Any] | None = None  # mgr.stats totals, sent after mgr.close()
    last_step: int = 0
    stderr: str = ""
    seconds: float = 0.0


def run_child(
    argv: list[str], bar: ProgressBar, *, kill_in_save: bool = False, workdir: str
) -> ChildRun:
    """Run the worker with ``argv`` and follow its events.

    With ``kill_in_save``, SIGKILL it once a save's background writer has announced that it is
    writing (and is held there) and training has finished a later step: the manager has then
    recorded every earlier save, and the save being written is in flight.
    """
    out = ChildRun()
    writing: dict[str, Any] | None = None
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+", dir=workdir) as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tardigrade.cli._demo_worker", *argv],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=_child_env(),
        )
        timer = _kill_after(proc, CHILD_TIMEOUT_S)
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                if not line.startswith(EVENT_PREFIX):
                    continue
                event, _, payload = line[len(EVENT_PREFIX) :].partition(" ")
                data = json.loads(payload)
                if event == "step":
                    out.last_step = data["step"]
                    bar.update(data["step"])
                    if (
                        writing is not None
                        and out.killed_in_save is None
                        and data["step"] > writing["step"]
                    ):
                        os.kill(proc.pid, signal.SIGKILL)
                        out.killed_in_save = writing["step"]
                        out.staging_file = writing["file"]
                        bar.update(data["step"], f"kill -9 while writing step {writing['step']}")
                elif event == "saved":
                    out.saves.append(data)
                elif event == "stats":
                    out.stats = data
                elif event == "restored":
                    out.restored = data
                    if data["step"] is not None:
                        bar.update(data["step"], f"restored {data['name']}")
                elif event == "saving" and kill_in_save:
                    writing = data  # its first data file is partly written; the writer waits
        finally:
            out.returncode = proc.wait()
            timer.cancel()
            err.seek(0)
            out.stderr = err.read()
    out.seconds = time.perf_counter() - start
    bar.close()
    return out


def _kill_after(proc: subprocess.Popen[str], seconds: float) -> threading.Timer:
    """A watchdog: a child that hangs (it should not) is killed instead of hanging the demo."""

    def kill() -> None:
        if proc.poll() is None:
            proc.kill()

    timer = threading.Timer(seconds, kill)
    timer.daemon = True
    timer.start()
    return timer


# ----------------------------------------------------------------------------------------------


def _fail(what: str, child: ChildRun, args: argparse.Namespace) -> int:
    print(f"tardigrade: error: {what} (exit status {child.returncode})", file=sys.stderr)
    tail = child.stderr.strip().splitlines()[-20:]
    # A script reading the report learns the demo failed, not only the exit status.
    report = {"bit_identical": None, "error": what, "returncode": child.returncode}
    emit_report(args, {**report, "stderr_tail": tail})
    if tail:
        print("  " + "\n  ".join(tail), file=sys.stderr)
    return 1


def _short(message: str, ckpt_dir: str, shown_as: str) -> str:
    """A library message with the absolute checkpoint directory written as the user gave it."""
    return message.removeprefix("tardigrade: ").replace(ckpt_dir, shown_as)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def _saves_table(runs: list[tuple[str, ChildRun]]) -> str:
    rows = [
        [
            str(s["step"]),
            run,
            human_bytes(s["nbytes"]),
            _ms(s["blocking_seconds"]),
            _ms(s["total_seconds"]),
            f"{s['throughput_gbps']:.3f}",
            "yes" if s["ok"] else f"NO: {s['error']}",
        ]
        for run, child in runs
        for s in child.saves
    ]
    return table(rows, ["STEP", "RUN", "SIZE", "BLOCKED", "TOTAL", "GB/S", "OK"], indent="  ")


def report_restore(restored: dict[str, Any], ckpt_dir: str, shown_as: str) -> list[str]:
    """What ``mgr.restore()`` did in run 2, one line each."""
    lines = [f"log: {_short(w, ckpt_dir, shown_as)}" for w in restored["warnings"]]
    for name in restored["removed"]:
        lines.append(
            f"skipped the incomplete save {name}\n  (no manifest: it never committed) and removed it"
        )
    for name in restored["skipped"]:
        lines.append(f"skipped {name} (see the log line; kept on disk for inspection)")
    if restored["name"] is None:
        lines.append("found no complete checkpoint: training starts from scratch")
        return lines
    data = restored["data"]
    lines.append(
        f"verified {restored['name']} and restored it into the live state: model, optimizer,\n"
        f"  LR schedule, RNGs, data position (epoch {data['epoch']}, {data['consumed']} of "
        f"{data['dataset_len']} samples consumed), step,\n"
        f"  loss history (last loss {restored['loss']:.4f})"
    )
    return lines


def _json_report(
    args: argparse.Namespace,
    ckpt_dir: str,
    runs: tuple[ChildRun, ChildRun, ChildRun],
    checks: list[tuple[str, bool]],
    on_disk: list[Any],
    lock_left: bool,
) -> dict[str, Any]:
    """What the text report says, as one JSON object (``--json``)."""
    first, second, third = runs
    restored = second.restored or {}
    saves = [{"run": i, **s} for i, child in ((1, first), (2, second)) for s in child.saves]
    return {
        "bit_identical": all(ok for _, ok in checks),
        "checks": [{"what": what, "identical": ok} for what, ok in checks],
        "ranks": 1,
        "dir": args.dir,
        "steps": args.steps,
        "every": args.every,
        "keep_last": args.keep_last,
        "seed": args.seed,
        "killed": {
            "step": first.killed_in_save,  # the save in flight when run 1 was SIGKILLed
            "training_step": first.last_step,
            "staging_file": first.staging_file,
            "on_disk_after": listed_json(on_disk),
            "lock_left": lock_left,
        },
        "restored": restored,  # what mgr.restore() did in run 2: step, name, skipped, ...
        "resumed_from_step": restored.get("step"),
        "runs": [
            {"run": i, "returncode": c.returncode, "last_step": c.last_step, "seconds": c.seconds}
            for i, c in ((1, first), (2, second), (3, third))
        ],
        "saves": saves,  # mgr.stats entries of runs 1 and 2
        "stats": second.stats,  # run 2's mgr.stats totals after mgr.close()
        "checkpoints": listed_json(list_checkpoints(ckpt_dir)),
    }


def run(args: argparse.Namespace) -> int:
    if args.ranks > 1:
        # Imports torch.distributed, which the one-process demo does not need.
        from ._demo_ranks import run as run_ranks

        return run_ranks(args)
    kill_at = check_args(args)
    started = time.perf_counter()
    ckpt_dir = prepare_dir(args.dir)
    show = False if args.no_progress or args.json else None
    common = ["--steps", str(args.steps), "--seed", str(args.seed)]
    managed = [
        *("--ckpt-dir", ckpt_dir, "--every", str(args.every)),
        *("--keep-last", str(args.keep_last)),
    ]
    say = (lambda *a: None) if args.json else print
    say(
        f"tardigrade demo: {args.steps} steps of an MLP with dropout, Adam, cosine LR and "
        "shuffled batches\n(a DataLoader over tg.ResumableSampler), checkpointed by\n"
        f'  mgr = tg.CheckpointManager("{args.dir}", state, every_steps={args.every}, '
        f"keep_last={args.keep_last}, async_save=True)"
    )
    with tempfile.TemporaryDirectory(prefix="tardigrade-demo-") as tmp:
        first = run_child(
            [*common, *managed, "--hang-in-save", str(kill_at)],
            ProgressBar(args.steps, "run 1: train, kill -9 mid-save ", enabled=show),
            kill_in_save=True,
            workdir=tmp,
        )
        if first.killed_in_save is None or first.returncode != -signal.SIGKILL:
            return _fail("run 1 was not killed in the middle of a save as planned", first, args)
        on_disk = list_checkpoints(ckpt_dir)
        lock_left = Catalog(ckpt_dir).storage.exists(Catalog.LOCK)

        resumed_final = os.path.join(tmp, "resumed")
        second = run_child(
            [*common, *managed, "--final", resumed_final],
            ProgressBar(args.steps, "run 2: resume, train to the end", enabled=show),
            workdir=tmp,
        )
        if second.returncode != 0 or second.restored is None:
            return _fail("run 2 (resume) failed", second, args)

        reference_final = os.path.join(tmp, "reference")
        third = run_child(
            [*common, "--final", reference_final],
            ProgressBar(args.steps, "run 3: uninterrupted reference ", enabled=show),
            workdir=tmp,
        )
        if third.returncode != 0:
            return _fail("run 3 (uninterrupted reference) failed", third, args)

        resumed = load(resumed_final)
        reference = load(reference_final)

    checks = [
        ("final parameters", identical(resumed["model"], reference["model"])),
        ("optimizer state", identical(resumed["optim"], reference["optim"])),
        (
            f"loss curve ({len(reference['losses'])} steps)",
            identical(resumed["losses"], reference["losses"]),
        ),
        (
            "LR schedule, RNGs, data position, counters",
            all(
                identical(resumed[k], reference[k])
                for k in ("sched", "rng", "data", "step", "epoch")
            ),
        ),
    ]
    restored = second.restored
    resumed_step = restored["step"]
    if args.json or args.report:
        report = _json_report(args, ckpt_dir, (first, second, third), checks, on_disk, lock_left)
        report.update(
            first_differing_loss_step=first_difference(resumed["losses"], reference["losses"]),
            seconds=round(time.perf_counter() - started, 3),
        )
        emit_report(args, report)
        if args.json:
            return 0 if report["bit_identical"] else 1

    print()
    committed_1 = [c.name for c in on_disk if c.status == COMMITTED]
    tmp_left = [c.name for c in on_disk if c.status == INCOMPLETE_TMP]
    print(
        f"run 1  start = mgr.restore() -> {(first.restored or {}).get('step')} (empty directory); "
        f"trained from step 1, SIGKILLed at step {first.last_step}\n"
        f"       while the background writer of the async save of step {first.killed_in_save} "
        f"was writing\n       {first.staging_file}"
    )
    print(
        f"       on disk after the kill: {len(committed_1)} committed checkpoints "
        f"({_span(committed_1)};\n       {sum(s['ok'] for s in first.saves)} saved, "
        f"keep_last={args.keep_last}), {len(tmp_left)} incomplete .tmp dir (the killed save)"
        + (", the dead run's .lock" if lock_left else "")
    )
    print(f"run 2  a new process: start = mgr.restore() -> {resumed_step}")
    for line in report_restore(restored, ckpt_dir, args.dir):
        print("       " + line.replace("\n", "\n       "))
    totals = second.stats or {}
    print(
        f"       trained steps {(resumed_step or 0) + 1} to {second.last_step}; after mgr.close(), "
        f"mgr.stats: {totals.get('succeeded')} saves succeeded, {totals.get('failed')} failed"
    )
    print(f"run 3  uninterrupted run from scratch to step {third.last_step}, no checkpoints")
    print()
    print(
        table([[what, "yes" if ok else "NO"] for what, ok in checks], ["SAME AS RUN 3", "BITWISE"])
    )
    if not identical(resumed["losses"], reference["losses"]):
        print(
            f"  first differing loss at step {first_difference(resumed['losses'], reference['losses'])}"
        )
    print()
    skipped = [
        *(f"the incomplete save of step {step_from_name(n)}" for n in restored["removed"]),
        *restored["skipped"],
    ]
    listing = list_checkpoints(ckpt_dir)
    kept = [c.name for c in listing if c.status == COMMITTED]
    saves = [s for child in (first, second) for s in child.saves]
    ok = [s for s in saves if s["ok"]]
    blocked = sum(s["blocking_seconds"] for s in ok)
    total = sum(s["total_seconds"] for s in ok)
    n = max(len(ok), 1)
    summary = [
        (
            "killed at step",
            f"{first.killed_in_save} (in the middle of its async save; training had reached "
            f"step {first.last_step})",
        ),
        (
            "resumed from step",
            f"{resumed_step if resumed_step is not None else 0} "
            + (
                f"({restored['name']}; restore() skipped {', '.join(skipped) or 'nothing'})"
                if restored["name"]
                else "(no complete checkpoint yet)"
            ),
        ),
        (
            "retention",
            f"keep_last={args.keep_last}: {len(ok)} checkpoints saved "
            f"({sum(s['ok'] for s in first.saves)} by run 1, "
            f"{sum(s['ok'] for s in second.saves)} by run 2), {len(kept)} on disk "
            f"({_span(kept)}); each older one was deleted once a newer one had committed",
        ),
        (
            "saves (mgr.stats)",
            f"{len(ok)} async saves, {len(saves) - len(ok)} failed. Training was blocked "
            f"{_ms(blocked / n)} per save (the snapshot to host memory, plus any wait for the "
            f"previous save: one is in flight at a time), {100 * blocked / (first.seconds + second.seconds):.2f}% "
            f"of the wall time of runs 1 and 2; a save took {_ms(total / n)} in all, "
            f"{100 * (1 - blocked / total) if total else 0:.0f}% of it in the background",
        ),
    ]
    for label, text in summary:
        print(
            textwrap.fill(
                text,
                width=100,
                initial_indent=f"{label:<21}",
                subsequent_indent=" " * 21,
                break_long_words=False,
                break_on_hyphens=False,
            )
        )
    print(_saves_table([("1", first), ("2", second)]))
    same = print_outcome(
        f"checkpoints in {args.dir}:",
        listing,
        checks,
        time.perf_counter() - started,
        f"{_prog()} ls {args.dir}",
    )
    return 0 if same else 1
