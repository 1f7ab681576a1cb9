"""Places where ``tardigrade.testing`` may watch the product run: hooks that are None unless a
kill point is armed in this process (``testing/_killpoint.py``).

The product calls :func:`entering_phase` as a rank enters each collective phase (its ``what``,
e.g. ``"tg.save (planning)"``), so a test can SIGKILL one rank between two phases of a
collective save: after the previous phase finished everywhere and before this one starts.
Torch-free and dependency-free, so it costs one attribute read when nothing is armed.
"""

from __future__ import annotations

from collections.abc import Callable

# Called with the phase's name; installed by testing/_killpoint.install, else None.
phase_hook: Callable[[str], None] | None = None


def entering_phase(what: str) -> None:
    """This rank is about to enter the collective phase ``what``."""
    if phase_hook is not None:
        phase_hook(what)
