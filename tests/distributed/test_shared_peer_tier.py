"""Shared data (format 7) on the RAM and peer tiers of a distributed job: each rank keeps in
memory the shared objects of the chunks it wrote, a peer's replica receives only the objects
it does not hold yet, and a node's loss restores bit-exactly from memory, reading nothing of
the directory.

The state is the sparse table of ``test_shared_distributed`` (``SparseAdam``, sharded by rows
over two ranks on two simulated nodes; each step touches one 1 MiB row block per rank) and a
block of zeros that both ranks hold: one shared object, and a plain data file that rank 0
copies for rank 1 in each save.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tardigrade as tg
from tardigrade import _shared
from tardigrade.format.manifest import SHARED_DIR, is_shared

from ._harness import manifest_of, run_ranks
from .test_peer_tier import boot, peer_of
from .test_shared_distributed import BLOCK_ROWS, BLOCKS, DIM, ROWS, _digest, _train_step

pytestmark = pytest.mark.distributed

BLOCK = BLOCK_ROWS * DIM * 4
KEYS = ("table", "exp_avg", "exp_avg_sq", "zeros")


def _state(emb: torch.nn.Embedding, opt: torch.optim.Optimizer, rank: int) -> dict[str, Any]:
    w = emb.weight
    moments = opt.state[w]
    lo = rank * BLOCKS * BLOCK_ROWS
    sharded = lambda t: tg.Sharded(t, (lo, 0), (ROWS, DIM))  # noqa: E731
    zeros = torch.zeros(BLOCK_ROWS, DIM)
    return {
        "table": sharded(w.data),
        "exp_avg": sharded(moments["exp_avg"]),
        "exp_avg_sq": sharded(moments["exp_avg_sq"]),
        "zeros": tg.Sharded(zeros, (rank * BLOCK_ROWS, 0), (2 * BLOCK_ROWS, DIM)),
        "opt_step": tg.PerRank(moments["step"]),
    }


def peer_table_rank(
    rank: int, world: int, shm: str, root: str, last: int, kind: str
) -> dict[str, Any]:
    """Restore, then save each step up to ``last`` (each replicated before the next), record
    what each save sent to the peer, and die with SIGKILL (memory keeps every copy)."""
    os.environ["TARDIGRADE_NODE"] = "AB"[rank]
    _shared.SHARE_CHUNK_BYTES = BLOCK + _shared.SHARE_HEADER_BYTES  # 1 MiB row blocks
    torch.manual_seed(rank)
    emb = torch.nn.Embedding(BLOCKS * BLOCK_ROWS, DIM, sparse=True)
    opt = torch.optim.SparseAdam(emb.parameters(), lr=0.01)
    _train_step(emb, opt, torch.arange(BLOCKS * BLOCK_ROWS))  # every row: moments all differ
    state = _state(emb, opt, rank)
    mgr = tg.CheckpointManager(
        root,
        state,
        async_save=kind != "sync",
        ram_tier=os.path.join(shm, "AB"[rank]),
        peer_replicas=1,
        persist_every=2 if kind == "persist_every" else None,
    )
    start = mgr.restore() or 0
    report: dict[str, Any] = {
        "restored": start,
        "from": mgr.restored_from,
        "restored_digests": [_digest(state[k].local) for k in KEYS],
        "sent": [],
    }
    for step in range(start + 1, last + 1):
        if step > 1:
            block = step % BLOCKS  # this step's rows: 50 of one row block
            _train_step(emb, opt, block * BLOCK_ROWS + torch.randperm(BLOCK_ROWS)[:50])
        stats = mgr.ram_tier_stats
        assert stats is not None
        before = stats.sent_bytes
        mgr.save(step)
        mgr.wait()
        assert peer_of(mgr).replicator.wait(60)
        report["sent"].append(stats.sent_bytes - before)
    stats = mgr.ram_tier_stats
    assert stats is not None
    report.update(
        digests=[_digest(state[k].local) for k in KEYS], failed=stats.failed, error=stats.last_error
    )
    (Path(root).parent / f"report-{rank}-{last}.json").write_text(json.dumps(report))
    dist.barrier()  # every replica is kept before any rank dies
    os.kill(os.getpid(), signal.SIGKILL)
    return report  # never reached


def _report(tmp_path: Path, rank: int, last: int) -> dict[str, Any]:
    return json.loads((tmp_path / f"report-{rank}-{last}.json").read_text())


@pytest.mark.parametrize("kind", ["async", "sync", "persist_every"])
def test_the_peer_tier_receives_only_new_objects_and_a_lost_node_restores_from_memory(
    tmp_path: Path, shm: Path, kind: str
) -> None:
    """``persist_every=2``: the odd steps are saved to memory alone (each rank commits its
    share in its own RAM tier), the newest of them restored after the node's loss."""
    root = tmp_path / "run"
    boot(shm, "A", "B")
    saves = 5
    out = run_ranks(peer_table_rank, 2, str(shm), str(root), saves, kind, timeout=180)
    assert out == [{"died": -signal.SIGKILL}] * 2, out
    first = [_report(tmp_path, r, saves) for r in range(2)]
    for r in first:
        assert r["failed"] == 0, r["error"]
    # What both ranks sent their peers, save by save. The first: every block of the 3
    # tensors on both ranks, the zeros' object and rank 1's plain copy of it. Later ones: the
    # changed block of each tensor on each rank and the plain copy again (a file of the
    # checkpoint's own); the counters and manifests are a few KB. An async save's rank keeps
    # (and sends) the objects of its own chunks, a synchronous one's half of the objects.
    sent = [a + b for a, b in zip(first[0]["sent"], first[1]["sent"], strict=True)]
    assert sent[0] >= (2 * 3 * BLOCKS + 2) * BLOCK, sent
    for nbytes in sent[1:]:
        assert (2 * 3 + 1) * BLOCK <= nbytes <= 1.02 * (2 * 3 + 1) * BLOCK, sent
    # Each node's memory holds the objects its rank's chunks reference, and its peer's.
    newest = f"step-{saves:09d}"
    copies = [ns for node in "AB" for ns in (shm / node).iterdir() if (ns / newest).is_dir()]
    assert len(copies) == 4  # each rank's own, and its peer's replica
    assert (root / newest).is_dir() == (kind != "persist_every")
    objects = {f for f in manifest_of(copies[0] / newest).files if is_shared(f)}
    held: set[str] = set()
    for ns in copies:
        held |= {str(p.relative_to(ns)) for p in (ns / SHARED_DIR).rglob("*.safetensors")}
    assert objects <= held

    # Node B is lost with its memory, and the directory's data of the newest step with it
    # (every shared object too): what restores it reads nothing of the directory.
    shutil.rmtree(shm / "B")
    for f in (root / newest).glob("*"):
        if f.name != "manifest.json":
            f.unlink()
    shutil.rmtree(root / SHARED_DIR)
    boot(shm, "B")
    again = saves + 1
    out = run_ranks(peer_table_rank, 2, str(shm), str(root), again, kind, timeout=180)
    assert out == [{"died": -signal.SIGKILL}] * 2, out
    for rank in range(2):
        r = _report(tmp_path, rank, again)
        assert r["restored"] == saves, r
        assert r["restored_digests"] == first[rank]["digests"], rank
        assert r["failed"] == 0, r["error"]
    assert _report(tmp_path, 1, again)["from"].startswith("the peer tier")
