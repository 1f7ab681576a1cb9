"""Coordinator cost of a distributed save, simulated: ``python -m bench.plan_scale``.

Feeds the global planner the local plans of N simulated ranks holding T tensors (by default half
sharded by rows over every rank, as FSDP does, half replicated; ``--sharded``) and builds the manifest the
coordinator would commit, without processes or I/O. Reports the time of each coordinator step
and the manifest's size, for several N, so its growth can be read off; and the time to pack
the plan table every rank receives ("plans out"). ``make bench`` runs it for 256 and 1,024 ranks.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from tardigrade._plan import _NBYTES, LocalEntry, LocalPlan, global_plan_from_wire
from tardigrade._sharding import Box
from tardigrade._write import WrittenFile, manifest_doc, seal_checked
from tardigrade.errors import SaveError
from tardigrade.format.checksum import ALGORITHM
from tardigrade.format.jsonio import dumps
from tardigrade.format.manifest import seal


def local_plans(world: int, tensors: int, sharded: float = 0.5) -> list[bytes]:
    """What every rank sends the coordinator (``LocalPlan.to_bytes``), for ``world`` ranks."""
    every = round(1 / sharded) if sharded > 0 else 0  # one tensor in `every` is sharded
    rows = 64

    def plan(r: int) -> LocalPlan:
        shared = []
        for i in range(tensors):
            if every and i % every == 0:
                box = Box((r * rows, 0), (rows * world, 256))
                shared.append(LocalEntry("F32", (rows, 256), False, box, f"layers.{i}.weight"))
            else:
                shared.append(LocalEntry("F32", (256,), False, None, f"layers.{i}.bias"))
        return LocalPlan(tuple(shared), (LocalEntry("I64", (4,), False, None, "rng"),))

    out = [plan(0).to_bytes(full=True)]
    if world > 1:
        # Ranks other than the coordinator send the same header and their pieces' boxes (each
        # sharded tensor: offsets (r * rows, 0), shape (rows, 256)); made here in bulk, and
        # checked against a real rank's payload.
        head = plan(1).to_bytes(full=False)
        head = head[: head.index(b"\0") + 1]
        n = len(range(0, tensors, every)) if every else 0
        for r in range(1, world):
            boxes = np.tile(np.array([r * rows, 0, rows, 256], dtype=np.int64), n)
            out.append(head + boxes.tobytes())
        assert out[1] == plan(1).to_bytes(full=False)
    return out


def run(world: int, tensors: int, sharded: float = 0.5) -> dict[str, float]:
    wire = local_plans(world, tensors, sharded)
    t0 = time.perf_counter()
    g = global_plan_from_wire(wire)
    t1 = time.perf_counter()
    written = {  # each file's tensor bytes, summed from the plan's table
        name: WrittenFile(
            int(g.table[rows, _NBYTES].sum()), "0" * 16, "0123456789abcdef" * len(rows)
        )
        for name, rows in zip(g.files, g.file_rows, strict=True)
    }
    header = {"format": "tardigrade", "format_version": 4, "world_size": world,
              "checksum_algorithm": ALGORITHM, "step": None, "epoch": None}  # fmt: skip
    tree = {"t": "dict", "v": []}
    doc = manifest_doc(header, tree, [[] for _ in range(world)], g, written, packed=False)
    try:
        size = len(seal_checked(doc, "simulated"))
        over = False
    except SaveError:  # a save would refuse it: larger than any reader accepts
        size = len(seal(dumps(doc)))
        over = True
    t2 = time.perf_counter()
    g.to_wire()  # what every rank receives to cut its own plan from
    t3 = time.perf_counter()
    return {
        "plan_s": t1 - t0,
        "manifest_s": t2 - t1,
        "coordinator_s": t2 - t0,
        "handout_s": t3 - t2,
        "manifest_mb": size / 1e6,
        "over_cap": over,
        "wire_mb": sum(map(len, wire)) / 1e6,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[128, 256, 512, 1024])
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument(
        "--sharded", type=float, default=0.5,
        help="fraction of the tensors sharded over every rank (0: all replicated, as DDP)",
    )  # fmt: skip
    args = ap.parse_args()
    print(
        f"{'ranks':>6} {'plan s':>8} {'manifest s':>11} {'manifest MB':>12} {'plans out s':>12}"
        f" {'wire MB':>8}"
    )
    for world in args.ranks:
        r = run(world, args.tensors, args.sharded)
        print(
            f"{world:>6} {r['plan_s']:>8.2f} {r['manifest_s']:>11.2f} {r['manifest_mb']:>12.1f}"
            f" {r['handout_s']:>12.2f} {r['wire_mb']:>8.1f}"
            + ("  (over the readers' manifest cap: a save refuses it)" if r["over_cap"] else "")
        )


if __name__ == "__main__":
    main()
