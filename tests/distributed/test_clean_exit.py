"""Ranks that used Tardigrade and destroyed their process group exit normally, with status 0.

A gloo process group stops its worker threads only when it is freed, and
``torch.distributed.destroy_process_group()`` frees it only when nothing else refers to it.
Threads that outlive it run into the interpreter's teardown, where a worker freeing the last
operation's tensors takes the GIL and is ended inside a C++ destructor: "terminate called
without an active exception" (SIGABRT), after all the work was done. Two things held the
group: a collective save left a reference cycle holding its ``Ranks`` (and so the group), and
torch.distributed.nn.functional, imported by the first optimizer built after
``init_process_group()``, binds the group as default arguments (importing tardigrade first
now imports it before the group exists). With a save as the last collective, each rank on one
CPU (its main thread runs on while the worker waits) and nothing between
``destroy_process_group()`` and the exit, a rank aborted in 18 runs of 20 before (5 of 12
with an optimizer, whose group was also held by torch.distributed.nn.functional); now in 0.
A third holder is the program's own: a DDP module kept past ``destroy_process_group()`` (the
README's example) keeps the group's threads alive into teardown whatever Tardigrade does, so
no finished operation of ours may be left for a gloo thread to free: 2 runs of 10 aborted
with a load as the last collective (1 in 12 of the README's example under torchrun). Keeping
the last operation's tensors from Python was not enough: the gloo worker that ran an operation
may hold it (and so its tensors) after wait() returned, until the scheduler runs that thread
again, and a later operation had replaced the tensors kept by then. Pinned to one CPU, 19 of
24 such runs aborted; now the last few operations of each group (Work and tensors) are kept
until the group is freed or the interpreter's teardown: 0 of 24.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tardigrade as tg
from tardigrade import _async
from tardigrade.distributed import _collectives
from tardigrade.distributed._collectives import Ranks
from tardigrade.distributed._launch import loopback_store

from ._harness import LOOPBACK, run_ranks_and_exits

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

SRC = str(Path(tg.__file__).resolve().parents[1])
KINDS = ("ddp", "tensors", "optimizer")  # ddp aborted 4 runs in 5 before (see the docstring)
RUNS = 5  # ddp, tensors, optimizer, ddp, tensors


def gloo_threads() -> list[str] | None:
    """Names of this process's gloo threads (Linux); None where they cannot be listed."""
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return None
    names = []
    for task in os.listdir(tasks):
        try:
            with open(os.path.join(tasks, task, "comm")) as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # the thread ended meanwhile
            continue
    return sorted(n for n in names if "gloo" in n)


def save_then_destroy(rank: int, world: int, root: str) -> dict[str, Any]:
    gc.disable()  # as between two automatic collections: only references free the group
    assert "torch.distributed.nn.functional" in sys.modules  # imported with tardigrade
    model = torch.nn.Linear(8, 8)
    optim = torch.optim.Adam(model.parameters())  # the first optimizer, after the group
    state = {"model": model, "optim": optim, "mine": tg.PerRank(rank), "step": 0}
    for step in range(3):
        tg.save(os.path.join(root, f"step-{step}"), state, step=step)
    # The groups Tardigrade creates itself: the fork behind collective async saves, freed when
    # its checkpointer closes (at exit at the latest), and the gloo sibling of a non-gloo
    # group, freed with that group.
    tg.save(os.path.join(root, "async"), state, async_=True).result()  # type: ignore[union-attr]
    real = _collectives._carries_cpu_over_gloo
    _collectives._carries_cpu_over_gloo = lambda group: False
    try:
        Ranks().barrier("through a sibling")
    finally:
        _collectives._carries_cpu_over_gloo = real
    created = gloo_threads()
    deadline = time.monotonic() + 5
    while created and created.count("pt_gloo_runloop") < 6 and time.monotonic() < deadline:
        time.sleep(0.05)  # a thread names itself once it runs
        created = gloo_threads()
    _async.default_checkpointer().close()  # what the exit does (atexit)
    dist.destroy_process_group()
    return {"created": created, "gloo_threads": gloo_threads()}


def test_destroy_process_group_frees_every_group_after_collective_saves(tmp_path: Path) -> None:
    results, codes = run_ranks_and_exits(save_then_destroy, 2, str(tmp_path), timeout=60)
    assert codes == [0, 0], (codes, results)
    for out in results:
        assert "error" not in out, results
        if sys.platform == "linux":
            assert out["created"].count("pt_gloo_runloop") == 6, out  # 3 groups, 2 threads each
            assert out["gloo_threads"] == [], out  # their threads stopped: all were freed


# A whole rank as a training script is written: import, join, build the state (with or
# without an optimizer), save collectively, destroy the group, leave. Nothing runs between the
# last collective and the interpreter's teardown but destroy_process_group().
RANK = textwrap.dedent(
    """
    import datetime, os, sys
    import torch, torch.distributed as dist
    import tardigrade as tg

    rank, port, root = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    if hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    wait = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=wait)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=wait)
    state = {"w": torch.randn(64, 64), "mine": tg.PerRank(rank), "step": 0}
    if sys.argv[4] == "optimizer":
        model = torch.nn.Linear(8, 8)
        state.update(model=model, optim=torch.optim.Adam(model.parameters()))
    if sys.argv[4] == "ddp":  # the program's DDP module holds the group past destroy
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
        state.update(model=ddp.module)
    for step in range(3):
        tg.save(os.path.join(root, f"step-{step}"), state, step=step)
    if sys.argv[4] == "ddp":  # a load as the last collective, as the README's example
        tg.load(os.path.join(root, "step-2"), into=state)
    dist.destroy_process_group()
    """
)


def test_ranks_exit_with_status_0_after_collective_saves(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=LOOPBACK)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")]))
    for run in range(RUNS):
        kind = KINDS[run % len(KINDS)]  # with an optimizer or DDP, as training scripts have
        root = tempfile.mkdtemp(dir=tmp_path)
        with loopback_store(60) as port:
            ranks = [
                subprocess.Popen(
                    [sys.executable, "-c", RANK, str(rank), str(port), root, kind],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
                for rank in range(2)
            ]
            outputs = [p.communicate(timeout=90)[0] for p in ranks]
        codes = [p.returncode for p in ranks]
        assert codes == [0, 0], (
            f"run {run} ({kind}): exit codes {codes} (-6: SIGABRT)\n" + "\n".join(outputs)
        )
        assert sorted(os.listdir(root)) == ["step-0", "step-1", "step-2"]
