"""``tardigrade demo``: kill -9 a training run in the middle of a save, resume it, and show that
the result is bit-identical to a run that was never interrupted.

Three child processes run the same training script (:mod:`tardigrade.cli._demo_worker`):

1. trains from scratch, checkpointing every N steps, and is SIGKILLed while one save is writing;
2. restarts, restores the newest complete checkpoint, and trains to the end;
3. trains from scratch to the end without interruption (and without checkpoints).

The parent then compares the final parameters, optimizer state and loss curve of runs 2 and 3.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .. import load
from ..errors import InvalidArgumentError
from ._listing import INCOMPLETE_TMP, list_checkpoints
from ._output import ProgressBar, human_bytes, table

HELP = "kill -9 a training run mid-save, resume it, check it is bit-identical"
DEFAULT_DIR = os.path.join("demo-run", "ckpt")
# Marks a directory as made by this demo, so a later run may clear it.
MARKER = ".tardigrade-demo"
CHILD_TIMEOUT_S = 300.0
# The worker reports to us on stdout, one "@tg <event> <json>" line per event.
EVENT_PREFIX = "@tg "


def checkpoint_name(step: int) -> str:
    return f"step-{step:09d}"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help=HELP,
        description=(
            "Train a small MLP in a child process, checkpointing every --every steps, and "
            "SIGKILL it while the save at --kill-at is writing. Resume in a new process from "
            "the newest complete checkpoint, train to the end, and compare with an "
            "uninterrupted run: parameters, optimizer state and loss curve must be "
            "bit-identical. Exits 1 if they are not."
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
        "--kill-at",
        type=int,
        default=None,
        metavar="STEP",
        help="kill the run while it saves this step (default: the save nearest 60%% of --steps)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of data, model and shuffling")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(run=run)


@dataclass
class ChildRun:
    """What one child process reported."""

    returncode: int = 0
    killed_in_save: int | None = None
    staging_file: str | None = None
    resumed_from: str | None = None
    skipped: list[tuple[str, str]] = field(default_factory=list)
    saves: list[dict[str, Any]] = field(default_factory=list)
    last_step: int = 0
    stderr: str = ""
    seconds: float = 0.0


def default_kill_step(steps: int, every: int) -> int:
    k = max(1, round(0.6 * steps / every)) * every
    return k if k < steps else max(every, (steps - 1) // every * every)


def check_args(args: argparse.Namespace) -> int:
    if args.steps < 2 or args.every < 1:
        raise InvalidArgumentError("--steps must be at least 2 and --every at least 1")
    kill = default_kill_step(args.steps, args.every) if args.kill_at is None else args.kill_at
    if kill % args.every or not 0 < kill < args.steps:
        raise InvalidArgumentError(
            f"--kill-at {kill}: must be a step that saves (a multiple of --every "
            f"{args.every}) before the last step {args.steps}"
        )
    return kill


def prepare_dir(path: str) -> str:
    """Empty the demo directory, refusing any directory this demo did not create."""
    path = os.path.abspath(path)
    if os.path.islink(path) or (os.path.exists(path) and not os.path.isdir(path)):
        raise InvalidArgumentError(f"--dir {path}: exists and is not a directory")
    if os.path.isdir(path):
        if os.listdir(path) and not os.path.exists(os.path.join(path, MARKER)):
            raise InvalidArgumentError(
                f"--dir {path}: not empty and not made by `tardigrade demo`; refusing to clear "
                "it. Pass a new or empty directory."
            )
        shutil.rmtree(path)
    os.makedirs(path)
    with open(os.path.join(path, MARKER), "w") as f:
        f.write("made by `tardigrade demo`; the next demo run clears this directory\n")
    return path


def _child_env() -> dict[str, str]:
    """The child imports this very copy of tardigrade, installed or not."""
    import tardigrade

    src = os.path.dirname(os.path.dirname(os.path.abspath(tardigrade.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    env.setdefault("PYTHONHASHSEED", "0")
    return env


def run_child(
    argv: list[str], bar: ProgressBar, *, kill_in_save: bool = False, workdir: str
) -> ChildRun:
    """Run the worker with ``argv``, follow its events; SIGKILL it when a save announces itself."""
    out = ChildRun()
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
                elif event == "saved":
                    out.saves.append(data)
                elif event == "resumed":
                    out.resumed_from = data["name"]
                    bar.update(data["step"], f"resumed from {data['name'] or 'scratch'}")
                elif event == "skipped":
                    out.skipped.append((data["name"], data["reason"]))
                elif event == "saving" and kill_in_save:
                    # The save of this step has started writing its first data file: now.
                    os.kill(proc.pid, signal.SIGKILL)
                    out.killed_in_save = data["step"]
                    out.staging_file = data["file"]
                    bar.update(out.last_step, f"kill -9 while saving step {data['step']}")
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
    timer = threading.Timer(seconds, lambda: proc.poll() is None and proc.kill())
    timer.daemon = True
    timer.start()
    return timer


# ----------------------------------------------------------------------------------------------
# comparing two final states bit for bit


def identical(a: Any, b: Any) -> bool:
    """Exact equality: same types, tensors equal element for element, floats equal in bits."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(identical(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(identical(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def first_difference(a: list[float], b: list[float]) -> int | None:
    """The 1-based step of the first loss that differs (or where one curve ends)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if not identical(x, y):
            return i + 1
    return None if len(a) == len(b) else min(len(a), len(b)) + 1


# ----------------------------------------------------------------------------------------------


def _prog() -> str:
    """How the user ran us (``.venv/bin/tardigrade`` under make), for commands we suggest."""
    argv0 = sys.argv[0] if sys.argv else ""
    return argv0 if os.path.basename(argv0) == "tardigrade" else "tardigrade"


def _fail(what: str, child: ChildRun) -> int:
    print(f"tardigrade: error: {what} (exit status {child.returncode})", file=sys.stderr)
    tail = child.stderr.strip().splitlines()[-20:]
    if tail:
        print("  " + "\n  ".join(tail), file=sys.stderr)
    return 1


def run(args: argparse.Namespace) -> int:
    kill_at = check_args(args)
    started = time.perf_counter()
    ckpt_dir = prepare_dir(args.dir)
    show = False if args.no_progress else None
    common = ["--steps", str(args.steps), "--seed", str(args.seed)]
    hang = ["--hang-in-save", str(kill_at)]
    print(
        f"tardigrade demo: {args.steps} steps of an MLP with dropout, Adam, cosine LR and "
        f"shuffled batches; checkpoint every {args.every} steps into {args.dir}"
    )
    with tempfile.TemporaryDirectory(prefix="tardigrade-demo-") as tmp:
        first = run_child(
            [*common, "--every", str(args.every), "--ckpt-dir", ckpt_dir, *hang],
            ProgressBar(args.steps, "run 1: train, kill -9 mid-save ", enabled=show),
            kill_in_save=True,
            workdir=tmp,
        )
        if first.killed_in_save is None or first.returncode != -signal.SIGKILL:
            return _fail("run 1 was not killed in the middle of a save as planned", first)
        on_disk = list_checkpoints(ckpt_dir)

        resumed_final = os.path.join(tmp, "resumed")
        second = run_child(
            [
                *common,
                "--every",
                str(args.every),
                "--ckpt-dir",
                ckpt_dir,
                "--resume",
                "--final",
                resumed_final,
            ],
            ProgressBar(args.steps, "run 2: resume, train to the end", enabled=show),
            workdir=tmp,
        )
        if second.returncode != 0:
            return _fail("run 2 (resume) failed", second)

        reference_final = os.path.join(tmp, "reference")
        third = run_child(
            [*common, "--final", reference_final],
            ProgressBar(args.steps, "run 3: uninterrupted reference ", enabled=show),
            workdir=tmp,
        )
        if third.returncode != 0:
            return _fail("run 3 (uninterrupted reference) failed", third)

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
            all(identical(resumed[k], reference[k]) for k in ("sched", "rng", "data", "step")),
        ),
    ]
    saves = first.saves + second.saves
    save_seconds = sum(s["seconds"] for s in saves)
    train_seconds = first.seconds + second.seconds

    print()
    print(
        f"run 1  trained to step {first.last_step}, checkpointing every {args.every} steps; "
        f"SIGKILLed while saving step {first.killed_in_save} "
        f"(it had written part of {first.staging_file})"
    )
    tmp_left = [c.name for c in on_disk if c.status == INCOMPLETE_TMP]
    newest = [c.name for c in on_disk if c.status == "committed"][-1:]
    print(
        f"       on disk after the kill: {sum(c.status == 'committed' for c in on_disk)} "
        f"committed checkpoints{f' (newest {newest[0]})' if newest else ''}, "
        f"{len(tmp_left)} incomplete .tmp dir (never visible to load)"
    )
    for name, reason in second.skipped:
        print(f"       skipped {name}: {reason}")
    print(
        f"run 2  resumed from {second.resumed_from or 'scratch (no complete checkpoint)'} "
        f"in a new process, trained to step {second.last_step}"
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
    resumed_step = int(second.resumed_from.rsplit("-", 1)[1]) if second.resumed_from else 0
    print(f"killed at step       {first.killed_in_save} (in the middle of its save)")
    print(
        f"resumed from step    {resumed_step} "
        + (f"({second.resumed_from})" if second.resumed_from else "(no complete checkpoint yet)")
    )
    avg = save_seconds / len(saves) if saves else 0.0
    print(
        f"time spent saving    {save_seconds:.3f} s in {len(saves)} saves "
        f"({avg * 1000:.1f} ms each, {100 * save_seconds / max(train_seconds, 1e-9):.1f}% of "
        "the wall time of runs 1 and 2)"
    )
    listing = list_checkpoints(ckpt_dir)
    print(f"checkpoints in {args.dir}:")
    print(
        table(
            [
                [c.name, human_bytes(c.nbytes), c.status]
                + (["(the killed save)"] if c.status == INCOMPLETE_TMP else [""])
                for c in listing
            ],
            ["NAME", "SIZE", "STATUS", ""],
            indent="  ",
        )
    )
    ok = all(good for _, good in checks)
    print()
    print(
        f"bit-identical: {'yes' if ok else 'NO'}  "
        f"(demo took {time.perf_counter() - started:.1f} s; try: {_prog()} ls {args.dir})"
    )
    return 0 if ok else 1
