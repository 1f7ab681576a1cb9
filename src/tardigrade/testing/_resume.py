"""``assert_resumes_exactly``: a killed-and-resumed run must equal an uninterrupted one, bit for bit.

The protocol between the harness and the training script is three environment variables, read
through three helpers that do nothing when they are not set (the script runs as usual then):

- ``TARDIGRADE_TEST_CHECKPOINTS`` (:func:`checkpoint_dir`): where the script keeps its
  checkpoints and resumes from. Each scenario gets a fresh one, kept across its runs.
- ``TARDIGRADE_TEST_LOSSES`` (:func:`log_loss`): a text file; the script appends one line per
  training step, ``STEP LOSS`` (the loss as ``float.hex`` or ``repr``: exact). Rank 0 only.
- ``TARDIGRADE_TEST_FINAL`` (:func:`save_final`): where the script, once it trained to the
  end, saves its final state with ``tg.save(..., overwrite=True)``.

A script that follows it::

    import tardigrade as tg
    from tardigrade.testing import checkpoint_dir, log_loss, save_final

    mgr = tg.CheckpointManager(checkpoint_dir("ckpt"), state, every_steps=5)
    start = mgr.restore()
    for step in range(1 if start is None else start + 1, 51):
        loss = train_one_step()
        log_loss(step, loss)
        mgr.step(step)
    mgr.close()
    save_final(state)
"""

from __future__ import annotations

import math
import os
import random
import shutil
import struct
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import InvalidArgumentError
from ._kill import KillResult, kill_during

__all__ = ["ResumeReport", "assert_resumes_exactly", "checkpoint_dir", "log_loss", "save_final"]

CHECKPOINTS_ENV = "TARDIGRADE_TEST_CHECKPOINTS"
LOSSES_ENV = "TARDIGRADE_TEST_LOSSES"
FINAL_ENV = "TARDIGRADE_TEST_FINAL"

# The moments drawn for ``kills=N`` (see kill_during), each where the reference run has some.
_DRAWN = ("write", "staging", "commit", "committed", "operation")
_COUNT_OF = {
    "write": "bytes",
    "staging": "begin",
    "commit": "commit",
    "committed": "commit",
    "operation": "operation",
}


def checkpoint_dir(default: str | os.PathLike[str]) -> str:
    """Where to keep checkpoints: the harness's directory under ``assert_resumes_exactly``,
    else ``default``."""
    return os.environ.get(CHECKPOINTS_ENV) or os.fspath(default)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def log_loss(step: int, loss: Any) -> None:
    """Append ``STEP LOSS`` to the harness's loss log (a float or 0-d tensor; rank 0 only).

    Does nothing outside ``assert_resumes_exactly``.
    """
    path = os.environ.get(LOSSES_ENV)
    if not path or _rank() != 0:
        return
    value = float(loss.detach() if hasattr(loss, "detach") else loss)
    # One write per line, flushed: a SIGKILL leaves whole lines (at most the last one cut).
    with open(path, "a") as f:
        f.write(f"{int(step)} {value.hex()} {value!r}\n")


def save_final(state: Any) -> None:
    """Save the final state where the harness compares it (collective in a distributed job).

    Does nothing outside ``assert_resumes_exactly``.
    """
    path = os.environ.get(FINAL_ENV)
    if path:
        import tardigrade as tg

        from ._killpoint import uncounted

        # Training has ended: this save is the harness's, no moment to draw a kill at.
        with uncounted():
            tg.save(path, state, overwrite=True)


@dataclass(frozen=True)
class ResumeReport:
    """What :func:`assert_resumes_exactly` ran: the reference run's steps and storage counts,
    and per scenario the kills (each a :class:`KillResult`), all of which matched."""

    steps: int
    counts: dict[str, int]
    scenarios: list[list[KillResult]] = field(default_factory=list)


