"""A node's loss: restore from the peer tier against the store, on 2 simulated nodes.

Two ranks over gloo, each a node of its own (``TARDIGRADE_NODE`` n0 / n1, each its own RAM
directory under /dev/shm), hold a row-sharded training state (``distributed.Layout``, DTensors)
and save it through a ``CheckpointManager`` whose root is a SeaweedFS prefix (the store,
started here on loopback), with ``ram_tier`` and ``peer_replicas=1``. Each round, side by side:

- ``peer``: node n1 is lost (its RAM directory emptied); new managers on both ranks restore:
  n0 holds its own share and n1's replica, and sends n1's share over gloo;
- ``store``: every node's memory is lost; the same restore reads the store;
- ``dcp``: DCP's fsspec reader (s3fs) loads the same state from the same store, when s3fs is
  installed.

Every restore verifies every byte; its time is the slowest rank's. Also measured: the training
thread's blocking in an async save with ``peer_replicas=1`` against the RAM tier alone (second
save of a manager: staging reused; the first save's replicas kept by then, as saves many steps
apart find them), the bytes a rank sends per save against its share, and the
time from a preemption signal to the step held in RAM + peers (``preemption_budget`` too short
for the store: that part is skipped).
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import tempfile
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

import torch
import torch.distributed as dist

import tardigrade as tg
from tardigrade.distributed._launch import loopback_store
from tardigrade.storage import open_root
from tardigrade.testing import S3Server

from .distributed import (
    LOOPBACK,
    Layout,
    _check,
    _fingerprint,
    _poison,
    _results,
    _sharded_state,
    _start,
)
from .measure import freeze_imports, settle
from .report import Target, _grid

WORLD = 2
# Per rank at the default --size: half the distributed part's (a rank holds its state, its
# staging, and a received share at once; two ranks and their RAM tiers fit 24 GB then).
DEFAULT_RANK_BYTES = 500_000_000


@dataclass(frozen=True)
class NodeLossOptions:
    rank_bytes: int
    repeats: int
    settle_s: float
    timeout_s: float = 3600.0


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, dist.ReduceOp.MAX)
    return float(t.item())


def _timed_restore(mgr: tg.CheckpointManager, opts: NodeLossOptions) -> tuple[float, Any]:
    settle(opts.settle_s)
    dist.barrier()
    t0 = time.perf_counter()
    step = mgr.restore()
    return _slowest(time.perf_counter() - t0), step


def _manager(root: str, state: Any, shm: Path, **kw: Any) -> tg.CheckpointManager:
    kw.setdefault("save_on_signals", ())
    return tg.CheckpointManager(root, state, ram_tier=shm, peer_replicas=kw.pop("peers", 1), **kw)


def _leave(mgr: tg.CheckpointManager) -> None:
    """Close as a crash leaves things: the RAM and peer tiers stay."""
    mgr._ram_keep = True
    mgr.close()


def _blocking(root: str, state: Any, shm: Path, peers: int) -> float:
    """The training thread's blocking in the second async save of a manager, the first one's
    replicas kept by then (as in training, where saves are many steps apart)."""
    with _manager(root, state, shm, peers=peers) as mgr:
        for step in (1, 2):
            mgr.save(step)
            mgr.wait()
            tier = mgr._tiers.first(_peer_tier())
            if tier is not None:
                tier.replicator.wait()
        return _slowest(mgr.stats[-1].blocking_seconds)


def _rank_work(rank: int, layout: Layout, opts: NodeLossOptions, env: dict[str, str]) -> Any:
    os.environ.update(env)
    node = f"n{rank}"
    os.environ["TARDIGRADE_NODE"] = node
    base = Path(env["NODE_LOSS_SHM"])
    shm = base / node
    shm.mkdir(parents=True, exist_ok=True)
    state = _sharded_state(layout, rank)
    expected = _fingerprint(state)
    root = env["NODE_LOSS_ROOT"]
    dcp_url = f"{root}-dcp"
    rounds = []
    try:
        import s3fs  # noqa: F401  (DCP's fsspec reader needs it for s3://)
        from torch.distributed.checkpoint import load as dcp_load
        from torch.distributed.checkpoint import save as dcp_save
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        dcp_save(state, storage_writer=FsspecWriter(dcp_url, thread_count=8))
        have_dcp = True
    except ImportError:
        have_dcp = False
    for rnd in range(opts.repeats + 1):  # round 0 warms up
        out: dict[str, Any] = {"round": rnd, "warmup": rnd == 0}
        mgr = _manager(root, state, shm)
        mgr.save(rnd + 1)
        mgr.wait()
        tier = mgr._tiers.first(_peer_tier())
        assert tier is not None and tier.replicator.wait(opts.timeout_s)
        stats = mgr.ram_tier_stats
        assert stats is not None and stats.failed == 0, stats
        share = sum(p.stat().st_size for p in Path(stats.root).rglob("*") if p.is_file())
        out["sent_per_share"] = stats.sent_bytes / max(1, share)
        _leave(mgr)
        # Node n1 is lost with its memory.
        if rank == 1:
            shutil.rmtree(shm)
            shm.mkdir()
        _poison(state)
        mgr = _manager(root, state, shm)
        out["peer_s"], step = _timed_restore(mgr, opts)
        assert step == rnd + 1 and (mgr.restored_from or "").startswith(("the peer", str(base)))
        _check(state, expected, "restore from the peer tier")
        _leave(mgr)
        # Every node's memory is lost: the store.
        shutil.rmtree(shm)
        shm.mkdir()
        _poison(state)
        mgr = _manager(root, state, shm)
        out["store_s"], step = _timed_restore(mgr, opts)
        assert step == rnd + 1 and (mgr.restored_from or "").startswith("s3://")
        _check(state, expected, "restore from the store")
        mgr.close()
        if have_dcp:
            _poison(state)
            settle(opts.settle_s)
            dist.barrier()
            t0 = time.perf_counter()
            dcp_load(state, storage_reader=FsspecReader(dcp_url))
            out["dcp_s"] = _slowest(time.perf_counter() - t0)
            _check(state, expected, "DCP fsspec load")
        # Replication while training: the blocking of an async save, with and without peers.
        # Their roots on disk, removed after: on /dev/shm they held memory round after round.
        local = Path(env["NODE_LOSS_DISK"]) / f"blocking-{rnd}"
        pair = [("ram_only", 0), ("with_peers", 1)]
        for key, peers in pair if rnd % 2 else pair[::-1]:
            settle(opts.settle_s)
            out[f"blocking_{key}_s"] = _blocking(f"{local}-{key}", state, shm, peers)
            shutil.rmtree(f"{local}-{key}", ignore_errors=True)
        rounds.append(out)
    # A preemption: signal to the step held in RAM + peers (no time left for the store).
    sig = (signal.SIGUSR1,)
    with _manager(root, state, shm, preemption_budget=1e-6, save_on_signals=sig) as mgr:
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            os.kill(os.getpid(), signal.SIGUSR1)
        mgr.step(10_000)
        preempt = _slowest(time.perf_counter() - t0)
        assert mgr.should_stop
    return {"rank": rank, "rounds": rounds, "preempt_s": preempt, "dcp": have_dcp}


def _peer_tier() -> type:
    from tardigrade.manager._tiers import PeerTier

    return PeerTier


def _rank_main(
    rank: int,
    port: int,
    layout: Layout,
    opts: NodeLossOptions,
    env: dict[str, str],
    writer: multiprocessing.connection.Connection,
) -> None:
    try:
        freeze_imports()
        torch.set_num_threads(1)
        os.environ["GLOO_SOCKET_IFNAME"] = LOOPBACK
        wait = datetime.timedelta(seconds=opts.timeout_s)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=wait)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=wait)
        report = {"ok": _rank_work(rank, layout, opts, env)}
    except BaseException as exc:
        report = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    writer.send_bytes(json.dumps(report).encode())
    writer.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def run(opts: NodeLossOptions, log: Any) -> dict[str, Any]:
    if not os.path.isdir("/dev/shm"):
        return {"skipped": "no /dev/shm on this machine"}
    try:
        import obstore  # noqa: F401
    except ImportError:
        return {"skipped": "obstore is not installed"}
    layout = Layout.for_bytes(opts.rank_bytes, WORLD)
    tmp = Path(tempfile.mkdtemp(prefix="tardigrade-bench-node-loss-"))
    shm = Path(tempfile.mkdtemp(prefix="tardigrade-bench-node-loss-", dir="/dev/shm"))
    server = S3Server(tmp)
    try:
        log(
            f"node loss: 2 nodes x 1 rank, {layout.rank_bytes / 1e9:.2f} GB per rank, the store "
            "on SeaweedFS (starting it)"
        )
        server.start()
        root = f"s3://{server.bucket}/node-loss-{uuid.uuid4().hex[:8]}"
        env = {**server.env(), "NODE_LOSS_ROOT": root, "NODE_LOSS_SHM": str(shm)}
        env["NODE_LOSS_DISK"] = str(tmp)
        ctx = multiprocessing.get_context("spawn")
        with loopback_store(opts.timeout_s) as port:
            ranks = _results(
                [
                    _start(ctx, _rank_main, (r, port, layout, opts, env), f"node-loss rank {r}")
                    for r in range(WORLD)
                ],
                opts.timeout_s,
            )
        for rd in ranks[0]["rounds"]:
            log(
                f"node loss round {rd['round']}: peer {rd['peer_s']:.2f} s, store "
                f"{rd['store_s']:.2f} s, dcp {rd.get('dcp_s', float('nan')):.2f} s, blocking "
                f"{rd['blocking_ram_only_s'] * 1e3:.0f} / {rd['blocking_with_peers_s'] * 1e3:.0f} ms"
            )
        for url in (root, f"{root}-dcp"):
            try:
                os.environ.update(server.env())
                open_root(url).delete("")
            except Exception as e:  # the server goes anyway
                log(f"node loss: cleaning {url}: {e}")
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    return {"rank_bytes": layout.rank_bytes, "ranks": ranks}


def summarise(results: dict[str, Any]) -> dict[str, Any]:
    if "ranks" not in results:
        return {}
    rounds = [r for r in results["ranks"][0]["rounds"] if not r["warmup"]]
    keys = ["peer_s", "store_s", "dcp_s", "blocking_ram_only_s", "blocking_with_peers_s"]
    out = {k: median(r[k] for r in rounds) for k in keys if all(k in r for r in rounds)}
    out["sent_per_share"] = max(
        r["sent_per_share"] for rank in results["ranks"] for r in rank["rounds"]
    )
    out["preempt_s"] = results["ranks"][0]["preempt_s"]
    out["rank_bytes"] = results["rank_bytes"]
    return out


def targets(s: dict[str, Any]) -> list[Target]:
    def ratio(a: str, b: str) -> float | None:
        return s[b] / s[a] if a in s and b in s else None

    return [
        Target("restore after a node's loss: peer tier vs the store (SeaweedFS)", ratio("peer_s", "store_s"), ">=", 5.0, "x"),
        Target("async save blocking with peer_replicas=1 / RAM tier only", ratio("blocking_ram_only_s", "blocking_with_peers_s"), "<=", 1.1, "x"),
        Target("bytes sent per save / the rank's share (1 replica)", s.get("sent_per_share"), "<=", 1.01, "x"),
    ]  # fmt: skip


def table(results: dict[str, Any], s: dict[str, Any]) -> str:
    if not s:
        return f"NODE LOSS: skipped ({results.get('skipped', 'no results')})"
    gb = s["rank_bytes"] * WORLD / 1e9
    rows = [
        [name, f"{s[k]:.3f}", f"{gb / s[k]:.2f}"]
        for name, k in (
            ("tg restore(): the lost node's share from the peer tier", "peer_s"),
            ("tg restore() from the store (SeaweedFS)", "store_s"),
            ("DCP load, fsspec reader, from the store", "dcp_s"),
        )
        if k in s
    ]
    head = (
        f"NODE LOSS: 2 nodes x 1 rank, {gb:.2f} GB in all, restore after node n1 is lost (medians)"
    )
    foot = (
        f"async save blocking: {s['blocking_ram_only_s'] * 1e3:.1f} ms RAM tier only, "
        f"{s['blocking_with_peers_s'] * 1e3:.1f} ms with peer_replicas=1; bytes sent per save "
        f"{s['sent_per_share']:.3f}x the share; preemption signal to RAM + peers: "
        f"{s['preempt_s']:.2f} s"
    )
    return "\n".join([head, _grid(["restore", "s", "GB/s"], rows), foot])
