"""Soak: SIGKILL checkpointing jobs at random moments, resume every time, check after every kill.

    python tests/soak/soak.py --kills 1000 --seed 1          (``make soak``)

Each cycle starts a job, on one process or on two gloo ranks, that resumes from its directory
with a ``CheckpointManager`` (synchronous or asynchronous saves, up to two in flight, half the
single-process asynchronous ones copying the state beside training (``overlap``: an optimizer
updates part of it), retention ``keep_last`` 1-3 or none, a save every 1-3 steps, chosen per cycle; sometimes ``restore(step)`` of an older
checkpoint, which abandons the later ones), trains a few steps of a deterministic update
(in-place, so an async save must hold the values of its own step) and sometimes ends with
``tardigrade gc``. Most cycles are SIGKILLed, the whole job at once, at a random moment: a
storage moment counted by ``tardigrade.testing``'s kill points (after N bytes, a save's
staging, inside a commit, just after one, before the Nth storage operation; on either rank),
the Nth Python line inside the cleanup (``gc``, and the manager's own at restore) or inside
retention, or a random time. A share of the two-rank kills ends one rank only: the other must
fail with a Tardigrade error, without hanging. Once every process of the job is gone (never
while one still runs), the driver checks the directory:

- every visible checkpoint verifies and holds exactly the state of its step (the update is a
  function of the step alone, computed here uninterrupted);
- the newest checkpoint the job reported committed, or a newer one, is still there;
- the next job's ``restore()`` resumes from the newest visible checkpoint (on every rank), or
  ``restore(step)`` from that step; a checkpoint of an abandoned timeline is never visible
  again;
- leftovers do not pile up and nothing else appears in the directory; a job that was not
  killed exits 0 and no save fails.

Jobs are forked from a zygote process that imported torch once (a fresh interpreter costs
seconds), each in a process group of its own, and the zygote is a child subreaper, so it reaps
every process of a job before it reports. ``tests/faults/test_soak.py`` runs 50 kills of this in
``make test``.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

N = 16384  # elements of w and m
P_N = 4096  # elements of the parameter an optimizer updates (one process)
# Elements of "frozen" (never changes: one shared object every checkpoint references) and
# "slow" (changes every 2nd step: objects written, referenced again, then swept): over 1 MiB
# of float32 each, so a single process's saves share them (format 7).
SHARED_N = 300_000
ROWS, COLS = 48, 64  # the sharded table of the two-rank jobs
STEP_NAME = re.compile(r"^step-(\d{9,})$")
ABANDONED_NAME = re.compile(r"^step-(\d{9,})\.abandoned-[0-9T]+(-\d+)?$")
MOMENTS = ("operation", "write", "staging", "commit", "committed", "random", "gc", "retention")
# How often each moment is drawn.
WEIGHTS = (25, 15, 10, 10, 10, 15, 8, 7)
# Python functions whose lines the "gc" and "retention" moments count, with all they call (the
# local cleanup removes directories with os calls, which the storage kill points do not see).
TRACED = {
    "gc": ["storage.local.LocalStorage.tidy", "_catalog.Catalog.sweep_shared"],
    "retention": ["manager._retainer.Retainer.retain"],
}


# -- the training job (runs in processes forked from the zygote) -----------------------------


def rows_of(rank: int, world: int) -> tuple[int, int]:
    return rank * ROWS // world, (rank + 1) * ROWS // world


def make_state(rank: int, world: int) -> dict[str, Any]:
    import torch

    import tardigrade as tg

    # "saved_by": the cycle whose job saved a checkpoint (set after each restore).
    state: dict[str, Any] = {"w": torch.zeros(N), "m": torch.zeros(N), "step": 0, "saved_by": 0}
    state.update(frozen=torch.arange(SHARED_N, dtype=torch.float32), slow=torch.zeros(SHARED_N))
    if world == 1:
        state["rng"] = tg.RNGState()
        # Updated by an optimizer's step() alone: what an overlapped save copies beside
        # training, fenced by that step (the rest of the state is snapshotted first).
        state["p"] = torch.zeros(P_N, requires_grad=True)
        state["opt"] = torch.optim.SGD([state["p"]], lr=0.1, momentum=0.9)
    else:
        lo, hi = rows_of(rank, world)
        state["emb"] = tg.Sharded(torch.zeros(hi - lo, COLS), (lo, 0), (ROWS, COLS))
    return state


def advance(state: dict[str, Any], step: int, rank: int, world: int, g0: Any = None) -> None:
    """One training step, in place. One process also draws from the global torch RNG (which
    the checkpoint's ``tg.RNGState`` restores); ``g0`` stands in for it in the driver."""
    import torch

    g = torch.Generator().manual_seed(step)
    noise = torch.randn(N, generator=g)
    if world == 1:
        noise += 1e-3 * (torch.randn(N, generator=g0) if g0 is not None else torch.randn(N))
    state["m"].mul_(0.9).add_(noise)
    state["w"].sub_(0.01 * state["m"])
    state["slow"].fill_(float(step // 2))
    if world == 1:
        state["p"].grad = torch.randn(P_N, generator=torch.Generator().manual_seed(10**6 + step))
        state["opt"].step()
    if world > 1:
        table = torch.randn(ROWS, COLS, generator=g)
        emb = state["emb"]
        lo, hi = rows_of(rank, world) if hasattr(emb, "local") else (0, ROWS)
        (emb.local if hasattr(emb, "local") else emb).add_(table[lo:hi])
    state["step"] = step


def run_job(cfg: dict[str, Any], rank: int) -> None:
    """One rank of one cycle's job; returns normally only when it trained to its end."""
    import torch
    import torch.distributed as dist

    import tardigrade as tg
    from tardigrade.cli import main as cli
    from tardigrade.testing import _killpoint

    world = cfg["world"]
    torch.set_num_threads(1)
    if world > 1:
        timeout = datetime.timedelta(seconds=cfg["timeout"])
        store = dist.FileStore(cfg["store"], world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    if cfg["kill"] is not None:
        point = {"scope": "job", **cfg["kill"]}
        _killpoint.install(_killpoint.KillPoint(**point, report=cfg["report"]))
    fd = os.open(f"{cfg['progress']}.{rank}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def note(line: str) -> None:
        os.write(fd, f"{line}\n".encode())

    traced_lines = arm_trace(cfg["trace"], note) if cfg["trace"] and rank == 0 else None

    recorded = 0

    def record(mgr: Any) -> None:
        nonlocal recorded
        for s in mgr.stats[recorded:]:
            note(f"committed {s.step}" if s.ok else f"failed {s.step} {s.error}")
        recorded = len(mgr.stats)

    if cfg["sabotage"] and rank == 0:
        sabotage(cfg["sabotage"], cfg["dir"])
    state = make_state(rank, world)
    note("phase open")
    mgr = tg.CheckpointManager(
        cfg["dir"],
        state,
        every_steps=cfg["every"],
        keep_last=cfg["keep_last"],
        async_save=cfg["async"],
        overlap=cfg["overlap"],
        timeout=cfg["timeout"],
    )
    note("phase restore")
    steps = mgr.steps() if cfg["rewind"] else []
    if len(steps) >= 2:
        # Go back to an older checkpoint: the later ones become an abandoned timeline, moved
        # aside on disk, so that a crash from here on resumes from this timeline.
        target = steps[(len(steps) - 1) // 2]
        note(f"rewinding {target}")
        start = mgr.restore(target)
    else:
        start = mgr.restore()
    note(f"restored {start}")
    state["saved_by"] = cfg["cycle"]
    if start is None:
        torch.manual_seed(0)
    begin = start or 0
    note("phase train")
    for step in range(begin + 1, begin + 1 + cfg["steps"]):
        advance(state, step, rank, world)
        mgr.step(step)
        record(mgr)
    note("phase close")
    mgr.close()
    record(mgr)
    if cfg["gc"] and rank == 0:
        note("phase gc")
        status = cli(["gc", cfg["dir"]])
        if status != 0:
            raise RuntimeError(f"tardigrade gc exited {status}")
    note("phase done")
    if (cfg["kill"] is not None and rank == (cfg["kill"]["rank"] or 0)) or traced_lines:
        # The kill point never came: how much this cycle did tells the driver what to draw.
        with open(os.path.join(cfg["report"], "completed.json"), "w") as f:
            json.dump({**_killpoint.counts(), "lines": traced_lines() if traced_lines else 0}, f)
    if world > 1:
        dist.destroy_process_group()


def arm_trace(spec: dict[str, Any], note: Any) -> Any:
    """SIGKILL the job at the ``nth`` Python line run inside the functions of ``TRACED[in]``
    (and what they call: ``shutil.rmtree``'s loop, ...); returns how many lines ran so far."""
    import functools

    import tardigrade

    lines = 0

    def local(frame: Any, event: str, arg: Any) -> Any:
        nonlocal lines
        if event == "line":
            lines += 1
            if lines == spec["nth"]:
                note(f"phase {spec['in']}")
                os.killpg(0, signal.SIGKILL)
        return local

    def wrap(fn: Any) -> Any:
        @functools.wraps(fn)
        def traced(*args: Any, **kw: Any) -> Any:
            old = sys.gettrace()
            sys.settrace(lambda frame, event, arg: local)
            try:
                return fn(*args, **kw)
            finally:
                sys.settrace(old)

        return traced

    for dotted in TRACED[spec["in"]]:
        *path, name = dotted.split(".")
        owner: Any = tardigrade
        for part in path:
            owner = getattr(owner, part, None)
        if owner is not None and hasattr(owner, name):
            setattr(owner, name, wrap(getattr(owner, name)))
    return lambda: lines


def sabotage(how: str, directory: str) -> None:
    """Break the directory as a bug would (the soak's own test: its checks must see it)."""
    steps = (
        sorted(n for n in os.listdir(directory) if STEP_NAME.match(n))
        if os.path.isdir(directory)
        else []
    )
    if how == "revive-abandoned" and steps:
        # Put a checkpoint of an abandoned timeline back in view, where its step is free.
        for n in sorted(os.listdir(directory)):
            m = ABANDONED_NAME.match(n)
            if m and not os.path.exists(os.path.join(directory, n.split(".")[0])):
                os.rename(os.path.join(directory, n), os.path.join(directory, n.split(".")[0]))
                return
        return
    if not steps:
        return
    newest = os.path.join(directory, steps[-1])
    if how == "drop-newest":
        shutil.rmtree(newest)
    elif how == "flip-byte":
        data = sorted(n for n in os.listdir(newest) if n.endswith(".safetensors"))[0]
        with open(os.path.join(newest, data), "r+b") as f:
            f.seek(-1, os.SEEK_END)
            b = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([b[0] ^ 1]))
    else:
        raise ValueError(f"unknown sabotage {how!r}")


def zygote() -> None:
    """Import once, then fork one job per request line; report when all of it is gone."""
    import ctypes

    import torch
    import torch.distributed

    import tardigrade
    import tardigrade.cli
    import tardigrade.testing._killpoint  # noqa: F401

    torch.set_num_threads(1)
    # An optimizer's first step imports and sets up what later ones reuse (a second or more):
    # done here once, or every job would spend it in its first step instead of in its saves,
    # where the kills are meant to land.
    p = torch.zeros(4, requires_grad=True)
    p.grad = torch.ones(4)
    torch.optim.SGD([p], lr=0.1, momentum=0.9).step()
    pr_set_child_subreaper = 36
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_set_child_subreaper, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        cfg = json.loads(line)
        started = time.monotonic()
        leader = os.fork()
        if leader == 0:
            _job_process(cfg)  # never returns
        # The job's own process group, made on both sides of the fork (whichever runs first),
        # so that a kill right after the fork cannot miss it.
        try:
            os.setpgid(leader, leader)
        except OSError:
            pass
        killed_by_delay = hung = False
        pidfd = os.pidfd_open(leader)
        try:
            wait = cfg["delay"] if cfg["delay"] is not None else cfg["hang"]
            if not select.select([pidfd], [], [], wait)[0]:
                # The leader is not reaped yet, so its group is this job's: kill it all.
                os.killpg(leader, signal.SIGKILL)
                killed_by_delay = cfg["delay"] is not None
                hung = not killed_by_delay
        finally:
            os.close(pidfd)
        status = None
        while True:  # every process of the job: the leader and, reparented here, its ranks
            try:
                pid, st = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            if pid == leader:
                status = st
        assert status is not None
        report = {
            "returncode": -os.WTERMSIG(status)
            if os.WIFSIGNALED(status)
            else os.WEXITSTATUS(status),
            "killed_by_delay": killed_by_delay,
            "hung": hung,
            "seconds": time.monotonic() - started,
        }
        out.write(json.dumps(report) + "\n")
        out.flush()


def _job_process(cfg: dict[str, Any]) -> None:
    code = 1
    try:
        os.setpgid(0, 0)
        log = os.open(cfg["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # requests are the zygote's alone
        rank = 0
        child = os.fork() if cfg["world"] > 1 else None
        if child == 0:
            rank = 1
        run_job(cfg, rank)
        code = 0
        if child:
            _, st = os.waitpid(child, 0)
            code = 0 if st == 0 else 1
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
    finally:
        os._exit(code)


# -- the driver ------------------------------------------------------------------------------


@dataclass
class Reference:
    """The uninterrupted run, step by step, as digests of what a checkpoint must hold."""

    world: int
    digests: list[str] = field(default_factory=list)
    state: Any = None
    g0: Any = None

    def digest(self, step: int) -> str:
        import torch

        if self.state is None:
            self.state = {"w": torch.zeros(N), "m": torch.zeros(N), "step": 0}
            self.state.update(
                frozen=torch.arange(SHARED_N, dtype=torch.float32), slow=torch.zeros(SHARED_N)
            )
            if self.world > 1:
                self.state["emb"] = torch.zeros(ROWS, COLS)
            else:
                self.state["p"] = torch.zeros(P_N, requires_grad=True)
                self.state["opt"] = torch.optim.SGD([self.state["p"]], lr=0.1, momentum=0.9)
            self.g0 = torch.Generator().manual_seed(0)
            self.digests.append(state_digest(self.state))
        while len(self.digests) <= step:
            advance(self.state, len(self.digests), 0, self.world, self.g0)
            self.digests.append(state_digest(self.state))
        return self.digests[step]


def state_digest(tree: dict[str, Any]) -> str:
    """Of a live state or a loaded one (its optimizer then a plain state dict)."""
    h = hashlib.sha256()
    for key in ("w", "m", "emb", "frozen", "slow", "p"):
        if key in tree:
            h.update(key.encode())
            h.update(tree[key].detach().contiguous().numpy().tobytes())
    if "opt" in tree:
        opt = tree["opt"]
        per_param = (opt.state_dict() if hasattr(opt, "state_dict") else opt)["state"]
        buf = per_param.get(0, {}).get("momentum_buffer")
        h.update(b"momentum" + (b"" if buf is None else buf.numpy().tobytes()))
    h.update(str(tree["step"]).encode())
    return h.hexdigest()


@dataclass
class Soak:
    """What a soak did and found."""

    kills: int = 0
    cycles: int = 0
    # Cycles killed at a storage moment (after N bytes, staging, ...) or at a random time.
    completed: int = 0  # cycles whose kill point never came: the job ended normally
    by_moment: Counter[str] = field(default_factory=Counter)
    by_world: Counter[int] = field(default_factory=Counter)
    by_mode: Counter[str] = field(default_factory=Counter)  # sync / async / overlap saves
    by_phase: Counter[str] = field(default_factory=Counter)  # what the job was doing
    resumes_checked: int = 0
    rewinds: int = 0  # restore(older step) began a new timeline
    max_abandoned: int = 0  # checkpoints of abandoned timelines set aside at once
    checkpoints_verified: int = 0
    max_leftovers: int = 0
    max_unreferenced: int = 0  # shared objects no visible checkpoint references, at a check
    shared_swept: int = 0  # such objects a final sweep removed (every checkpoint still whole)
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        return (
            f"{self.kills} kills in {self.cycles} cycles ({self.completed} ran to the end), "
            f"{self.seconds:.0f} s; by moment {dict(self.by_moment)}; by world size "
            f"{dict(self.by_world)}; by saves {dict(self.by_mode)}; by phase "
            f"{dict(self.by_phase)}; {self.resumes_checked} resumes checked ({self.rewinds} "
            f"rewinds, at most {self.max_abandoned} abandoned set aside), "
            f"{self.checkpoints_verified} checkpoint verifications, at most "
            f"{self.max_leftovers} leftovers and {self.max_unreferenced} unreferenced shared "
            f"objects ({self.shared_swept} swept at the end); {len(self.problems)} problem(s)"
        )


class Zygote:
    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline()
        if first.strip() != "ready":
            raise RuntimeError(f"the soak's zygote did not start: {first!r}")

    def run(self, cfg: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cfg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the soak's zygote died (exit {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def mode_of(cfg: dict[str, Any]) -> str:
    """How the cycle's job saved: sync, async, or async with overlap."""
    return "overlap" if cfg["overlap"] else "async" if cfg["async"] else "sync"


def run_soak(
    kills: int,
    *,
    seed: int = 0,
    workdir: str | os.PathLike[str] | None = None,
    two_rank_share: float = 0.35,
    rank_death_share: float = 0.1,
    rewind_share: float = 0.1,
    max_cycles: int | None = None,
    sabotage: str | None = None,
    log: Any = None,
) -> Soak:
    """Kill jobs until ``kills`` SIGKILLs landed (or ``max_cycles`` ran); return what happened.

    ``rewind_share``: the share of cycles that restore an older checkpoint than the newest
    (``restore(step)``: a new timeline; the later checkpoints are moved aside and never
    resumed from again). ``rank_death_share``: of the two-rank cycles killed at a storage operation, the share
    where only that rank dies (the other must fail within the collective timeout, never hang
    and never commit a partial checkpoint; it exits with an error). ``sabotage``
    (``"drop-newest"``, ``"flip-byte"``) makes every job break its directory
    before it resumes, as a bug would: the soak's own check that its checks find problems.
    """
    import tardigrade as tg

    rng = random.Random(seed)
    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="tardigrade-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",
    }
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(tg.__file__).resolve().parents[1]), *filter(None, [env.get("PYTHONPATH")])]
    )
    soak = Soak()
    refs = {1: Reference(1), 2: Reference(2)}
    ours = {
        n for n, c in vars(tg.errors).items() if isinstance(c, type) and issubclass(c, Exception)
    }
    # Per world size: the newest step known committed, the step the next restore must return,
    # and rough sizes of a cycle (to draw kill moments that land inside one).
    known: dict[int, int | None] = {1: None, 2: None}
    resume_at: dict[int, int | None] = {1: None, 2: None}
    # Per world size: the visible checkpoints at the last check (step -> the cycle that saved
    # it), and the checkpoints of abandoned timelines (step, cycle that saved it).
    seen: dict[int, dict[int, int]] = {1: {}, 2: {}}
    abandoned: dict[int, set[tuple[int, int]]] = {1: set(), 2: set()}
    sizes: dict[int, Counter[str]] = {
        w: Counter(
            {
                "operation": 150,
                "bytes": 1_000_000,
                "begin": 4,
                "commit": 4,
                "gc_lines": 300,
                "retention_lines": 300,
            }
        )
        for w in (1, 2)
    }
    seconds = {1: 0.5, 2: 1.0}  # how long the last cycle that ran to its end took
    started = time.monotonic()
    zyg = Zygote(env)
    try:
        while soak.kills < kills and (max_cycles is None or soak.cycles < max_cycles):
            soak.cycles += 1
            world = 2 if rng.random() < two_rank_share else 1
            d = root / f"world{world}"
            cyc = root / "cycles" / f"{soak.cycles:05d}"
            cyc.mkdir(parents=True)
            # Every moment in turn at first (so that a short soak has each), then at random.
            first = soak.cycles <= 2 * len(MOMENTS)
            moment = (
                MOMENTS[soak.cycles % len(MOMENTS)] if first else rng.choices(MOMENTS, WEIGHTS)[0]
            )
            cfg: dict[str, Any] = {
                "cycle": soak.cycles,
                "world": world,
                "dir": str(d),
                "store": str(cyc / "store"),
                "progress": str(cyc / "progress"),
                "report": str(cyc),
                "log": str(cyc / "log"),
                "steps": rng.randint(3, 10),
                "every": rng.choice([1, 2, 3]),
                "keep_last": rng.choice([1, 2, 3, 3, None]),
                "async": rng.random() < 0.5,
                "gc": rng.random() < 0.3,
                "timeout": 120,
                "hang": 600,
                "delay": None,
                "kill": None,
                "trace": None,
                "rewind": rng.random() < rewind_share,
                "sabotage": sabotage,
            }
            # Half the single-process async cycles copy the state beside training (drawn
            # apart, so the other draws of a seed stay as they were).
            cfg["overlap"] = (
                cfg["async"]
                and world == 1
                and random.Random(seed * 7919 + soak.cycles).random() < 0.5
            )
            kill_rank = rng.randrange(world)
            size = sizes[world]
            if moment == "random":
                cfg["delay"] = rng.uniform(0.0, seconds[world])
            elif moment in ("gc", "retention"):
                cfg["trace"] = {"in": moment, "nth": rng.randint(1, size[f"{moment}_lines"])}
                if moment == "gc":
                    cfg["gc"] = True
                else:
                    cfg["keep_last"] = rng.choice([1, 2])
            elif moment == "write":
                cfg["kill"] = {"at": "write", "after_bytes": rng.randint(1, size["bytes"])}
            elif moment == "operation":
                cfg["kill"] = {"at": "operation", "nth": rng.randint(1, size["operation"])}
            else:
                count = size["begin" if moment == "staging" else "commit"]
                cfg["kill"] = {"at": moment, "nth": rng.randint(1, max(1, count))}
            if cfg["kill"] is not None:
                cfg["kill"]["rank"] = kill_rank if world > 1 else None
            alone = moment == "operation" and world > 1 and rng.random() < rank_death_share
            if alone:
                moment = "rank-death"
                cfg["kill"]["scope"] = "process"
                cfg.update(timeout=10, hang=180)
            out = zyg.run(cfg)
            killed = out["returncode"] == -signal.SIGKILL or (
                alone and (cyc / "killed.json").exists()
            )
            if killed:
                soak.kills += 1
                soak.by_moment[moment] += 1
                soak.by_world[world] += 1
                soak.by_mode[mode_of(cfg)] += 1
            else:
                soak.completed += 1
                seconds[world] = out["seconds"]
            if out["hung"]:
                soak.problems.append(
                    f"cycle {soak.cycles} (world {world}): the job hung ({cfg['hang']} s); "
                    f"{cyc / 'log'}:\n" + _tail(cyc / "log")
                )
            elif alone and killed:
                # The survivor may fail, but only with Tardigrade's own errors (a dead peer is
                # a DistributedError, a save it ends is a SaveError), never a raw one.
                # (the last exception of the log: the one raised; earlier ones are its causes)
                raised = [
                    m.group(1).rsplit(".", 1)[-1]
                    for ln in _lines(cyc / "log")
                    if (m := re.match(r"^([\w.]+(?:Error|Exception)): ", ln))
                ]
                raw = [ln for ln in raised[-1:] if ln not in ours]
                if raw:
                    soak.problems.append(
                        f"cycle {soak.cycles} (world 2, rank {kill_rank} died alone): the "
                        f"survivor raised {raw[0]!r}; {cyc / 'log'}:\n" + _tail(cyc / "log")
                    )
            elif not killed and out["returncode"] != 0:
                soak.problems.append(
                    f"cycle {soak.cycles} (world {world}): the job failed with exit status "
                    f"{out['returncode']} without being killed; {cyc / 'log'}:\n"
                    + _tail(cyc / "log")
                )
            progress = {r: _lines(Path(f"{cfg['progress']}.{r}")) for r in range(world)}
            phases = [ln.split()[1] for ln in progress[0] if ln.startswith("phase ")]
            if killed:
                soak.by_phase[phases[-1] if phases else "start"] += 1
            done = cyc / "completed.json"
            if not killed and done.exists():
                # A cycle the kill point missed: draw the next ones within what it did.
                did = json.loads(done.read_text())
                lines = did.pop("lines")
                if cfg["trace"] is not None:
                    sizes[world][f"{cfg['trace']['in']}_lines"] = max(1, lines)
                else:
                    for k, v in did.items():
                        if k in size:
                            size[k] = v
            _check_cycle(
                soak, cfg, world, d, progress, refs[world], known, resume_at, seen, abandoned, tg
            )
            if soak.problems and log is not None and len(soak.problems) == 1:
                log(f"first problem: {soak.problems[0]}")
            if log is not None and soak.cycles % 50 == 0:
                soak.seconds = time.monotonic() - started
                log(soak.summary())
            if not soak.problems:
                shutil.rmtree(cyc, ignore_errors=True)
    finally:
        zyg.close()
        soak.seconds = time.monotonic() - started
    for world in (1, 2):
        _final_sweep(soak, root / f"world{world}", tg)
    if workdir is None and not soak.problems:
        shutil.rmtree(root, ignore_errors=True)
    return soak


def _check_cycle(
    soak: Soak,
    cfg: dict[str, Any],
    world: int,
    d: Path,
    progress: dict[int, list[str]],
    ref: Reference,
    known: dict[int, int | None],
    resume_at: dict[int, int | None],
    seen: dict[int, dict[int, int]],
    abandoned: dict[int, set[tuple[int, int]]],
    tg: Any,
) -> None:
    where = f"cycle {soak.cycles} (world {world}, kill {cfg['kill'] or cfg['delay']})"
    # The restore of this job resumed from the newest checkpoint the last check saw, or from
    # the older one it rewound to (from then on the newest of the new timeline counts).
    rewound = [int(ln.split()[1]) for ln in progress.get(0, []) if ln.startswith("rewinding ")]
    if rewound:
        soak.rewinds += 1
        known[world] = rewound[0]
        if any(ln.startswith("restored ") for ln in progress.get(0, [])):
            # restore(T) returned: what was newer is an abandoned timeline, never to be seen
            # (and resumed from) again; its steps may be saved anew, by later cycles.
            abandoned[world] |= {(s, by) for s, by in seen[world].items() if s > rewound[0]}
    restored = {
        r: ln.split()[1]
        for r, lines in progress.items()
        for ln in lines
        if ln.startswith("restored ")
    }
    for r, got in restored.items():
        want = str(rewound[0] if rewound else resume_at[world])
        soak.resumes_checked += r == 0
        if got != want:
            soak.problems.append(f"{where}: rank {r} restored step {got}, the newest is {want}")
    for lines in progress.values():
        for ln in lines:
            # A save fails only where a rank died alone (then it must, on the survivor).
            if ln.startswith("failed ") and cfg["kill"] and cfg["kill"].get("scope") != "process":
                soak.problems.append(f"{where}: a save failed: {ln}")
    committed = [int(ln.split()[1]) for ln in progress.get(0, []) if ln.startswith("committed ")]
    if committed:
        known[world] = max([*committed, *([known[world]] if known[world] is not None else [])])
    if not d.exists():
        resume_at[world] = None
        return
    visible: list[int] = []
    leftovers = set_aside = 0
    for name in sorted(os.listdir(d)):
        m = STEP_NAME.match(name)
        if name.startswith(".tmp-"):
            leftovers += 1
        elif m and (d / name / "manifest.json").is_file():
            visible.append(int(m.group(1)))
        elif ABANDONED_NAME.match(name):
            set_aside += 1
        elif name not in (".lock", ".shared"):
            soak.problems.append(f"{where}: unexpected {d / name} in the directory")
    soak.max_leftovers = max(soak.max_leftovers, leftovers)
    soak.max_abandoned = max(soak.max_abandoned, set_aside)
    if leftovers > 6:
        soak.problems.append(f"{where}: {leftovers} leftovers pile up in {d}")
    now: dict[int, int] = {}
    for s in visible:
        path = d / f"step-{s:09d}"
        try:
            tg.verify(path)
            tree = tg.load(path)
            soak.checkpoints_verified += 1
        except Exception as e:
            soak.problems.append(f"{where}: visible checkpoint {path} is broken: {e!r}")
            continue
        now[s] = tree.get("saved_by", -1)
        if (s, now[s]) in abandoned[world]:
            soak.problems.append(
                f"{where}: {path} (saved in cycle {now[s]}) belongs to a timeline that "
                "restore(step) abandoned, yet it is visible again"
            )
        if tree.get("step") != s or state_digest(tree) != ref.digest(s):
            soak.problems.append(
                f"{where}: {path} verifies but does not hold the state of step {s} "
                f"(it says step {tree.get('step')})"
            )
    unreferenced = _unreferenced(d, tg)
    soak.max_unreferenced = max(soak.max_unreferenced, len(unreferenced))
    if len(unreferenced) > 12:
        soak.problems.append(f"{where}: {len(unreferenced)} unreferenced shared objects pile up")
    newest = max(visible, default=None)
    if known[world] is not None and (newest is None or newest < known[world]):
        soak.problems.append(
            f"{where}: step {known[world]} was reported committed, but the newest visible "
            f"checkpoint is {newest}"
        )
    # Retention may delete a checkpoint only once a newer one committed: what is newest now
    # is what a restore must find, and the newest known committed can only grow.
    resume_at[world] = newest
    seen[world] = now
    if newest is not None:
        known[world] = max(newest, known[world] or 0)


def _unreferenced(d: Path, tg: Any) -> list[str]:
    """The shared objects under ``d`` that no checkpoint there (visible or set aside)
    references."""
    shared = d / ".shared"
    if not shared.is_dir():
        return []
    held = {p.relative_to(d).as_posix() for p in shared.glob("*/*.safetensors")}
    for ckpt in d.iterdir():
        if (ckpt / "manifest.json").is_file():
            try:
                held -= {f["name"] for f in tg.read_manifest(ckpt)["files"]}
            except Exception:
                return []  # unreadable: its check reports it
    return sorted(held)


def _final_sweep(soak: Soak, d: Path, tg: Any) -> None:
    """What a manager's sweep does after retention, on what the kills left: every shared
    object no checkpoint references goes, and every checkpoint still verifies."""
    if not d.is_dir():
        return
    before = len(_unreferenced(d, tg))
    tg.Catalog(d).sweep_shared(grace=False)
    soak.shared_swept += before
    if _unreferenced(d, tg):
        soak.problems.append(f"{d}: unreferenced shared objects are left after a sweep")
    for ckpt in sorted(d.iterdir()):
        named = STEP_NAME.match(ckpt.name) or ABANDONED_NAME.match(ckpt.name)
        if named and (ckpt / "manifest.json").is_file():  # not a killed save's staging
            try:
                tg.verify(ckpt)
            except Exception as e:
                soak.problems.append(f"{ckpt} is broken after the final sweep: {e!r}")


def _lines(path: Path) -> list[str]:
    if not path.exists():
        return []
    text = path.read_text()
    return [ln for ln in text.splitlines() if ln] if text.endswith("\n") else text.splitlines()[:-1]


def _tail(path: Path, n: int = 30) -> str:
    return "\n".join(_lines(path)[-n:]) if path.exists() else ""


def main() -> int:
    if sys.argv[1:] == ["--zygote"]:
        zygote()
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=1000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--dir", default=None, help="keep the checkpoints and cycle files here")
    p.add_argument("--two-rank-share", type=float, default=0.35)
    args = p.parse_args()
    soak = run_soak(
        args.kills,
        seed=args.seed,
        workdir=args.dir,
        two_rank_share=args.two_rank_share,
        log=lambda s: print(s, flush=True),
    )
    print(soak.summary())
    for problem in soak.problems[:20]:
        print("PROBLEM:", problem)
    return 1 if soak.problems else 0


if __name__ == "__main__":
    sys.exit(main())
