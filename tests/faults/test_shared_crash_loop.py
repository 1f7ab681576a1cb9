"""Kill -9 a job that shares data (format 7) on a store, again and again, anywhere: in its
restore's cleanup, its saves (sync and async), retention and its sweep, and ``gc``.

One S3 prefix on the session's SeaweedFS server lives through every cycle, as a bucket does.
Each cycle starts a job that restores the newest checkpoint, trains three steps saving each
(a frozen tensor of 1.1 MiB every checkpoint references, a "slow" one that changes every
other step, a small one that changes every step) with ``keep_last=2``, and every third cycle
runs ``gc``; it is SIGKILLed before a storage operation drawn at random. After each cycle:

- every visible checkpoint loads, verified, with exactly its step's values;
- nothing committed is lost: the job resumed from the newest checkpoint visible before it,
  and the newest visible never goes back;

and once the kills are done, a job that is not killed and a ``gc`` leave nothing unreachable:
no shared object that no checkpoint references, no data object of a save that never
committed. ``make test`` lands 24 kills; ``make soak`` 200 (``TARDIGRADE_CRASH_KILLS``).
"""

from __future__ import annotations

import os
import random
import uuid
from typing import Any

import pytest
import torch

import tardigrade as tg
from tardigrade._commit import commit_for
from tardigrade.format.manifest import SHARED_DIR, is_shared
from tardigrade.storage import open_root
from tardigrade.testing import kill_during

pytestmark = [
    pytest.mark.crash,
    pytest.mark.s3,
    pytest.mark.timeout(1800),
    # A cycle with fewer operations than the one drawn ends without a kill: counted apart.
    pytest.mark.filterwarnings("ignore:kill_during. not killed"),
]

KILLS = int(os.environ.get("TARDIGRADE_CRASH_KILLS", "24"))
NO_GRACE = {"gc_grace_seconds": 0}
N = 300_000  # 1.1 MiB of float32: a shared object

CHILD = f"""
import sys

import torch

import tardigrade as tg

url, mode, gc = sys.argv[1], sys.argv[2], sys.argv[3] == "gc"
N = {N}
state = {{"frozen": torch.zeros(N), "slow": torch.zeros(N), "w": torch.zeros(1000), "step": 0}}
opts = {NO_GRACE!r}
with tg.CheckpointManager(url, state, keep_last=2, async_save=mode == "async",
                          storage_options=opts) as mgr:
    mgr.restore()
    print("restored", state["step"], flush=True)
    first = state["step"] + 1
    for step in range(first, first + 3):
        state["frozen"].copy_(torch.arange(N, dtype=torch.float32))
        state["slow"].fill_(float(step // 2))
        state["w"].fill_(float(step))
        state["step"] = step
        mgr.save(step)
if gc:
    catalog = tg.Catalog(url, opts)
    lease = catalog.lease()
    lease.acquire()
    try:
        catalog.tidy()
    finally:
        lease.release()
print("done", flush=True)
"""


def expected(step: int) -> dict[str, Any]:
    return {
        "frozen": torch.arange(N, dtype=torch.float32),
        "slow": torch.full((N,), float(step // 2)),
        "w": torch.full((1000,), float(step)),
        "step": step,
    }


def check(url: str) -> list[int]:
    """Every visible checkpoint loads, verified, with its step's values; its steps."""
    catalog = tg.Catalog(url, NO_GRACE)
    steps = catalog.steps()
    for step in steps:
        got = tg.load(catalog.step_path(step), verify="all", storage_options=NO_GRACE)
        want = expected(step)
        assert got["step"] == step, (step, got["step"])
        for k in ("frozen", "slow", "w"):
            assert torch.equal(got[k], want[k]), (step, k)
    return steps


def unreachable(url: str) -> list[str]:
    """Shared objects no committed manifest references, and data objects of saves that never
    committed."""
    storage = open_root(url, NO_GRACE)
    catalog = tg.Catalog(storage)
    referenced: set[str] = set()
    left = []
    for name, objects, committed in commit_for(storage).candidates():
        if not name:
            continue
        owner = None
        if committed:
            m = catalog.manifest(name)
            owner = m.raw["save_id"][:16]
            referenced |= {f for f in m.files if is_shared(f)}
        left += [f"{name}/{n}" for n, _ in objects if owner is None or not n.startswith(owner)]
    objects = catalog.shared_objects()
    assert all(o.startswith(f"{SHARED_DIR}/") for o in objects), objects
    return sorted(left + [o for o in objects if o not in referenced])


def _said(out: str, word: str) -> int | None:
    for line in out.splitlines():
        if line.startswith(f"{word} "):
            return int(line.split()[1])
    return None


def test_kill_9_anywhere_with_shared_data_on_a_store_loses_nothing(s3_env: Any) -> None:
    url = f"s3://{s3_env.bucket}/shared-crash-{uuid.uuid4().hex[:12]}"
    rng = random.Random(27)
    # A cycle's storage operations, counted on a run that is not killed (from the second
    # cycle on: a restore, three saves with retention, and gc).
    for mode in ("sync", "async"):
        dry = kill_during(code=CHILD, args=[url, mode, "gc"], at="never")
        assert dry.returncode == 0 and "done" in dry.stdout, dry.tail()
    ops = dry.counts["operation"]
    assert ops >= 40, dry.counts
    newest = check(url)[-1]
    kills, cycles = 0, 0
    by_mode: dict[str, int] = {"sync": 0, "async": 0}
    while kills < KILLS:
        cycles += 1
        assert cycles <= 3 * KILLS, f"only {kills} kills landed in {cycles} cycles"
        mode = rng.choice(("sync", "async"))
        gc = "gc" if cycles % 3 == 0 else "-"
        r = kill_during(code=CHILD, args=[url, mode, gc], at="operation",
                        nth=rng.randint(1, ops))  # fmt: skip
        where = f"cycle {cycles} ({mode}, {gc}, {r.where})"
        if r.killed:
            kills += 1
            by_mode[mode] += 1
        else:
            assert r.returncode == 0 and "done" in r.stdout, (where, r.tail())
        restored = _said(r.stdout, "restored")
        assert restored in (None, newest), (where, restored, newest, r.tail())
        steps = check(url)
        assert steps and steps[-1] >= newest, (where, steps, newest)
        newest = steps[-1]
        assert len(unreachable(url)) <= 12, (where, unreachable(url))  # no pile
    assert by_mode["sync"] and by_mode["async"], by_mode
    final = kill_during(code=CHILD, args=[url, "async", "gc"], at="never")
    assert final.returncode == 0 and _said(final.stdout, "restored") == newest, final.tail()
    assert unreachable(url) == []
    assert check(url)[-1] == newest + 3
