"""Tiers: a checkpoint copied between storages (``copy_checkpoint``), and the manager's remote
tier (``CheckpointManager(local_dir, upload_to=...)``): background uploads, remote retention,
a restore on a fresh machine that downloads the newest remote checkpoint, and failed uploads
that are counted and retried but never stop training. The remote tier is ``memory://`` and
``s3://`` on the session's SeaweedFS."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tardigrade as tg
from tardigrade import _async
from tardigrade._tiers import Uploader, copy_checkpoint, file_rank
from tardigrade.errors import CheckpointExistsError, CorruptCheckpointError
from tardigrade.manager import _dispatch as _manager
from tardigrade.manager._tiers import RemoteTier
from tardigrade.storage import open_root
from tardigrade.testing import FaultyStorage


@pytest.fixture(params=["memory", "s3"])
def remote_url(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "s3":
        server = request.getfixturevalue("s3_env")
        url = f"s3://{server.bucket}/tier-{uuid.uuid4().hex[:12]}"
    else:
        url = f"memory://tier-{uuid.uuid4().hex[:12]}/remote"
    yield url
    open_root(url).delete("")


def uploader_of(mgr: tg.CheckpointManager) -> Any:
    """The manager's uploader (its remote tier's), for tests that wait on it."""
    tier = mgr._tiers.first(RemoteTier)
    assert tier is not None and tier.uploader is not None
    return tier.uploader


def state_at(step: int) -> dict[str, Any]:
    return {
        "w": torch.full((300_000,), float(step)),
        "name": "data-00000-of-00001.safetensors",  # a user string equal to a file's name
        "step": step,
    }


def test_a_checkpoint_copied_to_a_store_and_back_verifies_and_loads(
    tmp_path: Path, remote_url: str
) -> None:
    local, back = open_root(str(tmp_path / "local")), open_root(str(tmp_path / "back"))
    remote = open_root(remote_url)
    tg.save(local.url("step-000000001"), state_at(1), step=1)
    assert copy_checkpoint(local, "step-000000001", remote) == "copied"
    assert copy_checkpoint(local, "step-000000001", remote) == "present"  # the same save
    stored = remote.list("step-000000001")
    assert "manifest.json" in stored and len(stored) == 2
    assert any(n != "manifest.json" and n[16] == "." for n in stored)  # save-unique name
    assert tg.verify(remote.url("step-000000001")).files == 1
    assert copy_checkpoint(remote, "step-000000001", back) == "copied"
    assert sorted(back.list("step-000000001")) == sorted(local.list("step-000000001"))
    out = tg.load(back.url("step-000000001"))
    assert torch.equal(out["w"], state_at(1)["w"])
    assert out["name"] == "data-00000-of-00001.safetensors"  # user strings are not renamed
    # A different checkpoint of the same name is not replaced unless asked.
    tg.save(local.url("step-000000001"), state_at(7), step=1, overwrite=True)
    with pytest.raises(CheckpointExistsError, match="another checkpoint"):
        copy_checkpoint(local, "step-000000001", remote)
    copy_checkpoint(local, "step-000000001", remote, replace=True)
    assert float(tg.load(remote.url("step-000000001"))["w"][0]) == 7.0
    assert len(remote.list("step-000000001")) == 2  # the replaced save's data is gone


def test_a_damaged_source_is_not_copied_and_leaves_nothing(tmp_path: Path, remote_url: str) -> None:
    local, remote = open_root(str(tmp_path / "local")), open_root(remote_url)
    tg.save(local.url("step-000000001"), state_at(1), step=1)
    data = next(n for n in local.list("step-000000001") if n.endswith(".safetensors"))
    raw = local.read_bytes(f"step-000000001/{data}", 1 << 30)
    local.put(f"step-000000001/{data}", raw[:-10], mode="overwrite")
    with pytest.raises(CorruptCheckpointError, match="not copying a damaged checkpoint"):
        copy_checkpoint(local, "step-000000001", remote)
    assert remote.list() == []


def test_uploads_retention_and_a_fresh_machine_restores_from_the_remote(
    tmp_path: Path, remote_url: str
) -> None:
    state = state_at(0)
    with tg.CheckpointManager(
        tmp_path / "run", state, every_steps=1, keep_last=1, keep_last_remote=2,
        upload_to=remote_url,
    ) as mgr:  # fmt: skip
        for step in range(1, 5):
            state.update(state_at(step))
            state["w"].fill_(float(step))
            mgr.step(step)
        mgr.wait()
    # Closed: the final figures stay readable.
    final = mgr.uploads
    assert final is not None and final.pending == 0 and final.failed == 0
    assert final.uploaded == [f"step-00000000{s}" for s in range(1, 5)]
    # Retention spared each checkpoint until it was uploaded, then caught up.
    assert [n for n in open_root(str(tmp_path / "run")).list() if n.startswith("step-")] == [
        "step-000000004"
    ]
    remote_root = open_root(remote_url)
    assert [n for n in remote_root.list() if n.startswith("step-")] == [
        "step-000000003",
        "step-000000004",
    ]
    assert tg.verify(f"{remote_url}/step-000000004").files == 1
    # A fresh machine: an empty local directory, the same remote tier.
    fresh = state_at(0)
    fresh["w"].zero_()
    with tg.CheckpointManager(tmp_path / "new-machine", fresh, upload_to=remote_url) as mgr:
        assert mgr.restore() == 4
        assert float(fresh["w"][0]) == 4.0 and fresh["step"] == 4
        assert mgr.steps() == [4]  # downloaded into the fast tier


def test_each_tier_keeps_its_own_cadence(tmp_path: Path, remote_url: str) -> None:
    """The directory every step, the remote tier every third (``upload_every``): the remote
    takes only its own steps, the directory's retention still waits for those uploads, and a
    fresh machine restores the remote's newest."""
    state = state_at(0)
    with tg.CheckpointManager(
        tmp_path / "run", state, every_steps=1, keep_last=2, upload_to=remote_url,
        upload_every=3,
    ) as mgr:  # fmt: skip
        assert (mgr.upload_every, mgr.keep_last_remote) == (3, None)
        for step in range(1, 8):
            state.update(state_at(step))
            state["w"].fill_(float(step))
            mgr.step(step)
        mgr.wait()
        # Retention (keep_last=2) spares step 3 and 6 while they upload: it catches up once
        # they are (at close, at the latest).
        assert {6, 7} <= set(mgr.steps()) <= {3, 6, 7}
    assert tg.Catalog(tmp_path / "run").steps() == [6, 7]
    assert mgr.uploads is not None and mgr.uploads.uploaded == ["step-000000003", "step-000000006"]
    assert [n for n in open_root(remote_url).list() if n.startswith("step-")] == [
        "step-000000003",
        "step-000000006",
    ]
    fresh = state_at(0)
    with tg.CheckpointManager(tmp_path / "new-machine", fresh, upload_to=remote_url) as mgr:
        assert mgr.restore() == 6 and float(fresh["w"][0]) == 6.0


