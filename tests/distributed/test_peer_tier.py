"""The peer tier (``peer_replicas=``) in real gloo jobs of simulated nodes: each node its own
``TARDIGRADE_NODE`` and its own RAM directory. A node's loss (its ranks killed, its memory
gone) restores from the replicas its peers keep, bit-exactly, reading no data file of the
directory; a job restarted on fewer ranks loads the lost node's shares at the new world size.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tardigrade as tg
from tardigrade import _peers
from tardigrade._peers import Placement
from tardigrade.errors import CorruptCheckpointError, InvalidArgumentError
from tardigrade.manager._tiers import PeerTier
from tardigrade.storage import open_root
from tardigrade.testing import FaultyStorage

from ._harness import caught, run_ranks
from .test_manager_distributed import make_state, set_state, state_value

pytestmark = pytest.mark.distributed


def peer_of(mgr: tg.CheckpointManager) -> PeerTier:
    tier = mgr._tiers.first(PeerTier)
    assert tier is not None
    return tier


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def node_job_rank(
    rank: int, world: int, shm: str, local: str, nodes: list[str], last: int, kill: bool
) -> dict[str, Any]:
    """A rank of a job of simulated nodes: restore, report where from, save each step up to
    ``last`` (RAM + peers), wait until every replica is kept, then (``kill``) die with SIGKILL."""
    os.environ["TARDIGRADE_NODE"] = nodes[rank]
    lines = _Lines()
    logging.getLogger("tardigrade").addHandler(lines)
    logging.getLogger("tardigrade").setLevel(logging.INFO)
    state = make_state(rank, world, 0.0)
    mgr = tg.CheckpointManager(
        local, state, every_steps=1, ram_tier=os.path.join(shm, nodes[rank]), peer_replicas=1
    )
    start = mgr.restore()
    report: dict[str, Any] = {
        "restored": start,
        "value": state_value(state, rank),
        "from": mgr.restored_from,
        "log": [
            x
            for x in lines.lines
            if "restored from" in x or "not whole" in x or "skipping" in x or "failed" in x
        ],
    }
    for step in range((start or 0) + 1, last + 1):
        set_state(state, rank, float(step))
        mgr.step(step)
    mgr.wait()
    assert peer_of(mgr).replicator.wait(60)
    stats = mgr.ram_tier_stats
    assert stats is not None
    report.update(replicas=stats.replicas, sent=stats.sent_bytes, failed=stats.failed)
    if not kill:
        mgr.close()
        return report
    (Path(local).parent / f"report-{world}-{rank}-{last}.json").write_text(json.dumps(report))
    dist.barrier()  # every replica is kept before any rank dies
    os.kill(os.getpid(), signal.SIGKILL)
    return report  # never reached


def reports(tmp_path: Path, world: int, last: int) -> list[dict[str, Any]]:
    return [
        json.loads((tmp_path / f"report-{world}-{r}-{last}.json").read_text()) for r in range(world)
    ]


def boot(shm: Path, *nodes: str) -> None:
    """Each node's memory filesystem (its own directory here), there as a machine boots."""
    for node in nodes:
        (shm / node).mkdir(exist_ok=True)


def drop_data_files(ckpt: Path) -> None:
    """Delete the data files of a checkpoint in the directory (its manifest stays): a restore
    that reads any of them fails."""
    for f in ckpt.iterdir():
        if f.name != "manifest.json":
            f.unlink()


