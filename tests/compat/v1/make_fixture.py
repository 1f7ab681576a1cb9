"""Build the golden format-v1 checkpoint in ``tests/compat/v1/ckpt/``. Run it once, ever.

    .venv/bin/python tests/compat/v1/make_fixture.py

The checkpoint is committed to the repository and must keep loading with every later version
of Tardigrade (``tests/compat/test_golden.py``). This script refuses to overwrite it
(``tg.save`` without ``overwrite=True``). It prints the random draws that follow the saved RNG
state and the manifest's ``save_id``; the golden test hard-codes both.
"""

from __future__ import annotations

import math
import random
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch

import tardigrade as tg

HERE = Path(__file__).resolve().parent
CKPT = HERE / "ckpt"


class Counter:
    """A user object with state_dict()/load_state_dict()."""

    def __init__(self) -> None:
        self.calls = 41
        self.history = [0.5, -0.25]

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "history": self.history}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.calls, self.history = sd["calls"], sd["history"]


def build_state() -> dict[str, Any]:
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.copy_(torch.arange(6, dtype=torch.float32).reshape(2, 3) / 8 - 0.25)
        model.bias.copy_(torch.tensor([0.5, -1.5]))
    shared = torch.arange(8, dtype=torch.int16) * 3 - 7
    base = torch.arange(12, dtype=torch.float32) * 0.5
    return {
        "tensors": {
            "f32": (torch.arange(24, dtype=torch.float32).reshape(4, 6) - 11.5) / 3,
            "bf16": (torch.arange(16, dtype=torch.float32) * 0.37 - 2.0)
            .to(torch.bfloat16)
            .reshape(2, 8),
            "f16": torch.tensor(
                [0.0, -0.0, 1.0, -2.5, 65504.0, 6e-8, math.inf, -math.inf, math.nan],
                dtype=torch.float16,
            ),
            "f64": torch.tensor([math.pi, -math.e, 1e300, -1e-300, 0.0, -0.0], dtype=torch.float64),
            "f8": torch.tensor([0.5, -1.0, 448.0, 0.0], dtype=torch.float32).to(
                torch.float8_e4m3fn
            ),
            "i8": torch.arange(-128, 128, 16, dtype=torch.int8),
            "u8": torch.arange(0, 256, 17, dtype=torch.uint8),
            "bool": torch.tensor([True, False, True, True, False]),
            "i32": torch.tensor([[-(2**31), 2**31 - 1], [0, -1]], dtype=torch.int32),
            "i64": torch.tensor([2**62, -(2**63), 0, 7], dtype=torch.int64),
            "scalar": torch.tensor(3.25, dtype=torch.float32),
            "empty": torch.empty(0, 4, dtype=torch.float32),
            "strided": torch.arange(20, dtype=torch.int64).reshape(4, 5)[:, ::2],  # by value
        },
        "shared": {"a": shared, "b": shared},  # one tensor under two keys: stored once
        "numpy": {
            "i32": np.arange(6, dtype=np.int32).reshape(2, 3),
            "f16": np.array([1.5, -0.0, 65504.0], dtype=np.float16),
            "u64": np.array([0, 2**64 - 1, 12345], dtype=np.uint64),
            "bool": np.array([[True], [False]]),
        },
        "tree": {
            "tuple": (1, "two", 3.0, None),
            "list": [b"\x00\x01\xfe\xff", [], (), {}],
            "dict": {1: "int key", (2, "b"): "tuple key", "s": {"deep": [None, (True,)]}},
            "odict": OrderedDict([("z", 1), ("a", 2)]),
            "huge": 2**300 + 12345,
            "neg_huge": -(3**200),
            "negzero": -0.0,
            "nan": math.nan,
            "inf": math.inf,
            "ninf": -math.inf,
            "pi": math.pi,
            "true": True,
            "false": False,
            "str": "grüße ✓ 𝄞",
            "empty_str": "",
            "none": None,
            "bytes": bytes(range(16)),
            "dtype": torch.bfloat16,
        },
        "model": model,
        "user": Counter(),
        "rng": tg.RNGState(),
        "step": 7,
        # Overlapping views of one storage, stored once as a span. Kept last in the tree: the
        # entry renumbering after merging views mis-numbers leaves that come after it (see
        # test_leaves_next_to_overlapping_views_keep_their_values).
        "views": {"base": base, "head": base[:8], "tail": base[4:], "every3": base[::3]},
    }


def main() -> None:
    if CKPT.exists():
        sys.exit(f"{CKPT} exists; the golden fixture is generated once and never rewritten")
    random.seed(1234)
    np.random.seed(5678)
    torch.manual_seed(91011)
    # advance every generator a little so the saved state is not a fresh seed
    random.random()
    np.random.rand(3)
    torch.rand(2)
    state = build_state()
    tg.save(
        CKPT, state, step=7, epoch=2, metadata={"purpose": "golden v1"}, metrics={"loss": 0.125}
    )
    # RNGState was captured during save; these are the draws that follow it
    print("random.random() =", repr(random.random()))
    print("np.random.rand() =", repr(float(np.random.rand())))
    print("torch.rand(3) =", [repr(x) for x in torch.rand(3).tolist()])
    print("save_id =", tg.read_manifest(CKPT)["save_id"])


if __name__ == "__main__":
    main()
