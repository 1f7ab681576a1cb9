"""A writer that stalls inside a commit past its lease (SIGSTOP here; a long GC or swap pause
in life) and then wakes up commits its checkpoint into a location another job took over. That
commit must never become a checkpoint of the new holder's run: the new holder fenced it when it
took the lease (``Catalog.fence``), so restore, listings and retention pass over it, the next
save of that step replaces it, and no error reaches the training loop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import uuid
from typing import Any

import pytest
import torch

import tardigrade as tg

pytestmark = [pytest.mark.s3, pytest.mark.crash, pytest.mark.timeout(240)]

STALLS_IN_COMMIT = textwrap.dedent(
    """
    import os, signal, sys, threading
    import torch
    import tardigrade as tg
    from tardigrade.storage.s3 import S3Storage

    url, mode = sys.argv[1], sys.argv[2]
    state = {"w": torch.full((4,), 2.0), "step": 2}
    mgr = tg.CheckpointManager(url, state, lock_lease_seconds=1.0, async_save=mode == "async")
    mgr.save(2)
    mgr.wait()
    put = S3Storage.put

    def stalling_put(self, name, data, **kw):
        if name.endswith("step-000000004/manifest.json"):
            # Past its lease, after every check. Sent to this very thread: a process-wide
            # kill() may be taken by another thread, and this one then runs the put before
            # the whole process stops (the manifest was seen committed 2 runs in 6).
            signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
        return put(self, name, data, **kw)

    S3Storage.put = stalling_put
    state["w"].fill_(4.0)
    state["step"] = 4
    print("save returned", mgr.save(4), flush=True)
    try:
        mgr.close()
    except Exception as e:
        print("close raised", type(e).__name__, flush=True)
    """
)


def state(value: float = 0.0) -> dict[str, Any]:
    return {"w": torch.full((4,), value), "step": int(value)}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_stalled_writer_that_lost_its_lease_never_commits_into_the_new_run(
    s3_env: Any, mode: str
) -> None:
    url = f"s3://{s3_env.bucket}/zombie-{uuid.uuid4().hex[:12]}"
    zombie = subprocess.Popen(
        [sys.executable, "-c", STALLS_IN_COMMIT, url, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, status = os.waitpid(zombie.pid, os.WUNTRACED)  # stopped inside its commit
        assert os.WIFSTOPPED(status), zombie.communicate()
        # Stopped before its manifest went up: step 4 is not committed yet.
        assert tg.Catalog(url).steps() == [2]
        live = state()
        # The new job waits out the stalled holder's 1 s lease (lock_timeout's default), takes
        # the lease over and restores the last step the old one committed.
        mgr = tg.CheckpointManager(url, live, every_steps=1, keep_last=2)
        assert mgr.restore() == 2 and live["step"] == 2
        os.kill(zombie.pid, signal.SIGCONT)  # it wakes up and commits step 4
        _out, err = zombie.communicate(timeout=180)
    finally:
        if zombie.poll() is None:
            zombie.kill()
            zombie.wait()
    assert zombie.returncode == 0, err
    # The zombie's manifest is there, with its lease generation below the new holder's ...
    catalog = tg.Catalog(url)
    assert catalog.committed("step-000000004")
    assert catalog.generation("step-000000004") == 1
    # ... but it is no checkpoint of the run: not listed, not restored, not counted.
    assert catalog.steps() == [2] and mgr.steps() == [2]
    assert [e.status for e in catalog.listing()] == ["committed", "fenced"]
    # Training goes on: step 4 is saved over the zombie's commit, no error out of step().
    for s in (3, 4):
        live["w"].fill_(float(10 * s))
        live["step"] = s
        assert mgr.step(s) is True
    mgr.close()
    assert mgr.stats and all(st.error is None for st in mgr.stats)
    fresh = state()
    with tg.CheckpointManager(url, fresh) as again:
        assert again.restore() == 4
        assert again.steps() == [3, 4]
    assert torch.equal(fresh["w"], torch.full((4,), 40.0)) and fresh["step"] == 4


def test_gc_removes_a_fenced_commit_and_a_fence_hides_only_older_generations() -> None:
    """The rule alone, on memory://: a fence (generation 2, step 2) hides a checkpoint of
    generation 1 past step 2, never one at or below it, nor one of generation 2 or later."""
    from tardigrade._save import save_with
    from tardigrade._save_job import SaveOptions

    url = f"memory://zombie-{uuid.uuid4().hex[:12]}/run"
    for step, generation in ((1, 1), (2, 1), (5, 1), (6, 2)):
        save_with(f"{url}/step-00000000{step}", state(step),
                  SaveOptions(step=step, lease_generation=generation))  # fmt: skip
    catalog = tg.Catalog(url)
    assert catalog.steps() == [1, 2, 5, 6]  # no fence yet
    tg.Catalog(url).fence(2)  # the newest step in view is 6: nothing fenced by this one
    assert tg.Catalog(url).steps() == [1, 2, 5, 6]
    storage = catalog.storage
    storage.put(".fences.json", b'{"fences": [[2, 2]]}', mode="overwrite")
    fresh = tg.Catalog(url)
    assert fresh.steps() == [1, 2, 6] and fresh.scan().fenced == ["step-000000005"]
    assert [e.status for e in fresh.listing()] == ["committed", "committed", "fenced", "committed"]
    done = fresh.tidy()
    assert [t.name for t in done] == ["step-000000005 (committed after its writer lost the lease)"]
    assert not storage.exists("step-000000005/manifest.json")
    storage.put(".fences.json", b'{"fences": "bad"}', mode="overwrite")
    with pytest.raises(tg.CorruptCheckpointError, match=r"\.fences\.json: not a record"):
        tg.Catalog(url).steps()
