"""Every backend under the one contract: a fixture per backend, rooted in a fresh place.

Tests that take ``root_url`` or ``storage`` run once per backend: a local directory,
``memory://``, ``s3://`` on the session's SeaweedFS server (``tests/conftest.py``; its
endpoint and credentials reach the code under test through the AWS_* environment variables,
as a user's would) and the generic fsspec backend.

The fsspec backend is tested through a filesystem registered with fsspec under a test-only
scheme, ``tgfs://``: fsspec's own in-process memory filesystem with a store of its own. It is
found as a third-party filesystem (gcsfs, adlfs) is, by fsspec's registry, so the whole path
runs: the scheme lookup, ``url_to_fs`` with the storage options, transactions, the
create-only probe. An in-process store keeps it fast and deterministic; fsspec's local
filesystem would add nothing the local backend does not test, and no object store semantics.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from tardigrade.storage import Storage, open_root

# TARDIGRADE_TEST_BACKENDS="memory" (names, space-separated) narrows the tests to those backends:
# `make test-fast` runs the conformance suite on memory:// alone. `make test` runs them all.
_ONLY = os.environ.get("TARDIGRADE_TEST_BACKENDS", "").split()
BACKENDS = [b for b in ("local", "memory", "s3", "fsspec") if not _ONLY or b in _ONLY]
# The backends without rename: manifest-last commit.
STORES = [b for b in ("memory", "s3", "fsspec") if not _ONLY or b in _ONLY]
FSSPEC_SCHEME = "tgfs"


class TestFileSystem(MemoryFileSystem):
    """fsspec's memory filesystem under ``tgfs://``, with a store of its own."""

    __test__ = False  # not a test class, despite its name
    protocol = (FSSPEC_SCHEME,)
    store: dict[str, Any] = {}
    pseudo_dirs = [""]

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        path = str(path)
        return super()._strip_protocol(path.removeprefix(f"{FSSPEC_SCHEME}://"))


fsspec.register_implementation(FSSPEC_SCHEME, TestFileSystem, clobber=True)


def pytest_configure(config: pytest.Config) -> None:
    # Also registered by tests/distributed/conftest.py, which a run of tests/storage alone
    # does not load (the collective fault matrix lives here, beside the backends it runs on).
    config.addinivalue_line(
        "markers", "distributed: starts real processes joined by a torch.distributed group"
    )


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A pytest-xdist worker hands its counts to the controller (``tests/conftest.py``)."""
    from ._fault_matrix import INJECTED

    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["fault_matrix"] = dict(INJECTED)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The faults the fault matrix injected, per family (``_fault_matrix.INJECTED``); run
    by one process (with pytest-xdist workers, the controller prints their sum)."""
    from ._fault_matrix import INJECTED

    if INJECTED:
        terminalreporter.write_line(
            f"fault matrix: {sum(INJECTED.values())} faults injected: "
            + ", ".join(f"{k} {v}" for k, v in sorted(INJECTED.items()))
        )


def _root(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if kind == "local":
        yield str(tmp_path / "root")
        return
    if kind == "s3":
        server = request.getfixturevalue("s3_env")
        url = f"s3://{server.bucket}/t-{uuid.uuid4().hex[:12]}/root"
    elif kind == "fsspec":
        url = f"{FSSPEC_SCHEME}://test-{uuid.uuid4().hex}/root"
    else:
        url = f"memory://test-{uuid.uuid4().hex}/root"
    yield url
    open_root(url).delete("")


@pytest.fixture(params=BACKENDS)
def root_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty root of one backend: a directory of checkpoints, by URL."""
    yield from _root(request.param, request, tmp_path)


@pytest.fixture(params=STORES)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty root of one object store (manifest-last commit), by URL."""
    yield from _root(request.param, request, tmp_path)


@pytest.fixture
def storage(root_url: str) -> Storage:
    return open_root(root_url)
