"""The training run behind ``tardigrade demo``, in a process of its own so the demo can kill it.

    python -m tardigrade.cli._demo_worker --steps 300 --every 25 --ckpt-dir DIR \\
        [--resume] [--hang-in-save STEP] [--final PATH]

A small MLP with dropout learns a synthetic classification task with Adam, a cosine LR
schedule and shuffled batches. The whole training state is one dict saved with ``tg.save``
every ``--every`` steps. ``--resume`` restores the newest complete checkpoint first.
``--hang-in-save STEP`` makes the save at STEP stop after its first write and announce it,
so the parent can SIGKILL this process while that save is in flight.

Events go to stdout, one line each: ``@tg <event> <json>``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import tardigrade as tg
from tardigrade.errors import TardigradeError
from tardigrade.format.manifest import MANIFEST
from tardigrade.storage.local import LocalWriter

from ._listing import committed
from .demo import EVENT_PREFIX, checkpoint_name

# How long the save at --hang-in-save waits for the SIGKILL before carrying on regardless.
HANG_SECONDS = 30.0


@dataclass(frozen=True)
class Config:
    seed: int = 0
    samples: int = 1000  # not a multiple of the batch size: the last partial batch is dropped
    features: int = 32
    classes: int = 10
    hidden: int = 256
    dropout: float = 0.1
    batch_size: int = 32
    lr: float = 3e-3


def emit(event: str, **data: Any) -> None:
    print(f"{EVENT_PREFIX}{event} {json.dumps(data)}", flush=True)


class ShuffledBatches:
    """Batches of indices in a fresh random order every epoch; its position is two ints.

    The order of epoch ``e`` comes from ``torch.randperm`` with a generator seeded by
    ``(seed, e)``, so ``(epoch, index)`` alone says exactly which samples come next.
    """

    def __init__(self, n: int, batch_size: int, seed: int) -> None:
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.epoch = 0
        self.index = 0  # samples of this epoch already handed out
        self._order: tuple[int, torch.Tensor] | None = None

    def order(self) -> torch.Tensor:
        if self._order is None or self._order[0] != self.epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            self._order = (self.epoch, torch.randperm(self.n, generator=g))
        return self._order[1]

    def next_batch(self) -> torch.Tensor:
        if self.index + self.batch_size > self.n:
            self.epoch += 1
            self.index = 0
        batch = self.order()[self.index : self.index + self.batch_size]
        self.index += self.batch_size
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.index = state["epoch"], state["index"]


def make_data(cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed synthetic task: labels from a noisy random linear teacher."""
    g = torch.Generator().manual_seed(cfg.seed)
    x = torch.randn(cfg.samples, cfg.features, generator=g)
    teacher = torch.randn(cfg.features, cfg.classes, generator=g)
    y = (x @ teacher + 0.5 * torch.randn(cfg.samples, cfg.classes, generator=g)).argmax(1)
    return x, y


def make_state(cfg: Config, total_steps: int) -> dict[str, Any]:
    """The complete training state, freshly initialised: everything that resume must restore."""
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    model = nn.Sequential(
        nn.Linear(cfg.features, cfg.hidden),
        nn.ReLU(),
        nn.Dropout(cfg.dropout),
        nn.Linear(cfg.hidden, cfg.hidden),
        nn.ReLU(),
        nn.Dropout(cfg.dropout),
        nn.Linear(cfg.hidden, cfg.classes),
    )
    optim = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=total_steps)
    return {
        "model": model,
        "optim": optim,
        "sched": sched,
        "rng": tg.RNGState(),
        "step": 0,
        "epoch": 0,
        "data": ShuffledBatches(cfg.samples, cfg.batch_size, cfg.seed),
        "losses": [],
    }


def restore_latest(ckpt_dir: str, state: dict[str, Any]) -> str | None:
    """Restore the newest checkpoint that is complete and verifies; return its name."""
    for c in reversed(committed(ckpt_dir)):
        try:
            # Verify first: load(into=) reads straight into the live tensors, so a damaged
            # checkpoint must be rejected before any of its bytes reach the model.
            tg.verify(c.path)
            # Restore in place: tensors are read into the live model and optimizer,
            # load_state_dict() is called on each object, the RNGs are reset, and plain values
            # (step, epoch, the loss list) are replaced.
            tg.load(c.path, into=state)
        except TardigradeError as e:
            emit("skipped", name=c.name, reason=str(e))
            continue
        return c.name
    return None


def install_hang(hang_at: int | None, ckpt_dir: str) -> dict[str, bool]:
    """Make the save of step ``hang_at`` announce its first data write, then wait to be killed."""
    armed = {"on": False}
    if hang_at is None:
        return armed
    original = LocalWriter.write

    def write(self: LocalWriter, data: memoryview | bytes) -> None:
        original(self, data)
        if armed["on"] and not self.path.endswith(MANIFEST):
            armed["on"] = False
            emit("saving", step=hang_at, file=os.path.relpath(self.path, ckpt_dir))
            time.sleep(HANG_SECONDS)

    LocalWriter.write = write  # type: ignore[method-assign]
    return armed


def train(args: argparse.Namespace) -> None:
    cfg = Config(seed=args.seed)
    # A model this small runs fastest on one thread; it also keeps every run's math identical.
    torch.set_num_threads(1)
    x, y = make_data(cfg)
    state = make_state(cfg, args.steps)
    if args.resume:
        name = restore_latest(args.ckpt_dir, state)
        emit("resumed", name=name, step=state["step"])
    armed = install_hang(args.hang_in_save, args.ckpt_dir)
    model, optim, sched, data = state["model"], state["optim"], state["sched"], state["data"]
    model.train()
    while state["step"] < args.steps:
        batch = data.next_batch()
        loss = F.cross_entropy(model(x[batch]), y[batch])
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        sched.step()
        state["step"] += 1
        state["epoch"] = data.epoch
        state["losses"].append(loss.item())
        step = state["step"]
        emit("step", step=step)
        if args.ckpt_dir and args.every and step % args.every == 0:
            armed["on"] = step == args.hang_in_save
            result = tg.save(
                os.path.join(args.ckpt_dir, checkpoint_name(step)),
                state,
                step=step,
                epoch=state["epoch"],
                metrics={"loss": state["losses"][-1]},
            )
            emit("saved", step=step, seconds=result.total_seconds, nbytes=result.nbytes)
    if args.final:
        tg.save(args.final, state, step=state["step"], epoch=state["epoch"])
    emit("done", step=state["step"])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tardigrade.cli._demo_worker")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--every", type=int, default=0, help="checkpoint interval (0: never)")
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--hang-in-save", type=int, default=None, metavar="STEP")
    p.add_argument("--final", default=None, help="save the final state here")
    p.add_argument("--seed", type=int, default=0)
    train(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
