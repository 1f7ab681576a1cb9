"""Shared data (format 7) in collective saves: each rank decides for the chunks it writes,
rank 0's manifest references them, and any world size loads them.

The table here is a sparse embedding trained with ``SparseAdam`` and sharded by rows over two
ranks: a step touches the rows of one row block per rank, so a save writes only that block of
the table and of its two moments, and references every other block from the save before.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch

import tardigrade as tg
from tardigrade import _shared, _tiers
from tardigrade.format.manifest import SHARED_DIR, is_shared

from ._harness import manifest_of, run_ranks

pytestmark = pytest.mark.distributed

DIM = 64
BLOCK_ROWS = 4096  # one 1 MiB row block of fp32 x 64
BLOCKS = 4  # per rank
ROWS = 2 * BLOCKS * BLOCK_ROWS  # the whole table, over two ranks
SAVES = 5


def _objects(root: Path) -> dict[str, int]:
    shared = root / SHARED_DIR
    return {str(p.relative_to(root)): p.stat().st_size for p in shared.rglob("*.safetensors")}


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def _table_state(emb: torch.nn.Embedding, opt: torch.optim.Optimizer, lo: int) -> dict[str, Any]:
    w = emb.weight
    moments = opt.state[w]
    sharded = lambda t: tg.Sharded(t, (lo, 0), (ROWS, DIM))  # noqa: E731
    return {
        "table": sharded(w.data),
        "exp_avg": sharded(moments["exp_avg"]),
        "exp_avg_sq": sharded(moments["exp_avg_sq"]),
        "opt_step": tg.PerRank(moments["step"]),
    }


def _train_step(emb: torch.nn.Embedding, opt: torch.optim.Optimizer, rows: torch.Tensor) -> None:
    opt.zero_grad()
    emb(rows).square().sum().backward()
    opt.step()


def sparse_table_rank(rank: int, world: int, root: str, remote: str) -> dict[str, Any]:
    # Row blocks of 1 MiB, not 64 MiB (an object's header has room beside its chunk).
    _shared.SHARE_CHUNK_BYTES = BLOCK_ROWS * DIM * 4 + _shared.SHARE_HEADER_BYTES
    uploaded: list[str] = []  # the shared objects this rank's uploads copied
    copy_file = _tiers.copy_file

    def counting(src: Any, name: str, *args: Any, **kw: Any) -> None:
        if SHARED_DIR in name:
            uploaded.append(name)
        copy_file(src, name, *args, **kw)

    _tiers.copy_file = counting
    torch.manual_seed(rank)
    lo = rank * BLOCKS * BLOCK_ROWS
    emb = torch.nn.Embedding(BLOCKS * BLOCK_ROWS, DIM, sparse=True)
    opt = torch.optim.SparseAdam(emb.parameters(), lr=0.01)
    _train_step(emb, opt, torch.arange(BLOCKS * BLOCK_ROWS))  # every row: moments all differ
    state = _table_state(emb, opt, lo)
    written, new_objects = [], []
    with tg.CheckpointManager(root, state, keep_last=3, upload_to=remote) as mgr:
        for step in range(1, SAVES + 1):
            if step > 1:
                block = step % BLOCKS  # this step's rows: 50 of one row block
                rows = block * BLOCK_ROWS + torch.randperm(BLOCK_ROWS)[:50]
                _train_step(emb, opt, rows)
            before = set(_objects(Path(root)))
            mgr.save(step)
            mgr.wait()  # an async save: recorded once it committed
            if rank == 0:
                written.append(mgr.stats[-1].nbytes)
                new_objects.append(len(set(_objects(Path(root))) - before))
    return {
        "uploaded": uploaded,
        "written": written,
        "new_objects": new_objects,
        "digests": [_digest(state[k].local) for k in ("table", "exp_avg", "exp_avg_sq")],
    }


def test_sparse_table_writes_only_changed_row_blocks_and_loads_on_one_rank(tmp_path: Path) -> None:
    root, remote = tmp_path / "run", tmp_path / "remote"
    results = run_ranks(sparse_table_rank, 2, str(root), str(remote), timeout=120)
    assert all("error" not in r for r in results), results
    block = BLOCK_ROWS * DIM * 4
    written, new = results[0]["written"], results[0]["new_objects"]
    # The first save writes every block of the table and of both moments, on both ranks.
    assert new[0] == 2 * 3 * BLOCKS
    assert written[0] >= 2 * 3 * BLOCKS * block
    for n, nbytes in zip(new[1:], written[1:], strict=True):
        # Later saves: one changed block of each of the three tensors per rank; the small
        # per-rank step counters and the manifest are the rest.
        assert n == 2 * 3
        assert 2 * 3 * block <= nbytes <= 1.05 * 2 * 3 * block
    # Retention kept 3 checkpoints; the sweep left only the objects they reference.
    kept = sorted(p.name for p in root.glob("step-*"))
    assert kept == [f"step-{s:09d}" for s in range(SAVES - 2, SAVES + 1)]
    referenced = set()
    for name in kept:
        m = manifest_of(root / name)
        referenced |= {f for f in m.files if is_shared(f)}
        tg.verify(str(root / name))  # raises on a broken reference
    assert set(_objects(root)) == referenced
    # 2 -> 1: one process loads the whole table and both moments from the shared data.
    keys = ("table", "exp_avg", "exp_avg_sq")
    whole = {k: torch.zeros(ROWS, DIM) for k in keys}
    tg.load(str(root / kept[-1]), into=whole, strict=False)  # the per-rank counters stay
    half = BLOCKS * BLOCK_ROWS
    for rank, r in enumerate(results):
        got = [_digest(whole[k][rank * half : (rank + 1) * half]) for k in keys]
        assert got == r["digests"]
    # The uploads: every object once, split between the ranks; the remote (which keeps every
    # checkpoint) loads the newest alike.
    copied = results[0]["uploaded"] + results[1]["uploaded"]
    assert results[0]["uploaded"] and results[1]["uploaded"]
    assert len(copied) == len(set(copied)) == sum(new)
    assert len(_objects(remote)) == sum(new)
    again = {k: torch.zeros(ROWS, DIM) for k in keys}
    tg.load(str(remote / kept[-1]), into=again, strict=False)
    assert all(torch.equal(again[k], whole[k]) for k in keys)


def equal_chunks_rank(rank: int, world: int, root: str) -> None:
    rows = 5000  # 1.2 MiB per rank: one chunk each, a shared object each
    zeros = tg.Sharded(torch.zeros(rows, DIM), (rank * rows, 0), (2 * rows, DIM))
    ones = tg.Sharded(torch.ones(rows, DIM), (rank * rows, 0), (2 * rows, DIM))
    tg.save(f"{root}/step-1", {"zeros": zeros, "ones": ones})  # a plain checkpoint
    tg.save(f"{root}/step-2", {"zeros": zeros, "ones": ones}, base=f"{root}/step-1")
    tg.save(f"{root}/step-3", {"zeros": zeros, "ones": ones}, base=f"{root}/step-2")


def test_equal_chunks_on_two_ranks_are_one_object_and_a_plain_file(tmp_path: Path) -> None:
    """Both ranks hold the same bytes: each writes its object, rank 0 keeps the first one and
    makes the other a plain data file of the save (every file referenced once); the next save
    references the objects on both ranks and again copies one into a plain file."""
    results = run_ranks(equal_chunks_rank, 2, str(tmp_path), timeout=60)
    assert results == [None, None]
    for name in ("step-2", "step-3"):
        m = manifest_of(tmp_path / name)
        shared = [f for f in m.files if is_shared(f)]
        own = [f for f in m.files if not is_shared(f)]
        assert len(shared) == 2 and len(own) == 2  # zeros and ones: one of each kind
        assert len({c.file for t in m.tensors for c in t.chunks}) == 4
        tg.verify(str(tmp_path / name))
        got = {"zeros": torch.full((10000, DIM), 7.0), "ones": torch.zeros(10000, DIM)}
        tg.load(str(tmp_path / name), into=got)
        assert bool((got["zeros"] == 0).all()) and bool((got["ones"] == 1).all())
    assert len(_objects(tmp_path)) == 2
    assert set(_objects(tmp_path)) == {
        f for f in manifest_of(tmp_path / "step-3").files if is_shared(f)
    }
