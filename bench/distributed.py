"""Collective saves and loads on 2 real ranks over gloo, next to DCP and the raw write.

``run`` starts ``world`` fresh interpreters (the "spawn" start method) joined into a gloo group
through a TCPStore this process serves on 127.0.0.1 only. Each rank builds its own shard of a
training state (an MLP's weights and biases plus two Adam-like moments per parameter, every
tensor a ``DTensor`` cut by rows, ``Shard(0)``, over a 1-D CPU mesh) and runs ``repeats + 1``
rounds (round 0 is a warm-up, kept but not summarised), each in this order:

- the raw O_DIRECT write + fsync of the rank's own bytes from a pre-faulted buffer (``raw``);
- ``tg.save`` (collective) and DCP's ``save``, both durable;
- ``tg.load(into=live)`` and DCP's ``load`` into the live DTensors, files hot, live state
  poisoned first and checked after.

Every operation starts on every rank after the same settle and a barrier, and ends with a
barrier: its time is the slowest rank's, as the job sees it; GB/s counts the bytes of all ranks.
Peak RSS is each rank's above its own live state (the worst rank).

Then, on the same ranks: a DDP-style replicated state (plain tensors, the same on every rank)
saved with ``tg.save``, whose bytes on disk must be one copy, not one per rank; the latency of
the per-step agreement collective (``Ranks.agree_max``, mean of many calls); and the plan cache:
a tiny state saved several times, where only the first save may run the planning exchange (a
save that plans caches a new plan id; one that reuses the plan keeps it).

Last, one process without ``torch.distributed`` loads the last round's 2-rank checkpoints into
a plain full-size state (the 2 -> 1 resharding load), ``tg.load(into=)`` against DCP's
``load(no_dist=True)``. Then the coordinator of a large job, simulated (``plan_scale``): the
global plan and the manifest of 256 and 1,024 ranks saving 2,000 tensors, half sharded.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import tardigrade as tg
from tardigrade.distributed._launch import loopback_store

from . import plan_scale
from .measure import freeze_imports, measure, settle
from .raw import Scratch, raw_write_direct, remove, warm
from .report import Target, stats
from .state import DEPTH

Log = Callable[[str], None]

DEFAULT_RANK_BYTES = 1_000_000_000  # sharded state per rank at --dist-size 1
# The coordinator's work, simulated (no processes): issue item 11's job, and one a quarter of
# its size to read the manifest's growth off.
SCALE_RANKS = (256, 1024)
SCALE_TENSORS = 2000
WORLD = 2
AGREE_CALLS = 1000
PLAN_SAVES = 5  # saves of the tiny state; the first plans, the others should reuse the plan
REPLICATED_FRACTION = 0.25  # the replicated state's size, as a fraction of a rank's shard
LOOPBACK = "lo0" if sys.platform == "darwin" else "lo"
_EXIT_GRACE_S = 10.0

# DCP warns on every call without a process group; the resharding load means it.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


@dataclass(frozen=True, kw_only=True)
class DistOptions:
    """What the distributed part of one benchmark run does."""

    rank_bytes: int  # the sharded state's bytes per rank (about)
    repeats: int
    settle_s: float
    dir: Path
    world: int = WORLD
    agree_calls: int = AGREE_CALLS
    timeout_s: float = 3600.0
    keep_files: bool = False


@dataclass(frozen=True)
class Layout:
    """The sharded state's shape: ``DEPTH`` square layers of ``width``, rows over ``world``."""

    width: int
    world: int
    replicated_width: int

    @classmethod
    def for_bytes(cls, rank_bytes: int, world: int) -> Layout:
        # Per layer: a weight (w*w) and a bias (w), each with two moments: 3 * 4 bytes a value.
        per_layer = rank_bytes * world / DEPTH / 12
        w = (-1 + math.sqrt(1 + 4 * per_layer)) / 2
        step = 8 * world  # even rows on every rank
        width = max(step, round(w / step) * step)
        rep = math.sqrt(rank_bytes * REPLICATED_FRACTION / DEPTH / 4)
        return cls(width, world, max(8, round(rep / 8) * 8))

    @property
    def total_bytes(self) -> int:
        return DEPTH * 3 * (self.width * self.width + self.width) * 4

    @property
    def rank_bytes(self) -> int:
        return self.total_bytes // self.world

    @property
    def replicated_bytes(self) -> int:
        return DEPTH * self.replicated_width * self.replicated_width * 4

    def shapes(self) -> dict[tuple[str, ...], tuple[int, ...]]:
        """Every tensor's global shape by key path: model weights and biases, then moments."""
        w = self.width
        params = {f"{i}.weight": (w, w) for i in range(DEPTH)}
        params.update({f"{i}.bias": (w,) for i in range(DEPTH)})
        out: dict[tuple[str, ...], tuple[int, ...]] = {("model", k): s for k, s in params.items()}
        for k, s in params.items():
            out[("optim", k, "exp_avg")] = s
            out[("optim", k, "exp_avg_sq")] = s
        return out


