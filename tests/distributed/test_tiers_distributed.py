"""The manager's second tiers in a 2-rank gloo job: ``upload_to`` (each rank uploads the files
it wrote, rank 0 commits the remote manifest once every rank's are there; a fresh set of
machines restores from the remote on 2 ranks and on 1), and a RAM tier per rank (a job killed
with SIGKILL restarts from memory when every rank holds the newest save there, else from the
directory).

Each test spawns its ranks as few times as it can: starting ranks is the slow part.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import tardigrade as tg
from tardigrade import _tiers
from tardigrade._load import load_from
from tardigrade.manager._tiers import MemoryTier, RemoteTier
from tardigrade.storage import open_root
from tardigrade.testing import FaultyStorage

from ._harness import caught, run_ranks, run_ranks_and_exits
from .test_manager_distributed import make_state, set_state, state_value

pytestmark = pytest.mark.distributed


def uploader_of(mgr: tg.CheckpointManager) -> Any:
    """The manager's uploader (its remote tier's), for tests that wait on it."""
    tier = mgr._tiers.first(RemoteTier)
    assert tier is not None and tier.uploader is not None
    return tier.uploader


def ram_of(mgr: tg.CheckpointManager) -> Any:
    """The manager's RAM tier (``_ramtier.RamTier``)."""
    tier = mgr._tiers.first(MemoryTier)
    assert tier is not None
    return tier.ram


