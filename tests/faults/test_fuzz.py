"""The fuzz harness in the test suite: a bounded run, and every past finding replayed.

``make fuzz`` runs the same harness for as long as asked (``make fuzz FUZZ_N=20000``); see
tests/fuzz/fuzz.py for the mutations and the oracle.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import pytest

HARNESS = Path(__file__).resolve().parents[1] / "fuzz" / "fuzz.py"
FIXTURES = Path(__file__).resolve().parent / "fuzz_fixtures"
BOUNDED_CASES = 3750  # 750 a corpus


def _harness() -> Any:
    spec = importlib.util.spec_from_file_location("tardigrade_fuzz", HARNESS)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses and pickling-free helpers look themselves up
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(600)
def test_bounded_fuzz_run_finds_nothing() -> None:
    """>= 3,750 mutations of a fresh, the golden v1, the golden distributed v5 and v6
    checkpoints (chunk columns, per-rank parts, packed lists) and the golden v7 one (a shared
    object beside it), resealed half the time: every
    outcome is a correct load or a TardigradeError; nothing slow, hung, crashed, out of memory
    or silently different (except edits to the v1 manifest, which has no checksum: counted
    apart)."""
    fuzz = _harness()
    seed = int(os.environ.get("FUZZ_SEED", "1"))
    summary = fuzz.run_fuzz(BOUNDED_CASES, seed, workers=2, corpora=list(fuzz.CORPORA))
    findings = summary["findings"]
    assert not findings, "\n".join(
        f"{f['what']} [{f['desc']}] replay: python {HARNESS} --replay {f['seed']}:{f['index']} "
        f"--corpus {f['corpus']}\n  {f['detail']}"
        for f in findings[:20]
    )
    tally = summary["tally"]
    assert summary["cases"] >= BOUNDED_CASES
    # The newer formats seal their manifest: no edit anywhere may load a different value.
    for corpus in ("fresh", "v5", "v6", "v7"):
        assert "silent-unchecksummed-manifest" not in tally[corpus], tally
    # The harness reaches deep: many cases load, many are refused, in every corpus.
    for corpus in fuzz.CORPORA:
        assert tally[corpus].get("ok", 0) > 300, tally
        assert tally[corpus].get("rejected", 0) > 300, tally


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.iterdir() if p.is_dir()))
def test_fuzz_finding_stays_fixed(name: str, tmp_path: Path) -> None:
    fuzz = _harness()
    results = fuzz.replay_fixture(FIXTURES / name, tmp_path)
    bad = {t: r for t, r in results.items() if r["outcome"] in fuzz.BAD}
    assert not bad, f"{name}: {bad}"
    # What the finding was about is now refused, not loaded.
    assert results["load_verified"]["outcome"] == "rejected", results