def test_a_lost_node_restores_from_its_peers_memory_and_then_on_fewer_ranks(
    tmp_path: Path, shm: Path
) -> None:
    local, nodes = str(tmp_path / "run"), ["A", "A", "B", "B"]
    boot(shm, "A", "B")
    out = run_ranks(node_job_rank, 4, str(shm), local, nodes, 3, True, timeout=120)
    assert out == [{"died": -signal.SIGKILL}] * 4, out
    first = reports(tmp_path, 4, 3)
    for rank, r in enumerate(first):
        # Each rank keeps the replica of the same local rank of the other node: 0<->2, 1<->3.
        assert r["replicas"][-1] == f"step-000000003 of rank {(rank + 2) % 4}", r
        assert r["sent"] > 0 and r["failed"] == 0, r
    # Node B is lost: its ranks died, and its memory with them. The directory's data files of
    # step 3 are gone too: whatever restores step 3 reads none of them.
    shutil.rmtree(shm / "B")
    drop_data_files(tmp_path / "run" / "step-000000003")
    boot(shm, "B")  # a fresh machine in its place

    out = run_ranks(node_job_rank, 4, str(shm), local, nodes, 5, True, timeout=120)
    assert out == [{"died": -signal.SIGKILL}] * 4, out
    second = reports(tmp_path, 4, 5)
    for r in second:
        assert r["restored"] == 3 and r["value"] == 3.0, "\n".join(r["log"])
    assert second[2]["from"].startswith("the peer tier"), second[2]
    log = " ".join(second[0]["log"])
    assert "not whole in the RAM tier" in log, log  # node B's own copies are gone
    assert "rank 2's share from a replica on node 'A'" in log, log
    assert "rank 0's share from own RAM on node 'A'" in log, log

    # Node B is gone for good: the job restarts on node A's two ranks, which hold their own
    # shares of step 5 and node B's replicas; it loads at the new world size.
    shutil.rmtree(shm / "B")
    drop_data_files(tmp_path / "run" / "step-000000005")
    out = run_ranks(node_job_rank, 2, str(shm), local, ["A", "A"], 6, False, timeout=120)
    for r in out:
        assert r["restored"] == 5 and r["value"] == 5.0, out
        assert r["replicas"] == [] and r["sent"] == 0, out  # one node: no peer to send to


def test_the_placement_is_a_ring_of_nodes_and_never_the_own_node() -> None:
    p = Placement.of(["A", "A", "B", "B", "C", "C"], 2)
    assert [p.targets(r) for r in range(6)] == [[2, 4], [3, 5], [4, 0], [5, 1], [0, 2], [1, 3]]
    assert p.sources(0, 0) == [4] and p.sources(0, 1) == [2]
    uneven = Placement.of(["A", "A", "A", "B"], 1)
    assert [uneven.targets(r) for r in range(4)] == [[3], [3], [3], [0]]
    assert Placement.of(["A", "A"], 1).replicas == 0  # one node: none, said in a warning
    assert Placement.of(["A", "B"], 3).replicas == 1


def test_peer_replicas_needs_a_ram_tier_and_a_distributed_job(tmp_path: Path, shm: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="peer_replicas=1 needs a distributed job"):
        tg.CheckpointManager(tmp_path / "a", {"w": 1}, ram_tier=shm, peer_replicas=1)
    with pytest.raises(InvalidArgumentError, match="pass ram_tier=True"):
        tg.CheckpointManager(tmp_path / "b", {"w": 1}, peer_replicas=1)
    with pytest.raises(InvalidArgumentError, match="peer_replicas must be an int >= 0"):
        tg.CheckpointManager(tmp_path / "c", {"w": 1}, ram_tier=True, peer_replicas=-1)


