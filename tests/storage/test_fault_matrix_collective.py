"""Every storage operation of a collective save on 2 gloo ranks (synchronous, and
asynchronous: the protocol in the background on a forked group) fails in turn, on each rank.

The ranks run the whole matrix in one job (spawning ranks per fault would cost seconds each):
each enumerates its own operations of one save, then for every operation k of every rank,
the ranks save together with operation k failing on that rank, and check that every rank
raises a ``TardigradeError`` naming the location (errors are collective), that the
checkpoint committed before is intact, that nothing is left once gc ran, and that the next
collective save succeeds. Each k fails with one error kind, the kinds taken in turn (so every
kind hits every op kind), and once as an outage (see ``_fault_matrix.errors_for``): three
collective saves and a gc per fault make the full cross product cost more than it adds. A backend that lives in one process (``memory://``) cannot be
shared by ranks and is skipped.
"""

from __future__ import annotations

import contextlib
import io
import os
from typing import Any

import pytest
import torch.distributed as dist

import tardigrade as tg
from tardigrade.cli import main as cli
from tardigrade.errors import TardigradeError
from tardigrade.testing import FaultyStorage

from ..distributed._harness import make_state, run_ranks
from ._fault_matrix import (
    INJECTED,
    committed,
    errors_for,
    leftovers,
    past_the_grace_period,
    wipe,
)
from .conftest import BACKENDS

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(400)]

TIMEOUT = 30.0  # seconds a rank waits for the other in one save: far above what a save takes


def collective_matrix(
    rank: int, world: int, root: str, mode: str, sample: bool = True
) -> dict[str, Any]:
    faulty = FaultyStorage(root)  # the first in each fresh rank process: the same URL on both
    inner = faulty.inner

    def prepare() -> None:
        dist.barrier()
        if rank == 0:
            wipe(inner)
        dist.barrier()
        tg.save(inner.url("step-1"), make_state(rank, world, 1.0), step=1, timeout=TIMEOUT)

    def run(step: int) -> None:
        state = make_state(rank, world, float(step))
        url = faulty.url(f"step-{step}")
        if mode == "sync":
            tg.save(url, state, step=step, timeout=TIMEOUT)
            return
        # The collective protocol runs in the background on a forked gloo group; its error
        # reaches every rank's future.
        fut = tg.save(url, state, step=step, timeout=TIMEOUT, async_=True)
        assert isinstance(fut, tg.SaveFuture)
        fut.result()

    prepare()
    start = len(faulty.ops)
    run(5)
    mine = faulty.ops[start:]
    ops: list[list[str]] = [[] for _ in range(world)]
    dist.all_gather_object(ops, mine)
    problems: list[str] = []
    count = {"single": 0, "outage": 0}
    for victim in range(world):
        seen: dict[str, int] = {}
        for k, op in enumerate(ops[victim]):
            seen[op] = seen.get(op, 0) + 1
            for error, outage in errors_for(op, k, sample=sample):
                where = f"rank {victim}: {op} #{seen[op]} (operation {k + 1}), {error}"
                where += " and an outage after it" if outage else ""
                prepare()
                before = committed(inner) if rank == 0 else {}
                fired = len(faulty.injected)
                if rank == victim:
                    faulty.fail(op, nth=seen[op], error=error, outage=outage)
                try:
                    run(5)
                    raised = "returned"
                except TardigradeError as e:
                    raised = "ok" if faulty.root in str(e) else f"not naming {faulty.root}: {e}"
                except Exception as e:
                    raised = f"not a TardigradeError: {e!r}"
                faulty.heal()
                if rank == victim:
                    if len(faulty.injected) != fired + 1:
                        problems.append(f"{where}: the fault did not fire")
                    count["outage" if outage else "single"] += 1
                if raised != "ok":
                    problems.append(f"{where}: on rank {rank} the save {raised}")
                dist.barrier()
                if rank == 0:
                    after = committed(inner)
                    if after.get("step-1") != before["step-1"]:
                        problems.append(f"{where}: step-1 was modified or lost")
                    with (
                        past_the_grace_period(),  # the other rank's abandon is not seen here
                        contextlib.redirect_stdout(io.StringIO()),
                        contextlib.redirect_stderr(io.StringIO()),
                    ):
                        if cli(["gc", faulty.root]) != 0:  # as the single-process matrix
                            problems.append(f"{where}: gc failed once the fault was gone")
                    left = leftovers(inner)
                    if left:
                        problems.append(f"{where}: left behind: {left}")
                try:
                    run(6)
                except Exception as e:
                    problems.append(f"{where}: the next save failed on rank {rank}: {e!r}")
                if len(problems) > 20:
                    return {"root": faulty.root, "problems": problems, "count": count}
    return {"root": faulty.root, "problems": problems, "count": count, "ops": len(mine)}


# memory:// lives in one process, and ranks are processes: the backends ranks can share.
@pytest.mark.parametrize("root_url", [b for b in BACKENDS if b != "memory"], indirect=True)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_operation_of_a_collective_save_fails_in_turn(root_url: str, mode: str) -> None:
    full = os.environ.get("FAULT_MATRIX_FULL", "") not in ("", "0")  # every error kind
    results = run_ranks(collective_matrix, 2, root_url, mode, not full, timeout=360)
    assert not [r for r in results if "error" in r], results
    assert results[0]["root"] == results[1]["root"]
    problems = results[0]["problems"] + results[1]["problems"]
    assert not problems, "\n".join(problems)
    faults = sum(sum(r["count"].values()) for r in results)
    if not full:
        assert faults == 2 * sum(r["ops"] for r in results)  # one error kind, and an outage
    INJECTED[f"collective-save-{mode}[local]"] += faults
    print(f"collective-save ({mode}): {[r['count'] for r in results]}")