def _nest(flat: dict[tuple[str, ...], Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, leaf in flat.items():
        node = tree
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = leaf
    return tree


def _leaves(tree: dict[str, Any], prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, Any]]:
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _leaves(v, (*prefix, k))
        else:
            yield ".".join((*prefix, k)), v


def _local(t: Any) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _ends(t: torch.Tensor) -> list[float]:
    flat = t.reshape(-1)
    return [float(flat[0]), float(flat[-1])]


def _fingerprint(tree: dict[str, Any]) -> dict[str, list[float]]:
    return {name: _ends(_local(t)) for name, t in _leaves(tree)}


def _poison(tree: dict[str, Any]) -> None:
    with torch.no_grad():
        for _, t in _leaves(tree):
            flat = _local(t).view(-1)
            flat[0] = -12345.0
            flat[-1] = -12345.0


def _check(tree: dict[str, Any], expected: dict[str, list[float]], what: str) -> None:
    got = _fingerprint(tree)
    wrong = [k for k in expected if got.get(k) != expected[k]]
    if wrong or got.keys() != expected.keys():
        k = wrong[0] if wrong else "(the set of tensors)"
        raise RuntimeError(
            f"{what} did not restore {len(wrong)} tensor(s), e.g. {k}: expected "
            f"{expected.get(k)}, got {got.get(k)}"
        )


# --- one rank -------------------------------------------------------------------------------


def _sharded_state(layout: Layout, rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (layout.world,))
    gen = torch.Generator().manual_seed(1000 + rank)
    flat = {}
    for path, shape in layout.shapes().items():
        rows = shape[0] // layout.world
        local = torch.empty((rows, *shape[1:])).uniform_(-1, 1, generator=gen)
        stride = (shape[1], 1) if len(shape) == 2 else (1,)
        flat[path] = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride
        )
    return _nest(flat)


def _replicated_state(layout: Layout) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(7)  # the same values on every rank, as under DDP
    w = layout.replicated_width
    return {f"{i}.weight": torch.empty(w, w).uniform_(-1, 1, generator=gen) for i in range(DEPTH)}


def _fill(scratch: Scratch, tree: dict[str, Any]) -> None:
    pos = 0
    for _, t in _leaves(tree):
        b = _local(t).reshape(-1).view(torch.uint8)
        scratch.buf[pos : pos + b.numel()].copy_(b)
        pos += b.numel()


def _disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _save_dcp(state: dict[str, Any], path: Path) -> None:
    # As the single-process bench saves with DCP: 2 writer threads, files fsynced.
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=2, sync_files=True))


def _quiet(_: Any) -> None:
    """Drop a tool's return value: ``measure`` keeps only a dict of numbers."""


def _on_zero(rank: int, op: Callable[[], Any]) -> None:
    """``op`` on rank 0 only (e.g. deleting a shared directory), then a barrier."""
    if rank == 0:
        op()
    dist.barrier()


def _timed(opts: DistOptions, op: Callable[[], Any], *, since: float | None = None) -> Any:
    """``op`` on every rank at once, after the same settle; until the slowest rank is done."""
    settle(opts.settle_s, since=since)
    dist.barrier()

    def whole_job() -> Any:
        extra = op()
        dist.barrier()
        return extra

    return measure(whole_job).to_json()