def cadence_rank(
    rank: int, world: int, shm: str, root: str, nodes: list[str], last: int, kill: bool
) -> dict[str, Any]:
    """Saves every step to RAM + peers, every 4th to the root (``persist_every=4``); restores
    first, reporting where from and which root objects that read."""
    os.environ["TARDIGRADE_NODE"] = nodes[rank]
    faulty = FaultyStorage(root)  # faulty://1 on every rank: the root, its operations logged
    state = make_state(rank, world, 0.0)
    mgr = tg.CheckpointManager(
        faulty.root,
        state,
        every_steps=1,
        persist_every=4,
        ram_tier=os.path.join(shm, nodes[rank]),
        peer_replicas=1,
    )
    start = mgr.restore()
    report: dict[str, Any] = {
        "restored": start,
        "value": state_value(state, rank),
        "from": mgr.restored_from,
        # What the restore read of the root's checkpoints (its lock aside).
        "reads": [w for op, w in faulty.log if op == "open_reader" and "/step-" in w],
        "root_steps": mgr.steps(),
    }
    for step in range((start or 0) + 1, last + 1):
        set_state(state, rank, float(step))
        mgr.step(step)
    mgr.wait()
    assert peer_of(mgr).replicator.wait(60)
    report["root_after"] = mgr.steps()
    if not kill:
        mgr.close()
        return report
    (Path(shm) / f"report-{rank}-{last}.json").write_text(json.dumps(report))
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)
    return report  # never reached


@pytest.fixture(params=["directory", pytest.param("s3", marks=pytest.mark.s3)])
def root_of_job(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[str, dict[str, str]]]:
    """The job's root (a directory, or a SeaweedFS prefix) and the environment reaching it."""
    if request.param == "s3":
        server = request.getfixturevalue("s3_env")
        url = f"s3://{server.bucket}/peer-{uuid.uuid4().hex[:12]}"
        yield url, server.env()
        open_root(url).delete("")
    else:
        yield str(tmp_path / "run"), {}


def test_steps_saved_to_memory_alone_restore_after_a_node_loss_reading_nothing_of_the_root(
    shm: Path, root_of_job: tuple[str, dict[str, str]]
) -> None:
    root, env = root_of_job
    nodes = ["A", "A", "B", "B"]
    boot(shm, "A", "B")
    out = run_ranks(cadence_rank, 4, str(shm), root, nodes, 6, True, timeout=120, env=env)
    assert out == [{"died": -signal.SIGKILL}] * 4, out
    first = [json.loads((shm / f"report-{r}-6.json").read_text()) for r in range(4)]
    assert all(r["root_after"] == [4] for r in first), first  # the root took step 4 alone
    shutil.rmtree(shm / "B")  # node B is lost with its memory; a fresh machine replaces it
    boot(shm, "B")
    out = run_ranks(cadence_rank, 4, str(shm), root, nodes, 8, False, timeout=120, env=env)
    for r in out:
        # Step 6, saved to memory alone, every share held by node A (own and replicas).
        assert r["restored"] == 6 and r["value"] == 6.0, out
        assert r["reads"] == [], out  # not one object of the root was read
        assert r["root_steps"] == [4] and r["root_after"] == [4, 8], out
    assert out[2]["from"].startswith("the peer tier"), out


def preempted_rank(
    rank: int, world: int, shm: str, local: str, nodes: list[str], budget: float
) -> dict[str, Any]:
    """Train until SIGTERM reaches rank 1 (before step 7): every rank stops at the same
    boundary, the step saved into RAM + peers first, then the directory within ``budget``."""
    os.environ["TARDIGRADE_NODE"] = nodes[rank]
    lines = _Lines()
    logging.getLogger("tardigrade").addHandler(lines)
    state = make_state(rank, world, 0.0)
    mgr = tg.CheckpointManager(
        local,
        state,
        every_steps=1000,  # only the preemption saves
        ram_tier=os.path.join(shm, nodes[rank]),
        peer_replicas=1,
        preemption_budget=budget,
    )
    start = mgr.restore()
    report: dict[str, Any] = {"restored": start, "value": state_value(state, rank)}
    report["from"] = mgr.restored_from
    step = start or 0
    while start is None:
        step += 1
        set_state(state, rank, float(step))
        if rank == 1 and step == 7:
            os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's notice, mid-step
        mgr.step(step)
        if mgr.should_stop:
            break
    report.update(
        stopped=step,
        exit=mgr.exit_code,
        root=mgr.steps(),
        held=[x for x in lines.lines if "preemption:" in x],
    )
    mgr.close()  # after a preemption the RAM and peer tiers stay for the requeued job
    return report


