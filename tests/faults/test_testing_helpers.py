"""``tardigrade.testing.kill_during`` and ``assert_resumes_exactly`` on real scripts.

Each test runs a script as a real subprocess that ``kill_during`` SIGKILLs at one moment of its
checkpoint storage traffic, then checks on disk that the moment really was that one: the bytes
in the staging directory, the half-written manifest, the visible checkpoint. Nothing is timed:
the moments are counted in storage operations and bytes.
"""

from __future__ import annotations

import os
import select
import signal
import textwrap
from pathlib import Path

import pytest
import torch

import tardigrade as tg
from tardigrade.errors import CheckpointNotFoundError
from tardigrade.testing import KillResult, assert_resumes_exactly, kill_during

pytestmark = [pytest.mark.crash, pytest.mark.timeout(300)]

# Saves A, then B, then C (synchronously), printing after each save returned.
SAVES = textwrap.dedent(
    """
    import sys
    import torch
    import tardigrade as tg

    def state(seed):
        g = torch.Generator().manual_seed(seed)
        return {"w": torch.randn(200_000, generator=g), "b": torch.arange(seed), "step": seed}

    d = sys.argv[1]
    for i, name in enumerate("ABC"):
        tg.save(f"{d}/{name}", state(i + 1))
        print("SAVED", name, flush=True)
    """
)


def expected(seed: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(200_000, generator=g), "b": torch.arange(seed), "step": seed}


def assert_intact(path: Path, seed: int) -> None:
    tg.verify(path)
    got, want = tg.load(path), expected(seed)
    assert list(got) == list(want)
    assert torch.equal(got["w"], want["w"]) and torch.equal(got["b"], want["b"])
    assert got["step"] == want["step"]


def assert_invisible(path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError):
        tg.load(path)


def staging(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.name.startswith(".tmp-"))


def dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.iterdir())


def saves(tmp_path: Path, **point: object) -> tuple[KillResult, Path]:
    d = tmp_path / "ckpt"
    # Buffered writes: every byte handed to a writer is in the file when the process dies.
    env = {"TARDIGRADE_DIRECT_IO": "0", "OMP_NUM_THREADS": "1"}
    return kill_during(args=[str(d)], code=SAVES, env=env, **point), d  # type: ignore[arg-type]


def test_kill_after_n_bytes_leaves_exactly_that_many_bytes(tmp_path: Path) -> None:
    # A's data and manifest count first; then 5,000 bytes of B's data file go before the kill.
    ref, _ = saves(tmp_path / "ref", at="never")
    assert ref.returncode == 0 and not ref.killed and ref.counts["commit"] == 3
    n = ref.counts["bytes"] // 3 + 5_000  # A, B and C are about the same size
    r, d = saves(tmp_path, at="write", after_bytes=n)
    assert r.killed and r.returncode == -signal.SIGKILL, r.tail()
    assert r.stdout == "SAVED A\n"
    assert r.counts["bytes"] == n and r.where.startswith(f"write: {n} bytes written ("), r.where
    (st,) = staging(d)
    assert st.name.startswith(".tmp-B-")
    # A's files (data and manifest) are what counted first; the rest is in B's staging,
    # exactly, its data file cut mid-write.
    assert 0 < dir_bytes(st) == n - dir_bytes(d / "A")
    assert "manifest.json" not in os.listdir(st)
    assert_intact(d / "A", 1)
    assert_invisible(d / "B")


def test_kill_in_staging_leaves_an_empty_staging_directory(tmp_path: Path) -> None:
    r, d = saves(tmp_path, at="staging", nth=2)
    assert r.killed and r.returncode == -signal.SIGKILL, r.tail()
    assert r.stdout == "SAVED A\n" and r.where.startswith("staging #2: ")
    (st,) = staging(d)
    assert st.name.startswith(".tmp-B-") and os.listdir(st) == []
    assert r.counts["begin"] == 2 and r.counts["commit"] == 1
    assert_intact(d / "A", 1)
    assert_invisible(d / "B")


