"""The store part of ``make bench``: checkpoints on S3 (a local SeaweedFS, started here).

Side by side in one run, on the same bytes (a state of fp32 tensors): Tardigrade's save (sync
and async) and load into the live tensors; the raw parallel multipart put and ranged get of the
same bytes with the same client (obstore, 8 MiB parts, 8 in flight); and DCP with its fsspec
writer and reader (s3fs), when s3fs is installed. Each operation reports wall time, client CPU
per GB and peak memory above the live state. Rounds rotate the order of the tools.

Upload speed here is the server's, not the client's: SeaweedFS spends ~11 s of CPU per GB it
stores, on the same 2 cores (docs/research/s3-clients.md).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

import torch

import tardigrade as tg
from tardigrade.storage import open_root
from tardigrade.testing import S3Server

from .measure import measure, settle
from .report import Target, _grid

DEFAULT_STORE_BYTES = 1_000_000_000
MiB = 1 << 20
TENSORS = 16


@dataclass(frozen=True)
class StoreOptions:
    nbytes: int
    repeats: int
    settle_s: float


def make_state(nbytes: int) -> dict[str, torch.Tensor]:
    per = max(1, nbytes // TENSORS // 4)
    g = torch.Generator().manual_seed(0)
    return {f"t{i:02d}": torch.rand(per, generator=g) for i in range(TENSORS)}


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B")


def _extra(result: Any) -> dict[str, float] | None:
    """What an operation returned, if it is numbers for the report (not a save's result)."""
    return result if isinstance(result, dict) and "blocking_s" in result else None


def run(opts: StoreOptions, log: Callable[[str], None]) -> dict[str, Any]:
    try:
        import obstore
    except ImportError:
        log("store: skipped (no obstore: pip install 'tardigrade-ckpt[s3]')")
        return {"skipped": "obstore is not installed"}
    try:
        import s3fs  # noqa: F401  (DCP's fsspec writer needs it for s3://)
        from torch.distributed.checkpoint import load as dcp_load
        from torch.distributed.checkpoint import save as dcp_save
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        have_dcp = True
    except ImportError:
        have_dcp = False
        log("store: DCP's fsspec writer skipped (pip install s3fs)")
    tmp = Path(tempfile.mkdtemp(prefix="tardigrade-bench-s3-"))
    server = S3Server(tmp)
    saved_env = dict(os.environ)
    state = make_state(opts.nbytes)
    live = {k: torch.zeros_like(v) for k, v in state.items()}
    nbytes = sum(t.numel() * 4 for t in state.values())
    samples: dict[str, list[dict[str, Any]]] = {}
    try:
        log(f"store: starting SeaweedFS on loopback ({nbytes / 1e9:.2f} GB state)")
        server.start()
        os.environ.update(server.env())
        root = f"s3://{server.bucket}/bench"
        store = open_root(root)._store  # type: ignore[attr-defined]

        def raw_put(key: str) -> None:
            views = [_bytes(t) for t in state.values()]
            obstore.put(store, key, views, chunk_size=8 * MiB, max_concurrency=8)

        def raw_get(key: str) -> None:
            jobs = []
            pos = 0
            for t in live.values():
                view = _bytes(t)
                for lo in range(0, view.nbytes, 8 * MiB):
                    jobs.append((pos + lo, view[lo : lo + 8 * MiB]))
                pos += view.nbytes

            def fetch(job: tuple[int, memoryview]) -> None:
                start, out = job
                data = obstore.get_range(store, key, start=start, length=out.nbytes)
                out[:] = memoryview(data)

            with ThreadPoolExecutor(8) as pool:
                list(pool.map(fetch, jobs))

        def tg_save_async(url: str) -> dict[str, float]:
            import time

            t0 = time.perf_counter()
            fut = tg.save(url, state, async_=True)
            blocked = time.perf_counter() - t0
            fut.result()
            return {"blocking_s": blocked}

        def manager_save(url: str, *, tiered: bool) -> dict[str, float]:
            """Two async saves by a CheckpointManager into a local directory, with or without
            a remote tier; what counts is the training thread's blocking time in the second
            (staging buffers reused, as in a run; with a tier, the first save's upload runs
            meanwhile)."""
            local = tmp / f"local-{uuid.uuid4().hex[:8]}"
            upload = {"upload_to": url} if tiered else {}
            with tg.CheckpointManager(local, state, async_save=True, **upload) as mgr:
                mgr.save(1)
                mgr.wait()
                mgr.save(2)
                mgr.wait()
                blocked = mgr.stats[-1].blocking_seconds
            shutil.rmtree(local, ignore_errors=True)
            return {"blocking_s": blocked}

        ops: dict[str, tuple[Callable[[str], Any], Callable[[str], Any]]] = {
            "raw": (raw_put, raw_get),
            "tardigrade": (lambda u: tg.save(u, state), lambda u: tg.load(u, into=live)),
            "tardigrade_async": (tg_save_async, None),  # type: ignore[dict-item]
            "manager_local_async": (
                lambda u: manager_save(u, tiered=False),
                None,  # type: ignore[dict-item]
            ),
            "manager_tiered": (lambda u: manager_save(u, tiered=True), None),  # type: ignore[dict-item]
        }
        if have_dcp:
            ops["dcp"] = (
                lambda u: dcp_save(dict(state), storage_writer=FsspecWriter(u, thread_count=8)),
                lambda u: dcp_load(live, storage_reader=FsspecReader(u)),
            )
        names = list(ops)
        for rnd in range(opts.repeats + 1):  # round 0 warms up
            order = names[rnd % len(names) :] + names[: rnd % len(names)]
            for name in order:
                save, load = ops[name]
                tag = uuid.uuid4().hex[:8]
                where = f"{name}-{tag}" if name == "raw" else f"{root}/{name}-{tag}"
                settle(opts.settle_s)
                s = measure(lambda save=save, where=where: _extra(save(where)))
                if rnd:
                    samples.setdefault(f"{name}.save", []).append(s.to_json())
                if load is not None:
                    for t in live.values():
                        t.zero_()
                    settle(opts.settle_s)
                    s = measure(lambda load=load, where=where: _extra(load(where)))
                    if rnd:
                        samples.setdefault(f"{name}.load", []).append(s.to_json())
                    for k, v in state.items():
                        assert torch.equal(live[k], v), f"{name} loaded wrong bytes ({k})"
                open_root(root).delete(where if name == "raw" else where.rsplit("/", 1)[1])
            log(f"store: round {rnd} of {opts.repeats} done" + (" (warm-up)" if not rnd else ""))
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        # At once: its data is removed next (SIGTERM with clients connected took the whole
        # 10 s grace period here).
        server.stop(grace=0)
        shutil.rmtree(tmp, ignore_errors=True)
    return {"nbytes": nbytes, "samples": samples}


def summarise(results: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "samples" not in results:
        return out
    gb = results["nbytes"] / 1e9
    for op, runs in results["samples"].items():
        secs = median(r["seconds"] for r in runs)
        out[op] = {
            "seconds": secs,
            "mb_per_s": results["nbytes"] / 1e6 / secs,
            "cpu_s_per_gb": median(r["cpu_seconds"] for r in runs) / gb,
            "peak_above_pct": 100 * max(r["peak_rss_above"] for r in runs) / results["nbytes"],
            "blocking_s": median(r["extra"].get("blocking_s", 0.0) for r in runs),
        }
    return out


def targets(summary: dict[str, Any]) -> list[Target]:
    def ratio(a: str, b: str) -> float | None:
        if a in summary and b in summary:
            return float(summary[a]["mb_per_s"] / summary[b]["mb_per_s"])
        return None

    def blocking_ratio() -> float | None:
        a, b = summary.get("manager_tiered.save"), summary.get("manager_local_async.save")
        if a is None or b is None or not b["blocking_s"]:
            return None
        return float(a["blocking_s"] / b["blocking_s"])

    def peak(op: str) -> float | None:
        return float(summary[op]["peak_above_pct"]) if op in summary else None

    return [
        Target("store save vs raw parallel put", ratio("tardigrade.save", "raw.save"), ">=", 0.8, "x"),
        Target("store save vs DCP fsspec writer", ratio("tardigrade.save", "dcp.save"), ">=", 1.5, "x"),
        Target("store load vs raw parallel get", ratio("tardigrade.load", "raw.load"), ">=", 0.8, "x"),
        Target("store load vs DCP fsspec reader", ratio("tardigrade.load", "dcp.load"), ">=", 2.0, "x"),
        Target("store save peak memory above the state", peak("tardigrade.save"), "<=", 10.0, "%"),
        Target("tiered save blocking vs a local async save", blocking_ratio(), "<=", 1.1, "x"),
        Target("store load peak memory above the state", peak("tardigrade.load"), "<=", 10.0, "%"),
    ]  # fmt: skip


def table(results: dict[str, Any], summary: dict[str, Any]) -> str:
    if not summary:
        return f"STORE (S3): skipped ({results.get('skipped', 'no results')})"
    rows = [
        [
            op,
            f"{s['seconds']:.2f}",
            f"{s['mb_per_s']:.0f}",
            f"{s['cpu_s_per_gb']:.2f}",
            f"{s['peak_above_pct']:.1f}",
            f"{s['blocking_s'] * 1000:.0f}" if s["blocking_s"] else "",
        ]
        for op, s in sorted(summary.items())
    ]
    head = f"STORE (S3 on a local SeaweedFS; {results['nbytes'] / 1e9:.2f} GB state, medians)"
    return (
        head
        + "\n"
        + _grid(
            ["operation", "s", "MB/s", "client CPU s/GB", "peak above state %", "blocked ms"], rows
        )
    )