def _sharded_rounds(rank: int, layout: Layout, opts: DistOptions) -> dict[str, Any]:
    """The rounds of saves and loads of the sharded state; the last round's files are kept."""
    state = _sharded_state(layout, rank)
    expected = _fingerprint(state)
    local_bytes = sum(_local(t).numel() * 4 for _, t in _leaves(state))
    scratch = Scratch(local_bytes)
    _fill(scratch, state)  # pre-faults the reference buffer, as the single-process bench does
    paths = {"tardigrade": opts.dir / "tardigrade", "dcp": opts.dir / "dcp"}
    loads = {
        "tardigrade": lambda: _quiet(tg.load(paths["tardigrade"], into=state)),
        "dcp": lambda: dcp.load(state, storage_reader=dcp.FileSystemReader(paths["dcp"])),
    }
    rounds = []
    for r in range(opts.repeats + 1):
        save: dict[str, Any] = {}
        load: dict[str, Any] = {}
        raw = opts.dir / f"raw_write_direct-{rank}"
        remove(raw)
        save["raw_write_direct"] = _timed(opts, functools.partial(raw_write_direct, scratch, raw))
        remove(raw)
        _on_zero(rank, lambda: [remove(p) for p in paths.values()])
        save["tardigrade"] = _timed(opts, lambda: _quiet(tg.save(paths["tardigrade"], state)))
        save["dcp"] = _timed(opts, functools.partial(_save_dcp, state, paths["dcp"]))
        for name, fn in loads.items():
            since = time.monotonic()
            _on_zero(rank, functools.partial(warm, paths[name]))
            _poison(state)
            load[name] = _timed(opts, fn, since=since)
            _check(state, expected, f"rank {rank}: {name} load")
        rounds.append({"round": r, "warmup": r == 0, "save": save, "load": load})
    return {"local_bytes": local_bytes, "rounds": rounds, "fingerprint": expected}


def _replicated_save(rank: int, layout: Layout, opts: DistOptions) -> dict[str, Any]:
    """DDP-style: the same plain tensors on every rank, to be written once in total."""
    rep = _replicated_state(layout)
    path = opts.dir / "replicated"
    _on_zero(rank, functools.partial(remove, path))
    sample = _timed(opts, lambda: _quiet(tg.save(path, rep)))
    disk = _disk_bytes(path) if rank == 0 else 0
    _on_zero(rank, functools.partial(remove, path))
    return {"sample": sample, "disk_bytes": disk}


def _agree_latency(opts: DistOptions) -> float:
    """Mean seconds of ``Ranks.agree_max``, the tiny all-reduce a loop would make each step."""
    from tardigrade.distributed._collectives import Ranks

    ranks = Ranks.current()
    assert ranks is not None
    for i in range(50):
        ranks.agree_max(i)
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(opts.agree_calls):
        ranks.agree_max(i + ranks.rank)
    return (time.perf_counter() - t0) / opts.agree_calls


