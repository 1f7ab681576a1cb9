"""``kill_during``: run a training script and SIGKILL it at a chosen or random moment."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._warn import warn_user
from ..errors import InvalidArgumentError
from ._killpoint import ENV, KILLED_FILE, MOMENTS, KillPoint

__all__ = ["KillResult", "kill_during"]

# Besides the storage moments of _killpoint: a SIGKILL sent from outside after a random delay.
RANDOM = "random"


@dataclass(frozen=True)
class KillResult:
    """What happened to a script run by :func:`kill_during`.

    ``killed``: the kill point was reached and SIGKILL sent. ``where``: the moment, in words
    (``"commit #2: 310 of 621 bytes of /ckpt/.tmp-step-000000010-.../manifest.json"``, or
    ``"random time: 1.234 s after import tardigrade"``); None when not killed. ``returncode``:
    the script's exit status (``-9`` when SIGKILL ended it). ``counts``: the storage operations
    of the process that died, at its death, or, not killed, of the script's process that did
    the most at its exit (``"bytes"``, ``"operation"`` and one count per kind; empty after a
    random-time kill). ``rank``: that process's rank, where the script runs a distributed job.
    When ``kill_during`` returns, every process of the job has ended.
    """

    killed: bool
    where: str | None
    returncode: int
    counts: dict[str, int] = field(default_factory=dict)
    rank: int | None = None
    stdout: str = ""
    stderr: str = ""
    # Why the moment never came, when not killed and that can be told (the script made no
    # operation of the kind asked for, or fewer than nth): what to ask for instead.
    note: str | None = None

    def tail(self, lines: int = 30) -> str:
        """The end of the script's output, for an assertion message."""
        out = (self.stdout + self.stderr).splitlines()[-lines:]
        return "\n".join(out)


def kill_during(
    script: str | os.PathLike[str] | None = None,
    args: Sequence[str] = (),
    *,
    code: str | None = None,
    at: str = RANDOM,
    nth: int = 1,
    after_bytes: int | None = None,
    op: str | None = None,
    phase: str | None = None,
    within: tuple[float, float] = (0.0, 2.0),
    seed: int | None = None,
    rank: int | None = None,
    scope: str = "job",
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float = 600.0,
) -> KillResult:
    """Run a training script in a subprocess and SIGKILL it at a chosen moment; say what happened.

    The script is a Python file (``script``) or code (``code=``, run as ``python -c``), given
    the command-line arguments ``args``, and unchanged: its ``import tardigrade`` arms the kill point (through the
    ``TARDIGRADE_KILL_POINT`` environment variable), so it needs no hook of its own. Moments:

    - ``at="write", after_bytes=N``: once N bytes went to checkpoint storage (a data file then
      ends mid-write);
    - ``at="staging", nth=k``: the k-th save created its staging location, nothing written;
    - ``at="commit", nth=k``: inside the k-th commit, its manifest half written;
    - ``at="committed", nth=k``: right after the k-th commit, before the save returns;
    - ``at="operation", nth=k``: before the k-th storage operation (of kind ``op`` if given);
    - ``at="phase", nth=k``: as the rank enters its k-th collective phase (of those whose
      name contains ``phase``, if given; e.g. ``phase="(write and commit)"``), after every
      rank finished the phase before: between the ranks' phases of a collective save;
    - ``at="random"``: after a delay drawn uniformly from ``within`` seconds (with ``seed``),
      counted from the moment the script imported tardigrade;
    - ``at="never"``: not killed; the result counts the script's storage operations (to draw
      kill points from).

    ``rank`` counts the moment in that rank only (a distributed script); ``scope="job"``
    (default) kills the script and every process it started (its process group), as a machine
    going down does; ``"process"`` only the process that reached the moment (the rest of the
    job is killed once the script's own process has ended). A script that ends before the
    moment comes returns ``killed=False``. ``timeout`` (seconds) ends a hung run: every process
    is killed and ``TimeoutError`` raised.

    >>> from tardigrade.testing import kill_during
    >>> r = kill_during("train.py", ["--steps", "50"], at="commit", nth=2)  # doctest: +SKIP
    >>> r.killed, r.where  # doctest: +SKIP
    (True, 'commit #2: 318 of 637 bytes of /.../ckpt/.tmp-step-000000010-.../manifest.json')
    """
    if (script is None) == (code is None):
        raise InvalidArgumentError("pass a script path or code=..., exactly one of them")
    if at not in (RANDOM, *MOMENTS):
        raise InvalidArgumentError(f"at must be one of {[RANDOM, *MOMENTS]}, got {at!r}")
    lo, hi = within
    if not 0 <= lo <= hi:
        raise InvalidArgumentError(
            f"within must be (low, high) seconds, 0 <= low <= high: {within}"
        )
    report = tempfile.mkdtemp(prefix="tardigrade-kill-")
    try:
        point = KillPoint(
            at="never" if at == RANDOM else at,
            nth=nth,
            after_bytes=after_bytes,
            op=op,
            phase=phase,
            rank=rank,
            scope=scope,
            report=report,
        )
        child_env = dict(os.environ)
        child_env.update(env or {})
        child_env[ENV] = point.to_env()
        delay = random.Random(seed).uniform(lo, hi) if at == RANDOM else None
        result = _run(script, tuple(args), code, child_env, cwd, timeout, report, delay)
        if not result.killed and at not in ("never", RANDOM):
            note = _never_came(at, op, nth, after_bytes, result.counts)
            if note is not None:
                result = dataclasses.replace(result, note=note)
                warn_user(f"kill_during: not killed: {note}")
        return result
    finally:
        shutil.rmtree(report, ignore_errors=True)


