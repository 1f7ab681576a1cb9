"""Every backend under the one contract: a fixture per backend, rooted in a fresh place.

Tests that take ``root_url`` or ``storage`` run once per backend (local directory, memory://);
the object-store backend joins the list when it lands.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tardigrade.storage import Storage, open_root

BACKENDS = ["local", "memory"]


@pytest.fixture(params=BACKENDS)
def root_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty root of one backend: a directory of checkpoints, by URL."""
    if request.param == "local":
        yield str(tmp_path / "root")
    else:
        url = f"memory://test-{uuid.uuid4().hex}/root"
        yield url
        open_root(url).delete("")


@pytest.fixture
def storage(root_url: str) -> Storage:
    return open_root(root_url)
