"""Build the golden format-v4 checkpoint in ``tests/compat/v4/ckpt/``. Run it once, ever.

    .venv/bin/python tests/compat/v4/make_fixture.py

Format v4 is the distributed save: two ranks (gloo, on loopback, spawned here) save together,
each writing its own data file. The state holds one leaf of each distributed kind, with values
that need no random numbers:

* ``emb``: a ``tg.Sharded`` 5x3 float32 tensor cut unevenly by rows (rank 0 rows 0-2, rank 1
  rows 3-4), values ``arange(15) * 0.5 - 3``;
* ``bias``: a plain tensor every rank holds the same (replicated), ``[0.25, -1.0, 3.5]``;
* ``step``: ``7``;
* ``mine``: a ``tg.PerRank`` dict, ``{"rank": r, "seen": int64 [10 r, 10 r + 1]}`` on rank r.

The golden test (``tests/compat/test_golden.py``) loads it in one process.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tardigrade as tg

HERE = Path(__file__).resolve().parent
CKPT = HERE / "ckpt"
WORLD = 2
ROWS = ((0, 3), (3, 5))  # uneven on purpose


def build_state(rank: int) -> dict[str, Any]:
    full = (torch.arange(15, dtype=torch.float32) * 0.5 - 3).reshape(5, 3)
    lo, hi = ROWS[rank]
    return {
        "emb": tg.Sharded(full[lo:hi].clone(), (lo, 0), (5, 3)),
        "bias": torch.tensor([0.25, -1.0, 3.5]),
        "step": 7,
        "mine": tg.PerRank(
            {"rank": rank, "seen": torch.tensor([10 * rank, 10 * rank + 1], dtype=torch.int64)}
        ),
    }


def save_on(rank: int, port: int, ckpt: Path, purpose: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    try:
        tg.save(ckpt, build_state(rank), step=7, metadata={"purpose": purpose})
    finally:
        dist.destroy_process_group()


def main(ckpt: Path = CKPT, purpose: str = "golden v4") -> None:
    """Save the state on two spawned ranks (also run by later versions' fixture scripts)."""
    if ckpt.exists():
        sys.exit(f"{ckpt} exists; the golden fixture is generated once and never rewritten")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo0" if sys.platform == "darwin" else "lo")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(save_on, args=(port, ckpt, purpose), nprocs=WORLD)
    print("save_id =", tg.read_manifest(ckpt)["save_id"])


if __name__ == "__main__":
    main()
