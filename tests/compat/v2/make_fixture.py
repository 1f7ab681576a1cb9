"""Build the golden format-v2 checkpoint in ``tests/compat/v2/ckpt/``. Run it once, ever.

    .venv/bin/python tests/compat/v2/make_fixture.py

Format v2 seals the manifest with its own checksum and records every data file's header
checksum. The state is exactly the v1 fixture's (``../v1/make_fixture.py``, same seeds), so one
golden test (``tests/compat/test_golden.py``) checks both versions against the same values.
"""

from __future__ import annotations

import random
import runpy
import sys
from pathlib import Path

import numpy as np
import torch

import tardigrade as tg

HERE = Path(__file__).resolve().parent
CKPT = HERE / "ckpt"
V1 = runpy.run_path(str(HERE.parent / "v1" / "make_fixture.py"))


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
    tg.save(
        CKPT, state, step=7, epoch=2, metadata={"purpose": "golden v2"}, metrics={"loss": 0.125}
    )
    print("random.random() =", repr(random.random()))
    print("np.random.rand() =", repr(float(np.random.rand())))
    print("torch.rand(3) =", [repr(x) for x in torch.rand(3).tolist()])
    print("save_id =", tg.read_manifest(CKPT)["save_id"])


if __name__ == "__main__":
    main()