def _plan_cache(rank: int, layout: Layout, opts: DistOptions) -> list[dict[str, Any]]:
    """Saves of a tiny state: a save that plans caches a new plan id, one that reuses keeps it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from tardigrade.distributed import _save as tg_dist_save
    from tardigrade.distributed._collectives import Ranks

    ranks = Ranks.current()
    assert ranks is not None
    mesh = init_device_mesh("cpu", (layout.world,))
    tiny = {
        "w": DTensor.from_local(torch.ones(16, 8), mesh, [Shard(0)], run_check=False),
        "b": torch.zeros(8),
        "step": 3,
    }
    key = tg_dist_save._cache_key(ranks)
    plan_id = None
    out = []
    for i in range(PLAN_SAVES):
        path = opts.dir / f"plan-{i}"
        _on_zero(rank, functools.partial(remove, path))
        t0 = time.perf_counter()
        tg.save(path, tiny)
        seconds = time.perf_counter() - t0
        now = tg_dist_save._cache[key].plan_id
        out.append({"seconds": seconds, "planned": now != plan_id})
        plan_id = now
        _on_zero(rank, functools.partial(remove, path))
    return out


def _rank_work(rank: int, layout: Layout, opts: DistOptions, launched: float) -> dict[str, Any]:
    phases = {"start_s": time.time() - launched}  # interpreter, imports, joining the group
    t0 = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal t0
        phases[name] = time.perf_counter() - t0
        t0 = time.perf_counter()

    out: dict[str, Any] = {"rank": rank, **_sharded_rounds(rank, layout, opts)}
    lap("sharded_s")
    out["replicated"] = _replicated_save(rank, layout, opts)
    lap("replicated_s")
    out["agree_max_s"] = _agree_latency(opts)
    lap("agree_s")
    out["plan_saves"] = _plan_cache(rank, layout, opts)
    lap("plan_cache_s")
    return {**out, "phases": phases}


def _rank_main(
    rank: int,
    port: int,
    layout: Layout,
    opts: DistOptions,
    launched: float,
    writer: multiprocessing.connection.Connection,
) -> None:
    try:
        freeze_imports()
        # One compute thread per rank: the ranks share this machine's cores.
        torch.set_num_threads(1)
        os.environ["GLOO_SOCKET_IFNAME"] = LOOPBACK
        wait = datetime.timedelta(seconds=opts.timeout_s)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=wait)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=layout.world,
                                timeout=wait)  # fmt: skip
        report = {"ok": _rank_work(rank, layout, opts, launched)}
    except BaseException as exc:
        report = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    writer.send_bytes(json.dumps(report).encode())
    writer.close()
    if dist.is_initialized():
        dist.destroy_process_group()


# --- the resharding load: one process, no torch.distributed ---------------------------------


def _reshard_main(
    layout: Layout,
    opts: DistOptions,
    inbox: multiprocessing.connection.Connection,
    writer: multiprocessing.connection.Connection,
) -> None:
    """Started with the ranks (its imports overlap theirs); loads once ``inbox`` says what the
    full tensors' ends must be, i.e. once the ranks have written their checkpoints."""
    try:
        freeze_imports()
        expected = json.loads(inbox.recv_bytes())
        inbox.close()
        torch.set_num_threads(1)
        # Pre-faulted, as a live model's memory is.
        full = _nest({p: torch.zeros(s) for p, s in layout.shapes().items()})
        paths = {"tardigrade": opts.dir / "tardigrade", "dcp": opts.dir / "dcp"}
        loads = {
            "tardigrade": lambda: _quiet(tg.load(paths["tardigrade"], into=full)),
            "dcp": lambda: dcp.load(
                full, storage_reader=dcp.FileSystemReader(paths["dcp"]), no_dist=True
            ),
        }
        rounds = []
        for r in range(opts.repeats + 1):
            load = {}
            for name, fn in loads.items():
                since = time.monotonic()
                warm(paths[name])
                _poison(full)
                settle(opts.settle_s, since=since)
                load[name] = measure(fn).to_json()
                _check(full, expected, f"2 -> 1 {name} load")
            rounds.append({"round": r, "warmup": r == 0, "load": load})
        report: dict[str, Any] = {"ok": {"rounds": rounds, "live_bytes": layout.total_bytes}}
    except BaseException as exc:
        report = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    writer.send_bytes(json.dumps(report).encode())
    writer.close()


# --- orchestration --------------------------------------------------------------------------


def _start(
    ctx: Any, target: Callable[..., None], args: tuple[Any, ...], name: str
) -> tuple[Any, multiprocessing.connection.Connection]:
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(*args, writer), name=name, daemon=True)
    proc.start()
    writer.close()  # the child holds the only writer: its death reads as EOF here
    return proc, reader


def _stop(proc: Any) -> None:
    """Wait a grace period for ``proc`` to end, then SIGKILL it."""
    proc.join(timeout=_EXIT_GRACE_S)
    if proc.is_alive():
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=5)


