"""torchrun's elastic agent (``--max-restarts``, c10d rendezvous on loopback) restarting every
worker after one is SIGKILLed with its node: the job resumes from the newest step held in
memory (saved to RAM + peers alone, newer than the directory's; the lost node's share from its
peer's replica) and ends bit-identical to an uninterrupted run, with no manual step.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tardigrade as tg

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

SCRIPT = Path(__file__).with_name("_elastic_script.py")
SRC = str(Path(__file__).resolve().parents[2] / "src")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(out: Path, shm: Path, kill_at: int, last: int) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    env["GLOO_SOCKET_IFNAME"] = "lo"
    # Restarted workers sharing the rendezvous store read the last attempt's gloo addresses
    # (pytorch/pytorch#135712): each attempt its own store, as that issue advises.
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    # The launcher's variables of the test process's own environment, if any, are not ours.
    for var in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        env.pop(var, None)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
        "--max-restarts=3", "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--rdzv-id=elastic-{out.name}",
        "--monitor-interval=0.5", str(SCRIPT), str(out), str(shm), str(kill_at), str(last),
    ]  # fmt: skip
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)


def test_torchrun_restarts_every_worker_after_a_kill_and_the_job_resumes_exactly(
    tmp_path: Path, shm: Path
) -> None:
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    for out, kill_at in ((reference, 0), (killed, 7)):
        out.mkdir()
        (shm / out.name).mkdir()
        run = torchrun(out, shm / out.name, kill_at, 10)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    # The first attempt died at step 7: the restarted workers resumed step 6, saved to
    # RAM + peers alone (the directory holds step 4), with no manual step.
    for rank in range(2):
        report = json.loads((killed / f"report-{rank}-1.json").read_text())
        assert report["start"] == 6, report
        assert not report["from"].startswith(str(killed)), report  # from memory
        if rank == 1:  # its node lost: its share came from node 0's replica
            assert report["from"].startswith("the peer tier"), report
        full = json.loads((reference / f"report-{rank}-0.json").read_text())
        assert report["losses"] == {k: v for k, v in full["losses"].items() if int(k) > 6}
    a, b = (tg.load(d / "final") for d in (reference, killed))
    _assert_equal(a, b, "final state")
    assert tg.CheckpointManager(killed / "ckpt", {}).steps() == [4, 8]


def _assert_equal(a: object, b: object, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _assert_equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_equal(x, y, f"{where}/{i}")
    else:
        assert a == b, where
