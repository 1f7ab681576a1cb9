"""Random augmentation in DataLoader workers resumes bit-exactly, with any worker count.

``_augment_train_script.py`` trains on a dataset that augments every sample with ``torch``,
``random`` and ``numpy`` inside ``__getitem__``, wrapped in ``tg.SeededDataset``, loaded by
persistent workers through ``sampler.track()``. The reference is one uninterrupted run with 2
workers. A second run with 2 workers is SIGKILLed mid-epoch at a chosen step (the child blocks
there, workers alive, until the kill), and its checkpoint directory is resumed with 2, 0, 1
and 3 workers: every resumed run must end with the reference's losses, augmented inputs,
parameters, optimizer, scheduler, RNG and data position, bit for bit. The same experiment
without ``SeededDataset`` shows what the hook fixes: there the resumed run diverges.
"""

from __future__ import annotations

import os
import shutil
import signal
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tardigrade as tg

pytestmark = [pytest.mark.slow, pytest.mark.crash, pytest.mark.timeout(600)]

SCRIPT = Path(__file__).with_name("_augment_train_script.py")
TOTAL = 40  # 15 batches per epoch: the run crosses two epoch boundaries
KILL_AT = 23  # epoch 1, 8 batches in; the newest checkpoint is step 18, 3 batches into epoch 1
RESUMES_FROM = 18
CHILD_TIMEOUT = 180


def run_child(
    workdir: Path, workers: int, *, kill_at: int | None = None, unseeded: bool = False
) -> list[str]:
    """Run the script to the end, or until it pauses at ``kill_at`` and is SIGKILLed there."""
    env = dict(os.environ)
    env.pop("TG_TEST_PAUSE_AT", None)
    if kill_at is not None:
        env["TG_TEST_PAUSE_AT"] = str(kill_at)
    argv = [sys.executable, str(SCRIPT), str(workdir / "ckpt"), str(workdir / "out")]
    argv += [str(TOTAL), str(workers)] + (["--unseeded"] if unseeded else [])
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,  # the paused child blocks reading it; we never write
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    watchdog = threading.Timer(CHILD_TIMEOUT, proc.kill)
    watchdog.start()
    lines: list[str] = []
    killed = False
    try:
        assert proc.stdout is not None
        # Not read to EOF after the kill: orphaned workers keep the pipe open until they notice
        # their parent is gone.
        for raw in proc.stdout:
            lines.append(raw.rstrip("\n"))
            if kill_at is not None and lines[-1] == f"PAUSED {kill_at}":
                os.kill(proc.pid, signal.SIGKILL)
                killed = True
                break
        rc = proc.wait()
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()
    log = "\n".join(lines[-40:])
    if kill_at is None:
        assert rc == 0, f"training with {workers} workers failed (rc {rc}):\n{log}"
    else:
        assert killed and rc == -signal.SIGKILL, (
            f"expected a kill at step {kill_at}, rc {rc}:\n{log}"
        )
    return lines


def assert_identical(a: Any, b: Any, path: str) -> None:
    """Equal bit for bit, with the same types all the way down."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{list(a.shape)}"
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


def resumed_from(lines: list[str]) -> int | None:
    (word,) = [ln.split()[1] for ln in lines if ln.startswith("RESUMED ")]
    return None if word == "None" else int(word)


def first_difference(name: str, a: list[float], b: list[float]) -> str:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if struct.pack("<d", x) != struct.pack("<d", y):
            return f"{name} first differ at step {i + 1}: {x!r} != {y!r}"
    return f"{name}: sequences of lengths {len(a)} and {len(b)}"


def killed_run(tmp: Path, *, unseeded: bool = False) -> Path:
    """A 2-worker run SIGKILLed mid-epoch; its directory, ready to be copied and resumed."""
    d = tmp / "killed"
    lines = run_child(d, 2, kill_at=KILL_AT, unseeded=unseeded)
    assert resumed_from(lines) is None
    assert f"STEP {KILL_AT}" in lines and f"STEP {KILL_AT + 1}" not in lines
    committed = sorted(n for n in os.listdir(d / "ckpt") if n.startswith("step-"))
    assert committed == [f"step-{s:09d}" for s in (6, 12, 18)], committed
    return d


def resume(killed: Path, into: Path, workers: int, *, unseeded: bool = False) -> dict[str, Any]:
    shutil.copytree(killed / "ckpt", into / "ckpt")
    lines = run_child(into, workers, unseeded=unseeded)
    assert resumed_from(lines) == RESUMES_FROM
    return tg.load(into / "out")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("uninterrupted")
    assert resumed_from(run_child(d, 2)) is None
    tree = tg.load(d / "out")
    assert tree["step"] == TOTAL and len(tree["losses"]) == TOTAL
    assert (tree["data"]["epoch"], tree["data"]["consumed"]) == (2, 10 * 4)
    assert len(set(tree["inputs"])) == TOTAL
    return tree


def test_resume_after_sigkill_is_bit_identical_with_any_worker_count(
    reference: dict[str, Any], tmp_path: Path
) -> None:
    killed = killed_run(tmp_path)
    for workers in (2, 0, 1, 3):
        got = resume(killed, tmp_path / f"resumed-{workers}", workers)
        where = f"resumed with {workers} workers"
        # Inputs first: a divergence there is the augmentation's, not the training's.
        assert got["inputs"] == reference["inputs"], (
            where + ": " + first_difference("augmented inputs", got["inputs"], reference["inputs"])
        )
        assert got["losses"] == reference["losses"], (
            where + ": " + first_difference("losses", got["losses"], reference["losses"])
        )
        for key in ("model", "optim", "sched", "rng", "data", "step", "losses", "inputs"):
            assert_identical(got[key], reference[key], f"{where}: {key}")


def test_without_seeded_dataset_the_resumed_run_diverges(tmp_path: Path) -> None:
    """The control: the same run without the hook, as every loader was before it."""
    ref_dir = tmp_path / "uninterrupted"
    run_child(ref_dir, 2, unseeded=True)
    ref = tg.load(ref_dir / "out")
    got = resume(killed_run(tmp_path, unseeded=True), tmp_path / "resumed", 2, unseeded=True)
    assert got["inputs"][:RESUMES_FROM] == ref["inputs"][:RESUMES_FROM], "same run up to the save"
    assert got["inputs"][RESUMES_FROM] != ref["inputs"][RESUMES_FROM], (
        "expected the unseeded workers to augment the first batch after the resume differently"
    )
    assert got["losses"][RESUMES_FROM:] != ref["losses"][RESUMES_FROM:]