def _results(
    procs: list[tuple[Any, multiprocessing.connection.Connection]], timeout_s: float
) -> list[Any]:
    """Each process's result, in order; raise naming the processes that failed or hung."""
    deadline = time.monotonic() + timeout_s
    out: dict[int, Any] = {}
    try:
        while len(out) < len(procs):
            waiting = {procs[i][1]: i for i in range(len(procs)) if i not in out}
            left = deadline - time.monotonic()
            if left <= 0:
                names = [procs[i][0].name for i in waiting.values()]
                raise RuntimeError(f"distributed bench: {names} did not finish in {timeout_s:g} s")
            for ready in multiprocessing.connection.wait(list(waiting), timeout=left):
                i = waiting[ready]
                try:
                    out[i] = json.loads(ready.recv_bytes())  # type: ignore[union-attr]
                except EOFError:
                    procs[i][0].join(timeout=_EXIT_GRACE_S)
                    out[i] = {"error": f"died with exit code {procs[i][0].exitcode}"}
    finally:
        for proc, reader in procs:
            _stop(proc)
            reader.close()
    failed = [(procs[i][0].name, r) for i, r in sorted(out.items()) if "ok" not in r]
    if failed:
        name, r = failed[0]
        raise RuntimeError(
            f"distributed bench: {name} failed: {r['error']}\n{r.get('traceback', '')}"
        )
    return [out[i]["ok"] for i in range(len(procs))]


def run(opts: DistOptions, log: Log) -> dict[str, Any]:
    """The distributed part: 2 ranks, then the resharding load; every raw measurement."""
    t0 = time.perf_counter()
    layout = Layout.for_bytes(opts.rank_bytes, opts.world)
    opts.dir.mkdir(parents=True, exist_ok=True)
    log(
        f"distributed: {opts.world} ranks on gloo, {layout.rank_bytes / 1e9:.3f} GB per rank "
        f"({layout.total_bytes / 1e9:.3f} GB in all, width {layout.width}), in {opts.dir}"
    )
    ctx = multiprocessing.get_context("spawn")
    go_reader, go_writer = ctx.Pipe(duplex=False)
    resharder = _start(ctx, _reshard_main, (layout, opts, go_reader), "resharding load")
    go_reader.close()
    try:
        with loopback_store(opts.timeout_s) as port:
            ranks = _results(
                [
                    _start(ctx, _rank_main, (r, port, layout, opts, time.time()), f"rank {r}")
                    for r in range(opts.world)
                ],
                opts.timeout_s,
            )
        for r in ranks:
            for rd in r["rounds"]:
                tag = f"round {rd['round']}" + (" (warm-up)" if rd["warmup"] else "")
                for kind in ("save", "load"):
                    for name, s in rd[kind].items():
                        log(
                            f"distributed rank {r['rank']} {tag} {kind} {name}: "
                            f"{s['seconds']:.3f} s, RSS +{s['peak_rss_above'] / 1e9:.3f} GB"
                        )
            log(
                f"distributed rank {r['rank']} phases: "
                + ", ".join(f"{k} {v:.1f}" for k, v in r["phases"].items())
            )
        # The full tensors' ends: rank 0's first element and the last rank's last.
        expected = {
            k: [ranks[0]["fingerprint"][k][0], ranks[-1]["fingerprint"][k][1]]
            for k in ranks[0]["fingerprint"]
        }
        log(f"distributed: {opts.world} -> 1 resharding load in one process")
        go_writer.send_bytes(json.dumps(expected).encode())
        (reshard,) = _results([resharder], opts.timeout_s)
        for rd in reshard["rounds"]:
            for name, s in rd["load"].items():
                log(
                    f"distributed 2 -> 1 round {rd['round']} load {name}: {s['seconds']:.3f} s, "
                    f"RSS +{s['peak_rss_above'] / 1e9:.3f} GB"
                )
    finally:
        go_writer.close()  # a resharder still waiting reads EOF and ends
        _stop(resharder[0])
        resharder[1].close()
        if not opts.keep_files:
            remove(opts.dir)
    for r in ranks:
        del r["fingerprint"]
    scale = {}
    for world in SCALE_RANKS:
        log(f"distributed: coordinator of {world} simulated ranks x {SCALE_TENSORS} tensors")
        scale[str(world)] = plan_scale.run(world, SCALE_TENSORS)
        log(f"distributed: {world} ranks: {scale[str(world)]}")
    return {
        "meta": {
            "world": opts.world,
            "backend": "gloo",
            "layout": asdict(layout),
            "total_bytes": layout.total_bytes,
            "rank_bytes": layout.rank_bytes,
            "replicated_bytes": layout.replicated_bytes,
            "tensors": len(layout.shapes()),
            "repeats": opts.repeats,
            "settle_s": opts.settle_s,
            "agree_calls": opts.agree_calls,
            "elapsed_s": time.perf_counter() - t0,
        },
        "ranks": ranks,
        "reshard": reshard,
        "scale": scale,
    }


