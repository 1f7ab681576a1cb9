"""Seconds to validate the hostile manifests of ``tests/faults/test_hostile_limits.py``.

    python -m bench.hostile

The test bounds the work (box visits per chunk), which a busy machine cannot make fail; this
times the same documents, for the figure the test's bound stands for: about 1 s per 10 MB.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import time
from pathlib import Path

from tardigrade.errors import CorruptCheckpointError
from tardigrade.format import manifest

CASES_FILE = Path(__file__).resolve().parents[1] / "tests" / "faults" / "test_hostile_limits.py"
TARGET_SECONDS_PER_10MB = 1.0


def main() -> None:
    spec = importlib.util.spec_from_file_location("hostile_cases", CASES_FILE)
    assert spec is not None and spec.loader is not None
    cases = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cases)
    worst = 0.0
    for name, build in cases.CASES.items():
        raw = json.dumps(build(), separators=(",", ":")).encode()
        gc.collect()
        start = time.process_time()
        try:
            manifest.parse(raw, "hostile.json")
        except CorruptCheckpointError:
            pass
        per_10mb = (time.process_time() - start) * 10_000_000 / len(raw)
        worst = max(worst, per_10mb)
        print(f"{name:28s} {len(raw) / 1e6:5.1f} MB  {per_10mb:5.2f} s per 10 MB")
    verdict = "PASS" if worst <= TARGET_SECONDS_PER_10MB else "MISS"
    print(f"worst {worst:.2f} s per 10 MB (target {TARGET_SECONDS_PER_10MB} s): {verdict}")


if __name__ == "__main__":
    main()