def test_kill_inside_the_commit_leaves_half_a_manifest_and_nothing_visible(
    tmp_path: Path,
) -> None:
    r, d = saves(tmp_path, at="commit", nth=2)
    assert r.killed and r.returncode == -signal.SIGKILL, r.tail()
    assert r.stdout == "SAVED A\n" and r.where.startswith("commit #2: ")
    half, full = (int(x) for x in r.where.split(": ")[1].split(" bytes")[0].split(" of "))
    (st,) = staging(d)
    assert (st / "manifest.json").stat().st_size == half == full // 2
    data = [p for p in st.iterdir() if p.name != "manifest.json"]
    assert data and all(p.stat().st_size > 0 for p in data)
    assert_intact(d / "A", 1)
    assert_invisible(d / "B")
    # The leftovers block nothing: B saves again, complete.
    tg.save(d / "B", expected(2))
    assert_intact(d / "B", 2)


def test_kill_just_after_the_commit_leaves_it_visible_and_complete(tmp_path: Path) -> None:
    r, d = saves(tmp_path, at="committed", nth=2)
    assert r.killed and r.returncode == -signal.SIGKILL, r.tail()
    assert r.stdout == "SAVED A\n", "the save of B must not have returned"
    assert r.where.startswith("committed #2: ") and r.where.endswith("the save has not returned")
    assert staging(d) == []
    assert_intact(d / "A", 1)
    assert_intact(d / "B", 2)
    assert_invisible(d / "C")


def test_kill_at_the_last_operation_counts_like_an_uninterrupted_run(tmp_path: Path) -> None:
    ref, _ = saves(tmp_path / "ref", at="never")
    assert ref.returncode == 0 and ref.stdout == "SAVED A\nSAVED B\nSAVED C\n"
    last = ref.counts["operation"]
    r, d = saves(tmp_path, at="operation", nth=last)
    assert r.killed and r.where.startswith(f"operation #{last} ("), r.where
    # Killed as its last operation began: counted (every kind), not done.
    assert r.counts["operation"] == last
    assert sum(v for k, v in r.counts.items() if k not in ("operation", "bytes")) == last
    assert_intact(d / "A", 1)
    assert_intact(d / "B", 2)
    assert "SAVED C" not in r.stdout


def test_kill_at_a_random_time_of_endless_saves(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import sys, itertools, torch, tardigrade as tg
        for i in itertools.count():
            tg.save(f"{sys.argv[1]}/s-{i:05d}", {"w": torch.full((100_000,), float(i))})
        """
    )
    d = tmp_path / "ckpt"
    r = kill_during(args=[str(d)], code=code, at="random", within=(0.2, 0.6), seed=3)
    assert r.killed and r.returncode == -signal.SIGKILL, r.tail()
    assert r.where is not None and r.where.startswith("random time: ")
    names = sorted(n for n in os.listdir(d) if not n.startswith(".tmp-"))
    for n in names:  # every visible checkpoint is complete and holds its own values
        tg.verify(d / n)
        assert torch.equal(tg.load(d / n)["w"], torch.full((100_000,), float(int(n[2:]))))
    assert len(staging(d)) <= 1


def test_job_scope_kills_every_process_the_script_started(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import subprocess, sys, torch, tardigrade as tg
        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(sleeper.pid, flush=True)
        tg.save(sys.argv[1], {"w": torch.zeros(10)})
        """
    )
    r = kill_during(args=[str(tmp_path / "c")], code=code, at="commit")
    assert r.killed and r.returncode == -signal.SIGKILL, r.tail()
    pid = int(r.stdout.split()[0])
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return  # gone already
    try:
        # Readable once the process has exited; the wait only guards against a hang.
        assert select.select([fd], [], [], 60)[0] == [fd], f"process {pid} survived the kill"
    finally:
        os.close(fd)


