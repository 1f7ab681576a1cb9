"""A collective called on only some ranks, at the public API: the callers raise within the
timeout, name what they called, commit nothing, and every rank still exits cleanly.

Each case spawns fresh ranks: a collective that timed out leaves its process group unusable.
Every rank first saves a checkpoint together (the "previous" one); then only the callers make
the call under test with a short ``timeout``, while the others stay alive past it (so the
callers time out rather than see a closed connection) and then return. A caller's exit waits
for them to leave: gloo cannot cancel the operation given up on (see ``Ranks``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import tardigrade as tg

from ._harness import caught, make_state, run_ranks_and_exits

pytestmark = pytest.mark.distributed

TIMEOUT = 2.0  # the short timeout of the call under test


def partial_call(
    rank: int, world: int, root: str, op: str, callers: list[int], linger: float = TIMEOUT + 1
) -> dict[str, Any]:
    """Save a checkpoint on every rank, then make ``op`` on ``callers`` only."""
    state = make_state(rank, world, 1.0)
    previous = os.path.join(root, "step-1")
    mgr = None
    if op.startswith("manager"):
        dist.barrier()  # the ranks start apart; from here on they keep within the short timeout
        mgr = tg.CheckpointManager(
            os.path.join(root, "mgr"), state, every_steps=1, async_save=False, timeout=TIMEOUT
        )
        mgr.save(1)
    else:
        tg.save(previous, state, step=1, timeout=60)
    state = make_state(rank, world, 2.0)
    if rank not in callers:
        time.sleep(linger)  # alive past the callers' timeout, then leave
        return {"type": "not called"}
    calls = {
        "save": lambda: tg.save(os.path.join(root, "step-2"), state, step=2, timeout=TIMEOUT),
        "load": lambda: tg.load(previous, into=state, timeout=TIMEOUT),
        "verify": lambda: tg.verify(previous, timeout=TIMEOUT),
        "manager.step": lambda: mgr.step(2),  # type: ignore[union-attr]
        "manager.save": lambda: mgr.save(2),  # type: ignore[union-attr]
        "manager.restore": lambda: mgr.restore(),  # type: ignore[union-attr]
    }
    out = caught(calls[op], timed=True)
    if mgr is not None:
        # Leaving as a `with` block does on an exception: no wait for the missing ranks.
        mgr._close(meet=False)
    return out


def check_partial(root: Path, op: str, world: int, callers: list[int]) -> None:
    results, codes = run_ranks_and_exits(partial_call, world, str(root), op, callers, timeout=60)
    assert codes == [0] * world, (codes, results)  # every rank left on its own, exit status 0
    called = {
        "save": "tg.save",
        "load": "tg.load",
        "verify": "tg.verify",
        "manager.step": f"CheckpointManager({str(root / 'mgr')!r}).step(2)",
        "manager.save": f"CheckpointManager({str(root / 'mgr')!r}).save(2)",
        "manager.restore": f"CheckpointManager({str(root / 'mgr')!r}).restore(",
    }[op]
    for rank, out in enumerate(results):
        if rank not in callers:
            assert out == {"type": "not called"}
            continue
        assert out["type"] == "DistributedError", out
        message = out["message"]
        assert message.startswith(f"{called}"), message
        assert f"rank {rank} of {world} gave up after 2." in message
        assert f"the timeout is {TIMEOUT:g} s" in message
        assert f"did not call {called}" in message
        # It waited its timeout (no bound above: the message's "gave up after 2.x s" is the
        # library's own measure, and a wait for the ranks that left reads otherwise).
        assert out["seconds"] > TIMEOUT - 0.1, out

    # Nothing committed, nothing left in flight, the previous checkpoint intact.
    if op.startswith("manager"):
        mgr_dir = root / "mgr"
        assert sorted(os.listdir(mgr_dir)) == ["step-000000001"]
        previous = mgr_dir / "step-000000001"
    else:
        assert sorted(os.listdir(root)) == ["step-1"]
        previous = root / "step-1"
    assert tg.verify(previous).files > 0
    tree = tg.load(previous)
    assert tree["step"] == 1 and bool((tree["w"] == 1.0).all())


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "op", ["save", "load", "verify", "manager.step", "manager.save", "manager.restore"]
)
def test_a_call_made_by_rank_0_alone_fails_there_within_the_timeout(
    tmp_path: Path, op: str
) -> None:
    check_partial(tmp_path, op, 2, [0])


@pytest.mark.timeout(90)
@pytest.mark.parametrize("op", ["save", "manager.step"])
def test_a_call_made_by_two_of_three_ranks_fails_on_both_within_the_timeout(
    tmp_path: Path, op: str
) -> None:
    check_partial(tmp_path, op, 3, [0, 1])


def save_against_load(rank: int, world: int, root: str) -> dict[str, Any]:
    """Rank 0 saves while rank 1 loads; then both save together, which still works."""
    state = make_state(rank, world, 1.0)
    previous = os.path.join(root, "step-1")
    tg.save(previous, state, step=1, timeout=60)
    state = make_state(rank, world, 2.0)
    out: dict[str, Any] = {}
    if rank == 0:
        out["crossed"] = caught(
            lambda: tg.save(os.path.join(root, "step-2"), state, step=2, timeout=TIMEOUT),
            timed=True,
        )
    else:
        out["crossed"] = caught(lambda: tg.load(previous, timeout=TIMEOUT), timed=True)
    out["listing"] = sorted(os.listdir(root))
    # The header exchange kept the ranks in step: the group is still usable.
    tg.save(os.path.join(root, "step-3"), state, step=3, timeout=60)
    return out


@pytest.mark.timeout(90)
def test_save_on_one_rank_and_load_on_the_other_fail_on_both(tmp_path: Path) -> None:
    results, codes = run_ranks_and_exits(save_against_load, 2, str(tmp_path), timeout=60)
    assert codes == [0, 0], (codes, results)
    called = ["tg.save (begin)", "tg.load"]
    for rank, out in enumerate(results):
        crossed = out["crossed"]
        assert crossed["type"] == "DistributedError", crossed
        assert crossed["message"].startswith(
            f"{called[rank]}: rank {1 - rank} of 2 made a different collective call than rank "
            f"{rank}, which called {called[rank]!r}."
        ), crossed
        assert out["listing"] == ["step-1"]
    assert sorted(os.listdir(tmp_path)) == ["step-1", "step-3"]
    assert tg.verify(tmp_path / "step-3").step == 3
