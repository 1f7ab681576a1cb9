"""``python -m bench.async_probe``: async save blocking vs memcpy, round by round, quickly.

For iterating on the async save's blocking time without a full ``make bench``. Round 0 is the
process's first save, set up by ``--setup``:

- ``manager`` (default): as a fresh training run meets it. The model and optimizer are built
  before their first step (Adam has no moments yet), a ``tg.CheckpointManager`` is created
  (reserving staging for what exists: the parameters), then the loop trains and calls
  ``mgr.step(s)`` from step 1; the policy's first save comes at step ``--first-save-after``
  (1: right after the first optimizer step, as a loop that saves its first step does). The
  time blocked is that ``step()`` call's.
- ``reserved``: the whole state (moments included) is built first, then a checkpointer
  reserves its staging and the probe waits for the reservation: the best case.
- ``none``: the whole state, a checkpointer that reserves nothing.

Later rounds save the same state again (``mgr.save`` or ``ckpt.save``). Every save is compared
with a memcpy of the state into a pre-faulted buffer, each after ``--gap`` idle seconds (this VM
hands freed memory back after ~2 s idle); in ``manager`` mode the first save follows the
training steps directly, as it would in training. Per round it prints both times, their
ratio, the page faults and CPU seconds of the blocking phase (CPU well under 2x the wall time on
2 cores: other processes had the cores) and the load average.
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
from collections.abc import Callable
from pathlib import Path

import tardigrade as tg

from .raw import Scratch, memcpy
from .state import build_state, parse_size, state_nbytes


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.async_probe",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--size", default="1.5GB", help="state size (as bench --size; default 1.5GB)")
    p.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    p.add_argument("--gap", type=float, default=3.0, help="idle seconds before each op")
    p.add_argument(
        "--setup",
        choices=("manager", "reserved", "none"),
        default="manager",
        help="how the first save is reached (default manager: a fresh training run)",
    )
    p.add_argument(
        "--first-save-after",
        type=int,
        default=1,
        metavar="N",
        help="--setup manager: optimizer steps before the first save (default 1)",
    )
    p.add_argument("--dir", type=Path, help="where to save (default: a temporary directory)")
    args = p.parse_args(argv)
    if args.first_save_after < 1:
        p.error("--first-save-after must be at least 1")

    root = args.dir or Path(tempfile.mkdtemp(prefix="tg-async-probe-"))
    root.mkdir(parents=True, exist_ok=True)

    def idle() -> None:
        gc.collect()
        time.sleep(args.gap)

    fresh = args.setup == "manager"
    state = build_state(parse_size(args.size), stepped=not fresh)
    scratch = Scratch(state_nbytes(state.width))
    scratch.buf.fill_(0xA5)  # pre-faults the reference buffer
    mgr: tg.CheckpointManager | None = None
    ckpt: tg.AsyncCheckpointer | None = None
    first_save: Callable[[], tuple[float, int, float]]
    if fresh:
        idle()  # the process has built its model and optimizer and settled
        mgr = tg.CheckpointManager(
            root / "run",
            state.live,
            every_steps=args.first_save_after,
            keep_last=1,
            save_on_signals=(),
        )
        assert mgr._async is not None
        reserved = mgr._async
        reserved.wait_reserved()  # training's first step would take longer than this
        print(
            f"manager created before the first optimizer step: "
            f"{reserved.staging.allocated_bytes / 1e9:.2f} GB of staging reserved for a state "
            f"of {state.nbytes / 1e9:.2f} GB (no optimizer moments yet)",
            flush=True,
        )

        def first_save() -> tuple[float, int, float]:
            """Train up to the policy's first save; time the ``step()`` call that saves."""
            assert mgr is not None
            for s in range(1, args.first_save_after):
                state.train_step()
                assert not mgr.step(s)
            state.train_step()
            return _timed(lambda: _check(mgr.step(args.first_save_after), "the policy's save"))

    else:
        reserved = ckpt = tg.AsyncCheckpointer()
        if args.setup == "reserved":
            t = time.perf_counter()
            ckpt.reserve(state.live)
            ckpt.wait_reserved()
            print(f"staging reserved in {time.perf_counter() - t:.2f} s", flush=True)

        def first_save() -> tuple[float, int, float]:
            assert ckpt is not None
            return _timed(lambda: _check(ckpt.save(root / "round-0", state.live), "round 0"))

    def save_again(r: int) -> None:
        if mgr is not None:
            _check(mgr.save(args.first_save_after + r), f"round {r}")
        else:
            assert ckpt is not None
            _check(ckpt.save(root / f"round-{r}", state.live), f"round {r}")

    def wait() -> None:
        if mgr is not None:
            mgr.wait()
            assert mgr.stats.failed == 0, mgr.stats
        else:
            assert ckpt is not None
            ckpt.wait()

    ratios = []
    try:
        for r in range(args.rounds):
            copy_s = None
            if not (r == 0 and fresh):
                idle()
                t = time.perf_counter()
                memcpy(scratch, state)
                copy_s = time.perf_counter() - t
                idle()
            block_s, faults, cpu = first_save() if r == 0 else _timed(lambda r=r: save_again(r))
            wait()
            if copy_s is None:  # the first save of a fresh run: its memcpy after it
                idle()
                t = time.perf_counter()
                memcpy(scratch, state)
                copy_s = time.perf_counter() - t
            ratios.append(block_s / copy_s)
            note = ""
            if r == 0:
                note = (
                    f" (first save of {state.nbytes / 1e9:.2f} GB; staging now "
                    f"{reserved.staging.allocated_bytes / 1e9:.2f} GB)"
                )
            print(
                f"round {r}{note}: memcpy {copy_s:.3f} s, async blocked {block_s:.3f} s "
                f"({ratios[-1]:.2f}x; CPU {cpu:.2f} s, {faults} page faults), "
                f"load average {os.getloadavg()[0]:.1f}",
                flush=True,
            )
            for old in root.glob("round-*"):
                shutil.rmtree(old)
    finally:
        if mgr is not None:
            mgr.close()
        if ckpt is not None:
            ckpt.close()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    if ratios:
        print(
            f"ratio first save {ratios[0]:.2f}x; median {statistics.median(ratios):.2f}x, "
            f"min {min(ratios):.2f}x, max {max(ratios):.2f}x over {len(ratios)} rounds"
        )
    return 0


def _check(outcome: object, what: str) -> None:
    if not outcome:
        raise RuntimeError(f"{what}: no save was started")


def _timed(op: Callable[[], None]) -> tuple[float, int, float]:
    """Run ``op``; its wall seconds, minor page faults and CPU seconds."""
    faults, cpu, t = _faults(), time.process_time(), time.perf_counter()
    op()
    return time.perf_counter() - t, _faults() - faults, time.process_time() - cpu


if __name__ == "__main__":
    sys.exit(main())
