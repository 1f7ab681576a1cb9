"""What both demos share (``tardigrade demo`` and ``tardigrade demo --ranks N``): the argument
checks, the run directory, the children's environment and event lines, and the bit-for-bit
comparison of two final states."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
from typing import Any

import numpy as np
import torch

from ..errors import InvalidArgumentError
from ._output import human_bytes, table

# Marks a directory as made by this demo, so a later run may clear it.
MARKER = ".tardigrade-demo"
CHILD_TIMEOUT_S = 300.0
# The worker reports to us on stdout, one "@tg <event> <json>" line per event.
EVENT_PREFIX = "@tg "


def checkpoint_name(step: int) -> str:
    from .. import Catalog  # a manager's names (torch-free, as this module)

    return Catalog.step_name(step)


def default_kill_step(steps: int, every: int) -> int:
    k = max(1, round(0.6 * steps / every)) * every
    return k if k < steps else max(every, (steps - 1) // every * every)


def check_args(args: argparse.Namespace) -> int:
    if args.ranks < 1:
        raise InvalidArgumentError(f"--ranks {args.ranks}: must be at least 1")
    if args.steps < 2 or args.every < 1 or args.keep_last < 1:
        raise InvalidArgumentError("--steps must be at least 2, --every and --keep-last at least 1")
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


def _prog() -> str:
    """How the user ran us (``.venv/bin/tardigrade`` under make), for commands we suggest."""
    argv0 = sys.argv[0] if sys.argv else ""
    return argv0 if os.path.basename(argv0) == "tardigrade" else "tardigrade"


def _span(names: list[str]) -> str:
    if not names:
        return "none"
    return names[0] if len(names) == 1 else f"{names[0]} to {names[-1]}"


def emit_report(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """The demo's JSON report: on stdout with ``--json``, into the file ``--report`` names
    (beside the text report, for a CI job's artifacts)."""
    text = json.dumps(report, indent=2)
    if args.report:
        os.makedirs(os.path.dirname(os.path.abspath(args.report)), exist_ok=True)
        with open(args.report, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    if args.json:
        print(text)


def listed_json(entries: list[Any]) -> list[dict[str, Any]]:
    """Checkpoints as the demo's ``--json`` report lists them."""
    return [
        {"name": c.name, "step": c.step, "nbytes": c.nbytes, "status": c.status} for c in entries
    ]


def print_outcome(
    heading: str, listing: list[Any], checks: list[tuple[str, bool]], seconds: float, hint: str
) -> bool:
    """The end of a demo's report: the checkpoints left, then whether the runs were identical."""
    print(heading)
    print(
        table(
            [[c.name, human_bytes(c.nbytes), c.status] for c in listing],
            ["NAME", "SIZE", "STATUS"],
            indent="  ",
        )
    )
    same = all(good for _, good in checks)
    print()
    print(f"bit-identical: {'yes' if same else 'NO'}  (demo took {seconds:.1f} s; try: {hint})")
    return same