# The count each moment is numbered by (see _killpoint), to tell why a moment never came.
_COUNTED_BY = {"staging": "begin", "commit": "commit", "committed": "commit", "phase": "phase"}


def _never_came(
    at: str, op: str | None, nth: int, after_bytes: int | None, counts: dict[str, int]
) -> str | None:
    """Why a script that ran to its end was not killed at the moment asked for, or None."""
    made = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if k not in ("bytes",))
    if at == "write":
        done = counts.get("bytes", 0)
        if after_bytes is not None and done < after_bytes:
            return (
                f"the script wrote {done} bytes of checkpoint data, fewer than after_bytes="
                f"{after_bytes}; ask for at most {done}"
            )
        return None
    kind = op if at == "operation" and op is not None else _COUNTED_BY.get(at, "operation")
    done = counts.get(kind, 0)
    if done >= nth:
        return None
    if done == 0:
        return (
            f"the script made no {kind!r} operation (its storage made: {made or 'none'}); a "
            "local directory's saves make begin, open_writer and commit, a store's open_writer, "
            "put, stat and list: ask for one the script makes"
        )
    return f"the script made {done} {kind!r} operation(s), fewer than nth={nth}"


def _run(
    script: str | os.PathLike[str] | None,
    args: tuple[str, ...],
    code: str | None,
    env: dict[str, str],
    cwd: str | os.PathLike[str] | None,
    timeout: float,
    report: str,
    delay: float | None,
) -> KillResult:
    argv = [sys.executable, *(["-c", code] if code is not None else [os.fspath(script or "")])]
    out_path, err_path = Path(report, "stdout"), Path(report, "stderr")
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        # A session of its own: the whole job is one process group, killed as one.
        proc = subprocess.Popen(
            [*argv, *args], stdout=out, stderr=err, env=env, cwd=cwd, start_new_session=True
        )
    deadline = time.monotonic() + timeout
    sent: str | None = None
    try:
        if delay is not None:
            sent = _kill_after(proc, report, delay, deadline)
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            proc.wait()
            raise TimeoutError(
                f"kill_during: {script or 'code'} still ran after {timeout} s; every process of "
                f"it was killed. Output:\n{_text(out_path, err_path)[-4000:]}"
            ) from None
    finally:
        # Nothing of the job outlives it (ranks of a job whose launcher died, say), and
        # nothing of it still runs when the caller looks at what it left on disk.
        _kill_group(proc.pid)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _wait_gone(proc.pid)
    record: dict[str, Any] = {}
    killed_file = Path(report, KILLED_FILE)
    if killed_file.exists():
        record = json.loads(killed_file.read_text() or "{}")
    else:
        # Not killed: the counts of the process that did the most (a launcher does nothing
        # with storage; its ranks do).
        exits = [json.loads(p.read_text()) for p in Path(report).glob("exit-*.json")]
        exits.sort(key=lambda r: (r["counts"].get("operation", 0), r["pid"] == proc.pid))
        record = exits[-1] if exits else {}
    stdout = out_path.read_bytes().decode(errors="replace")
    stderr = err_path.read_bytes().decode(errors="replace")
    where = record.get("where")
    if sent is not None and proc.returncode == -signal.SIGKILL:
        where = sent
    return KillResult(
        killed=where is not None,
        where=where,
        returncode=proc.returncode,
        counts=dict(record.get("counts", {})),
        rank=record.get("rank"),
        stdout=stdout,
        stderr=stderr,
    )


def _kill_after(
    proc: subprocess.Popen[bytes], report: str, delay: float, deadline: float
) -> str | None:
    """SIGKILL the job ``delay`` s after its first process imported tardigrade; the words
    for where, or None if it ended before."""
    while not any(n.startswith("ready-") for n in os.listdir(report)):
        if proc.poll() is not None or time.monotonic() > deadline:
            return None
        time.sleep(0.005)
    try:
        proc.wait(timeout=delay)
        return None  # it finished first
    except subprocess.TimeoutExpired:
        pass
    _kill_group(proc.pid)
    return f"random time: {delay:.3f} s after import tardigrade"


def _group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``, from /proc."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
            members.append(int(entry))
    return members


def _wait_gone(pgid: int, grace: float = 60.0) -> None:
    """Wait until every process of the killed group ``pgid`` has exited (a SIGKILLed process
    may finish the system call it is in, e.g. a write); each waits at most ``grace`` s."""
    if not os.path.isdir("/proc") or not hasattr(os, "pidfd_open"):
        return
    for pid in _group_members(pgid):
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            continue  # gone already
        try:
            select.select([fd], [], [], grace)
        finally:
            os.close(fd)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _text(*paths: Path) -> str:
    return "".join(p.read_bytes().decode(errors="replace") for p in paths if p.exists())
