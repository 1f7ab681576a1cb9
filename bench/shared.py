"""Write only what changed: saves that share data (format 7) against full saves, in one run.

- ``lora``: a fine-tuning state, a frozen base (fp32 weights, ~2/3 of the bench state's
  bytes) and a trainable low-rank adapter of ~2% of its parameters with AdamW's two moments.
  A full save of it (``tg.save``, no sharing: today's save) against the next save with
  ``base=`` the previous checkpoint after a training step changed the adapter: its bytes
  written (against the bytes that changed) and its time; and an upload (``copy_checkpoint``
  to a second directory holding the previous upload) against a full upload.
- ``dense``: every tensor changes each save (the bench's usual case): a synchronous save and
  an async save's blocking with sharing against the same without it (the hashing must hide
  under the write), and a load of each. The saves with sharing remember what changed, as a
  manager's do (``_shared.Changes``).
- ``spread``: a checkpoint whose objects were written by 10 earlier saves (each changed a
  tenth of the tensors) loads against a plain checkpoint of the same state.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

import torch

import tardigrade as tg
from tardigrade._save import base_index, save_with
from tardigrade._save_job import SaveOptions
from tardigrade._shared import Changes
from tardigrade._tiers import copy_checkpoint
from tardigrade.storage import LocalStorage

from .measure import measure, settle
from .report import Target, _grid

LAYERS = 8
SPREAD = 10


@dataclass(frozen=True)
class SharedOptions:
    nbytes: int  # the frozen base's bytes
    repeats: int
    settle_s: float
    dir: Path


def lora_state(nbytes: int) -> dict[str, Any]:
    """A base of ``LAYERS`` square fp32 weights of ``nbytes`` in all, frozen; an adapter of
    rank ~1% of the width per layer (two factors: ~2% of the base's parameters); AdamW's two
    moments of the adapter."""
    width = max(64, int((nbytes / 4 / LAYERS) ** 0.5))
    rank = max(1, width // 100)
    g = torch.Generator().manual_seed(0)
    base = {f"l{i}": torch.randn(width, width, generator=g) for i in range(LAYERS)}
    adapter = {
        f"l{i}.{ab}": torch.randn(*shape, generator=g)
        for i in range(LAYERS)
        for ab, shape in (("a", (rank, width)), ("b", (width, rank)))
    }
    moments = {k: {"m": torch.zeros_like(v), "v": torch.zeros_like(v)} for k, v in adapter.items()}
    return {"base": base, "adapter": adapter, "optim": moments, "step": 0}


def train(state: dict[str, Any]) -> int:
    """One step: the adapter and its moments change; returns the bytes that changed."""
    state["step"] += 1
    changed = 0
    for k, w in state["adapter"].items():
        m = state["optim"][k]
        m["m"].mul_(0.9).add_(0.01)
        m["v"].mul_(0.99).add_(0.001)
        w.sub_(1e-3 * m["m"])
        changed += 3 * w.nbytes
    return changed


def _size(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _lora(opts: SharedOptions, work: Path) -> dict[str, Any]:
    state = lora_state(opts.nbytes)
    out: dict[str, Any] = {"full_s": [], "shared_s": [], "shared_bytes": [], "changed_bytes": []}
    tg.save(work / "run" / "plain", state)  # shares nothing: the next one writes the objects
    tg.save(work / "run" / "first", state, base=work / "run" / "plain")
    shutil.rmtree(work / "run" / "plain")
    copy_checkpoint(LocalStorage(str(work / "run")), "first", LocalStorage(str(work / "up")))
    up_first = _size(work / "up")
    previous = "first"
    for rnd in range(opts.repeats):
        changed = train(state)
        settle(opts.settle_s)
        full = measure(lambda rnd=rnd: {"n": tg.save(work / f"full-{rnd}", state).nbytes})
        shutil.rmtree(work / f"full-{rnd}")
        settle(opts.settle_s)
        name = f"next-{rnd}"
        result: list[Any] = []

        def save(name: str = name, prev: str = previous, into: list[Any] = result) -> None:
            into.append(tg.save(work / "run" / name, state, base=work / "run" / prev))

        s = measure(save)
        out["full_s"].append(full.seconds)
        out["shared_s"].append(s.seconds)
        out["shared_bytes"].append(result[0].nbytes)
        out["changed_bytes"].append(changed)
        before = _size(work / "up")
        copy_checkpoint(LocalStorage(str(work / "run")), name, LocalStorage(str(work / "up")))
        out.setdefault("upload_bytes", []).append(_size(work / "up") - before)
        previous = name
    out["full_upload_bytes"] = up_first
    return out


BLOCKING_SAMPLES = 3  # async saves per round and side in the dense part


def _dense(opts: SharedOptions, work: Path) -> dict[str, Any]:
    state = lora_state(opts.nbytes)["base"]  # every tensor changes between saves
    out: dict[str, list[float]] = {}
    # A checkpointer each (their staging reused from save to save, as a manager's is).
    savers = {"plain": tg.AsyncCheckpointer(), "shared": tg.AsyncCheckpointer()}
    # What each save found new, for the next one's (a manager's saves keep it): the chunks
    # that changed are then hashed as they are written.
    changes = {"sync": Changes(), "async": Changes()}

    def options(where: Path, base: Path | None, kind: str) -> SaveOptions:
        if base is None:
            return SaveOptions()
        index = base_index(where, base, None)
        index.changes = changes[kind]
        return SaveOptions(shared=index)

    for rnd in range(opts.repeats + 1):  # round 0 warms the async savers' staging up
        for t in state.values():
            t.add_(1.0)
        tg.save(work / f"base-{rnd}", state)  # a base that shares nothing: all written
        pair: list[tuple[str, Path | None]] = [("plain", None), ("shared", work / f"base-{rnd}")]
        for key, base in pair if rnd % 2 else pair[::-1]:
            where = work / f"{key}-{rnd}"
            settle(opts.settle_s)
            chosen = options(where, base, "sync")
            s = measure(lambda where=where, o=chosen: {"n": save_with(where, state, o).nbytes})  # type: ignore[union-attr]  # fmt: skip
            out.setdefault(f"{key}_save_s", []).append(s.seconds)
            live = {k: torch.empty_like(v) for k, v in state.items()}
            settle(opts.settle_s)
            loaded = measure(lambda where=where, live=live: tg.load(where, into=live) and None)
            out.setdefault(f"{key}_load_s", []).append(loaded.seconds)
            del live
            shutil.rmtree(where)
            # Blocking is tens of ms and varies 2x from save to save on a shared VM (what the
            # load before left in memory): several samples a round, both sides alike.
            for _ in range(BLOCKING_SAMPLES):
                settle(opts.settle_s)
                fut = savers[key].submit(where, state, options(where, base, "async"))
                assert fut is not None
                res = fut.result()
                out.setdefault(f"{key}_blocking_s", []).append(res.blocking_seconds)
                shutil.rmtree(where)
        shutil.rmtree(work / f"base-{rnd}")
        for p in (work / ".shared").glob("*/*"):
            p.unlink()
    for saver in savers.values():
        saver.close()
    # Round 0's samples (each side's first round) warmed up; the rest count.
    return {k: v[BLOCKING_SAMPLES if k.endswith("_blocking_s") else 1 :] for k, v in out.items()}


def _spread(opts: SharedOptions, work: Path) -> dict[str, Any]:
    state = lora_state(opts.nbytes)["base"]
    keys = sorted(state)
    root = work / "spread"
    previous = None
    for i in range(SPREAD):
        # Each save changes a tenth of the tensors (rows of each, so all its tensors are split
        # across saves once the weights are in 64 MiB objects).
        for j, k in enumerate(keys):
            if j % SPREAD == i % len(keys) or (len(keys) < SPREAD and i < len(keys) and j == i):
                state[k].add_(1.0)
        tg.save(root / f"s{i}", state, base=None if previous is None else root / previous)
        previous = f"s{i}"
    tg.save(work / "plain", state)
    out: dict[str, list[float]] = {"spread_load_s": [], "plain_load_s": []}
    for rnd in range(opts.repeats):
        pair = [("plain_load_s", work / "plain"), ("spread_load_s", root / previous)]
        for key, where in pair if rnd % 2 else pair[::-1]:
            live = {k: torch.empty_like(v) for k, v in state.items()}
            settle(opts.settle_s)
            s = measure(lambda where=where, live=live: tg.load(where, into=live) and None)
            out[key].append(s.seconds)
            assert all(torch.equal(live[k], state[k]) for k in keys)
            del live
    return out


def run(opts: SharedOptions, log: Callable[[str], None]) -> dict[str, Any]:
    opts.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="shared-", dir=opts.dir))
    log(f"shared data: a {opts.nbytes / 1e9:.2f} GB frozen base with a LoRA adapter")
    try:
        results = {"lora": _lora(opts, work / "lora")}
        log("shared data: dense saves (everything changes)")
        results["dense"] = _dense(opts, work / "dense")
        log(f"shared data: a checkpoint spread over {SPREAD} saves")
        results["spread"] = _spread(opts, work / "spread")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"nbytes": opts.nbytes, **results}


def summarise(results: dict[str, Any]) -> dict[str, Any]:
    if "lora" not in results:
        return {}
    lora, dense, spread = results["lora"], results["dense"], results["spread"]
    out = {
        "lora_full_s": median(lora["full_s"]),
        "lora_shared_s": median(lora["shared_s"]),
        "lora_written_vs_changed": median(
            w / c for w, c in zip(lora["shared_bytes"], lora["changed_bytes"], strict=True)
        ),
        "lora_upload_vs_full": median(lora["upload_bytes"]) / lora["full_upload_bytes"],
    }
    for k, v in dense.items():
        out[f"dense_{k}"] = median(v)
    for k, v in spread.items():
        out[k] = median(v)
    return out


def targets(s: dict[str, Any]) -> list[Target]:
    def ratio(a: str, b: str) -> float | None:
        return s[a] / s[b] if a in s and b in s and s[b] else None

    return [
        Target("shared data: LoRA save, bytes written / bytes changed", s.get("lora_written_vs_changed"), "<=", 1.05, "x"),
        Target("shared data: LoRA save time / a full save's", ratio("lora_shared_s", "lora_full_s"), "<=", 0.3, "x"),
        Target("shared data: LoRA upload bytes / a full upload's", s.get("lora_upload_vs_full"), "<=", 0.1, "x"),
        Target("shared data: dense save time / without sharing", ratio("dense_shared_save_s", "dense_plain_save_s"), "<=", 1.05, "x"),
        Target("shared data: dense async blocking / without sharing", ratio("dense_shared_blocking_s", "dense_plain_blocking_s"), "<=", 1.05, "x"),
        Target("shared data: dense load / without sharing", ratio("dense_shared_load_s", "dense_plain_load_s"), "<=", 1.05, "x"),
        Target(f"shared data: load spread over {SPREAD} saves / a plain load", ratio("spread_load_s", "plain_load_s"), "<=", 1.1, "x"),
    ]  # fmt: skip


def table(results: dict[str, Any], s: dict[str, Any]) -> str:
    if not s:
        return "SHARED DATA: skipped"
    rows = [
        ["LoRA: full save (no sharing)", f"{s['lora_full_s']:.3f}", ""],
        ["LoRA: next save, sharing", f"{s['lora_shared_s']:.3f}", f"{s['lora_written_vs_changed']:.2f}x the changed bytes"],
        ["LoRA: upload of the next checkpoint", "", f"{s['lora_upload_vs_full']:.3f}x a full upload's bytes"],
        ["dense: save, plain / sharing", f"{s['dense_plain_save_s']:.3f} / {s['dense_shared_save_s']:.3f}", ""],
        ["dense: async blocking, plain / sharing", f"{s['dense_plain_blocking_s']:.3f} / {s['dense_shared_blocking_s']:.3f}", ""],
        ["dense: load, plain / sharing", f"{s['dense_plain_load_s']:.3f} / {s['dense_shared_load_s']:.3f}", ""],
        [f"load spread over {SPREAD} saves / plain", f"{s['spread_load_s']:.3f} / {s['plain_load_s']:.3f}", ""],
    ]  # fmt: skip
    return (
        f"SHARED DATA: a {results['nbytes'] / 1e9:.2f} GB frozen base + LoRA adapter (medians)\n"
        + _grid(["", "s", ""], rows)
    )