@pytest.mark.parametrize("budget", [25.0, 1e-6])
def test_a_preempted_job_stops_everywhere_holding_its_step_in_memory_and_resumes_it(
    tmp_path: Path, shm: Path, budget: float
) -> None:
    local, nodes = str(tmp_path / "run"), ["A", "B"]
    boot(shm, "A", "B")
    out = run_ranks(preempted_rank, 2, str(shm), local, nodes, budget, timeout=120)
    for r in out:
        assert r["restored"] is None and r["stopped"] == 7, out  # the same boundary
        assert r["exit"] == 128 + signal.SIGTERM, out
    log = " ".join(out[0]["held"])
    if budget > 1:
        assert out[0]["root"] == [7], out
        assert "step-000000007 is held in the RAM tier, the peer tier, the directory" in log, log
    else:  # too short for the directory: the fast tiers hold it, and the log says so
        assert out[0]["root"] == [], out
        assert "is not in" in log and "held in the RAM tier, the peer tier," in log, log
    # The requeued job resumes step 7 exactly, from memory.
    again = run_ranks(preempted_rank, 2, str(shm), local, nodes, budget, timeout=120)
    for r in again:
        assert r["restored"] == 7 and r["value"] == 7.0, again
        assert r["from"].startswith(("the RAM tier", str(shm))), again  # from memory


def two_node_rank(
    rank: int, world: int, shm: str, local: str, last: int, die_in: str, run: str | None = None
) -> dict[str, Any]:
    """Nodes A and B, one rank each: restore, save steps up to ``last`` (every step), then die
    (SIGKILL). ``die_in`` kills a rank at a phase of step ``last``'s replication instead (see
    ``die_replicating``)."""
    node = "AB"[rank]
    os.environ["TARDIGRADE_NODE"] = node
    lines = _Lines()
    logging.getLogger("tardigrade").addHandler(lines)
    logging.getLogger("tardigrade").setLevel(logging.INFO)
    state = make_state(rank, world, 0.0)
    mgr = tg.CheckpointManager(
        local,
        state,
        every_steps=1,
        ram_tier=os.path.join(shm, node),
        peer_replicas=1,
        timeout=20,
        run_id=run,
    )
    start = mgr.restore()
    report: dict[str, Any] = {"restored": start, "value": state_value(state, rank)}
    report.update(source=mgr.restored_from, log=lines.lines[:])
    die_replicating(die_in, rank, f"step-{last:09d}")
    for step in range((start or 0) + 1, last + 1):
        set_state(state, rank, float(step))
        mgr.step(step)
    mgr.wait()
    peer_of(mgr).replicator.wait(60)
    (Path(shm) / f"two-{rank}-{last}.json").write_text(json.dumps(report))
    os.kill(os.getpid(), signal.SIGKILL)
    return report  # never reached


def die_replicating(phase: str, rank: int, name: str) -> None:
    """Kill this rank at ``phase`` of checkpoint ``name``'s replication: rank 1 while it
    ``"packs"`` its share or mid-``"sending"`` it (after the pair agreed on its size), rank 0
    (keeping rank 1's replica) ``"before-commit"`` (every byte arrived and written) or
    ``"after-commit"`` (the replica renamed into place)."""

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if phase == "packing" and rank == 1:
        real_pack = _peers.pack

        def packing(shares: Any, n: str, *a: Any) -> Any:
            if n == name:
                die()
            return real_pack(shares, n, *a)

        _peers.pack = packing  # type: ignore[assignment]
    elif phase == "sending" and rank == 1:
        real_pack = _peers.pack

        def sending(shares: Any, n: str, *a: Any) -> Any:
            payload = real_pack(shares, n, *a)
            if n == name:
                payload.read_into = lambda start, into: die()  # type: ignore[method-assign]
            return payload

        _peers.pack = sending  # type: ignore[assignment]
    elif phase == "before-commit" and rank == 0:
        real_verify = _peers.verify_files

        def verifying(storage: Any, staging: str, *a: Any) -> Any:
            if name in staging:
                die()
            return real_verify(storage, staging, *a)

        _peers.verify_files = verifying  # type: ignore[assignment]
    elif phase == "after-commit" and rank == 0:
        real_keep = _peers.keep_share

        def keeping(tier: Any, share: Any, *a: Any) -> None:
            real_keep(tier, share, *a)
            if share.name == name:
                die()

        _peers.keep_share = keeping  # type: ignore[assignment]