def assert_resumes_exactly(
    script: str | os.PathLike[str] | None = None,
    args: Sequence[str] = (),
    *,
    code: str | None = None,
    kills: int | Sequence[Mapping[str, Any] | Sequence[Mapping[str, Any]]] = 3,
    seed: int = 0,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float = 600.0,
    keep: str | os.PathLike[str] | None = None,
) -> ResumeReport:
    """Assert that killing a training script with SIGKILL and restarting it changes nothing.

    Runs the script (a file, or ``code=``; with the command-line ``args``) once uninterrupted, then, per scenario,
    from an empty checkpoint directory: killed by :func:`kill_during`, restarted (killed again
    if the scenario says so) and run to the end. Every loss logged by any run and the final
    state must equal the uninterrupted run's bit for bit (tensors, floats, ints, strings, the
    structure), and the runs together must log every step. The script follows the protocol of
    this module (:func:`checkpoint_dir`, :func:`log_loss`, :func:`save_final`).

    ``kills``: an int draws that many one-kill scenarios from the uninterrupted run's storage
    counts with ``seed`` (a random byte count, staging, commit, just committed, or a random
    storage operation; of a distributed script, in the rank that did the most); or a list of scenarios, each the ``kill_during`` keywords of one kill
    (``{"at": "commit", "nth": 2}``) or a list of them (killed once per item, in a row).
    ``keep``: a directory that keeps every run's files (else a temporary one, removed when
    the assertion holds and named in the message when it fails).

    Raises AssertionError naming the scenario, the kill and the first difference: the step and
    both losses, or the path in the state and both values. Returns a :class:`ResumeReport`.

    >>> from tardigrade.testing import assert_resumes_exactly
    >>> assert_resumes_exactly("train.py", kills=[{"at": "commit", "nth": 2}])  # doctest: +SKIP
    """
    if (script is None) == (code is None):
        raise InvalidArgumentError("pass a script path or code=..., exactly one of them")
    name = os.fspath(script) if script is not None else "the code"
    root = Path(keep) if keep is not None else Path(tempfile.mkdtemp(prefix="tardigrade-resume-"))
    root.mkdir(parents=True, exist_ok=True)
    run = _Runs(script, tuple(args), code, env, cwd, timeout, root, name)
    ref = run.one("uninterrupted", "reference", {"at": "never"})
    if ref.returncode != 0:
        run.fail(f"the uninterrupted run failed (exit status {ref.returncode}):\n{ref.tail()}")
    want = run.losses(["reference"], complete=True)
    if not want:
        run.fail(f"the uninterrupted run logged no loss (log_loss / ${LOSSES_ENV})")
    final = run.final("reference")
    if final is None:
        run.fail(f"the uninterrupted run saved no final state (save_final / ${FINAL_ENV})")
    scenarios = _scenarios(kills, ref.counts, ref.rank, seed, run)
    report = ResumeReport(steps=len(want), counts=dict(ref.counts))
    for i, scenario in enumerate(scenarios):
        label = f"scenario {i}"
        results = []
        runs = []
        for j, point in enumerate(scenario):
            tag = f"s{i}-kill{j}"
            r = run.one(label, tag, point)
            if not r.killed:
                run.fail(
                    f"{label}: kill point {dict(point)} was never reached (the run ended with "
                    f"exit status {r.returncode}); pick an earlier moment:\n{r.tail()}"
                )
            results.append(r)
            runs.append(tag)
        tag = f"s{i}-resumed"
        done = run.one(label, tag, {"at": "never"})
        runs.append(tag)
        how = "; then ".join(f"killed at {r.where}" for r in results)
        if done.returncode != 0:
            run.fail(
                f"{label}: {how}; the resumed run failed (exit status {done.returncode}):\n"
                f"{done.tail()}"
            )
        got = run.losses(runs, complete=False)
        for step, value in sorted(got):
            if step not in want:
                run.fail(
                    f"{label}: {how}; a run logged step {step}, which the uninterrupted run never did"
                )
            if _bits(value) != _bits(want[step]):
                run.fail(
                    f"{label}: {how}; resumed, the loss of step {step} is {value!r}, the "
                    f"uninterrupted run's is {want[step]!r}"
                )
        missing = sorted(set(want) - {s for s, _ in got})
        if missing:
            run.fail(f"{label}: {how}; no run logged step(s) {missing[:10]}")
        diff = _first_difference(run.final(tag), final, "state")
        if diff is not None:
            hint = ""
            if "rng" in diff.lower() or "random" in diff.lower():
                hint = (
                    " (if the script does not seed every RNG it saves, e.g. random.seed, "
                    "np.random.seed, torch.manual_seed, any two runs differ there)"
                )
            run.fail(
                f"{label}: {how}; resumed, the final state differs from the uninterrupted "
                f"run's: {diff}{hint}"
            )
        report.scenarios.append(results)
    if keep is None:
        shutil.rmtree(root, ignore_errors=True)
    return report


