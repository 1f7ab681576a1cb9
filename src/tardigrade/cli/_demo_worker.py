"""The training run behind ``tardigrade demo``, in a process of its own so the demo can kill it.

    python -m tardigrade.cli._demo_worker --steps 300 --every 25 --keep-last 4 --ckpt-dir DIR \\
        [--hang-in-save STEP] [--final PATH]

A small MLP with dropout learns a synthetic classification task with Adam, a cosine LR
schedule and shuffled batches from a ``DataLoader`` over a ``tg.ResumableSampler``. With
``--ckpt-dir`` the run is the loop a user writes: a ``tg.CheckpointManager`` saves
asynchronously every ``--every`` steps and keeps the last ``--keep-last``, and
``start = mgr.restore()`` resumes from the newest complete checkpoint (or starts fresh).
Without it the run trains from scratch and saves nothing.

``--hang-in-save STEP`` makes the background writer of the save of STEP stop after its first
write and announce it, so the parent can SIGKILL this process while that save is in flight.

Events go to stdout, one line each: ``@tg <event> <json>``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tardigrade as tg
from tardigrade.format.manifest import MANIFEST
from tardigrade.storage.local import LocalWriter

from ._demo_run import EVENT_PREFIX, checkpoint_name
from ._listing import INCOMPLETE_TMP, list_checkpoints

# How long the save at --hang-in-save waits for the SIGKILL before carrying on regardless.
HANG_SECONDS = 30.0

_emit_lock = threading.Lock()


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
    """One event line for the parent; whole lines, also from the background writer thread."""
    line = f"{EVENT_PREFIX}{event} {json.dumps(data)}\n"
    with _emit_lock:
        sys.stdout.write(line)
        sys.stdout.flush()


class CollectWarnings(logging.Handler):
    """Collects tardigrade's warnings (lock takeover, skipped checkpoints, ...)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def collect_warnings() -> Iterator[list[str]]:
    """The warnings the library logs inside the ``with`` block, as messages."""
    handler = CollectWarnings()
    logger = logging.getLogger("tardigrade")
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)


def make_data(cfg: Config) -> TensorDataset:
    """A fixed synthetic task: labels from a noisy random linear teacher."""
    g = torch.Generator().manual_seed(cfg.seed)
    x = torch.randn(cfg.samples, cfg.features, generator=g)
    teacher = torch.randn(cfg.features, cfg.classes, generator=g)
    y = (x @ teacher + 0.5 * torch.randn(cfg.samples, cfg.classes, generator=g)).argmax(1)
    return TensorDataset(x, y)


def make_model(cfg: Config, total_steps: int) -> tuple[nn.Module, Any, Any]:
    """The demo's model, optimizer and LR schedule, initialised from torch's current RNG."""
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
    return model, optim, sched


def make_state(cfg: Config, total_steps: int) -> dict[str, Any]:
    """The complete training state, freshly initialised: everything that resume must restore."""
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    model, optim, sched = make_model(cfg, total_steps)
    return {
        "model": model,
        "optim": optim,
        "sched": sched,
        "rng": tg.RNGState(),
        "step": 0,
        "epoch": 0,
        # The data position: (epoch, samples consumed); the order of each epoch is a
        # permutation drawn from (seed, epoch) alone.
        "data": tg.ResumableSampler(cfg.samples, shuffle=True, seed=cfg.seed),
        "losses": [],
    }


def make_loader(cfg: Config, dataset: TensorDataset, sampler: tg.ResumableSampler) -> DataLoader:
    # Every iter(loader) draws a worker base seed; without a generator of its own that draw
    # comes from the global torch RNG (which dropout uses), and a resumed run, which creates
    # its iterator mid-epoch, would diverge. The sampler's generator is reseeded from the
    # position (new epoch, restore), so it needs no place in the checkpoint.
    return DataLoader(
        dataset,
        batch_size=cfg.batch_size,
        sampler=sampler,
        drop_last=True,
        num_workers=0,  # the sampler counts what it hands out; with workers use sampler.track()
        generator=sampler.generator,
    )


def batches(loader: DataLoader) -> Iterator[Any]:
    """Batches forever; each new iterator continues from the sampler's position."""
    while True:
        yield from loader


def restore(mgr: tg.CheckpointManager, *, warnings: Sequence[str] = ()) -> int | None:
    """``start = mgr.restore()``, reporting what it found on disk, skipped, removed and restored.

    ``warnings`` are messages logged earlier (e.g. when the manager took over a dead run's
    lock); they are reported with the ones ``restore()`` logs.
    """
    before = list_checkpoints(mgr.directory) if tg.Catalog(mgr.directory).storage.is_dir("") else []
    with collect_warnings() as logged:
        start = mgr.restore()
    after = {c.name for c in list_checkpoints(mgr.directory)}
    state = mgr.state
    emit(
        "restored",
        step=start,
        name=None if start is None else checkpoint_name(start),
        # Checkpoint directories newer than the one restored did not verify or never
        # committed: skipped, and kept on disk (the warnings say why).
        skipped=[
            c.name
            for c in before
            if c.status != INCOMPLETE_TMP
            and c.step is not None
            and (start is None or c.step > start)
        ],
        removed=[c.name for c in before if c.status == INCOMPLETE_TMP and c.name not in after],
        data=state["data"].state_dict() if start is not None else None,
        loss=state["losses"][-1] if start is not None and state["losses"] else None,
        warnings=[*warnings, *logged],
    )
    return start