@pytest.fixture(params=["directory", pytest.param("s3", marks=pytest.mark.s3)])
def remote(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """The remote tier's URL, and the environment that reaches it (the S3 credentials)."""
    if request.param == "s3":
        server = request.getfixturevalue("s3_env")
        url = f"s3://{server.bucket}/dist-tier-{uuid.uuid4().hex[:12]}"
        yield url, server.env()
        open_root(url).delete("")
    else:
        yield str(tmp_path / "remote"), {}


def upload_rank(rank: int, world: int, local: str, remote: str) -> dict[str, Any]:
    state = make_state(rank, world, 0.0)
    with tg.CheckpointManager(
        local, state, every_steps=1, keep_last=1, keep_last_remote=2, upload_to=remote
    ) as mgr:
        for step in range(1, 4):
            set_state(state, rank, float(step))
            mgr.step(step)
        mgr.wait()
        assert uploader_of(mgr).wait(60)
        uploads = mgr.uploads
        assert uploads is not None
        return {"uploaded": list(uploads.uploaded), "failed": uploads.failed}


def restore_rank(rank: int, world: int, local: str, remote: str) -> dict[str, Any]:
    # Each rank downloads its own share: reading the other rank's data files fails here.
    faulty = FaultyStorage(remote)  # faulty://1 on both ranks
    faulty.fail("open_reader", where=f"data-r{1 - rank:05d}", error="EACCES", times=1000)
    state = make_state(rank, world, 0.0)
    with tg.CheckpointManager(local, state, upload_to=faulty.root) as mgr:
        step = mgr.restore()
        return {"step": step, "value": state_value(state, rank), "steps": mgr.steps()}


def test_each_rank_uploads_its_files_and_new_machines_restore_on_two_ranks_and_on_one(
    tmp_path: Path, remote: tuple[str, dict[str, str]]
) -> None:
    url, env = remote
    out, exits = run_ranks_and_exits(
        upload_rank, 2, str(tmp_path / "run"), url, env=env, timeout=120
    )
    names = ["step-000000001", "step-000000002", "step-000000003"]
    assert out == [{"uploaded": names, "failed": 0}] * 2, out
    assert exits == [0, 0]  # the uploads' own gloo group was freed before the ranks' teardown
    root = open_root(url)
    # Remote retention (keep_last_remote=2) on rank 0; local retention caught up at close.
    assert [n for n in root.list() if n.startswith("step-")] == names[1:]
    assert [n for n in os.listdir(tmp_path / "run") if n.startswith("step-")] == names[2:]
    manifest = tg.read_manifest(f"{url}/step-000000003")
    files = [f["name"] for f in manifest["files"]]
    # Both ranks' files reached the remote, under the remote's own names.
    assert any("data-r00000" in f for f in files) and any("data-r00001" in f for f in files)
    assert tg.verify(f"{url}/step-000000003").files == len(files)
    assert sorted(n for n in root.list("step-000000003") if n != "manifest.json") == sorted(files)

    # New machines: an empty local directory, the same remote tier; 2 ranks, then 1.
    out = run_ranks(restore_rank, 2, str(tmp_path / "new"), url, env=env, timeout=120)
    assert out == [{"step": 3, "value": 3.0, "steps": [3]}] * 2, out
    state = make_state(0, 1, 0.0)
    with tg.CheckpointManager(tmp_path / "one", state, upload_to=url) as mgr:
        assert mgr.restore() == 3
        assert state_value(state, 0) == 3.0  # the whole table, resharded from 2 ranks
        assert mgr.steps() == [3]


def failing_upload_rank(rank: int, world: int, local: str, remote: str) -> dict[str, Any]:
    # The same wrapper on both ranks (the ranks agree on where they upload: faulty://1);
    # every write of rank 1's own data files fails.
    faulty = FaultyStorage(remote)
    if rank == 1:
        faulty.fail("write", where="data-r00001", error="EIO", times=1000)
    target = faulty.root
    state = make_state(rank, world, 1.0)
    with tg.CheckpointManager(local, state, async_save=False, upload_to=target) as mgr:
        uploader_of(mgr).backoff = 0.0  # retried at once: the test need not wait
        saved = mgr.save(1)
        assert uploader_of(mgr).wait(60)
        uploads = mgr.uploads
        assert uploads is not None
        return {
            "saved": saved,
            "steps": mgr.steps(),
            "uploaded": list(uploads.uploaded),
            "failed": uploads.failed,
            "error": uploads.last_error,
            "injected": len(faulty.injected),
        }


def test_an_upload_failing_on_one_rank_commits_nothing_remote_and_is_counted_everywhere(
    tmp_path: Path,
) -> None:
    remote = tmp_path / "remote"
    out = run_ranks(failing_upload_rank, 2, str(tmp_path / "run"), str(remote), timeout=120)
    for o in out:
        assert o["saved"] is True and o["steps"] == [1], o  # training and the local tier go on
        # The first try and 3 retries, each failed on every rank; none committed.
        assert o["uploaded"] == [] and o["failed"] == 4, o
        assert "injected EIO" in o["error"] and "rank 1" in o["error"], o
    assert [o["injected"] for o in out] == [0, 4]
    # Nothing committed, and nothing left behind by the failed copies (rank 0 cleaned up).
    assert not (remote / "step-000000001" / "manifest.json").exists()
    assert [n for n in os.listdir(remote) if n.startswith(("step-", ".tmp"))] == []


def dying_upload_rank(rank: int, world: int, local: str, remote: str) -> dict[str, Any]:
    """Step 1 uploads on both ranks; rank 1 then dies (SIGKILL) halfway through writing its
    first data object of step 2's upload. Rank 0 reports what its uploads and close() saw."""
    state = make_state(rank, world, 1.0)
    mgr = tg.CheckpointManager(local, state, async_save=False, upload_to=remote, timeout=30)
    uploader_of(mgr).backoff = 0.0  # retried at once: the test need not wait
    mgr.save(1)
    assert uploader_of(mgr).wait(60)
    if rank == 1:
        copy_file = _tiers.copy_file

        def dies_mid_object(src: Any, src_name: str, dst: Any, dst_name: str, *a: Any) -> None:
            if not src_name.startswith("step-000000002/"):
                return copy_file(src, src_name, dst, dst_name, *a)
            w = dst.open_writer(dst_name)
            w.write(b"\0" * 4096)  # a part of the object, never closed
            os.kill(os.getpid(), signal.SIGKILL)

        _tiers.copy_file = dies_mid_object
    set_state(state, rank, 2.0)
    mgr.save(2)
    assert uploader_of(mgr).wait(120)  # given up on, not hung: rank 1 is gone
    uploads = mgr.uploads
    assert uploads is not None
    saved = sorted(n for n in os.listdir(local) if n.startswith("step-"))  # steps() is collective
    out = {"uploaded": list(uploads.uploaded), "failed": uploads.failed,
           "error": uploads.last_error, "saved": saved}  # fmt: skip
    out["close"] = caught(mgr.close)  # its collectives find rank 1 gone
    return out


def test_a_rank_dying_mid_upload_commits_nothing_remote_and_keeps_the_previous_upload(
    tmp_path: Path,
) -> None:
    remote = tmp_path / "remote"
    out = run_ranks(dying_upload_rank, 2, str(tmp_path / "run"), str(remote), timeout=180)
    assert out[1] == {"died": -signal.SIGKILL}, out
    survivor = out[0]
    # Step 2 is saved locally; its upload failed on every try (the first and 3 retries) and
    # was given up, reported with the lost rank, never raised into training.
    assert survivor["saved"] == ["step-000000001", "step-000000002"], out
    assert survivor["uploaded"] == ["step-000000001"], out
    assert survivor["failed"] == 4 and "lost the other ranks" in survivor["error"], out
    assert survivor["close"]["type"] == "DistributedError", out
    # The remote holds step 1 alone, intact; nothing of step 2 is visible or left behind.
    assert [n for n in os.listdir(remote) if n.startswith(("step-", ".tmp"))] == [
        "step-000000001"
    ], os.listdir(remote)
    assert tg.verify(remote / "step-000000001").files >= 2
    assert tg.load(remote / "step-000000001")["step"] == 1


def ram_job_rank(rank: int, world: int, local: str, shm: str, last: int) -> dict[str, Any]:
    """Restore, report where from, save up to step ``last``, then die with SIGKILL (both ranks)."""
    state = make_state(rank, world, 0.0)
    mgr = tg.CheckpointManager(local, state, ram_tier=shm, every_steps=1)
    start = mgr.restore()
    report = {
        "restored": start,
        "value": state_value(state, rank),
        "from": mgr.restored_from,
        "path": None if start is None else mgr.path(start),
        "from_ram": mgr.ram_tier_stats.restored,  # type: ignore[union-attr]
        "root": mgr.ram_tier_stats.root,  # type: ignore[union-attr]
    }
    for step in range((start or 0) + 1, last + 1):
        set_state(state, rank, float(step))
        mgr.step(step)
    mgr.wait()
    ram_of(mgr).wait()  # this rank's copy is in memory
    report["stored"] = list(mgr.ram_tier_stats.stored)  # type: ignore[union-attr]
    root = Path(report["root"])
    report["files"] = sorted(os.listdir(root / f"step-{last:09d}"))
    # Where the parent reads it: a rank killed on purpose returns nothing.
    (Path(local).parent / f"report-{rank}-{last}.json").write_text(json.dumps(report))
    dist.barrier()  # both ranks' copies are committed before either dies
    os.kill(os.getpid(), signal.SIGKILL)
    return report  # never reached


def teed_ram_rank(rank: int, world: int, local: str, shm: str) -> dict[str, Any]:
    """An async save with a RAM tier; training mutates the state as soon as save() returns."""
    faulty = FaultyStorage(local)  # faulty://1 on both ranks: the directory, its reads logged
    state = make_state(rank, world, 1.0)
    name = "step-000000001"
    with tg.CheckpointManager(faulty.root, state, ram_tier=shm) as mgr:
        mgr.save(1)
        set_state(state, rank, 5.0)  # training goes on at once
        mgr.wait()
        ram_of(mgr).wait()
        read_back = [w for op, w in faulty.log if op == "open_reader" and "data-r" in w]
        stats = mgr.ram_tier_stats
        assert stats is not None
        files = sorted(os.listdir(Path(stats.root) / name))
        # This rank's files from memory, the other's from the directory, every byte verified.
        ram = ram_of(mgr)
        tree = load_from(lambda: ram.overlay(name, faulty), name, into=None, verify="all")
        return {
            "stored": stats.stored,
            "failed": stats.failed,
            "read_back": read_back,
            "files": files,
            "values": sorted({float(tree["emb"].min()), float(tree["emb"].max()),
                              float(tree["w"].min()), float(tree["w"].max())}),
        }  # fmt: skip


def test_each_ranks_ram_copy_is_written_from_its_staged_copy_with_the_values_of_save_time(
    tmp_path: Path, shm: Path
) -> None:
    out = run_ranks(teed_ram_rank, 2, str(tmp_path / "run"), str(shm), timeout=120)
    for rank, o in enumerate(out):
        assert o["stored"] == ["step-000000001"] and o["failed"] == 0, out
        # Not read back from the directory: written from the slabs the save staged.
        assert o["read_back"] == [], out
        data = [f for f in o["files"] if f != "manifest.json"]
        assert data and all(f.startswith(f"data-r{rank:05d}-") for f in data), out
        assert "manifest.json" in o["files"], out
        assert o["values"] == [1.0], out  # a copy made before training resumed, not an alias


def reports(tmp_path: Path, last: int) -> list[dict[str, Any]]:
    return [json.loads((tmp_path / f"report-{r}-{last}.json").read_text()) for r in range(2)]


def test_a_killed_job_restarts_from_every_ranks_ram_tier_or_from_disk_when_one_lacks_it(
    tmp_path: Path, shm: Path
) -> None:
    local = str(tmp_path / "run")
    out = run_ranks(ram_job_rank, 2, local, str(shm), 2, timeout=120)
    assert out == [{"died": -signal.SIGKILL}] * 2, out
    first = reports(tmp_path, 2)
    assert first[0]["root"] != first[1]["root"]  # one RAM tier per rank
    for rank, r in enumerate(first):
        assert r["restored"] is None and r["stored"][-1] == "step-000000002", r
        # Each rank keeps its own data files (and the manifest), not the other's.
        data = [f for f in r["files"] if f != "manifest.json"]
        assert data and all(f.startswith(f"data-r{rank:05d}-") for f in data), r
        assert "manifest.json" in r["files"]

    # The restart on this node: every rank holds step 2 in memory, so all read from there.
    out = run_ranks(ram_job_rank, 2, local, str(shm), 3, timeout=120)
    assert out == [{"died": -signal.SIGKILL}] * 2, out
    second = reports(tmp_path, 3)
    for rank, r in enumerate(second):
        assert r["restored"] == 2 and r["value"] == 2.0, r
        assert r["from_ram"] == 1 and r["from"] == f"{first[rank]['root']}/step-000000002", r

    # Rank 1's copy of step 3 is gone (a rank moved to another node): both read the disk.
    subprocess.run(["rm", "-rf", second[1]["root"]], check=True)
    out = run_ranks(ram_job_rank, 2, local, str(shm), 4, timeout=120)
    assert out == [{"died": -signal.SIGKILL}] * 2, out
    for r in reports(tmp_path, 4):
        assert r["restored"] == 3 and r["value"] == 3.0, r
        assert r["from_ram"] == 0 and r["from"] == r["path"], r