# A small deterministic training loop that follows the assert_resumes_exactly protocol. With
# "forget-optim" it leaves the optimizer out of its checkpoints, so a resumed run restarts
# Adam's moments from zero and its losses drift from the uninterrupted run's.
TRAIN = textwrap.dedent(
    """
    import sys
    import torch
    import tardigrade as tg
    from tardigrade.testing import checkpoint_dir, log_loss, save_final

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 1)
    optim = torch.optim.Adam(model.parameters(), lr=0.05)
    x = torch.randn(64, 6, generator=torch.Generator().manual_seed(1))
    y = x.sum(1, keepdim=True)
    state = {"model": model, "optim": optim, "step": 0}
    if "forget-optim" in sys.argv:
        del state["optim"]
    mgr = tg.CheckpointManager(checkpoint_dir("ckpt"), state, every_steps=3, keep_last=2)
    mgr.restore()
    while state["step"] < 12:
        i = state["step"] % 8
        loss = (model(x[i * 8 : i * 8 + 8]) - y[i * 8 : i * 8 + 8]).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        state["step"] += 1
        log_loss(state["step"], loss)
        mgr.step(state["step"])
    mgr.close()
    save_final({**state, "optim": optim})
    """
)


def test_assert_resumes_exactly_passes_a_loop_killed_twice_in_a_row() -> None:
    report = assert_resumes_exactly(
        code=TRAIN, kills=[[{"at": "commit", "nth": 2}, {"at": "committed", "nth": 3}]]
    )
    # Four checkpoints (steps 3, 6, 9, 12) and the final state.
    # The final state's save is the harness's, not a moment of training: not counted.
    assert report.steps == 12 and report.counts["commit"] == 4
    ((first, second),) = report.scenarios
    assert first.where.startswith("commit #2: ") and second.where.startswith("committed #3: ")


def test_assert_resumes_exactly_names_the_first_differing_loss() -> None:
    with pytest.raises(AssertionError) as e:
        assert_resumes_exactly(
            args=["forget-optim"], code=TRAIN, kills=[{"at": "committed", "nth": 2}]
        )
    msg = str(e.value)
    # Killed right after step 6's checkpoint committed. Step 7's loss comes from the restored
    # parameters (equal); its optimizer step starts Adam afresh, so step 8 is the first to differ.
    assert "scenario 0: killed at committed #2: " in msg, msg
    assert "resumed, the loss of step 8 is " in msg and "the uninterrupted run's is " in msg, msg


def test_assert_resumes_exactly_refuses_a_script_that_logs_nothing() -> None:
    silent = TRAIN.replace("log_loss(state", "(state")
    with pytest.raises(AssertionError, match="the uninterrupted run logged no loss"):
        assert_resumes_exactly(code=silent, kills=1)


# Two ranks started by torch.multiprocessing (spawn): each imports tardigrade itself, which
# arms the kill point from the environment kill_during set.
TWO_RANKS = textwrap.dedent(
    """
    import os, sys
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    def rank_main(rank, d):
        import tardigrade as tg

        print("PID", rank, os.getpid(), flush=True)
        store = dist.FileStore(os.path.join(d, "store"), 2)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
        for i in range(2):
            table = tg.Sharded(torch.full((4, 8), float(rank)), (4 * rank, 0), (8, 8))
            tg.save(os.path.join(d, f"ckpt-{i}"), {"t": table, "w": torch.ones(1000)})
            print("SAVED", rank, i, flush=True)
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.start_processes(rank_main, args=(sys.argv[1],), nprocs=2, start_method="spawn")
    """
)


