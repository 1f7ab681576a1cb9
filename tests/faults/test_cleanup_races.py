"""Cleanup never destroys a live save or a committed checkpoint; overwrite replaces only checkpoints.

``tg.save`` takes no directory lock, so ``tardigrade gc`` and a manager's tidy-up must tell a
live save's staging directory from a dead one's by the flock every save holds on it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
import torch

import tardigrade as tg
from tardigrade import _write
from tardigrade._catalog import Catalog
from tardigrade.errors import CheckpointExistsError
from tardigrade.storage import local

SRC = str(Path(__file__).resolve().parents[2] / "src")


def state(seed: int = 0) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 64, generator=g), "step": seed}


# ----------------------------------------------------------------------------------------------
# gc beside saves that hold no lock (item 3)


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_tidy_looping_beside_a_save_loop_never_breaks_a_save(tmp_path: Path, async_: bool) -> None:
    stop = threading.Event()
    removed: list[str] = []

    def gc_loop() -> None:
        while not stop.is_set():
            removed.extend(t.name for t in Catalog(str(tmp_path)).tidy())

    thread = threading.Thread(target=gc_loop, daemon=True)
    thread.start()
    saved = []
    try:
        for i in range(150):
            path = tmp_path / f"c{i:04d}"
            if async_:
                tg.save(path, state(i), async_=True).result(timeout=30)
            else:
                tg.save(path, state(i))
            saved.append(path)
    finally:
        stop.set()
        thread.join(timeout=30)
    broken = []
    for i, path in enumerate(saved):
        try:
            tg.verify(path)
            assert tg.load(path)["step"] == i
        except Exception as e:  # collect every broken save, then report them together
            broken.append(f"{path.name}: {e!r}")
    assert not broken, f"{len(broken)} of {len(saved)} committed saves broken:\n" + "\n".join(
        broken[:5]
    )
    assert not [n for n in removed if not n.startswith(".tmp-")]


HOLDER = """
import sys, time
from tardigrade._commit import commit_for
from tardigrade.storage.local import LocalStorage
staging = commit_for(LocalStorage(sys.argv[1])).begin("step-000000007", "0" * 32)
print(staging, flush=True)
time.sleep(120)
"""


def test_tidy_skips_another_process_s_live_staging_and_removes_it_once_that_process_dies(
    tmp_path: Path,
) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": SRC},
    )
    try:
        staging = child.stdout.readline().strip()  # type: ignore[union-attr]
        assert staging.startswith(".tmp-step-000000007-")
        assert Catalog(str(tmp_path)).tidy() == []
        assert (tmp_path / staging).is_dir()
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        assert [t.name for t in Catalog(str(tmp_path)).tidy()] == [staging]
        assert not (tmp_path / staging).exists()
    finally:
        child.kill()
        child.wait(timeout=30)


def test_a_staging_directory_removed_before_it_was_locked_is_recreated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The window between mkdir and flock: a cleanup takes the fresh directory for dead.
    real_lock = local.lock_dir
    calls = []

    def lock_after_a_cleanup(path: str, *, wait: bool) -> int | None:
        if not calls:
            calls.append(path)
            os.rmdir(path)
        return real_lock(path, wait=wait)

    monkeypatch.setattr(local, "lock_dir", lock_after_a_cleanup)
    tg.save(tmp_path / "a", state(3))
    assert calls and tg.load(tmp_path / "a")["step"] == 3


# ----------------------------------------------------------------------------------------------
# recovery after a crashed replace (item 5)


@pytest.mark.parametrize("name", ["best-model", "step-000000004", "v2.final"])
def test_a_moved_aside_checkpoint_is_put_back_whatever_its_name(tmp_path: Path, name: str) -> None:
    # The state a crash between the two renames of a replace leaves behind.
    tg.save(tmp_path / name, state(4))
    aside = tmp_path / f".tmp-{name}-replaced-{uuid.uuid4().hex}"
    os.rename(tmp_path / name, aside)
    done = Catalog(str(tmp_path)).tidy()
    assert [(t.name, t.action) for t in done] == [(name, "recovered")]
    assert tg.load(tmp_path / name)["step"] == 4


def test_a_moved_aside_checkpoint_is_dropped_only_once_its_replacement_committed(
    tmp_path: Path,
) -> None:
    tg.save(tmp_path / "best", state(1))
    aside = tmp_path / f".tmp-best-replaced-{uuid.uuid4().hex}"
    os.rename(tmp_path / "best", aside)
    tg.save(tmp_path / "best", state(2))  # the replacement did commit
    assert [t.action for t in Catalog(str(tmp_path)).tidy()] == ["removed"]
    assert tg.load(tmp_path / "best")["step"] == 2
    # Something that is not a checkpoint at the name: both are kept.
    tg.save(tmp_path / "other", state(5))
    aside = tmp_path / f".tmp-mine-replaced-{uuid.uuid4().hex}"
    os.rename(tmp_path / "other", aside)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    assert Catalog(str(tmp_path)).tidy() == []
    assert aside.is_dir() and (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def test_replace_without_atomic_swap_holds_the_moved_aside_checkpoint_against_cleanup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local, "_exchange", lambda a, b: False)
    tg.save(tmp_path / "best", state(1))
    real_rename = local._rename_new
    seen: list[list[str]] = []

    def rename(src: str, dst: str) -> None:
        real_rename(src, dst)
        if "-replaced-" in os.fspath(dst):
            # Between the two renames: a cleanup must not put the old one back.
            seen.append([t.name for t in Catalog(str(tmp_path)).tidy()])

    monkeypatch.setattr(local, "_rename_new", rename)
    tg.save(tmp_path / "best", state(2), overwrite=True)
    assert seen == [[]]
    assert tg.load(tmp_path / "best")["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best"]


# ----------------------------------------------------------------------------------------------
# overwrite=True replaces a checkpoint and nothing else (item 2)


def test_overwrite_refuses_a_directory_of_checkpoints(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with tg.CheckpointManager(run, state(), async_save=False) as mgr:
        mgr.save(1)
        mgr.save(2)
    with pytest.raises(CheckpointExistsError, match="not a committed checkpoint"):
        tg.save(run, state(), overwrite=True)
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("step-")) == [
        "step-000000001",
        "step-000000002",
    ]
    assert tg.load(run / "step-000000002")["step"] == 0


def test_overwrite_refuses_a_directory_of_user_files(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("years of work")
    with pytest.raises(CheckpointExistsError, match="move or delete it yourself"):
        tg.save(tmp_path / "mine", state(), overwrite=True)
    assert (tmp_path / "mine" / "thesis.tex").read_text() == "years of work"


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_regular_file_in_the_way_is_refused_and_named_as_a_file(
    tmp_path: Path, overwrite: bool
) -> None:
    (tmp_path / "ckpt").write_text("precious")
    with pytest.raises(CheckpointExistsError, match=r"ckpt: a file is in the way") as info:
        tg.save(tmp_path / "ckpt", state(), overwrite=overwrite)
    assert "already exists" not in str(info.value)
    assert (tmp_path / "ckpt").read_text() == "precious"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.parametrize("swap", [True, False], ids=["exchange", "renames"])
def test_something_appearing_at_the_path_during_an_overwrite_is_not_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, swap: bool
) -> None:
    if not swap:
        monkeypatch.setattr(local, "_exchange", lambda a, b: False)
    tg.save(tmp_path / "ckpt", state(1))
    real_check = _write.check_target

    def check_then_race(storage, name, overwrite, *, racing=False):  # type: ignore[no-untyped-def]
        real_check(storage, name, overwrite, racing=racing)
        if racing:  # right before commit: the checkpoint is swapped for a user's file
            os.rename(tmp_path / "ckpt", tmp_path / "moved")
            (tmp_path / "ckpt").write_text("precious")

    monkeypatch.setattr(_write, "check_target", check_then_race)
    with pytest.raises(CheckpointExistsError, match="not a checkpoint appeared"):
        tg.save(tmp_path / "ckpt", state(2), overwrite=True)
    assert (tmp_path / "ckpt").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "moved"]
