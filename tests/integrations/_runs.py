"""Running a framework script three ways and comparing: uninterrupted, SIGKILLed, resumed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

import tardigrade as tg

HERE = Path(__file__).parent
SRC = str(HERE.parents[1] / "src")


def run(script: str, *args: object, expect_kill: bool = False, ranks: int = 0) -> None:
    """Run ``script`` in a fresh interpreter, or on ``ranks`` gloo ranks under torchrun."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, env.get("PYTHONPATH")) if p)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    launch = [sys.executable]
    if ranks:
        launch += ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
    proc = subprocess.run(
        [*launch, str(HERE / script), *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    if expect_kill:
        # torchrun ends the other ranks and exits 1 when one is killed.
        killed = 1 if ranks else -signal.SIGKILL
        assert proc.returncode == killed, proc.stderr[-3000:]
        if ranks:
            assert "Signal 9 (SIGKILL)" in proc.stderr, proc.stderr[-3000:]
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]


def steps(out: Path) -> dict[int, str]:
    lines = (out / "steps.log").read_text().splitlines()
    return {int(line.split()[0].split("=")[1]): line for line in lines}


def assert_same_run(full: Path, killed: Path, resumed: Path, saved_at: int) -> None:
    """The killed run up to its checkpoint plus the resumed run is the uninterrupted run:
    every step's loss, epoch and batch, then the final parameters and optimizer state."""
    want = steps(full)
    got = {s: line for s, line in steps(killed).items() if s <= saved_at}
    assert max(steps(killed)) > saved_at, "the run was not killed after its checkpoint"
    got.update(steps(resumed))
    assert min(steps(resumed)) == saved_at + 1
    diff = [s for s in sorted(want) if got.get(s) != want[s]]
    assert not diff, f"first differing step {diff[0]}: {got.get(diff[0])} != {want[diff[0]]}"
    assert sorted(got) == sorted(want)
    a, b = tg.load(full / "final"), tg.load(resumed / "final")
    _assert_equal_trees(a, b, "final")


def _assert_equal_trees(a: object, b: object, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _assert_equal_trees(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where  # type: ignore[arg-type]
        for i, (x, y) in enumerate(zip(a, b, strict=True)):  # type: ignore[arg-type]
            _assert_equal_trees(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"