def install_hang(hang_at: int | None, ckpt_dir: str) -> None:
    """Make the save of step ``hang_at`` announce its first data write, then wait to be killed.

    The hook matches the save's staging directory, so no other save can trip it; with async
    saves it runs in the background writer thread while training goes on.
    """
    if hang_at is None:
        return
    original = LocalWriter.write
    marker = f"{os.sep}.tmp-{checkpoint_name(hang_at)}-"
    once = threading.Lock()  # several files may be written in parallel: announce only one

    def write(self: LocalWriter, data: memoryview | bytes, **kw: Any) -> None:
        original(self, data, **kw)
        if marker in self.path and not self.path.endswith(MANIFEST) and once.acquire(False):
            emit("saving", step=hang_at, file=os.path.relpath(self.path, ckpt_dir))
            time.sleep(HANG_SECONDS)

    LocalWriter.write = write  # type: ignore[method-assign]  # the demo's hang, in this child process only


def report_saves(mgr: tg.CheckpointManager, sent: int) -> int:
    """Send the entries of ``mgr.stats`` after the first ``sent``; return how many are sent.

    The manager records an async save when a later ``step()`` (or ``close()``) finds it done.
    """
    for s in mgr.stats[sent:]:
        emit("saved", **asdict(s), throughput_gbps=s.throughput_gbps)
    return len(mgr.stats)


def train_step(
    state: dict[str, Any],
    data: Iterator[tuple[torch.Tensor, torch.Tensor]],
    step: int,
    reduce: Any = None,
) -> None:
    """One training step of the demo's model on the next batch of ``data``; ``reduce`` (the
    ranks' demo: all-reduce the gradients) turns the loss into the number recorded."""
    model, optim, sched, sampler = state["model"], state["optim"], state["sched"], state["data"]
    x, y = next(data)
    loss = F.cross_entropy(model(x), y)
    optim.zero_grad(set_to_none=True)
    loss.backward()
    state["losses"].append(loss.item() if reduce is None else reduce(loss))
    optim.step()
    sched.step()
    state["step"] = step
    state["epoch"] = sampler.epoch


def train(args: argparse.Namespace) -> None:
    cfg = Config(seed=args.seed)
    # A model this small runs fastest on one thread; it also keeps every run's math identical.
    torch.set_num_threads(1)
    dataset = make_data(cfg)
    state = make_state(cfg, args.steps)
    model, sampler = state["model"], state["data"]
    loader = make_loader(cfg, dataset, sampler)

    mgr = None
    start = 0
    if args.ckpt_dir:
        with collect_warnings() as logged:  # e.g. taking over the lock of a killed run
            mgr = tg.CheckpointManager(
                args.ckpt_dir,
                state,
                every_steps=args.every,
                keep_last=args.keep_last,
                async_save=True,
            )
        restored = restore(mgr, warnings=logged)
        start = 0 if restored is None else restored
    install_hang(args.hang_in_save, args.ckpt_dir)
    sent = 0

    model.train()
    data = batches(loader)
    for step in range(start + 1, args.steps + 1):
        train_step(state, data, step)
        if mgr is not None:
            # Saves when step % every == 0: blocks only to copy the state to host memory.
            mgr.step(step, epoch=sampler.epoch, metrics={"loss": state["losses"][-1]})
            sent = report_saves(mgr, sent)
        emit("step", step=step)  # after mgr.step(): the demo's kill waits for a finished step
    if mgr is not None:
        mgr.close()  # waits for the last save, applies retention, releases the lock
        sent = report_saves(mgr, sent)
        emit(
            "stats",
            succeeded=mgr.stats.succeeded,
            failed=mgr.stats.failed,
            blocking_seconds=mgr.stats.blocking_seconds,
            total_seconds=mgr.stats.total_seconds,
        )
    if args.final:
        tg.save(args.final, state, step=state["step"], epoch=state["epoch"])
    emit("done", step=state["step"])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tardigrade.cli._demo_worker")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--ckpt-dir", default=None, help="checkpoint with a manager here (resuming)")
    p.add_argument("--every", type=int, default=25, help="checkpoint interval in steps")
    p.add_argument("--keep-last", type=int, default=None, help="checkpoints kept (None: all)")
    p.add_argument("--hang-in-save", type=int, default=None, metavar="STEP")
    p.add_argument("--final", default=None, help="save the final state here")
    p.add_argument("--seed", type=int, default=0)
    train(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
