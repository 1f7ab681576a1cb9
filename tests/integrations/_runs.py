"""Running a framework script three ways and comparing: uninterrupted, SIGKILLed, resumed."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import IO

import torch

import tardigrade as tg

HERE = Path(__file__).parent
_MARK = "TARDIGRADE_TEST_RUN"
SRC = str(HERE.parents[1] / "src")


def run(
    script: str, *args: object, expect_kill: bool = False, ranks: int = 0, timeout: float = 300
) -> None:
    """Run ``script`` in a fresh interpreter, or on ``ranks`` gloo ranks under torchrun.

    A run still going after ``timeout`` seconds fails with every process's Python stack (see
    _stacks/sitecustomize.py); whatever way the run ends, no process of it is left behind.
    """
    env = dict(os.environ)
    paths = (SRC, str(HERE / "_stacks"), env.get("PYTHONPATH"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env["PYTHONFAULTHANDLER"] = "1"  # a fatal signal (SIGABRT, SIGSEGV) prints the stacks too
    # Every process of the run inherits this mark; what outlives the run is found by it.
    mark = f"{_MARK}={uuid.uuid4().hex}"
    env[_MARK] = mark.split("=", 1)[1]
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    launch = [sys.executable]
    if ranks:
        launch += ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
    # Output to files, not pipes: stack dumps are appended under a header per process, and a
    # stuck grandchild holding a pipe open cannot block reading it.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("a+") as err:
        proc = subprocess.Popen(
            [*launch, str(HERE / script), *map(str, args)],
            stdout=out,
            stderr=err,
            text=True,
            env=env,
            start_new_session=True,
        )
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _dump_stacks(proc.pid, err)
            raise AssertionError(
                f"{script} {' '.join(map(str, args))} did not end within {timeout} s; "
                f"every process's stacks and the end of stderr:\n{_tail(err, 20000)}"
            ) from None
        except BaseException:  # pytest-timeout or Ctrl-C: say where the run was, then stop it
            _dump_stacks(proc.pid, err)
            print(_tail(err, 20000), file=sys.stderr)
            raise
        finally:
            _kill_tree(proc)
            _kill_marked(mark)
        stderr = _tail(err, 3000)
    if expect_kill:
        # torchrun ends the other ranks and exits 1 when one is killed.
        killed = 1 if ranks else -signal.SIGKILL
        assert returncode == killed, stderr
        if ranks:
            assert "Signal 9 (SIGKILL)" in stderr, stderr
    else:
        assert returncode == 0, stderr


def _tail(f: IO[str], n: int) -> str:
    f.flush()
    f.seek(0)
    return f.read()[-n:]


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (torchrun starts each rank in a session of its own,
    so a process group would miss them), parents first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # ended meanwhile
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        found.append(p)
        todo += sorted(children.get(p, []))
    return found


def _dump_stacks(pid: int, err: IO[str]) -> None:
    """Append each live process's stacks to ``err``, under a header naming it."""
    for p in _descendants(pid):
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        state = status.split("State:", 1)[-1].split("\n", 1)[0].strip()
        err.write(f"\n--- stacks of pid {p} ({state}): {cmd[:300]}\n")
        err.flush()
        try:
            os.kill(p, signal.SIGUSR1)
        except ProcessLookupError:
            continue
        time.sleep(1)  # the handler writes from the process itself
        spy = shutil.which("py-spy")  # native frames too, where it is installed
        if spy:
            done = subprocess.run(
                [spy, "dump", "--native", "--pid", str(p)],
                capture_output=True,
                text=True,
                timeout=60,
            )
            err.write(done.stdout + done.stderr)
            err.flush()


def _kill_marked(mark: str) -> None:
    """SIGKILL every process left with ``mark`` in its environment. A rank killed with its
    DataLoader workers running leaves them behind for good under the fork server (see
    _common.use_forkserver_under_ranks): their parent is the server, alive, so their watchdog
    never sees the rank die, and they keep the server alive in turn. Orphans are children of
    init, outside the run's process tree."""
    needle = mark.encode() + b"\0"
    killed: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue  # ended meanwhile, or not ours to read
        if needle in environ:
            try:
                os.kill(int(entry), signal.SIGKILL)
                killed.append(int(entry))
            except ProcessLookupError:
                pass
    # Gone once the kernel has taken them down (a zombie init has yet to reap counts as gone).
    deadline = time.monotonic() + 30
    while killed and time.monotonic() < deadline:
        killed = [p for p in killed if _alive(p)]
        time.sleep(0.01)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _kill_tree(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is not None:
        return  # ended (and reaped: its pid may be another process's now)
    for p in reversed(_descendants(proc.pid)):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def steps(out: Path) -> dict[int, str]:
    lines = (out / "steps.log").read_text().splitlines()
    return {int(line.split()[0].split("=")[1]): line for line in lines}


def assert_same_run(full: Path, killed: Path, resumed: Path, saved_at: int) -> None:
    """The killed run up to its checkpoint plus the resumed run is the uninterrupted run:
    every step's loss, epoch and batch, then the final parameters and optimizer state."""
    want = steps(full)
    got = {s: line for s, line in steps(killed).items() if s <= saved_at}
    assert max(steps(killed)) > saved_at, "the run was not killed after its checkpoint"
    got.update(steps(resumed))
    assert min(steps(resumed)) == saved_at + 1
    diff = [s for s in sorted(want) if got.get(s) != want[s]]
    assert not diff, f"first differing step {diff[0]}: {got.get(diff[0])} != {want[diff[0]]}"
    assert sorted(got) == sorted(want)
    a, b = tg.load(full / "final"), tg.load(resumed / "final")
    _assert_equal_trees(a, b, "final")


def _assert_equal_trees(a: object, b: object, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _assert_equal_trees(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where  # type: ignore[arg-type]
        for i, (x, y) in enumerate(zip(a, b, strict=True)):  # type: ignore[arg-type]
            _assert_equal_trees(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"
