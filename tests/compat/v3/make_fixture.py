"""Build the golden format-v3 checkpoint in ``tests/compat/v3/ckpt/``. Run it once, ever.

    .venv/bin/python tests/compat/v3/make_fixture.py

Format v3 adds leaf kinds to the state tree: torch.Size, torch.device, Counter, set,
frozenset, complex, numpy scalars, complex tensors (stored as their real view) and sparse
tensors (stored as component tensors), and writes views of one buffer that do not overlap as
separate tensors. The state is the v1 fixture's (``../v1/make_fixture.py``, same seeds) plus a
``"leaves"`` subtree holding every new kind, built without drawing random numbers, so the
golden test (``tests/compat/test_golden.py``) checks the common part of every version against
the same values.
"""

from __future__ import annotations

import random
import runpy
import struct
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

import tardigrade as tg

HERE = Path(__file__).resolve().parent
CKPT = HERE / "ckpt"
V1 = runpy.run_path(str(HERE.parent / "v1" / "make_fixture.py"))

# A negative quiet NaN with payload 0x123, as a float64 and as a float32.
NAN64 = struct.unpack("<d", bytes.fromhex("2301000000f8ffff"))[0]
NAN32 = np.frombuffer(bytes.fromhex("2301c0ff"), dtype=np.float32)[0]


def build_leaves() -> dict[str, Any]:
    parts = (torch.arange(12, dtype=torch.float32).reshape(6, 2) - 5.5) / 4
    parts[2, 0] = -0.0
    parts[3, 1] = torch.from_numpy(np.array([NAN32]))[0]
    c64 = torch.view_as_complex(parts)
    c128 = torch.view_as_complex(
        torch.tensor([[1.0, -0.0], [NAN64, 2.5], [1e300, -1e-300]], dtype=torch.float64)
    )
    dense = torch.tensor(
        [
            [0.0, 1.5, 0.0, 0.0],
            [2.0, 0.0, 0.0, -3.0],
            [0.0, 0.0, 0.0, 0.0],
            [0.0, 4.0, 0.5, 0.0],
        ]
    )
    uncoalesced = torch.sparse_coo_tensor(
        torch.tensor([[2, 0, 2], [1, 3, 1]]), torch.tensor([1.0, 2.0, 3.0]), (3, 4)
    )
    buf = torch.arange(1000, dtype=torch.float32) * 0.25
    return {
        "size": torch.Size([3, 0, 7]),
        "device": torch.device("cuda:1"),
        "cpu": torch.device("cpu"),
        "counter": Counter({"b": 2, 3: 1, (1, 2): -4}),
        "set": {3, "a", None, (1, b"x"), 2.5, frozenset({1})},
        "frozenset": frozenset({("w", 1), 7}),
        "complex": complex(-0.0, NAN64),
        "np": [
            np.int64(5),
            np.float32(1.5),
            np.bool_(True),
            np.float64(-0.0),
            np.uint8(255),
            np.float16(-2.5),
            np.complex64(complex(1.0, -2.0)),
            NAN32,
        ],
        "keys": {
            frozenset({1, 2}): "frozenset",
            1 + 2j: "complex",
            np.int64(7): "np.int64",
            torch.device("cuda", 0): "device",
            torch.Size([2]): "size",
        },
        "c64": c64,
        "c64_rows": c64[1:4],
        "c128": c128,
        "coo": dense.to_sparse(),
        "coo_uncoalesced": uncoalesced,
        "csr": dense.to_sparse_csr(),
        "csc": dense.to_sparse_csc(),
        "bsr": dense.to_sparse_bsr((2, 2)),
        "apart": {"head": buf[:10], "tail": buf[-10:]},
    }


def main() -> None:
    if CKPT.exists():
        sys.exit(f"{CKPT} exists; the golden fixture is generated once and never rewritten")
    random.seed(1234)
    np.random.seed(5678)
    torch.manual_seed(91011)
    random.random()
    np.random.rand(3)
    torch.rand(2)
    state = V1["build_state"]()
    state["leaves"] = build_leaves()
    tg.save(
        CKPT, state, step=7, epoch=2, metadata={"purpose": "golden v3"}, metrics={"loss": 0.125}
    )
    print("random.random() =", repr(random.random()))
    print("np.random.rand() =", repr(float(np.random.rand())))
    print("torch.rand(3) =", [repr(x) for x in torch.rand(3).tolist()])
    print("save_id =", tg.read_manifest(CKPT)["save_id"])


if __name__ == "__main__":
    main()
