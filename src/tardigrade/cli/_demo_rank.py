"""One rank of ``tardigrade demo --ranks N``, in a process of its own so the demo can kill it.

    python -m tardigrade.cli._demo_rank --rank R --world N --port PORT --steps 300 \\
        [--ckpt-dir DIR --every 25 --keep-last 4] [--resume CKPT] [--hang-in-save STEP] \\
        [--final PATH]

The rank joins a gloo group through the store the parent serves on 127.0.0.1:PORT and trains
the demo's MLP data-parallel: every rank holds the whole model, draws its own share of each
global batch from a ``tg.ResumableSampler(rank=R, world_size=N)``, applies its own dropout
(its RNG is ``tg.PerRank(tg.RNGState())``) and averages gradients with one all-reduce a step.
With ``--ckpt-dir`` every rank calls ``tg.save`` every ``--every`` steps (a collective save:
each rank writes its own files, rank 0 commits); ``--resume CKPT`` first restores
``tg.load(CKPT, into=state)`` on every rank.

``--hang-in-save STEP`` makes this rank stop after its first data write of the save of STEP and
announce it, so the parent can SIGKILL it while the save is in flight. A save that fails (the
other ranks see the killed one go) is reported and ends the process with exit status 3.

Events go to stdout, one line each: ``@tg <event> <json>``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import tardigrade as tg

from ._demo_run import checkpoint_name
from ._demo_worker import (
    Config,
    batches,
    emit,
    install_hang,
    make_data,
    make_loader,
    make_model,
    train_step,
)
from ._listing import COMMITTED, list_checkpoints

# Exit status of a rank whose collective save failed (a peer died mid-save).
EXIT_SAVE_FAILED = 3


def make_state(cfg: Config, total_steps: int, rank: int, world: int) -> dict[str, Any]:
    """The complete training state of one rank, freshly initialised."""
    # Seeded alike on every rank: every rank starts from the same parameters, as DDP requires.
    torch.manual_seed(cfg.seed)
    model, optim, sched = make_model(cfg, total_steps)
    # Then apart: each rank draws its own dropout masks, so its RNG is a per-rank value.
    rank_seed = cfg.seed * 1000 + rank + 1
    random.seed(rank_seed)
    np.random.seed(rank_seed)
    torch.manual_seed(rank_seed)
    return {
        "model": model,  # replicated: identical on every rank, written once in total
        "optim": optim,
        "sched": sched,
        "rng": tg.PerRank(tg.RNGState()),
        "step": 0,
        "epoch": 0,
        # The global data position; each rank takes every world-th sample of a global batch.
        "data": tg.ResumableSampler(
            cfg.samples,
            shuffle=True,
            seed=cfg.seed,
            rank=rank,
            world_size=world,
            batch_size=cfg.batch_size,
            drop_last=True,
        ),
        "losses": [],  # the global (all-reduced) loss of each step, the same on every rank
    }


def average_gradients(params: list[torch.Tensor], loss: torch.Tensor, world: int) -> float:
    """All-reduce the gradients and the loss in one buffer; return the global mean loss.

    Gloo's all-reduce gives every rank the same bytes, so the ranks stay identical.
    """
    grads = [p.grad for p in params if p.grad is not None]  # every one after backward()
    flat = torch.cat([*(g.reshape(-1) for g in grads), loss.detach().reshape(1)])
    dist.all_reduce(flat)
    flat /= world
    at = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[at : at + n].view_as(g))
        at += n
    return float(flat[-1])


def apply_retention(ckpt_dir: str, keep_last: int) -> None:
    """Keep the ``keep_last`` newest committed checkpoints (rank 0, after a commit)."""
    committed = [c for c in list_checkpoints(ckpt_dir) if c.status == COMMITTED]
    for c in committed[:-keep_last]:
        tg.Catalog(ckpt_dir).retire(c.name)  # out of view first, as retention does


def train(args: argparse.Namespace) -> int:
    cfg = Config(seed=args.seed)
    rank, world = args.rank, args.world
    torch.set_num_threads(1)
    wait = datetime.timedelta(seconds=args.timeout * 6)  # joining may wait for slow starters
    store = dist.TCPStore("127.0.0.1", args.port, is_master=False, timeout=wait)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=wait)
    status = _train(args, cfg, rank, world)
    # Also after a failed save: freeing the group stops its gloo threads, which must not run
    # into the interpreter's teardown (see distributed._collectives). The peer that failed
    # the save was killed, so its connections are closed and nothing waits for it here.
    dist.destroy_process_group()
    return status


def _train(args: argparse.Namespace, cfg: Config, rank: int, world: int) -> int:
    dataset = make_data(cfg)
    state = make_state(cfg, args.steps, rank, world)
    model, sampler = state["model"], state["data"]
    loader = make_loader(cfg, dataset, sampler)
    params = list(model.parameters())

    start = 0
    if args.resume:
        began = time.perf_counter()
        keys = [k for k in state if k not in (args.skip_restore or [])]
        tg.load(args.resume, into=state, keys=keys, timeout=args.timeout)
        start = state["step"]
        if rank == 0:
            emit(
                "restored",
                step=start,
                seconds=time.perf_counter() - began,
                data=sampler.state_dict(),
                loss=state["losses"][-1] if state["losses"] else None,
                skipped=args.skip_restore or [],
            )
    if args.hang_in_save is not None:
        install_hang(args.hang_in_save, args.ckpt_dir)

    model.train()
    data = batches(loader)
    for step in range(start + 1, args.steps + 1):
        train_step(state, data, step, lambda loss: average_gradients(params, loss, world))
        if args.ckpt_dir and step % args.every == 0:
            path = os.path.join(args.ckpt_dir, checkpoint_name(step))
            began = time.perf_counter()
            try:
                result = tg.save(path, state, step=step, epoch=sampler.epoch, timeout=args.timeout)
            except tg.DistributedError as e:
                emit(
                    "save_failed",
                    rank=rank,
                    step=step,
                    error=type(e).__name__,
                    message=str(e),
                    seconds=time.perf_counter() - began,
                )
                return EXIT_SAVE_FAILED
            if rank == 0:
                assert isinstance(result, tg.SaveResult)
                apply_retention(args.ckpt_dir, args.keep_last)
                emit(
                    "saved",
                    step=step,
                    nbytes=result.nbytes,
                    files=result.files,
                    seconds=result.total_seconds,
                )
        if rank == 0:
            emit("step", step=step)
    if args.final:
        tg.save(args.final, state, step=state["step"], epoch=state["epoch"], timeout=args.timeout)
    if rank == 0:
        emit("done", step=state["step"])
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tardigrade.cli._demo_rank")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True, help="the parent's store on 127.0.0.1")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--ckpt-dir", default=None, help="save collectively into this directory")
    p.add_argument("--every", type=int, default=25, help="checkpoint interval in steps")
    p.add_argument("--keep-last", type=int, default=4, help="committed checkpoints kept")
    p.add_argument("--resume", default=None, metavar="CKPT", help="tg.load(CKPT, into=state)")
    p.add_argument(
        "--skip-restore",
        action="append",
        metavar="KEY",
        help="leave this top-level key of the state as initialised on resume (for tests: an "
        "inexact resume must be caught)",
    )
    p.add_argument("--hang-in-save", type=int, default=None, metavar="STEP")
    p.add_argument("--final", default=None, help="save the final state here (collectively)")
    p.add_argument("--timeout", type=float, default=10.0, help="collective timeout in seconds")
    p.add_argument("--seed", type=int, default=0)
    return train(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