def two_node_reports(shm: Path, last: int) -> list[dict[str, Any]]:
    return [json.loads((shm / f"two-{r}-{last}.json").read_text()) for r in range(2)]


def test_a_corrupt_replica_falls_back_to_the_directory_with_a_log_line(
    tmp_path: Path, shm: Path
) -> None:
    local = str(tmp_path / "run")
    boot(shm, "A", "B")
    run_ranks(two_node_rank, 2, str(shm), local, 2, "", timeout=120)
    shutil.rmtree(shm / "B")  # node B is lost
    boot(shm, "B")
    # Node A's replica of rank 1's share of step 2 is damaged: a byte of a data file flipped.
    (replica,) = [p for p in (shm / "A").glob("tardigrade-*/step-000000002/data-r00001-*")]
    raw = bytearray(replica.read_bytes())
    raw[-1] ^= 0xFF
    replica.write_bytes(bytes(raw))
    run_ranks(two_node_rank, 2, str(shm), local, 3, "", timeout=120)
    for r in two_node_reports(shm, 3):
        # Every byte is verified: the damage is found, and the directory's copy restored.
        assert r["restored"] == 2 and r["value"] == 2.0, r
        assert r["source"] == str(tmp_path / "run" / "step-000000002"), r
    log = " ".join(two_node_reports(shm, 3)[0]["log"])
    assert "from the peer tier failed" in log and "reading it from the next tier" in log, log


@pytest.mark.parametrize("phase", ["packing", "sending", "before-commit", "after-commit"])
def test_a_rank_dying_at_any_phase_of_a_replication_restores_a_whole_step_never_a_mix(
    tmp_path: Path, shm: Path, phase: str
) -> None:
    local = str(tmp_path / "run")
    boot(shm, "A", "B")
    out = run_ranks(two_node_rank, 2, str(shm), local, 3, phase, timeout=120)
    assert out == [{"died": -signal.SIGKILL}] * 2, out
    shutil.rmtree(shm / "B")  # node B is lost with its memory
    boot(shm, "B")
    run_ranks(two_node_rank, 2, str(shm), local, 4, "", timeout=120)
    reports = two_node_reports(shm, 4)
    log = " ".join(reports[0]["log"])
    for r in reports:
        assert r["restored"] == 3 and r["value"] == 3.0, r
    if phase == "after-commit":
        # Node A kept rank 1's share of step 3 whole before it died: memory serves the step.
        assert reports[1]["source"].startswith("the peer tier"), reports
        assert "rank 1's share from a replica on node 'A'" in log, log
    else:
        # Node A holds its own share of step 3 and rank 1's of step 2 (step 3's never
        # committed there): no step is whole in memory; the directory serves step 3.
        for r in reports:
            assert r["source"] == str(tmp_path / "run" / "step-000000003"), r
        assert "step-000000003 is not whole in the peer tier" in log, log
        assert "share of rank(s) [1]" in log, log


