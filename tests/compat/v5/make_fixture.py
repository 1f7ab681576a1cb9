"""Build the golden format-v5 checkpoint in ``tests/compat/v5/ckpt/``. Run it once, ever.

    .venv/bin/python tests/compat/v5/make_fixture.py

Format v5 stores a distributed save's chunks as columns (and derives each chunk's safetensors
key from the tensor's name). The state, the two ranks and how they save are exactly those of
the v4 fixture (``tests/compat/v4/make_fixture.py``, which this runs), so the two checkpoints
hold the same values in the two encodings.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    # By module name, so that the spawned ranks (which get this sys.path) import it too.
    sys.path.insert(0, str(HERE.parent / "v4"))
    v4 = importlib.import_module("make_fixture")
    v4.main(HERE / "ckpt", "golden v5")


if __name__ == "__main__":
    main()
