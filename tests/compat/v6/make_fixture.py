"""Build the golden format-v6 checkpoints in ``tests/compat/v6/``. Run it once, ever.

    .venv/bin/python tests/compat/v6/make_fixture.py

Format v6 adds packed lists and tuples (long runs of ints or floats stored as one base64 string
of their little-endian bytes). It is written by one process (``ckpt``: chunks as in v4) and by
several (``ckpt-2ranks``: chunks as columns, as in v5), so both are kept. The values need no
random numbers:

* ``perm``: the list ``[(37 * i) % 101 for i in range(101)]`` (ints, packed);
* ``floats``: a tuple of 64 floats cycling ``0.5, -0.0, NaN with payload 0xdead, inf`` (packed);
* ``short``: ``[1, 2, 3]`` (too short to pack);
* ``w``: a float32 tensor ``arange(6) / 4``;
* in ``ckpt-2ranks`` also ``mine``: a ``tg.PerRank`` list ``[1000 * r + i for i in range(70)]``
  on rank r (packed, per rank).
"""

from __future__ import annotations

import os
import socket
import struct
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tardigrade as tg

HERE = Path(__file__).resolve().parent
WORLD = 2
NAN = struct.unpack("<d", struct.pack("<Q", 0x7FF8_0000_0000_DEAD))[0]


def build_state() -> dict[str, Any]:
    return {
        "perm": [(37 * i) % 101 for i in range(101)],
        "floats": (0.5, -0.0, NAN, float("inf")) * 16,
        "short": [1, 2, 3],
        "w": torch.arange(6, dtype=torch.float32) / 4,
    }


def save_on(rank: int, port: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    try:
        state = {**build_state(), "mine": tg.PerRank([1000 * rank + i for i in range(70)])}
        tg.save(HERE / "ckpt-2ranks", state, step=6, metadata={"purpose": "golden v6, 2 ranks"})
    finally:
        dist.destroy_process_group()


def main() -> None:
    for name in ("ckpt", "ckpt-2ranks"):
        if (HERE / name).exists():
            sys.exit(f"{HERE / name} exists; golden fixtures are generated once, never rewritten")
    tg.save(HERE / "ckpt", build_state(), step=6, metadata={"purpose": "golden v6"})
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo0" if sys.platform == "darwin" else "lo")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(save_on, args=(port,), nprocs=WORLD)
    for name in ("ckpt", "ckpt-2ranks"):
        print(name, "save_id =", tg.read_manifest(HERE / name)["save_id"])


if __name__ == "__main__":
    main()