@pytest.fixture
def small_node(tmp_path: Path) -> Iterator[Path]:
    """A node whose memory filesystem is a 16 MiB tmpfs, unmounted at teardown (root needed)."""
    mnt = tmp_path / "A"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a filesystem needs root")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount here: {mounted.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def room_rank(rank: int, world: int, nodes: list[str], local: str) -> dict[str, Any]:
    os.environ["TARDIGRADE_NODE"] = nodes[rank]
    state = {"w": tg.Sharded(torch.zeros(1 << 20), (rank << 20,), (world << 20,))}  # 4 MB
    return caught(lambda: tg.CheckpointManager(local, state, ram_tier=nodes[rank], peer_replicas=1))


def test_too_little_memory_on_a_node_is_refused_at_start_on_every_rank(
    tmp_path: Path, shm: Path, small_node: Path
) -> None:
    nodes = [str(small_node), str(shm)]
    out = run_ranks(room_rank, 2, nodes, str(tmp_path / "run"), timeout=60)
    for r in out:
        assert r["type"] == "StorageError" and r["errno"] == errno.ENOSPC, out
        # It names the node, what it needs and what it has, and what to do.
        assert f"on node {str(small_node)!r}" in r["message"], out
        assert "MB free" in r["message"] and "peer_replicas" in r["message"], out


def test_a_torn_or_foreign_payload_is_refused_by_name() -> None:
    good = _peers.unpack  # a payload of one share: its head, its manifest, one file
    head = json.dumps(
        [{"share": 1, "name": "step-1", "save_id": "x", "manifest": 2, "files": [["f", 3]]}]
    ).encode()
    payload = len(head).to_bytes(8, "little") + head + b"{}" + b"abc"
    (share,) = good(memoryview(payload), 1)
    assert share.manifest == b"{}" and bytes(share.files["f"]) == b"abc"
    for bad in (payload[:-1], payload + b"x", payload[:5], b"\xff" * 8 + payload[8:]):
        with pytest.raises(CorruptCheckpointError, match="the shares rank 1 sent"):
            good(memoryview(bad), 1)
    negative = payload.replace(b'"manifest": 2', b'"manifest": -2')
    with pytest.raises(CorruptCheckpointError, match="malformed"):
        good(memoryview(negative), 1)


def overwrite_rank(rank: int, world: int, local: str, step: int, value: float) -> None:
    """Save ``step`` again (``force=True``), all of it ``value``: another save of that step."""
    state = make_state(rank, world, 0.0)
    set_state(state, rank, value)
    with tg.CheckpointManager(local, state) as mgr:
        mgr.save(step, force=True)


def test_another_run_s_copies_and_a_stale_copy_are_never_restored(
    tmp_path: Path, shm: Path
) -> None:
    local = str(tmp_path / "run")
    boot(shm, "A", "B")
    run_ranks(two_node_rank, 2, str(shm), local, 2, "", "one", timeout=120)
    shutil.rmtree(shm / "B")
    boot(shm, "B")
    # Another job (run "two") on the same directory: run "one"'s copies are never restored,
    # though node A holds every share of step 2 (its own, and node B's replica).
    run_ranks(two_node_rank, 2, str(shm), local, 3, "", "two", timeout=120)
    for r in two_node_reports(shm, 3):
        assert r["restored"] == 2 and r["source"] == str(tmp_path / "run" / "step-000000002"), r
    # Step 3 is saved again meanwhile (all 7s): the memory's copies of step 3 are stale, and
    # the directory's save is restored, not theirs.
    run_ranks(overwrite_rank, 2, local, 3, 7.0, timeout=120)
    run_ranks(two_node_rank, 2, str(shm), local, 4, "", "two", timeout=120)
    for r in two_node_reports(shm, 4):
        assert r["restored"] == 3 and r["value"] == 7.0, r
        assert r["source"] == str(tmp_path / "run" / "step-000000003"), r
    # The same run restarting finds its own copies of step 4, in memory.
    run_ranks(two_node_rank, 2, str(shm), local, 5, "", "two", timeout=120)
    for r in two_node_reports(shm, 5):
        assert r["restored"] == 4 and r["value"] == 4.0, r
        assert not r["source"].startswith(str(tmp_path)), r


