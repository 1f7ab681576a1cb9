"""Build the golden format-v7 checkpoints in ``tests/compat/v7/``. Run it once, ever.

    .venv/bin/python tests/compat/v7/make_fixture.py

Format v7 adds shared data: a chunk of 1 MiB or more is a shared object of the root
(``root/.shared/ab/<xxh3-128 of the file>.safetensors``) that every checkpoint holding the
same bytes references. ``root/step-1`` is a plain checkpoint's successor that writes the
shared object; ``root/step-2`` references it and writes only what changed. The values need no
random numbers:

* ``base``: float32 ``arange(262144).reshape(256, 1024) / 7`` (exactly 1 MiB: shared);
* ``adapter``: float32 ``full((4, 8), step)`` (small: in each checkpoint's own data file);
* ``step``: 1, then 2.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

import tardigrade as tg

HERE = Path(__file__).resolve().parent


def build_state(step: int) -> dict[str, Any]:
    return {
        "base": torch.arange(262144, dtype=torch.float32).reshape(256, 1024) / 7,
        "adapter": torch.full((4, 8), float(step)),
        "step": step,
    }


def main() -> None:
    root = HERE / "root"
    if root.exists():
        sys.exit(f"{root} exists; golden fixtures are generated once, never rewritten")
    tg.save(root / "plain", build_state(0))
    tg.save(root / "step-1", build_state(1), step=1, base=root / "plain")
    tg.save(root / "step-2", build_state(2), step=2, base=root / "step-1")
    tg.Catalog(root).retire("plain")  # its data was never shared: gone with it
    for name in ("step-1", "step-2"):
        print(name, "save_id =", tg.read_manifest(root / name)["save_id"])


if __name__ == "__main__":
    main()
