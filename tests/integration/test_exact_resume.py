"""Bit-exact resume, proven with real processes killed by SIGKILL.

``_train_script.py`` trains a small MLP with dropout on a shuffling ResumableSampler with Adam
and StepLR, checkpointing every 5 steps asynchronously through a CheckpointManager. The
reference is one uninterrupted run. Every other run is SIGKILLed (at a random step, twice in a
row, or while its background writer is in the middle of a save) and restarted until it
finishes. The final parameters, optimizer and scheduler state, RNG states, data position and
the whole per-step loss sequence must equal the reference bit for bit.
"""

from __future__ import annotations

import math
import os
import random
import re
import signal
import struct
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tardigrade as tg

pytestmark = [pytest.mark.slow, pytest.mark.crash, pytest.mark.timeout(300)]

SCRIPT = Path(__file__).with_name("_train_script.py")
TOTAL = 60
EVERY = 5
STEP_SLEEP = "0.02"  # per step in the killed runs, so a kill lands within a step or two
CHILD_TIMEOUT = 120

# Three kill points drawn at random (seeded), the last two in one run killed twice, and one
# kill inside a save. Each child costs seconds (importing torch and its optimizers), so the
# scenarios are few.
_rng = random.Random(20240611)
_a = _rng.randrange(2, TOTAL - 2)
_b = _rng.randrange(2, TOTAL // 2)
_c = _rng.randrange(_b + 12, TOTAL - 2)
# Each scenario: the kills, in order, of one training run; ("step", n) kills once the child
# reports step n, ("save", n) kills while the background writer is stalled in step n's save.
SCENARIOS = {
    f"kill-at-{_a}": [("step", _a)],
    f"kill-at-{_b}-then-{_c}": [("step", _b), ("step", _c)],
    "kill-during-save-of-10": [("save", 10)],
}


@dataclass
class ChildRun:
    rc: int
    lines: list[str] = field(default_factory=list)

    @property
    def resumed(self) -> int | None:
        (word,) = [ln.split()[1] for ln in self.lines if ln.startswith("RESUMED ")]
        return None if word == "None" else int(word)

    @property
    def steps(self) -> list[int]:
        return [int(m.group(1)) for ln in self.lines if (m := re.fullmatch(r"STEP (\d+)", ln))]

    def log(self) -> str:
        return "\n".join(self.lines[-40:])


def run_child(workdir: Path, kill: tuple[str, int] | None = None) -> ChildRun:
    """Run the script; with ``kill``, SIGKILL it at that point and return after it died."""
    env = dict(os.environ)
    env.pop("TG_TEST_SLOW_SAVE_STEP", None)
    env["TG_TEST_STEP_SLEEP"] = STEP_SLEEP if kill else "0"
    if kill and kill[0] == "save":
        env["TG_TEST_SLOW_SAVE_STEP"] = str(kill[1])
    trigger = None
    if kill:
        trigger = f"STEP {kill[1]}" if kill[0] == "step" else f"SAVE_STARTED {kill[1]}"
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(workdir / "ckpt"), str(workdir / "out"), str(TOTAL)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    timed_out = threading.Event()

    def on_timeout() -> None:
        timed_out.set()
        proc.kill()

    watchdog = threading.Timer(CHILD_TIMEOUT, on_timeout)
    watchdog.start()
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            lines.append(line)
            if trigger is not None and (line == trigger or line.startswith(trigger + " ")):
                os.kill(proc.pid, signal.SIGKILL)
                trigger = None
        rc = proc.wait()
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    run = ChildRun(rc, lines)
    assert not timed_out.is_set(), f"the child ran past {CHILD_TIMEOUT} s:\n{run.log()}"
    if kill is None:
        assert rc == 0, f"training failed (rc {rc}):\n{run.log()}"
    else:
        assert rc == -signal.SIGKILL, f"expected the child to die at {kill}, rc {rc}:\n{run.log()}"
    return run


def assert_identical(a: Any, b: Any, path: str = "") -> None:
    """Equal bit for bit, with the same types all the way down."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{list(a.shape)}"
        assert torch.equal(a, b), f"{path}: tensors differ"
        ab, bb = (t.contiguous().reshape(-1).view(torch.uint8) for t in (a, b))
        assert torch.equal(ab, bb), f"{path}: tensor bytes differ"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), path
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), f"{path}: {a!r} != {b!r}"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_identical(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_identical(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def first_difference(a: list[float], b: list[float]) -> str:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if struct.pack("<d", x) != struct.pack("<d", y):
            return f"losses first differ at step {i + 1}: {x!r} != {y!r}"
    return f"loss sequences of lengths {len(a)} and {len(b)}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("uninterrupted")
    run = run_child(d)
    assert run.resumed is None and run.steps == list(range(1, TOTAL + 1))
    tree = tg.load(d / "out")
    losses = tree["losses"]
    assert len(losses) == TOTAL and all(isinstance(x, float) and math.isfinite(x) for x in losses)
    assert len(set(losses)) == TOTAL, "the losses should all differ (dropout, shuffling, Adam)"
    assert tree["step"] == TOTAL
    assert tree["data"]["epoch"] == 2, "the run must cross epoch boundaries"
    assert tree["sched"]["last_epoch"] == TOTAL
    assert tree["optim"]["state"], "Adam must have state"
    return tree


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_killed_and_resumed_run_is_bit_identical(
    name: str, reference: dict[str, Any], tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    last_resumed: int | None = None
    reached = 0
    for kill in SCENARIOS[name]:
        run = run_child(tmp_path, kill)
        if reached >= 2 * EVERY:
            assert run.resumed is not None, f"{name}: killed after step {reached}, no resume"
        reached = max(run.steps, default=run.resumed or 0)
        if kill[0] == "step":
            assert kill[1] in run.steps, f"{name}: died before reaching step {kill[1]}"
            assert reached < TOTAL, f"{name}: the child finished before the kill landed"
        else:
            # Killed inside the save: it is staged but not committed, and the previous
            # checkpoint is intact.
            names = os.listdir(ckpt)
            assert f"step-{kill[1]:09d}" not in names, names
            assert any(n.startswith(f".tmp-step-{kill[1]:09d}-") for n in names), names
            assert f"step-{kill[1] - EVERY:09d}" in names, names
        last_resumed = run.resumed

    final = run_child(tmp_path)
    assert not (tmp_path / "ckpt" / ".lock").exists()
    resumed = final.resumed
    assert resumed is not None or reached < 2 * EVERY, f"{name}: nothing to resume after {reached}"
    if resumed is not None:
        assert resumed % EVERY == 0 and resumed <= reached, (resumed, reached)
        assert last_resumed is None or resumed >= last_resumed
    if SCENARIOS[name][-1][0] == "save":
        assert resumed == SCENARIOS[name][-1][1] - EVERY
    assert final.steps == list(range((resumed or 0) + 1, TOTAL + 1))
    assert not [n for n in os.listdir(ckpt) if n.startswith(".tmp-")], "leftovers not removed"

    got = tg.load(tmp_path / "out")
    assert got["losses"] == reference["losses"], first_difference(
        got["losses"], reference["losses"]
    )
    for key in ("model", "optim", "sched", "rng", "data", "step", "losses"):
        assert_identical(got[key], reference[key], key)
