"""Units every report uses, defined once."""

from __future__ import annotations


def gbps(nbytes: int, seconds: float) -> float:
    """Throughput in GB/s (1e9 bytes); infinite for bytes moved in no measurable time."""
    if seconds > 0:
        return nbytes / seconds / 1e9
    return float("inf") if nbytes else 0.0