def test_a_cadence_for_a_tier_that_is_not_there_is_refused(tmp_path: Path) -> None:
    with pytest.raises(tg.InvalidArgumentError, match="upload_every=5 was given without upload_to"):
        tg.CheckpointManager(tmp_path / "run", state_at(0), upload_every=5)
    with pytest.raises(tg.InvalidArgumentError, match="upload_every"):
        tg.CheckpointManager(
            tmp_path / "run", state_at(0), upload_to=tmp_path / "r", upload_every=0
        )


def test_a_failed_upload_is_counted_retried_and_never_stops_training(
    tmp_path: Path, remote_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    faulty = FaultyStorage(remote_url)
    state = state_at(0)
    caplog.set_level(logging.ERROR, logger="tardigrade")
    with tg.CheckpointManager(
        tmp_path / "run", state, async_save=False, upload_to=faulty.root
    ) as mgr:
        faulty.fail("commit", error="EIO")  # the first upload's commit fails once
        state["w"].fill_(1.0)
        assert mgr.save(1) is True  # training goes on
        assert uploader_of(mgr).wait(60)
        uploads = mgr.uploads
        assert uploads is not None
        assert uploads.failed == 1 and uploads.uploaded == ["step-000000001"]
        assert uploads.last_error is not None and "injected EIO" in uploads.last_error
    assert any("UPLOAD FAILED for step-000000001" in r.getMessage() for r in caplog.records)
    assert tg.verify(f"{remote_url}/step-000000001").files == 1
    assert [n for n in open_root(remote_url).list() if n.startswith("step-")] == ["step-000000001"]


def test_a_remote_holding_another_runs_checkpoints_is_said_once_and_not_retried(
    tmp_path: Path, remote_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Two runs upload the same steps into one prefix: the second run's uploads can never
    commit. Said at creation, and each failed upload once (no retries, no backoff waits)."""
    with tg.CheckpointManager(tmp_path / "a", state_at(0), upload_to=remote_url) as mgr:
        mgr.save(1)
    caplog.set_level(logging.WARNING, logger="tardigrade")
    with tg.CheckpointManager(tmp_path / "b", state_at(0), upload_to=remote_url) as mgr:
        mgr.save(1)  # another run, the same step: its upload conflicts
        mgr.wait()
        assert uploader_of(mgr).wait(60)
        uploads = mgr.uploads
        assert uploads is not None and uploads.failed == 1 and uploads.uploaded == []
    with tg.CheckpointManager(tmp_path / "b", state_at(0), upload_to=remote_url) as mgr:
        pass  # a restart of run b: the remote's step 1 is another save than b's own
    failed = [r.getMessage() for r in caplog.records if "UPLOAD FAILED" in r.getMessage()]
    assert len(failed) == 1 and "(not retried)" in failed[0] and "another prefix" in failed[0]
    (said,) = [r.getMessage() for r in caplog.records if "checkpoints of another run" in
               r.getMessage() and "already holds" in r.getMessage()]  # fmt: skip
    assert "step-000000001 is another save" in said


def test_one_job_uploads_into_a_remote_root(tmp_path: Path, remote_url: str) -> None:
    with tg.CheckpointManager(tmp_path / "a", state_at(0), upload_to=remote_url):
        with pytest.raises(tg.CheckpointLockedError, match="another job is writing"):
            tg.CheckpointManager(tmp_path / "b", state_at(0), upload_to=remote_url)
        # The refused manager released its own local lock: its directory is free again.
        with tg.CheckpointManager(tmp_path / "b", state_at(0)):
            pass
    with tg.CheckpointManager(tmp_path / "b", state_at(0), upload_to=remote_url):
        pass  # free once the first job closed


@pytest.mark.parametrize("async_save", [True, False])
def test_uploads_wait_while_training_waits_on_a_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool
) -> None:
    """On a few cores an upload running beside a save's staging copy slowed it (a tiered
    save blocked training ~2x as long as a local one, measured): the manager holds the copies
    while training waits, the staging copy of an async save or the whole of a sync save."""
    url = f"memory://tier-{uuid.uuid4().hex[:12]}/remote"
    state = state_at(0)
    open_while: list[bool] = []  # whether uploads could copy while training waited
    with tg.CheckpointManager(tmp_path / "run", state, async_save=async_save, upload_to=url) as mgr:
        uploader = uploader_of(mgr)
        assert uploader is not None
        if async_save:
            stage_copy = _async.stage_copy

            def recording_stage_copy(*args: Any, **kwargs: Any) -> None:
                open_while.append(uploader._go.is_set())
                stage_copy(*args, **kwargs)

            monkeypatch.setattr(_async, "stage_copy", recording_stage_copy)
        else:
            save = _manager.save_with

            def recording_save(*args: Any, **kwargs: Any) -> Any:
                open_while.append(uploader._go.is_set())
                return save(*args, **kwargs)

            monkeypatch.setattr(_manager, "save_with", recording_save)
        for step in (1, 2, 3):
            state["w"].fill_(float(step))
            assert mgr.save(step)
        assert uploader._go.is_set()  # and open again after each save
        assert uploader.wait(60)
    assert open_while == [False] * 3
    assert tg.load(f"{url}/step-000000003")["step"] == 0
    assert float(tg.load(f"{url}/step-000000003")["w"][0]) == 3.0


def test_a_held_uploader_copies_nothing_until_released(tmp_path: Path) -> None:
    local = open_root(tmp_path / "local")
    tg.save(local.url("step-000000001"), state_at(1))
    remote = open_root(f"memory://tier-{uuid.uuid4().hex[:12]}/remote")
    uploader = Uploader(local, remote)
    try:
        with uploader.held():
            uploader.submit("step-000000001")
            assert not uploader.wait(0.5)  # paused before its first chunk
            assert not remote.exists("step-000000001/MANIFEST")
        assert uploader.wait(60)
        assert uploader.stats.uploaded == ["step-000000001"]
    finally:
        uploader.close(60)
    assert tg.verify(remote.url("step-000000001")).files == 1


def test_a_memory_directory_in_front_of_a_disk_directory(tmp_path: Path) -> None:
    """Tiers compose with any two locations: /dev/shm (here a temporary directory) as the
    fast tier in front of a disk directory. A restart on the same node restores from the
    fast tier; a new node (its /dev/shm empty) restores from the disk tier."""
    shm, disk = tmp_path / "shm", tmp_path / "disk"
    state = state_at(0)
    with tg.CheckpointManager(shm, state, keep_last=1, upload_to=disk, async_save=False) as mgr:
        for step in (1, 2):
            state["w"].fill_(float(step))
            mgr.save(step)
    assert sorted(p.name for p in shm.iterdir() if p.name.startswith("step-")) == ["step-000000002"]
    assert tg.verify(disk / "step-000000002").files == 1
    same_node = state_at(0)
    with tg.CheckpointManager(shm, same_node, upload_to=disk) as mgr:
        assert mgr.restore() == 2 and float(same_node["w"][0]) == 2.0
    new_node = state_at(0)
    with tg.CheckpointManager(tmp_path / "other-shm", new_node, upload_to=disk) as mgr:
        assert mgr.restore() == 2 and float(new_node["w"][0]) == 2.0


def test_a_remote_checkpoint_that_cannot_be_downloaded_leaves_the_local_restore(
    tmp_path: Path, remote_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    state = state_at(0)
    with tg.CheckpointManager(tmp_path / "run", state, async_save=False, upload_to=remote_url) as m:
        state["w"].fill_(1.0)
        m.save(1)
    remote = open_root(remote_url)
    tg.save(f"{remote_url}/step-000000002", state_at(2), step=2)  # newer, then damaged:
    remote.put("step-000000002/manifest.json", b'{"format":"tardigrade"}', mode="overwrite")
    restored = state_at(0)
    with tg.CheckpointManager(tmp_path / "run", restored, upload_to=remote_url) as m:
        assert m.restore() == 1 and float(restored["w"][0]) == 1.0
    assert any("downloading step-000000002" in r.getMessage() for r in caplog.records)
    assert [p.name for p in (tmp_path / "run").iterdir() if not p.name.startswith(".")] == [
        "step-000000001"
    ]  # nothing of the failed download is left


def test_the_rank_that_wrote_a_file_is_read_from_its_name_on_a_directory_and_a_store() -> None:
    # A distributed upload sends each rank's own files; a single process's are rank 0's.
    assert file_rank("data-r00001-00000-of-00002.safetensors") == 1
    assert file_rank("0123456789abcdef.data-r00012-00001-of-00002.safetensors") == 12
    assert file_rank("data-00000-of-00001.safetensors") == 0
    assert file_rank("0123456789abcdef.data-00000-of-00001.safetensors") == 0


@pytest.mark.parametrize("error", ["lost_reply", "EIO"])
def test_a_copy_whose_commit_fails_never_leaves_a_committed_manifest_without_its_data(
    tmp_path: Path, error: str
) -> None:
    """The manifest's conditional create reaches the store, then the reply is lost (or the
    request fails): the copy must not remove its data objects unless the manifest is not
    there, or the remote holds a committed checkpoint that can never load."""
    local = open_root(str(tmp_path / "local"))
    tg.save(local.url("step-000000001"), state_at(1), step=1)
    remote = FaultyStorage(f"memory://tier-{uuid.uuid4().hex[:12]}/remote")
    remote.fail("put", where="manifest.json", error=error)
    try:
        copy_checkpoint(local, "step-000000001", remote)
    except Exception as e:
        assert "injected" in str(e), e
    name = "step-000000001"
    if remote.inner.exists(f"{name}/manifest.json"):  # committed: it must load whole
        assert tg.verify(remote.inner.url(name)).files == 1
        assert torch.equal(tg.load(remote.inner.url(name))["w"], state_at(1)["w"])
    else:  # not committed: nothing of the copy is left
        assert remote.inner.list(name) == []
    assert len(remote.injected) == 1
    # The next copy of the same save finds it there, or makes it.
    assert copy_checkpoint(local, name, remote.inner) in ("present", "copied")
    assert tg.verify(remote.inner.url(name)).files == 1
    remote.inner.delete("")
