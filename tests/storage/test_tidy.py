"""When each backend's ``tidy`` (``tardigrade gc``, a manager's cleanup) removes what a save
that never committed left, beyond the conformance suite's generic rules (``TestTidy``,
``TestStoreTidy`` there): the defaults of the fsspec backend (1 h, as S3) and of ``memory://``
(none), and the zombie writer that the grace period exists for, end to end.
"""

from __future__ import annotations

import io
import time
import uuid
from contextlib import redirect_stderr, redirect_stdout
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import torch

import tardigrade as tg
from tardigrade._commit import commit_for
from tardigrade.cli import main
from tardigrade.errors import InvalidArgumentError
from tardigrade.storage import FsspecStorage, MemoryStorage, Storage, open_root
from tardigrade.storage import base as storage_base
from tardigrade.storage.fsspec import _modified

from .conftest import FSSPEC_SCHEME


@pytest.fixture
def tgfs_root() -> Any:
    url = f"{FSSPEC_SCHEME}://tidy-{uuid.uuid4().hex}/root"
    yield url
    open_root(url).delete("")


def later(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Move tidy's clock ``seconds`` on from now (no sleeping)."""
    monkeypatch.setattr(storage_base, "_clock", lambda: time.time() + seconds)


def another_process_s_data(storage: Storage, name: str) -> str:
    """A data object that a save by another process wrote (nothing abandoned here)."""
    data = f"{name}/{commit_for(storage).data_name('data-00000-of-00001', uuid.uuid4().hex)}"
    w = storage.open_writer(data)
    w.write(b"x" * 100)
    w.close()
    return data


def test_fsspec_leaves_another_process_s_young_data_for_an_hour_by_default(
    tgfs_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = open_root(tgfs_root)
    assert isinstance(storage, FsspecStorage) and storage.gc_grace_seconds == 3600
    tg.save(f"{tgfs_root}/step-000000001", {"w": torch.ones(3)})
    data = another_process_s_data(storage, "step-000000002")
    assert tg.Catalog(storage).tidy() == [] and storage.exists(data)
    later(monkeypatch, 3500)
    assert tg.Catalog(storage).tidy() == [] and storage.exists(data)
    later(monkeypatch, 3700)
    done = tg.Catalog(storage).tidy()
    assert [(t.name, t.action, t.nbytes) for t in done] == [("step-000000002", "removed", 100)]
    assert storage.list() == ["step-000000001"]


def test_fsspec_takes_gc_grace_seconds_for_itself(tgfs_root: str) -> None:
    storage = open_root(tgfs_root, {"gc_grace_seconds": 0})
    assert isinstance(storage, FsspecStorage) and storage.gc_grace_seconds == 0
    assert "gc_grace_seconds" not in storage.fs.storage_options  # not the filesystem's
    data = another_process_s_data(storage, "step-000000002")
    assert [t.name for t in tg.Catalog(storage).tidy()] == ["step-000000002"]
    assert not storage.exists(data)


def test_gc_on_an_fsspec_url_keeps_young_data_unless_told_a_shorter_grace_period(
    tgfs_root: str,
) -> None:
    storage = open_root(tgfs_root)
    tg.save(f"{tgfs_root}/step-000000001", {"w": torch.ones(3)})
    data = another_process_s_data(storage, "step-000000002")
    for argv, left in (([], True), (["--storage-option", "gc_grace_seconds=0"], False)):
        out = io.StringIO()
        with redirect_stdout(out), redirect_stderr(io.StringIO()):
            assert main(["gc", tgfs_root, *argv]) == 0
        assert storage.exists(data) == left, out.getvalue()
    assert "removed" in out.getvalue() and "step-000000002" in out.getvalue()


def test_a_zombie_s_save_survives_a_new_manager_s_cleanup_and_commits_whole(
    tgfs_root: str,
) -> None:
    """Issue 18's rule, nothing committed is ever unloadable, against the race the grace
    period closes: a writer whose lease expired is still uploading step 3 when a new job opens
    the root and cleans up; then the zombie commits its manifest."""
    tg.save(f"{tgfs_root}/step-000000001", {"w": torch.full((8,), 1.0), "step": 1})
    tg.save(f"{tgfs_root}/step-000000003", {"w": torch.full((8,), 3.0), "step": 3})
    storage = open_root(tgfs_root)
    manifest = storage.read_bytes("step-000000003/manifest.json", 1 << 20)
    storage.delete("step-000000003/manifest.json")  # uploaded, not committed yet
    state = {"w": torch.zeros(8), "step": 0}
    with tg.CheckpointManager(tgfs_root, state, async_save=False) as mgr:
        assert mgr.restore() == 1  # its cleanup ran
    storage.put("step-000000003/manifest.json", manifest, mode="create")  # the zombie commits
    tg.verify(f"{tgfs_root}/step-000000003")
    assert float(tg.load(f"{tgfs_root}/step-000000003")["w"][0]) == 3.0


def test_memory_has_no_grace_period_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """memory:// is in this process only (users' fast tests): what a save left, whoever
    wrote it, goes at the next cleanup; ``gc_grace_seconds`` tries a real store's rule."""
    root = f"memory://tidy-{uuid.uuid4().hex}/root"
    storage = open_root(root)
    assert isinstance(storage, MemoryStorage) and storage.gc_grace_seconds == 0
    data = another_process_s_data(storage, "step-000000002")
    assert [t.name for t in tg.Catalog(storage).tidy()] == ["step-000000002"]
    assert not storage.exists(data)
    patient = open_root(root, {"gc_grace_seconds": 60})
    data = another_process_s_data(patient, "step-000000002")
    assert tg.Catalog(patient).tidy() == [] and patient.exists(data)
    later(monkeypatch, 61)
    assert [t.name for t in tg.Catalog(patient).tidy()] == ["step-000000002"]
    with pytest.raises(InvalidArgumentError, match=r"memory://.*gc_grace_seconds"):
        open_root(root, {"endpoint": "http://127.0.0.1:1"})


def test_fsspec_reads_the_age_filesystems_report() -> None:
    when = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    assert _modified({"LastModified": when}) == when.timestamp()  # s3fs
    assert _modified({"updated": "2026-01-02T03:04:05.000Z"}) == when.timestamp()  # gcsfs
    assert _modified({"created": when.timestamp()}) == when.timestamp()  # memory, local
    # The last write wins over the creation.
    assert _modified({"created": when, "mtime": when + timedelta(hours=1)}) == (
        when.timestamp() + 3600
    )
    assert _modified({"size": 3}) is None and _modified({"updated": "yesterday"}) is None
