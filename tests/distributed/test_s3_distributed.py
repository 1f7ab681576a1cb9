"""Collective saves and loads on S3 (the session's SeaweedFS): each rank uploads its own data
objects, rank 0 commits the manifest after every rank succeeded, and a 2-rank checkpoint
loads on 2 ranks and on 1 (resharded). Endpoint and credentials reach the ranks through the
AWS_* variables, as on a real cluster."""

from __future__ import annotations

import os
import uuid
from typing import Any

import pytest
import torch

import tardigrade as tg

from ._harness import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.s3]

ROWS, COLS = 9, 4


def full() -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)


def rows_of(rank: int, world: int) -> tuple[int, int]:
    edges = [round(i * ROWS / world) for i in range(world + 1)]
    return edges[rank], edges[rank + 1]


def state_on(rank: int, world: int, *, fill: bool) -> dict[str, Any]:
    lo, hi = rows_of(rank, world)
    rows = full()[lo:hi].clone() if fill else torch.zeros(hi - lo, COLS)
    return {
        "emb": tg.Sharded(rows, (lo, 0), (ROWS, COLS)),
        "rep": torch.ones(5) if fill else torch.zeros(5),
        "mine": tg.PerRank({"rank": rank}),
    }


def save_rank(rank: int, world: int, ckpt: str) -> Any:
    tg.save(ckpt, state_on(rank, world, fill=True), step=3)
    return tg.read_manifest(ckpt)["world_size"]


def load_rank(rank: int, world: int, ckpt: str) -> Any:
    state = state_on(rank, world, fill=False)
    tg.load(ckpt, into=state)
    lo, hi = rows_of(rank, world)
    assert torch.equal(state["emb"].local, full()[lo:hi])
    assert torch.equal(state["rep"], torch.ones(5))
    return state["mine"].value["rank"]


def test_two_ranks_save_on_s3_and_load_on_two_and_on_one(s3_env: Any) -> None:
    ckpt = f"s3://{s3_env.bucket}/dist-{uuid.uuid4().hex[:12]}/ckpt"
    env = s3_env.env()
    assert run_ranks(save_rank, 2, ckpt, env=env, timeout=120) == [2, 2]
    m = tg.read_manifest(ckpt)
    assert m["world_size"] == 2 and len(m["per_rank"]) == 2
    assert run_ranks(load_rank, 2, ckpt, env=env, timeout=120) == [0, 1]
    tree = tg.load(ckpt)  # one process, no group: the whole tensor
    assert torch.equal(tree["emb"], full()) and tree["mine"]["rank"] == 0
    assert tg.verify(ckpt).files == len(m["files"])
    from tardigrade.storage import open_root

    root = open_root(ckpt.rsplit("/", 1)[0])
    names = root.list("ckpt")
    assert "manifest.json" in names and len(names) == len(m["files"]) + 1, names
    root.delete("")


def save_rank_with_options(rank: int, world: int, ckpt: str, opts: dict[str, Any]) -> Any:
    assert not any(k.startswith("AWS_") for k in os.environ)  # the options are all it has
    tg.save(ckpt, state_on(rank, world, fill=True), step=3, storage_options=opts)
    return tg.read_manifest(ckpt, storage_options=opts)["world_size"]


def load_rank_with_options(rank: int, world: int, ckpt: str, opts: dict[str, Any]) -> Any:
    state = state_on(rank, world, fill=False)
    tg.load(ckpt, into=state, storage_options=opts)
    tg.verify(ckpt, storage_options=opts)  # collective too
    lo, hi = rows_of(rank, world)
    assert torch.equal(state["emb"].local, full()[lo:hi])
    return state["mine"].value["rank"]


def test_collective_save_and_load_take_storage_options(
    s3_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)  # the ranks inherit this environment
    opts = s3_server.options()
    ckpt = f"s3://{s3_server.bucket}/dist-{uuid.uuid4().hex[:12]}/ckpt"
    assert run_ranks(save_rank_with_options, 2, ckpt, opts, timeout=120) == [2, 2]
    assert run_ranks(load_rank_with_options, 2, ckpt, opts, timeout=120) == [0, 1]
    from tardigrade.storage import open_root

    open_root(ckpt.rsplit("/", 1)[0], opts).delete("")
