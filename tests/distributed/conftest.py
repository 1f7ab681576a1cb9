"""Multi-process tests: each starts real ranks with ``_harness.run_ranks``."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "distributed: starts real processes joined by a torch.distributed group"
    )
