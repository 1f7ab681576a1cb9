"""The RAM tier (``CheckpointManager(dir, state, ram_tier=True | path)``): the newest checkpoint
kept in host shared memory, so that a process killed with SIGKILL and restarted on the same node
restores from memory. Written from the async save's staging copy (never from the live tensors),
bounded to the newest checkpoint, removed at a normal end and kept on a crash, namespaced per
checkpoint directory, and a full memory filesystem never stops training."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tardigrade as tg
from tardigrade._load import load_from
from tardigrade._ramtier import RamTier, namespace
from tardigrade.errors import InvalidArgumentError, StorageError
from tardigrade.storage import open_root
from tardigrade.testing import FaultyStorage

SRC = Path(tg.__file__).resolve().parents[1]


def state_at(step: int, n: int = 300_000) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.rand(n, generator=g), "b": torch.arange(1000) * step, "step": step}


def ram_root(directory: Path, base: str = "/dev/shm") -> Path:
    return Path(base) / namespace(str(directory.resolve()))


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs mounted for the test (root only), unmounted afterwards."""
    where = tmp_path / "tiny-shm"
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False)


CHILD = textwrap.dedent(
    """
    import sys, time, torch, tardigrade as tg
    sys.path.insert(0, {tests!r})
    from test_ram_tier import state_at
    state = state_at(0)
    mgr = tg.CheckpointManager({directory!r}, state, ram_tier=True)
    for step in (1, 2):
        fresh = state_at(step)
        for k in ("w", "b"):
            state[k].copy_(fresh[k])
        state["step"] = step
        mgr.save(step)
    mgr.wait()
    assert mgr.ram_tier_stats.stored == ["step-000000001", "step-000000002"], mgr.ram_tier_stats
    print("committed", flush=True)
    time.sleep(600)
    """
)