# --- summary, targets, text -----------------------------------------------------------------


def _job_sample(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One operation of the job: the slowest rank's time, the worst rank's memory."""
    return {
        "seconds": max(s["seconds"] for s in per_rank),
        "peak_rss_above": max(s["peak_rss_above"] for s in per_rank),
        "peak_anon_above": max(s["peak_anon_above"] for s in per_rank),
        "extra": {},
    }


def summarise(results: dict[str, Any]) -> dict[str, Any]:
    m = results["meta"]
    ranks = results["ranks"]
    total, per_rank = m["total_bytes"], m["rank_bytes"]
    n_rounds = len(ranks[0]["rounds"])
    measured = [i for i in range(n_rounds) if not ranks[0]["rounds"][i]["warmup"]]
    out: dict[str, Any] = {}
    for kind in ("save", "load"):
        out[kind] = {
            name: stats(
                [_job_sample([r["rounds"][i][kind][name] for r in ranks]) for i in measured],
                total,
                per_rank,
            )
            for name in ranks[0]["rounds"][0][kind]
        }
    rs = [rd for rd in results["reshard"]["rounds"] if not rd["warmup"]]
    out["reshard"] = {
        name: stats([rd["load"][name] for rd in rs], total, results["reshard"]["live_bytes"])
        for name in rs[0]["load"]
    }
    rep = [r["replicated"] for r in ranks]
    out["replicated"] = {
        **stats([_job_sample([x["sample"] for x in rep])], m["replicated_bytes"], per_rank),
        "one_copy_bytes": m["replicated_bytes"],
        "disk_bytes": rep[0]["disk_bytes"],
        "written_over_one_copy": rep[0]["disk_bytes"] / m["replicated_bytes"],
    }
    plans = ranks[0]["plan_saves"]
    out["agree_max_ms"] = 1e3 * max(r["agree_max_s"] for r in ranks)
    small, big = (results["scale"][str(w)] for w in SCALE_RANKS)
    out["scale"] = {
        **big,
        "ranks": SCALE_RANKS[-1],
        "tensors": SCALE_TENSORS,
        "growth": big["manifest_mb"] / small["manifest_mb"],
        "ranks_growth": SCALE_RANKS[-1] / SCALE_RANKS[0],
    }
    out["plan_cache"] = {
        "saves": len(plans),
        "planned": [p["planned"] for p in plans],
        "planning_after_first": sum(p["planned"] for p in plans[1:]),
        "first_s": plans[0]["seconds"],
        "later_median_s": statistics.median(p["seconds"] for p in plans[1:]),
    }
    return out


def targets(d: dict[str, Any]) -> list[Target]:
    """The targets of the distributed issue (item 13), from ``summarise``'s output."""

    def ratio(a: dict[str, Any], an: str, b: dict[str, Any], bn: str) -> float | None:
        return a[an]["gbps"] / b[bn]["gbps"] if an in a and bn in b else None

    save, load, reshard = d["save"], d["load"], d["reshard"]
    rss = [
        g["tardigrade"]["peak_rss_above_pct"] for g in (save, load, reshard) if "tardigrade" in g
    ]
    return [
        Target("2-rank tg.save / DCP save", ratio(save, "tardigrade", save, "dcp"), ">=", 1.5, "x"),
        Target(
            "2-rank tg.save / raw O_DIRECT write (same bytes)",
            ratio(save, "tardigrade", save, "raw_write_direct"),
            ">=",
            0.85,
            "x",
        ),
        Target(
            "2-rank tg.load(into) / DCP load",
            ratio(load, "tardigrade", load, "dcp"),
            ">=",
            2.0,
            "x",
        ),
        Target(
            "2 -> 1 resharding tg.load / DCP load",
            ratio(reshard, "tardigrade", reshard, "dcp"),
            ">=",
            2.0,
            "x",
        ),
        Target(
            "2-rank tg peak RSS per rank above live (worst: save, load, 2->1 load)",
            max(rss) if rss else None,
            "<=",
            10.0,
            "%",
        ),
        Target(
            "2-rank replicated tg.save: bytes on disk / one copy",
            d["replicated"]["written_over_one_copy"],
            "<=",
            1.01,
            "x",
        ),
        Target("2-rank agree_max on gloo (mean)", d["agree_max_ms"], "<", 0.5, "ms"),
        Target(
            f"coordinator plan + manifest, {d['scale']['ranks']} simulated ranks x "
            f"{d['scale']['tensors']} tensors",
            d["scale"]["coordinator_s"],
            "<",
            2.0,
            "s",
        ),
        Target(
            f"manifest growth over {d['scale']['ranks_growth']:.0f}x the ranks (linear: <= "
            f"{d['scale']['ranks_growth']:.0f}x)",
            d["scale"]["growth"],
            "<=",
            d["scale"]["ranks_growth"],
            "x",
        ),
        Target(
            "2-rank planning exchanges in saves after the first (plan cache)",
            float(d["plan_cache"]["planning_after_first"]),
            "<=",
            0.0,
        ),
    ]


def table(results: dict[str, Any], d: dict[str, Any]) -> str:
    from .report import RSS_HEADERS, _grid, _rss

    m = results["meta"]
    rows = []
    groups = (("save", "raw_write_direct"), ("load", "dcp"), ("reshard", "dcp"))
    for kind, ref in groups:
        for name, s in d[kind].items():
            x = s["gbps"] / d[kind][ref]["gbps"] if ref in d[kind] and name != ref else None
            rows.append(
                [
                    f"{kind} {name}",
                    f"{s['median_s']:.3f}",
                    f"{s['min_s']:.3f}",
                    f"{s['max_s']:.3f}",
                    f"{s['gbps']:.2f}",
                    "-" if x is None else f"{x:.2f} x {ref}",
                    *_rss(s),
                ]
            )
    save = d["save"]
    if "tardigrade" in save and "dcp" in save:
        extra_save = f"; tg.save / DCP save {save['tardigrade']['gbps'] / save['dcp']['gbps']:.2f}x"
    else:
        extra_save = ""
    rep, plan, sc = d["replicated"], d["plan_cache"], d["scale"]
    return "\n".join(
        [
            f"Distributed: {m['world']} ranks on {m['backend']} (one machine), "
            f"{m['rank_bytes'] / 1e9:.3f} GB per rank ({m['total_bytes'] / 1e9:.3f} GB in all, "
            f"{m['tensors']} DTensors Shard(0)); median of {m['repeats']} (+1 warm-up); "
            f"{m['elapsed_s']:.0f} s",
            "  times: from a barrier to the slowest rank's end; GB/s: all ranks' bytes; RSS: the "
            "worst rank's above its live state (2 -> 1: one process above its full state)"
            + extra_save,
            _grid(["op", "median s", "min s", "max s", "GB/s", "ratio", *RSS_HEADERS], rows),
            f"  replicated (DDP-style) tg.save of {rep['one_copy_bytes'] / 1e9:.3f} GB on each "
            f"rank: {rep['disk_bytes'] / 1e9:.3f} GB on disk "
            f"({rep['written_over_one_copy']:.3f}x one copy), {rep['median_s']:.3f} s",
            f"  agree_max: {d['agree_max_ms']:.3f} ms a call (mean of {m['agree_calls']}, "
            "worst rank)",
            f"  coordinator, simulated: {sc['ranks']} ranks x {sc['tensors']} tensors (half sharded "
            f"over every rank): plan {sc['plan_s']:.2f} s, manifest built and checked "
            f"{sc['manifest_s']:.2f} s ({sc['manifest_mb']:.1f} MB, {sc['growth']:.2f}x the "
            f"{SCALE_RANKS[0]}-rank one), plan table packed for the ranks {sc['handout_s']:.2f} s",
            f"  plan cache: {plan['saves']} saves of a tiny state, planned "
            f"{['yes' if p else 'no' for p in plan['planned']]}; first {plan['first_s']:.4f} s, "
            f"later {plan['later_median_s']:.4f} s (median)",
        ]
    )
