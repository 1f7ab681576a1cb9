"""An error raised on one rank of a collective keeps its class and errno on every rank, so code
that handles it as in one process (``except FileNotFoundError``, ``restore()`` skipping an
unreadable checkpoint) behaves the same in a distributed job.

One run of two ranks checks everything in order: an error raised through a collective leaves the
group in step, so each check also proves the previous one left it usable.
"""

from __future__ import annotations

import errno
import logging
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import tardigrade as tg
from tardigrade.testing import FaultyStorage

from ._harness import caught, make_state, run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(150)]


class ReadsASecret:
    """A stateful object whose ``state_dict()`` fails the way reading a protected file does."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail

    def state_dict(self) -> dict[str, Any]:
        if self.fail:
            raise PermissionError(errno.EACCES, "Permission denied", "/etc/secret-token")
        return {"token": "t"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def error_classes(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # The first of each fresh rank process: the same faulty:// URL on both ranks (as is the
    # second, below). Faults are armed on rank 1's only.
    faulty = FaultyStorage(root)
    here = os.path.join(root, "here")
    tg.save(here, make_state(rank, world, 1.0), step=1, timeout=30)

    # 1. A collective load of a missing checkpoint, on every rank, then on rank 1 only.
    out["missing_everywhere"] = caught(lambda: tg.load(os.path.join(root, "nope"), timeout=30))
    out["missing_on_1"] = caught(
        lambda: tg.load(os.path.join(root, "nope") if rank == 1 else here, timeout=30)
    )

    # 2. A PermissionError on rank 1 while the save gathers its state: in one process it
    # propagates as itself.
    state = {**make_state(rank, world, 2.0), "secret": ReadsASecret(fail=rank == 1)}
    out["denied_state"] = caught(
        lambda: tg.save(os.path.join(root, "denied"), state, step=2, timeout=30)
    )

    # 3. ENOSPC on rank 1 while it writes its data file: a SaveError, as in one process.
    if rank == 1:
        faulty.fail("write", where="data-r00001", error="ENOSPC", times=1_000)
    out["disk_full"] = caught(
        lambda: tg.save(faulty.url("full"), make_state(rank, world, 2.0), timeout=30)
    )
    faulty.heal()
    dist.barrier()
    out["listing"] = sorted(os.listdir(root))
    dist.barrier()  # every rank has listed before rank 0 creates mgr/ below

    # 4. restore() skips candidates that rank 1 cannot read: step 3 gives it an I/O error
    # (EIO) reading data, step 2 lost a data file; it restores step 1 on every rank.
    skipped: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: skipped.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("tardigrade").addHandler(handler)
    state = make_state(rank, world, 1.0)
    faulty = FaultyStorage(os.path.join(root, "mgr"))
    mgr = tg.CheckpointManager(faulty.root, state, async_save=False, timeout=30)
    for step in (1, 2, 3):
        for leaf in (state["emb"].local, state["w"]):
            leaf.fill_(float(step))
        state["step"] = step
        mgr.save(step)
    dist.barrier()
    if rank == 0:
        step_2 = os.path.join(root, "mgr", "step-000000002")
        os.remove(os.path.join(step_2, next(f for f in os.listdir(step_2) if "r00001" in f)))
    dist.barrier()
    if rank == 1:
        faulty.fail("read", where=f"{os.sep}step-000000003{os.sep}", error="EIO", times=1_000)
    try:
        out["restored"] = mgr.restore()
    finally:
        faulty.heal()
    out["state"] = [float(state["emb"].local[0, 0]), float(state["w"][0, 0]), state["step"]]
    out["skipped"] = [m for m in skipped if "skipping checkpoint" in m]
    mgr.close()
    return out


def test_errors_keep_their_class_and_errno_on_every_rank(tmp_path: Path) -> None:
    results = run_ranks(error_classes, 2, str(tmp_path), timeout=120)
    assert not [r for r in results if "error" in r], results

    def same_everywhere(key: str) -> dict[str, Any]:
        assert results[0][key] == results[1][key], key
        return results[0][key]

    missing = same_everywhere("missing_everywhere")
    assert missing["type"] == "CheckpointNotFoundError" and "FileNotFoundError" in missing["mro"]
    assert missing["causes"] == [0, 1]
    missing = same_everywhere("missing_on_1")
    assert missing["type"] == "CheckpointNotFoundError" and "FileNotFoundError" in missing["mro"]
    assert missing["causes"] == [1]
    assert missing["message"].startswith("tg.load failed on rank 1 of 2;")

    denied = same_everywhere("denied_state")
    assert {"PermissionError", "StorageError", "TardigradeError"} <= set(denied["mro"])
    assert denied["errno"] == errno.EACCES
    assert denied["causes"] == [1]
    assert (
        "rank 1: PermissionError: [Errno 13] Permission denied: '/etc/secret-token'"
        in (denied["message"])
    )

    full = same_everywhere("disk_full")
    assert full["type"] == "SaveError" and full["causes"] == [1]
    assert "injected ENOSPC" in full["message"] and "data-r00001" in full["message"]

    for out in results:
        assert out["listing"] == ["here"]  # neither failed save committed anything
        assert out["restored"] == 1
        assert out["state"] == [1.0, 1.0, 1]
        assert [m.split(": ")[1].rsplit("/", 1)[1] for m in out["skipped"]] == [
            "step-000000003",
            "step-000000002",
        ], out["skipped"]
        assert "failed on rank 1 of 2" in out["skipped"][0]
        # rank 1's read error names the file it failed on (a StorageError with the errno)
        assert re.search(
            r"rank 1: StorageError: \[Errno 5\] \S*step-000000003\S*: injected EIO",
            out["skipped"][0],
        ), out["skipped"][0]
