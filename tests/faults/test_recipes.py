"""The preemption recipes of docs/failures.md, run here as written where this machine can: the
SLURM batch script (``srun`` and ``scontrol`` stubbed; the signal sent to the batch shell as
``--signal=B:USR1@90`` does) forwards USR1 to training, which saves and stops with exit code
138, and the script requeues the job; the requeued run resumes the saved step."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

TRAIN = """\
import signal, sys, time
from pathlib import Path
import tardigrade as tg

state = {"step": 0, "w": [0.0]}
with tg.CheckpointManager("ckpt", state, every_steps=1000,
                          save_on_signals=(signal.SIGTERM, signal.SIGUSR1)) as mgr:
    start = mgr.restore() or 0
    Path(f"started-{start}").write_text("")
    step = start
    while not mgr.should_stop:
        step += 1
        state["step"], state["w"] = step, [float(step)]
        mgr.step(step)
        if step == start + 3:
            Path("training").write_text(str(step))
        time.sleep(0.01)
sys.exit(mgr.exit_code)
"""


def slurm_script() -> str:
    text = (ROOT / "docs" / "failures.md").read_text()
    (script,) = re.findall(r"```bash\n(#!/bin/bash\n#SBATCH.*?)```", text, flags=re.S)
    return script


def executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def start(cwd: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["bash", "job.sh"], cwd=cwd, env=env, start_new_session=True)


def stop(job: subprocess.Popen[bytes]) -> None:
    """End the job and its training process, whatever state a failure left them in."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(job.pid, signal.SIGKILL)
    job.wait()


@pytest.mark.skipif(sys.platform != "linux", reason="a bash batch script")
def test_the_slurm_recipe_forwards_usr1_saves_stops_and_requeues(tmp_path: Path) -> None:
    stubs = tmp_path / "bin"
    stubs.mkdir()
    executable(stubs / "srun", '#!/bin/bash\nexec "$@"\n')  # one task, here
    executable(stubs / "scontrol", f'#!/bin/bash\necho "$@" >> {tmp_path}/scontrol.log\n')
    executable(stubs / "python", f'#!/bin/bash\nexec {sys.executable} "$@"\n')
    executable(tmp_path / "job.sh", slurm_script())
    (tmp_path / "train.py").write_text(TRAIN)
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}

    job = start(tmp_path, env)
    try:
        while not (tmp_path / "training").exists():  # a hang ends by the test's timeout
            assert job.poll() is None, "the job ended before training"
            time.sleep(0.05)
        job.send_signal(signal.SIGUSR1)  # what SLURM sends the batch shell 90 s ahead
        assert job.wait(timeout=120) == 128 + signal.SIGUSR1
    finally:
        stop(job)
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    saved = sorted(p.name for p in (tmp_path / "ckpt").glob("step-*"))
    assert len(saved) == 1, saved  # the preemption's save (every_steps=1000 saved nothing else)
    step = int(saved[0].removeprefix("step-"))

    # The requeued job resumes the saved step.
    again = start(tmp_path, env)
    try:
        while not (tmp_path / f"started-{step}").exists():
            assert again.poll() is None, "the requeued job ended before resuming"
            time.sleep(0.05)
    finally:
        stop(again)