@pytest.mark.timeout(300)
def test_rank_counts_the_moment_in_one_rank_and_the_whole_job_dies(tmp_path: Path) -> None:
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    d = tmp_path / "ckpt"
    d.mkdir()
    env = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    r = kill_during(script, [str(d)], at="write", after_bytes=1, rank=1, env=env)
    assert r.killed and r.rank == 1, r.tail()
    assert r.where.startswith("write: 1 bytes written (1 of "), r.where
    assert r.returncode == -signal.SIGKILL, "the launcher dies with its ranks"
    assert "SAVED" not in r.stdout
    assert_invisible(d / "ckpt-0")
    pids = [int(ln.split()[2]) for ln in r.stdout.splitlines() if ln.startswith("PID ")]
    assert len(pids) == 2, r.stdout
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            assert select.select([fd], [], [], 60)[0] == [fd], f"rank process {pid} survived"
        finally:
            os.close(fd)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("phase", "rank"), [("tg.save (begin)", 0), ("tg.save (write and commit)", 1)]
)
def test_a_rank_killed_between_the_phases_of_a_collective_save_commits_nothing(
    tmp_path: Path, phase: str, rank: int
) -> None:
    """Between two phases of the second save (every rank done with the phase before, none
    in this one): the first checkpoint stays whole, the second is invisible."""
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    d = tmp_path / "ckpt"
    d.mkdir()
    env = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    r = kill_during(script, [str(d)], at="phase", phase=phase, nth=2, rank=rank, env=env)
    assert r.killed and r.rank == rank, r.tail()
    assert r.where == f"phase #2: rank {rank} entering {phase!r}", r.where
    assert r.counts["phase"] == 2, r.counts  # only the phases of that name are counted
    # (Whether the other rank printed SAVED for the first save before the job died is a race.)
    first = tg.load(d / "ckpt-0")
    assert torch.equal(first["w"], torch.ones(1000))
    assert tg.verify(d / "ckpt-0").tensors == 2
    assert_invisible(d / "ckpt-1")


def test_a_phase_kill_point_is_checked_when_made() -> None:
    with pytest.raises(tg.InvalidArgumentError, match="phase must be a non-empty part"):
        kill_during(code="pass", at="phase", phase="")


def test_drawn_kills_fall_inside_training_never_in_the_final_save() -> None:
    report = assert_resumes_exactly(code=TRAIN, kills=4, seed=0)
    assert report.counts["commit"] == 4  # steps 3, 6, 9, 12: the final save is not counted
    for (kill,) in report.scenarios:
        assert kill.killed and ".final" not in (kill.where or ""), kill.where


def test_a_kill_point_that_never_comes_says_why(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="kill_during: not killed: the script made no 'put'"):
        r, _ = saves(tmp_path, at="operation", op="put", nth=1)
    assert not r.killed and r.returncode == 0
    assert r.note is not None and "begin" in r.note and "ask for one the script makes" in r.note
    with pytest.warns(UserWarning, match=r"made 3 'commit' operation\(s\), fewer than nth=9"):
        r, _ = saves(tmp_path / "b", at="commit", nth=9)
    assert not r.killed


def test_a_lost_reply_on_begin_leaves_nothing_gc_cannot_remove_at_once(tmp_path: Path) -> None:
    """The staging a lost reply hid from the save is a dead writer's leftover: gc removes it
    in this very process (its flock was let go)."""
    from tardigrade.testing import FaultyStorage

    faulty = FaultyStorage(str(tmp_path))
    faulty.fail("begin", error="lost_reply")
    with pytest.raises(tg.SaveError, match="injected lost_reply"):
        tg.save(faulty.url("step-1"), {"w": torch.ones(3)})
    assert staging(tmp_path)  # the staging directory exists: the operation was done
    done = tg.Catalog(tmp_path).tidy()
    assert [t.action for t in done] == ["removed"], done
    assert not staging(tmp_path)


def test_faulty_urls_work_below_the_root_wherever_a_path_does(tmp_path: Path) -> None:
    from tardigrade.testing import FaultyStorage

    faulty = FaultyStorage(str(tmp_path))
    tg.save(faulty.url("run/step-1"), {"w": torch.ones(3)})
    assert tg.load(faulty.url("run/step-1"))["w"].sum() == 3
    with tg.CheckpointManager(faulty.url("run2"), {"w": torch.ones(3)}, async_save=False) as mgr:
        faulty.fail("commit", error="EIO")  # armed on the root: fires below it too
        assert mgr.save(1) is False and mgr.save(2) is True
        assert mgr.steps() == [2]
    assert any(op == "commit" and "run2/step-000000001" in where for op, where in faulty.log)
    assert faulty.injected and (tmp_path / "run2" / "step-000000002").is_dir()
