"""The soak in ``make test``: 50 random SIGKILLs of checkpointing jobs, checked after each.

``make soak`` runs the same driver (tests/soak/soak.py) for 1,000 kills; see its docstring for
the jobs, the kill moments and the checks. Bounded by kills, not seconds: the run ends when 50
kills landed (or, if the kill points stopped firing, after a bounded number of cycles, which
fails the test).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = [pytest.mark.crash, pytest.mark.timeout(600)]

DRIVER = Path(__file__).resolve().parents[1] / "soak" / "soak.py"
KILLS = 50


def driver() -> ModuleType:
    if "tardigrade_soak" in sys.modules:
        return sys.modules["tardigrade_soak"]
    spec = importlib.util.spec_from_file_location("tardigrade_soak", DRIVER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_fifty_random_kills_lose_nothing_and_resume_from_the_newest(tmp_path: Path) -> None:
    soak = driver().run_soak(KILLS, seed=50, workdir=tmp_path, max_cycles=4 * KILLS)
    assert soak.problems == [], "\n\n".join(soak.problems[:5])
    assert soak.kills == KILLS, soak.summary()
    # The kills spread over both world sizes, the three save modes, and storage moments as well as
    # random times; and the checks ran.
    assert soak.by_world[1] and soak.by_world[2], soak.summary()
    assert soak.by_mode["sync"] and soak.by_mode["async"], soak.summary()
    assert soak.by_mode["overlap"], soak.summary()  # async, copying beside training
    assert soak.by_moment["random"] and soak.by_moment["operation"], soak.summary()
    assert soak.by_phase["gc"] and soak.by_phase["retention"], soak.summary()
    assert soak.rewinds, soak.summary()
    assert soak.resumes_checked >= KILLS // 2 and soak.checkpoints_verified >= KILLS, soak.summary()
    # Single-process saves share data: kills left objects no checkpoint references (never a
    # pile: the next retention sweeps them; a final sweep leaves none, every checkpoint whole).
    assert soak.max_unreferenced >= 1, soak.summary()


SEEN = {
    "drop-newest": "restored step",
    "flip-byte": "is broken: ChecksumMismatchError",
    "revive-abandoned": "belongs to a timeline that restore(step) abandoned",
}


@pytest.mark.parametrize("sabotage", list(SEEN))
def test_the_soak_sees_a_lost_damaged_or_revived_checkpoint(sabotage: str, tmp_path: Path) -> None:
    """The checks themselves: jobs that delete their newest checkpoint, flip one of its bytes,
    or put a checkpoint of an abandoned timeline back in view before resuming (as a bug
    would) are reported."""
    soak = driver().run_soak(
        6, seed=11, workdir=tmp_path, max_cycles=40, sabotage=sabotage, rewind_share=0.5
    )
    assert any(SEEN[sabotage] in p for p in soak.problems), soak.problems[:5]