def test_a_process_killed_after_a_save_restarts_from_the_ram_tier(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    root = ram_root(directory)
    script = CHILD.format(tests=str(Path(__file__).parent), directory=str(directory))
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line == b"committed\n", proc.stderr.read() if proc.stderr else line  # type: ignore[union-attr]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL
        # The crash left the RAM tier in place: the newest checkpoint only.
        assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == [
            "step-000000002"
        ]
        # Damage the directory's copy of the newest step: only a restore that reads the RAM
        # tier's bytes can still restore step 2 (the directory's would fail verification).
        data = next((directory / "step-000000002").glob("data-*"))
        raw = bytearray(data.read_bytes())
        raw[-1] ^= 0xFF
        data.write_bytes(bytes(raw))

        restored = state_at(0)
        with tg.CheckpointManager(directory, restored, ram_tier=True) as mgr:
            assert mgr.restore() == 2
            assert mgr.restored_from == str(root / "step-000000002")
            stats = mgr.ram_tier_stats
            assert stats is not None and stats.restored == 1 and stats.root == str(root)
        expected = state_at(2)
        for k in ("w", "b"):
            assert restored[k].dtype == expected[k].dtype
            assert restored[k].numpy().tobytes() == expected[k].numpy().tobytes()
        assert restored["step"] == 2
        assert not root.exists()  # the restarted job ended normally: removed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        subprocess.run(["rm", "-rf", str(root)], check=False)


@pytest.mark.parametrize(
    "mode", ["async", "async-budget", "sync"], ids=["async", "async-budget", "sync"]
)
def test_the_ram_copy_holds_the_values_of_save_time_not_later_ones(
    tmp_path: Path, shm: Path, mode: str
) -> None:
    """Parameters mutated right after ``save()`` returns: the RAM tier holds the values from
    before (a copy, never an alias of live tensors; NVRx #376, Lightning #20953)."""
    options: dict[str, Any] = {"async_save": mode != "sync"}
    if mode == "async-budget":
        options["max_staging_bytes"] = 4 << 20  # writers drain slabs while staging goes on
    state = state_at(1, n=4_000_000)  # 16 MB: the background copy is still running
    before = {k: state[k].clone() for k in ("w", "b")}
    with tg.CheckpointManager(tmp_path / "ckpt", state, ram_tier=shm, **options) as mgr:
        mgr.save(1)
        state["w"].add_(1.0)  # training resumes at once
        state["b"].mul_(-1)
        mgr.wait()
        stats = mgr.ram_tier_stats
        assert stats is not None and stats.stored == ["step-000000001"] and stats.failed == 0
        copy = tg.load(Path(stats.root) / "step-000000001")  # verifies every checksum
        for k in ("w", "b"):
            assert copy[k].numpy().tobytes() == before[k].numpy().tobytes(), k
        assert not torch.equal(copy["w"], state["w"])


def test_only_the_newest_checkpoint_is_kept_and_close_removes_it(tmp_path: Path, shm: Path) -> None:
    state = state_at(0)
    with tg.CheckpointManager(tmp_path / "ckpt", state, ram_tier=shm) as mgr:
        root = Path(mgr.ram_tier_stats.root)  # type: ignore[union-attr]
        assert root.parent == shm and root.name == namespace(str((tmp_path / "ckpt").resolve()))
        for step in (1, 2, 3):
            state["step"] = step
            mgr.save(step)
            mgr.wait()
            assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == [
                f"step-{step:09d}"
            ]
        assert mgr.steps() == [1, 2, 3]  # the directory keeps its own retention (all here)
    assert not root.exists()


def test_a_with_block_left_by_an_exception_keeps_the_ram_tier(tmp_path: Path, shm: Path) -> None:
    state = state_at(1)
    with (
        pytest.raises(RuntimeError, match="diverged"),
        tg.CheckpointManager(tmp_path / "ckpt", state, ram_tier=shm) as mgr,
    ):
        mgr.save(1)
        mgr.wait()
        raise RuntimeError("loss diverged")
    root = ram_root(tmp_path / "ckpt", str(shm))
    assert (root / "step-000000001" / "manifest.json").is_file()
    again = state_at(0)
    with tg.CheckpointManager(tmp_path / "ckpt", again, ram_tier=shm) as mgr:
        assert mgr.restore() == 1 and mgr.restored_from == str(root / "step-000000001")
    assert torch.equal(again["w"], state_at(1)["w"])


def test_a_damaged_ram_copy_falls_back_to_the_directory_copy_of_the_same_step(
    tmp_path: Path, shm: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = state_at(0)
    with tg.CheckpointManager(tmp_path / "ckpt", state, ram_tier=shm) as mgr:
        for step in (1, 2):
            state["w"].copy_(state_at(step)["w"])
            mgr.save(step)
        mgr.wait()
        mgr._ram_keep = True  # as after a crash
    data = next((ram_root(tmp_path / "ckpt", str(shm)) / "step-000000002").glob("data-*"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # inside a tensor: found once bytes reached the live state
    data.write_bytes(bytes(raw))
    restored = state_at(0)
    with tg.CheckpointManager(tmp_path / "ckpt", restored, ram_tier=shm) as mgr:
        assert mgr.restore() == 2
        assert mgr.restored_from == str(tmp_path / "ckpt" / "step-000000002")
        assert mgr.ram_tier_stats.restored == 0  # type: ignore[union-attr]
    assert torch.equal(restored["w"], state_at(2)["w"])
    assert any("from the RAM tier failed" in r.getMessage() for r in caplog.records)


def test_a_ram_tier_in_front_of_an_object_store(shm: Path) -> None:
    """The directory is a store (``memory://``, whose data objects carry save-unique names):
    the RAM copy keeps the store's names, so the store's manifest fits it as it is."""
    url = f"memory://ram-{uuid.uuid4().hex[:12]}/run"
    state = state_at(3)
    with tg.CheckpointManager(url, state, ram_tier=shm) as mgr:
        mgr.save(3)
        mgr.wait()
        root = Path(mgr.ram_tier_stats.root)  # type: ignore[union-attr]
        assert [p.name[16] for p in (root / "step-000000003").glob("*.data-*")] == ["."]
        mgr._ram_keep = True  # as after a crash
    restored = state_at(0)
    with tg.CheckpointManager(url, restored, ram_tier=shm) as mgr:
        assert mgr.restore() == 3 and mgr.restored_from == str(root / "step-000000003")
    assert torch.equal(restored["w"], state_at(3)["w"])


def test_two_jobs_on_one_node_do_not_share_a_ram_tier(tmp_path: Path, shm: Path) -> None:
    a, b = state_at(1), state_at(2)
    with (
        tg.CheckpointManager(tmp_path / "a", a, ram_tier=shm) as ma,
        tg.CheckpointManager(tmp_path / "b", b, ram_tier=shm) as mb,
    ):
        ma.save(5)
        mb.save(5)
        ma.wait()
        mb.wait()
        roots = {ma.ram_tier_stats.root, mb.ram_tier_stats.root}  # type: ignore[union-attr]
        assert len(roots) == 2
        for mgr in (ma, mb):
            mgr._ram_keep = True  # as after a crash: both stay
    for directory, want in (("a", 1), ("b", 2)):
        restored = state_at(0)
        with tg.CheckpointManager(tmp_path / directory, restored, ram_tier=shm) as mgr:
            assert mgr.restore() == 5
            assert mgr.restored_from == str(
                ram_root(tmp_path / directory, str(shm)) / "step-000000005"
            )
        assert torch.equal(restored["w"], state_at(want)["w"])


def test_a_ram_copy_of_a_checkpoint_the_directory_no_longer_holds_is_not_restored(
    tmp_path: Path, shm: Path
) -> None:
    """Someone emptied the directory to start afresh: the RAM tier's copy of the old run's
    step does not come back (a RAM copy counts only as a copy of the directory's same save)."""
    state = state_at(1)
    with tg.CheckpointManager(tmp_path / "ckpt", state, ram_tier=shm) as mgr:
        mgr.save(1)
        mgr.wait()
        mgr._ram_keep = True
    subprocess.run(["rm", "-rf", str(tmp_path / "ckpt")], check=True)
    with tg.CheckpointManager(tmp_path / "ckpt", state_at(0), ram_tier=shm) as mgr:
        assert mgr.restore() is None
    # The directory holds another save of the same step: the directory's is restored.
    with tg.CheckpointManager(tmp_path / "ckpt", state_at(1), ram_tier=shm) as mgr:
        mgr.save(1)
        mgr.wait()
        mgr._ram_keep = True
    tg.save(tmp_path / "ckpt" / "step-000000001", state_at(7), overwrite=True)
    restored = state_at(0)
    with tg.CheckpointManager(tmp_path / "ckpt", restored, ram_tier=shm) as mgr:
        assert mgr.restore() == 1 and mgr.restored_from == str(tmp_path / "ckpt" / "step-000000001")
    assert torch.equal(restored["w"], state_at(7)["w"])


def test_a_full_memory_filesystem_is_reported_and_training_goes_on(
    tmp_path: Path, small_tmpfs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = state_at(1, n=1_000_000)  # 4 MB: more than the 1 MiB tmpfs holds
    with tg.CheckpointManager(tmp_path / "ckpt", state, ram_tier=small_tmpfs) as mgr:
        mgr.save(1)
        mgr.save(2)  # async; the next one waits for it
        mgr.wait()
        stats = mgr.ram_tier_stats
        assert stats is not None and stats.failed == 2 and stats.stored == []
        assert stats.last_error is not None and stats.root in stats.last_error
        assert "ram_tier=" in stats.last_error and "free" in stats.last_error
        assert mgr.stats.failed == 0 and mgr.steps() == [1, 2]  # the saves themselves: fine
    assert tg.verify(tmp_path / "ckpt" / "step-000000002").nbytes >= 4_000_000
    assert sum("RAM TIER COPY FAILED" in r.getMessage() for r in caplog.records) == 2


def test_running_out_of_memory_mid_copy_leaves_nothing_and_releases_the_staging(
    tmp_path: Path, small_tmpfs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The space check passed (a race with another user of /dev/shm), then a write failed with
    ENOSPC: counted, the half-written copy removed, the disk checkpoint committed, and the next
    async save (which needs the staging slabs back) works."""
    monkeypatch.setattr(RamTier, "_make_room", lambda self, need, keep: None)
    state = state_at(1, n=1_000_000)
    with tg.CheckpointManager(
        tmp_path / "ckpt", state, ram_tier=small_tmpfs, max_staging_bytes=2 << 20
    ) as mgr:
        for step in (1, 2):
            mgr.save(step)
            mgr.wait()
        stats = mgr.ram_tier_stats
        assert stats is not None and stats.failed == 2
        assert "No space left" in (stats.last_error or "")
        assert "ram_tier=" in (stats.last_error or "")  # and what to do about it
        root = Path(stats.root)
        # Nothing half-written left (the shared objects it published: swept).
        assert [p.name for p in root.iterdir() if p.name != ".shared"] == [".source"]
        assert not [p for p in root.rglob("*") if p.is_file() and p.name != ".source"]
        assert mgr.steps() == [1, 2] and mgr.stats.failed == 0
    assert tg.verify(tmp_path / "ckpt" / "step-000000002").nbytes >= 4_000_000


def test_a_save_that_fails_in_the_directory_commits_nothing_in_the_ram_tier(
    tmp_path: Path, shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The RAM copy is committed only after the directory's: it never holds a step the
    directory does not."""
    import tardigrade._write as write

    state = state_at(1)
    with tg.CheckpointManager(tmp_path / "ckpt", state, ram_tier=shm) as mgr:
        mgr.save(1)
        mgr.wait()
        root = Path(mgr.ram_tier_stats.root)  # type: ignore[union-attr]

        def refuse(*args: Any, **kwargs: Any) -> None:
            raise OSError(5, "injected: the disk failed at the commit")

        monkeypatch.setattr(write, "commit_staging", refuse)
        mgr.save(2)
        mgr.wait()
        assert mgr.stats.failed == 1 and mgr.steps() == [1]
        assert sorted(p.name for p in root.iterdir()) == [".shared", ".source", "step-000000001"]
        stats = mgr.ram_tier_stats
        assert stats is not None and stats.stored == ["step-000000001"] and stats.failed == 0
        monkeypatch.undo()
        mgr.save(3)  # the staging slabs came back from both writers
        mgr.wait()
        assert sorted(p.name for p in root.iterdir()) == [".shared", ".source", "step-000000003"]


def test_a_ram_tier_location_that_cannot_work_is_refused_when_the_manager_is_created(
    tmp_path: Path, shm: Path
) -> None:
    with pytest.raises(StorageError, match="No such file"):
        tg.CheckpointManager(tmp_path / "a", state_at(0), ram_tier=tmp_path / "missing")
    with pytest.raises(InvalidArgumentError, match="inside the checkpoint directory"):
        tg.CheckpointManager(tmp_path / "d", state_at(0), ram_tier=tmp_path / "d" / "shm")
    with pytest.raises(InvalidArgumentError, match="ram_tier must be"):
        tg.CheckpointManager(tmp_path / "c", state_at(0), ram_tier=3)  # type: ignore[arg-type]
    # Each refused manager released the directory's lock.
    for name in ("a", "c", "d"):
        with tg.CheckpointManager(tmp_path / name, state_at(0)):
            pass


@pytest.mark.parametrize("planted", ["link", "file", "others_dir", "open_dir"])
def test_a_squatted_ram_tier_name_does_not_stop_the_job_or_its_restore(
    tmp_path: Path, shm: Path, planted: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Another local user plants something at the predictable name: the job starts all the
    same, on a private directory of its own, and a restart finds that one again."""
    squatted = ram_root(tmp_path / "ckpt", str(shm))
    if planted == "link":
        (tmp_path / "elsewhere").mkdir()
        os.symlink(tmp_path / "elsewhere", squatted)
    elif planted == "file":
        squatted.write_bytes(b"mine")
    else:
        squatted.mkdir(mode=0o777)
        os.chmod(squatted, 0o777)
        if planted == "others_dir":
            if os.geteuid() != 0:
                pytest.skip("needs root to make a directory of another user")
            os.chown(squatted, 65534, 65534)
    caplog.set_level(logging.WARNING, logger="tardigrade")
    state = state_at(1)
    with tg.CheckpointManager(tmp_path / "ckpt", state, ram_tier=shm) as mgr:
        mgr.save(1)
        mgr.wait()
        ram = mgr.ram_tier_stats
        assert ram is not None and ram.stored == ["step-000000001"]
        root = ram.root
        assert root != str(squatted) and root.startswith(f"{squatted}.")
        # A crash: the RAM copy stays, and the restarted job finds it behind the squatter.
        mgr._ram_keep = True
    assert any("taken by someone else" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / "elsewhere").exists() or not any((tmp_path / "elsewhere").iterdir())
    fresh = state_at(0)
    with tg.CheckpointManager(tmp_path / "ckpt", fresh, ram_tier=shm) as mgr:
        assert mgr.restore() == 1 and mgr.restored_from is not None
        assert mgr.restored_from.startswith(root)


def test_a_restore_from_the_ram_tier_says_so_in_the_log(
    tmp_path: Path, shm: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tardigrade")
    state = state_at(1)
    with tg.CheckpointManager(tmp_path / "ckpt", state, ram_tier=shm) as mgr:
        mgr.save(1)
        mgr.wait()
        assert mgr.restore() == 1
    assert any("from the RAM tier" in r.getMessage() for r in caplog.records)


def test_a_ranks_share_in_memory_reads_the_other_files_from_the_store_under_their_names(
    shm: Path,
) -> None:
    """A distributed job's rank keeps only its own files (and the manifest) in its RAM tier; a
    restore reads the rest from the directory, a store whose names carry the save's id."""
    url = f"memory://ram-{uuid.uuid4().hex[:12]}/run"
    disk = open_root(url)
    tg.save(f"{url}/step-000000001", state_at(1))
    name = "step-000000001"
    # Rank 0 wrote none of the data files: its tier holds the manifest alone.
    none = RamTier(url, shm, rank=0)
    none.copy_in(disk, name, files=lambda f: False)
    assert os.listdir(Path(none.root) / name) == ["manifest.json"]
    assert none.copy_of(name, disk) is not None  # the same save as the directory's
    tree = load_from(lambda: none.overlay(name, disk), name, into=None, verify="all")
    assert torch.equal(tree["w"], state_at(1)["w"])
    # Rank 1 wrote them all: with the store's data gone, its tier alone restores the step.
    every = RamTier(url, shm, rank=1)
    assert every.root != none.root  # one namespace per rank
    every.copy_in(disk, name)
    disk.delete_many([f"{name}/{n}" for n in disk.list(name) if n != "manifest.json"])
    tree = load_from(lambda: every.overlay(name, disk), name, into=None, verify="all")
    assert torch.equal(tree["w"], state_at(1)["w"]) and tree["step"] == 1
    disk.delete("")


def test_a_manager_without_a_ram_tier_agrees_on_nothing_for_it(tmp_path: Path) -> None:
    """ram_tier=False (the default) costs no collective at construction: only a RAM tier that
    is asked for is agreed on by every rank."""
    from tardigrade.manager._tiers import open_memory_tier

    class Ranks:
        rank = 0

        def everywhere(self, mine: bool, what: str) -> bool:
            raise AssertionError(f"a collective for a tier that is off: {what}")

    catalog = tg.Catalog(str(tmp_path))
    assert open_memory_tier(False, root=catalog, ranks=Ranks(), run=None) is None  # type: ignore[arg-type]


# -- the run id: a RAM copy counts only in the run that made it ------------------------------


def crashed_run(directory: Path, shm: Path, run_id: str | None, steps: tuple[int, ...]) -> Path:
    """A run that saved ``steps`` with a RAM tier, then died (its RAM copy stays)."""
    state = state_at(0)
    with tg.CheckpointManager(directory, state, ram_tier=shm, run_id=run_id) as mgr:
        for step in steps:
            state["w"].copy_(state_at(step)["w"])
            mgr.save(step)
        mgr.wait()
        mgr._ram_keep = True  # as after a crash
        root = Path(mgr.ram_tier_stats.root)  # type: ignore[union-attr]
    assert (root / f"step-{steps[-1]:09d}" / "manifest.json").is_file()
    return root


def test_a_restart_of_the_same_run_restores_from_memory(tmp_path: Path, shm: Path) -> None:
    root = crashed_run(tmp_path / "ckpt", shm, "job-7", (1, 2))
    assert root.name == namespace(str(tmp_path / "ckpt"), "job-7")
    restored = state_at(0)
    with tg.CheckpointManager(tmp_path / "ckpt", restored, ram_tier=shm, run_id="job-7") as mgr:
        assert mgr.restore() == 2 and mgr.restored_from == str(root / "step-000000002")
    assert torch.equal(restored["w"], state_at(2)["w"])


@pytest.mark.parametrize("before", ["job-7", None], ids=["another-run-id", "no-run-id"])
def test_another_run_s_ram_copy_is_never_restored_and_is_removed(
    tmp_path: Path, shm: Path, before: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    """A new job on the same directory (another run id): the RAM copy the last one left is the
    same save as the directory's newest, and still is not taken (a copy counts only in its own
    run); it goes, since it holds memory and can never be used."""
    caplog.set_level(logging.INFO, logger="tardigrade")
    old = crashed_run(tmp_path / "ckpt", shm, before, (1, 2))
    restored = state_at(0)
    with tg.CheckpointManager(tmp_path / "ckpt", restored, ram_tier=shm, run_id="job-8") as mgr:
        assert not old.exists()
        assert mgr.restore() == 2
        assert mgr.restored_from == str(tmp_path / "ckpt" / "step-000000002")
        assert mgr.ram_tier_stats.restored == 0  # type: ignore[union-attr]
    assert torch.equal(restored["w"], state_at(2)["w"])
    assert any("of another run of" in r.getMessage() for r in caplog.records)


def test_another_directory_s_ram_tier_is_left_alone(tmp_path: Path, shm: Path) -> None:
    other = crashed_run(tmp_path / "other", shm, "job-7", (1,))
    with tg.CheckpointManager(tmp_path / "ckpt", state_at(0), ram_tier=shm, run_id="job-8"):
        pass
    assert (other / "step-000000001" / "manifest.json").is_file()


def test_the_run_id_defaults_to_the_launcher_s(
    tmp_path: Path, shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def root_with(**env: str) -> str:
        for k in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        with tg.CheckpointManager(tmp_path / "ckpt", state_at(0), ram_tier=shm) as mgr:
            return Path(mgr.ram_tier_stats.root).name  # type: ignore[union-attr]

    directory = str(tmp_path / "ckpt")
    assert root_with() == namespace(directory)
    assert root_with(SLURM_JOB_ID="4242") == namespace(directory, "4242")
    both = root_with(SLURM_JOB_ID="4242", TORCHELASTIC_RUN_ID="rdzv-1")
    assert both == namespace(directory, "rdzv-1")  # torchrun's id, inside a SLURM allocation
    for bad in ("", "x" * 257, 7):
        with pytest.raises(InvalidArgumentError, match="run_id must be"):
            tg.CheckpointManager(tmp_path / "bad", state_at(0), run_id=bad)  # type: ignore[arg-type]


def test_a_run_id_from_the_environment_is_checked_as_one_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launcher's variable is input like any other: a value no run id can be (empty is
    'unset'; too long, or with a NUL) is refused by name, before anything is written."""
    monkeypatch.setenv("SLURM_JOB_ID", "x" * 100_000)
    with pytest.raises(InvalidArgumentError, match="SLURM_JOB_ID") as raised:
        tg.CheckpointManager(tmp_path / "ckpt", state_at(0), ram_tier=True)
    assert "run_id=" in str(raised.value) and len(str(raised.value)) < 1000
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("async_save", [True, False])
def test_the_ram_tier_saves_more_often_than_the_directory(
    tmp_path: Path, shm: Path, async_save: bool
) -> None:
    """persist_every=5 with a save every step: the directory holds the multiples of 5 alone,
    the RAM tier the newest step; a crash restarts from the RAM tier's step 7, exactly, and an
    explicit restore(5) leaves the later step 7 behind (not restored after a second crash)."""
    state = state_at(0)
    with (
        pytest.raises(RuntimeError, match="crash"),
        tg.CheckpointManager(
            tmp_path / "ckpt",
            state,
            ram_tier=shm,
            every_steps=1,
            persist_every=5,
            async_save=async_save,
        ) as mgr,
    ):
        for step in range(1, 8):
            state["w"].copy_(state_at(step)["w"])
            mgr.step(step)
        mgr.wait()
        assert mgr.steps() == [5]  # the directory took step 5 alone
        # Step 6 (the RAM tier alone) may commit there before step 5's copy (after the
        # directory's commit): two saves in flight.
        assert sorted(mgr.ram_tier_stats.stored[-3:]) == [  # type: ignore[union-attr]
            "step-000000005",
            "step-000000006",
            "step-000000007",
        ]
        raise RuntimeError("crash")
    root = ram_root(tmp_path / "ckpt", str(shm))
    assert sorted(p.name for p in root.glob("step-*")) == ["step-000000007"]
    restored = state_at(0)
    with (
        pytest.raises(RuntimeError, match="crash"),
        tg.CheckpointManager(
            tmp_path / "ckpt", restored, ram_tier=shm, every_steps=1, persist_every=5
        ) as mgr,
    ):
        assert mgr.restore() == 7 and mgr.restored_from == str(root / "step-000000007")
        assert torch.equal(restored["w"], state_at(7)["w"])
        assert mgr.restore(5) == 5  # back to the directory's step 5: step 7 is left behind
        raise RuntimeError("crash")
    again = state_at(0)
    with tg.CheckpointManager(tmp_path / "ckpt", again, ram_tier=shm, persist_every=5) as mgr:
        assert mgr.restore() == 5
    assert torch.equal(again["w"], state_at(5)["w"])


def test_persist_every_needs_a_ram_tier(tmp_path: Path, shm: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="persist_every=5 saves the steps between"):
        tg.CheckpointManager(tmp_path / "a", {"w": 1}, persist_every=5)
    with pytest.raises(InvalidArgumentError, match="persist_every must be a positive int"):
        tg.CheckpointManager(tmp_path / "b", {"w": 1}, ram_tier=shm, persist_every=0)


@pytest.mark.parametrize("budget", [25.0, 1e-6])
def test_a_preemption_saves_to_the_ram_tier_first_then_the_directory_within_its_budget(
    tmp_path: Path, shm: Path, budget: float, caplog: pytest.LogCaptureFixture
) -> None:
    state = state_at(0)
    with tg.CheckpointManager(
        tmp_path / "ckpt", state, ram_tier=shm, every_steps=100, preemption_budget=budget
    ) as mgr:
        for step in range(1, 10):
            state["w"].copy_(state_at(step)["w"])
            if step == 4:
                os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's notice
            mgr.step(step)
            if mgr.should_stop:
                break
        assert step == 4 and mgr.exit_code == 128 + signal.SIGTERM
        assert mgr.steps() == ([4] if budget > 1 else [])
    # The preempted job's close() keeps the RAM tier for the requeued one.
    root = ram_root(tmp_path / "ckpt", str(shm))
    assert (root / "step-000000004" / "manifest.json").is_file()
    said = " ".join(r.getMessage() for r in caplog.records)
    if budget > 1:
        # The directory's copy is the RAM tier's very save (copied, not saved again).
        ours = tg.Checkpoint.open(root / "step-000000004").manifest.raw["save_id"]
        theirs = tg.Checkpoint.open(tmp_path / "ckpt" / "step-000000004").manifest.raw
        assert theirs["save_id"] == ours
        assert "step-000000004 is held in the RAM tier, the directory" in said, said
    else:
        assert "is not in" in said and "held in the RAM tier, 0." in said, said
    again = state_at(0)
    with tg.CheckpointManager(tmp_path / "ckpt", again, ram_tier=shm) as mgr:
        assert mgr.restore() == 4 and mgr.restored_from == str(root / "step-000000004")
        assert mgr.exit_code is None
    assert torch.equal(again["w"], state_at(4)["w"])


def test_a_bad_preemption_budget_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="preemption_budget must be a positive"):
        tg.CheckpointManager(tmp_path / "a", {"w": 1}, preemption_budget=0)


def test_recording_a_save_keeps_the_newer_ones_already_there(tmp_path: Path, shm: Path) -> None:
    """An async save's outcome is recorded after the next saves (into the RAM tier alone) may
    have committed there: recording step 6 must not remove step 7 (newest only means older
    ones go). On the old rule, step 7 went, and with it the newest step in memory."""
    tier = RamTier(str(tmp_path / "ckpt"), shm)
    for step in (6, 7):
        tg.save(tier.storage.url(f"step-{step:09d}"), state_at(step))
    tier.saved(tier.storage, "step-000000006", files=None, teed=True)
    tier.saved(tier.storage, "step-000000007", files=None, teed=True)
    assert tier.stats.stored == ["step-000000006", "step-000000007"]
    assert tier.catalog.steps() == [7]  # 6 went once 7 was recorded, not before
    tier.close(clean=True)


def test_a_step_in_memory_newer_than_the_remote_s_is_restored_without_a_download(
    tmp_path: Path, shm: Path
) -> None:
    remote = FaultyStorage(str(tmp_path / "remote"))  # its reads logged
    state = state_at(0)
    kw: dict[str, Any] = {"ram_tier": shm, "persist_every": 4, "upload_to": remote.root}
    with (
        pytest.raises(RuntimeError, match="crash"),
        tg.CheckpointManager(tmp_path / "ckpt", state, every_steps=1, **kw) as mgr,
    ):
        for step in range(1, 7):
            state["w"].copy_(state_at(step)["w"])
            mgr.step(step)
        mgr.wait()
        assert mgr.uploads is not None
        raise RuntimeError("crash")
    assert (tmp_path / "remote" / "step-000000004" / "manifest.json").is_file()
    subprocess.run(["rm", "-rf", str(tmp_path / "ckpt" / "step-000000004")], check=True)
    remote.log.clear()
    restored = state_at(0)
    with tg.CheckpointManager(tmp_path / "ckpt", restored, **kw) as mgr:
        # Memory holds step 6, newer than the remote's 4: nothing is downloaded.
        assert mgr.restore() == 6
        assert not [w for op, w in remote.log if op == "open_reader" and "step-" in w]
        assert mgr.steps() == []
    assert torch.equal(restored["w"], state_at(6)["w"])
