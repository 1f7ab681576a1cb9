"""How fast the ``tardigrade`` command starts for the commands that need no torch.

Each command runs in a fresh interpreter (``python -m tardigrade.cli``, as the console script
does); the median wall time of a few runs is reported against the 0.3 s target: a user typing
``tardigrade --version``, ``tardigrade ls ckpt`` or ``tardigrade inspect ckpt/step-1`` should
not wait for torch to import.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time

from .report import Target

TARGET_S = 0.3
COMMANDS = (["--version"], ["--help"], ["ls", "{dir}"], ["inspect", "{dir}/step-1"])


def measure(runs: int = 5) -> dict[str, float]:
    """Median seconds per command (``ls`` of a directory holding one small checkpoint,
    ``inspect`` of that checkpoint)."""
    out = {}
    with tempfile.TemporaryDirectory() as d:
        subprocess.run(
            [
                sys.executable,
                "-c",
                f"import tardigrade as tg; tg.save({d!r} + '/step-1', {{'x': 1}})",
            ],
            check=True,
        )
        for argv in COMMANDS:
            args = [a.format(dir=d) for a in argv]
            times = []
            for _ in range(runs):
                t = time.perf_counter()
                subprocess.run(
                    [sys.executable, "-m", "tardigrade.cli", *args],
                    check=True,
                    capture_output=True,
                )
                times.append(time.perf_counter() - t)
            out[" ".join(argv).replace(" {dir}", " DIR")] = statistics.median(times)
    return out


def targets(seconds: dict[str, float]) -> list[Target]:
    return [
        Target(f"tardigrade {name} starts without torch", s, "<", TARGET_S, "s")
        for name, s in seconds.items()
    ]
