"""Kill -9 anywhere in retention or garbage collection on a store: every committed checkpoint
still loads and verifies, and once a later cleanup runs nothing unreachable is left.

The store is S3 on the session's SeaweedFS server (it outlives the killed process, as a real
bucket does). A child process opens a manager on a prefix that holds committed checkpoints and
what crashed saves left (data objects of saves that never committed, beside a checkpoint and
under a name of their own), restores (its cleanup sweeps by reachability) and saves a new step
(retention then retires the old ones): it is SIGKILLed before its k-th delete, for every k.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import torch

import tardigrade as tg
from tardigrade._commit import commit_for
from tardigrade.storage import open_root
from tardigrade.testing import kill_during

pytestmark = [pytest.mark.crash, pytest.mark.s3, pytest.mark.timeout(600)]

NO_GRACE = {"gc_grace_seconds": 0}

CHILD = """
import sys

import torch

import tardigrade as tg

url = sys.argv[1]
state = {"w": torch.zeros(1000)}
with tg.CheckpointManager(url, state, keep_last=3, async_save=False,
                          storage_options={"gc_grace_seconds": 0}) as mgr:
    mgr.restore()                # the cleanup: the sweep by reachability
    state["w"].fill_(9.0)
    mgr.save(9)                  # retention (the newest three kept): steps 1 and 2 go
"""


def prepare(url: str) -> None:
    """Four committed checkpoints (1, 2, 3, 4), and what crashed saves left."""
    state = {"w": torch.zeros(1000)}
    with tg.CheckpointManager(url, state, async_save=False, storage_options=NO_GRACE) as mgr:
        for step in (1, 2, 3, 4):
            state["w"].fill_(float(step))
            mgr.save(step)
    storage = open_root(url, NO_GRACE)
    for name, save_id in (("step-000000003", "e" * 32), ("step-000000007", "f" * 32)):
        for i in range(2):
            data = f"{name}/{commit_for(storage).data_name(f'data-{i}.safetensors', save_id)}"
            storage.put(data, b"what a crashed save left", mode="overwrite")


def check(url: str) -> list[int]:
    """Every committed checkpoint loads, verified, with the values its step saved."""
    catalog = tg.Catalog(url, NO_GRACE)
    steps = catalog.steps()
    for step in steps:
        got = tg.load(catalog.step_path(step), verify="all", storage_options=NO_GRACE)
        assert torch.equal(got["w"], torch.full((1000,), float(step))), step
    return steps


def unreachable(url: str) -> list[str]:
    """Data objects no committed manifest references (by this format's rule: a checkpoint's
    manifest lists its files, named under its save id)."""
    storage = open_root(url, NO_GRACE)
    catalog = tg.Catalog(storage)
    left = []
    for name, objects, committed in commit_for(storage).candidates():
        if not name:
            continue
        owner = catalog.manifest(name).raw["save_id"][:16] if committed else None
        left += [f"{name}/{n}" for n, _ in objects if owner is None or not n.startswith(owner)]
    return sorted(left)


def test_kill_9_anywhere_in_retention_or_gc_loses_no_committed_checkpoint(s3_env: Any) -> None:
    base = f"s3://{s3_env.bucket}/gc-crash-{uuid.uuid4().hex[:12]}"
    dry = f"{base}/dry"
    prepare(dry)
    assert unreachable(dry)  # the sweep has work to do
    counted = kill_during(code=CHILD, args=[dry], at="never")
    assert counted.returncode == 0, counted.tail()
    deletes = counted.counts.get("delete", 0)
    assert deletes >= 3, counted.counts  # the sweep's and retention's
    assert check(dry) == [3, 4, 9] and unreachable(dry) == []
    for k in range(1, deletes + 1):
        url = f"{base}/k{k}"
        prepare(url)
        r = kill_during(code=CHILD, args=[url], at="operation", op="delete", nth=k)
        assert r.killed, (k, r.tail())
        steps = check(url)
        assert {3, 4} <= set(steps), (k, steps)  # never retired: kept with step 9
        # A later run's cleanup (past the grace period: none) leaves nothing unreachable.
        again = kill_during(code=CHILD.replace("mgr.save(9)", "pass"), args=[url], at="never")
        assert again.returncode == 0, again.tail()
        assert unreachable(url) == [], k
        assert not any(n.startswith("step-000000007") for n in open_root(url).list())
        assert check(url) == steps