def restore_dying_rank(rank: int, world: int, shm: str, local: str) -> dict[str, Any]:
    """Restore after node B's loss; rank 0, which sends rank 1's share, dies doing it."""
    node = "AB"[rank]
    os.environ["TARDIGRADE_NODE"] = node
    state = make_state(rank, world, 0.0)
    mgr = tg.CheckpointManager(
        local, state, ram_tier=os.path.join(shm, node), peer_replicas=1, timeout=5
    )
    if rank == 0:

        def dying(*args: Any) -> Any:
            os.kill(os.getpid(), signal.SIGKILL)  # the peer dies mid-restore

        _peers.pack = dying  # type: ignore[assignment]
    return caught(mgr.restore)


def test_a_peer_dying_during_the_restore_fails_it_on_the_others_never_hangs(
    tmp_path: Path, shm: Path
) -> None:
    local = str(tmp_path / "run")
    boot(shm, "A", "B")
    run_ranks(two_node_rank, 2, str(shm), local, 2, "", timeout=120)
    shutil.rmtree(shm / "B")
    boot(shm, "B")
    out = run_ranks(restore_dying_rank, 2, str(shm), local, timeout=120)
    assert out[0] == {"died": -signal.SIGKILL}, out
    # Bounded by the manager's timeout: the survivor raises instead of waiting forever.
    assert out[1]["type"] == "DistributedError", out


# ----------------------------------------------------------------------------------------------
# FSDP2 + Adam + the data position, on 2 nodes of 2 ranks, the store on SeaweedFS

FSDP_LEN, FSDP_BATCH = 48, 2  # 4 ranks x 2 samples a step: an epoch is 6 steps


def fsdp_node_state(rank: int, world: int, seed: int) -> dict[str, Any]:
    from .test_mesh_and_fsdp import fsdp_build

    model, optim = fsdp_build(seed, world)
    torch.manual_seed(seed + rank)  # each rank's own noise stream
    sampler = tg.ResumableSampler(FSDP_LEN, seed=3, rank=rank, world_size=world)
    return {"model": model, "optim": optim, "data": sampler, "rng": tg.PerRank(tg.RNGState()), "step": 0}  # fmt: skip


def fsdp_node_train(state: dict[str, Any], last: int, mgr: Any = None) -> dict[int, float]:
    """Steps from the state's step to ``last``, each on the sampler's next batch plus noise of
    the rank's RNG; ``mgr.step`` after each. The loss of each step."""
    data = torch.randn(FSDP_LEN, 8, generator=torch.Generator().manual_seed(7))
    sampler = state["data"]
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(data),
        batch_size=FSDP_BATCH,
        sampler=sampler,
        generator=sampler.generator,  # an iterator's seed not drawn from the noise stream
    )
    losses, it = {}, iter(loader)
    while state["step"] < last:
        try:
            (x,) = next(it)
        except StopIteration:  # the epoch ended; the sampler has moved to the next one
            it = iter(loader)
            (x,) = next(it)
        loss = state["model"](x + 0.1 * torch.randn_like(x)).square().mean()
        loss.backward()
        state["optim"].step()
        state["optim"].zero_grad()
        state["step"] += 1
        losses[state["step"]] = loss.item()
        if mgr is not None:
            mgr.step(state["step"])
    return losses