class _Runs:
    """The runs of one assertion: each with its own loss log and final state under ``root``."""

    def __init__(
        self,
        script: Any,
        args: tuple[str, ...],
        code: str | None,
        env: Mapping[str, str] | None,
        cwd: Any,
        timeout: float,
        root: Path,
        name: str,
    ) -> None:
        self.script, self.args, self.code = script, args, code
        self.env, self.cwd, self.timeout = dict(env or {}), cwd, timeout
        self.root, self.name = root, name

    def one(self, label: str, tag: str, point: Mapping[str, Any]) -> KillResult:
        scenario = tag.split("-")[0]
        env = {
            **self.env,
            CHECKPOINTS_ENV: str(self.root / scenario / "checkpoints"),
            LOSSES_ENV: str(self.root / f"{tag}.losses"),
            FINAL_ENV: str(self.root / f"{tag}.final"),
        }
        (self.root / scenario).mkdir(exist_ok=True)
        return kill_during(
            self.script,
            self.args,
            code=self.code,
            env=env,
            cwd=self.cwd,
            timeout=self.timeout,
            **point,
        )

    def losses(self, tags: list[str], *, complete: bool) -> Any:
        """The losses the runs ``tags`` logged: a dict step -> loss for one complete run, else
        a list of (step, loss)."""
        out: list[tuple[int, float]] = []
        for tag in tags:
            path = self.root / f"{tag}.losses"
            text = path.read_text() if path.exists() else ""
            lines = text.splitlines()
            if text and not text.endswith("\n"):
                lines = lines[:-1]  # cut by the kill
            for line in lines:
                parts = line.split()
                try:
                    step, value = int(parts[0]), _parse(parts[1])
                except (IndexError, ValueError):
                    self.fail(f"{path}: not a 'STEP LOSS' line: {line!r}")
                out.append((step, value))
        if not complete:
            return out
        steps = [s for s, _ in out]
        if len(set(steps)) != len(steps):
            self.fail(f"the uninterrupted run logged some steps twice: {sorted(steps)[:20]}...")
        return dict(out)

    def final(self, tag: str) -> Any:
        import tardigrade as tg

        path = self.root / f"{tag}.final"
        return tg.load(path) if path.exists() else None

    def fail(self, message: str) -> Any:
        raise AssertionError(
            f"assert_resumes_exactly({self.name}): {message}\n(the runs' files: {self.root})"
        )


def _parse(text: str) -> float:
    return float.fromhex(text) if "0x" in text.lower() else float(text)


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


def _scenarios(
    kills: int | Sequence[Mapping[str, Any] | Sequence[Mapping[str, Any]]],
    counts: Mapping[str, int],
    rank: int | None,
    seed: int,
    run: _Runs,
) -> list[list[Mapping[str, Any]]]:
    if isinstance(kills, int) and not isinstance(kills, bool):
        if kills < 1:
            raise InvalidArgumentError(f"kills must be at least 1, got {kills}")
        moments = [m for m in _DRAWN if counts.get(_COUNT_OF[m], 0) > 0]
        if not moments:
            run.fail(
                "the uninterrupted run wrote nothing to checkpoint storage, so there is no "
                f"moment to kill it at (counts: {dict(counts)})"
            )
        rng = random.Random(seed)
        drawn: list[list[Mapping[str, Any]]] = []
        for _ in range(kills):
            at = rng.choice(moments)
            n = rng.randint(1, counts[_COUNT_OF[at]])
            point: dict[str, Any] = {"at": at, "rank": rank}
            point.update({"after_bytes": n} if at == "write" else {"nth": n})
            drawn.append([point])
        return drawn
    if isinstance(kills, bool):
        raise InvalidArgumentError(
            f"kills must be a number of kills or a list of kill points, got {kills!r}"
        )
    out: list[list[Mapping[str, Any]]] = []
    for item in kills:
        out.append([item] if isinstance(item, Mapping) else list(item))
    if not out:
        raise InvalidArgumentError("kills is empty: give at least one scenario")
    return out


def _first_difference(got: Any, want: Any, path: str) -> str | None:
    """Where ``got`` first differs from ``want`` (bit for bit, types included), or None."""
    import numpy as np
    import torch

    if type(got) is not type(want):
        return f"{path}: {type(got).__name__} != {type(want).__name__} (uninterrupted)"
    if isinstance(want, torch.Tensor):
        if got.dtype != want.dtype or got.shape != want.shape:
            return f"{path}: {got.dtype}{list(got.shape)} != {want.dtype}{list(want.shape)}"
        a = got.contiguous().reshape(-1).view(torch.uint8)
        b = want.contiguous().reshape(-1).view(torch.uint8)
        if not torch.equal(a, b):
            flat_g, flat_w = got.reshape(-1), want.reshape(-1)
            i = int((a != b).nonzero()[0, 0]) // max(1, want.element_size())
            return (
                f"{path}: tensors differ, first at flat index {i}: {flat_g[i].item()!r} != "
                f"{flat_w[i].item()!r} (uninterrupted)"
            )
        return None
    if isinstance(want, np.ndarray):
        if got.dtype != want.dtype or got.shape != want.shape or got.tobytes() != want.tobytes():
            return f"{path}: arrays differ"
        return None
    if isinstance(want, float):
        if _bits(got) != _bits(want) and not (math.isnan(got) and math.isnan(want)):
            return f"{path}: {got!r} != {want!r} (uninterrupted)"
        return None
    if isinstance(want, dict):
        if list(got) != list(want):
            return f"{path}: keys {list(got)} != {list(want)} (uninterrupted)"
        for k in want:
            d = _first_difference(got[k], want[k], f"{path}[{k!r}]")
            if d is not None:
                return d
        return None
    if isinstance(want, (list, tuple)):
        if len(got) != len(want):
            return f"{path}: length {len(got)} != {len(want)} (uninterrupted)"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            d = _first_difference(g, w, f"{path}[{i}]")
            if d is not None:
                return d
        return None
    if got != want:
        return f"{path}: {got!r} != {want!r} (uninterrupted)"
    return None