def fsdp_node_rank(
    rank: int, world: int, shm: str, root: str, nodes: list[str], last: int, kill: bool
) -> dict[str, Any]:
    """Restore, train to ``last`` saving async every 2nd step to RAM + peers and every 6th to
    the store, report (what the restore read of the store, the losses, the whole parameters
    and moments, the data position), then (``kill``) die with SIGKILL once every replica is
    kept. On a first run (nothing to restore), an uninterrupted run is reported beside it."""
    from .test_mesh_and_fsdp import full_values

    os.environ["TARDIGRADE_NODE"] = nodes[rank]
    faulty = FaultyStorage(root)  # the store, its operations logged
    state = fsdp_node_state(rank, world, seed=0)
    mgr = tg.CheckpointManager(
        faulty.root,
        state,
        every_steps=2,
        persist_every=6,
        ram_tier=os.path.join(shm, nodes[rank]),
        peer_replicas=1,
        timeout=60,
    )
    start = mgr.restore()
    report: dict[str, Any] = {
        "restored": start,
        "from": mgr.restored_from,
        "reads": [w for op, w in faulty.log if op == "open_reader" and "/step-" in w],
    }
    if start is None:
        reference = fsdp_node_state(rank, world, seed=0)
        ref_losses = fsdp_node_train(reference, 10)
        report["reference"] = {
            "losses": ref_losses,
            "values": full_values(reference["model"], reference["optim"]),
            "data": reference["data"].state_dict(),
        }
        torch.manual_seed(rank)  # the run's noise stream from its start, as the reference's
    report["losses"] = fsdp_node_train(state, last, mgr)
    mgr.wait()
    assert peer_of(mgr).replicator.wait(60)
    report.update(values=full_values(state["model"], state["optim"]), data=state["data"].state_dict())  # fmt: skip
    report["root_steps"] = mgr.steps()
    if not kill:
        mgr.close()
        return report
    (Path(shm) / f"fsdp-{world}-{rank}-{last}.json").write_text(json.dumps(report))
    dist.barrier()  # every replica is kept before any rank dies
    os.kill(os.getpid(), signal.SIGKILL)
    return report  # never reached


@pytest.mark.s3
def test_fsdp2_training_survives_a_node_loss_bit_exactly_reading_nothing_of_the_store(
    shm: Path, s3_env: Any
) -> None:
    root = f"s3://{s3_env.bucket}/fsdp-node-{uuid.uuid4().hex[:12]}"
    env = s3_env.env()
    nodes = ["A", "A", "B", "B"]
    boot(shm, "A", "B")
    try:
        out = run_ranks(fsdp_node_rank, 4, str(shm), root, nodes, 8, True, timeout=180, env=env)
        assert out == [{"died": -signal.SIGKILL}] * 4, out
        first = [json.loads((shm / f"fsdp-4-{r}-8.json").read_text()) for r in range(4)]
        assert all(r["root_steps"] == [6] for r in first), first  # step 8: memory alone

        # Node B is lost with its memory; a fresh machine replaces it, and the job restarts.
        shutil.rmtree(shm / "B")
        boot(shm, "B")
        out = run_ranks(fsdp_node_rank, 4, str(shm), root, nodes, 10, True, timeout=180, env=env)
        assert out == [{"died": -signal.SIGKILL}] * 4, out
        second = [json.loads((shm / f"fsdp-4-{r}-10.json").read_text()) for r in range(4)]
        for r, (before, after) in enumerate(zip(first, second, strict=True)):
            assert after["restored"] == 8 and after["reads"] == [], after  # not one store read
            ref = before["reference"]
            # Losses, whole parameters and Adam moments, and the data position: as if the job
            # had never stopped.
            assert {**before["losses"], **after["losses"]} == ref["losses"], r
            assert after["values"] == ref["values"] and after["data"] == ref["data"], r
        assert second[2]["from"].startswith("the peer tier"), second[2]

        # Node B is gone for good: 2 ranks on node A load step 10 (node B's shares from their
        # replicas) at the new world size, again reading nothing of the store.
        shutil.rmtree(shm / "B")
        out = run_ranks(fsdp_node_rank, 2, str(shm), root, ["A", "A"], 10, False, timeout=180, env=env)  # fmt: skip
        for r in out:
            assert r["restored"] == 10 and r["reads"] == [], r
            assert r["values"] == first[0]["reference"]["values"], r
            assert r["data"] == first[0]["reference"]["data"], r
    finally:
        open_root(root).delete("")
