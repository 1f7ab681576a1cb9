"""What the framework resume tests train: random augmentation in workers, dropout, Adam.

Small on purpose (40 samples of 8 features, batches of 4: 10 steps an epoch), so a run of a
few epochs in a fresh process costs the framework's import time and little else.
"""

from __future__ import annotations

import multiprocessing
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

N, FEATURES, CLASSES, BATCH = 40, 8, 3, 4


class Augmented(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Every read draws from torch, random and numpy, as real augmentation does."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(N, FEATURES, generator=g)
        self.y = (self.x @ torch.randn(FEATURES, CLASSES, generator=g)).argmax(1)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[i] + 0.3 * torch.randn(FEATURES)
        if random.random() < 0.5:
            x = x.flip(0)
        return x * float(np.random.uniform(0.7, 1.3)), self.y[i]


def net() -> nn.Module:
    # Dropout draws from the global torch RNG in every step: the RNG must resume exactly too.
    return nn.Sequential(
        nn.Linear(FEATURES, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, CLASSES)
    )


def log_step(out: Path, **fields: Any) -> None:
    """Append one line per training step (floats as hex: bit-exact), flushed before a kill."""
    text = " ".join(f"{k}={v.hex() if isinstance(v, float) else v}" for k, v in fields.items())
    with open(out / "steps.log", "a") as f:
        f.write(text + "\n")
        f.flush()


def use_forkserver_under_ranks() -> None:
    """Under torchrun, start DataLoader workers from a fork server instead of forking the rank.

    A rank runs gloo's threads, and a gloo thread that finishes a collective drops the work's
    Python references there: it creates a Python thread state, taking the interpreter's thread
    list lock without holding the GIL. A fork at that moment (the next epoch's workers start
    right after the last step's allreduce) gives the child that lock held, with no thread left
    to release it, and CPython before 3.11.10 takes it in the child inside os.fork()
    (gh-112275): the worker hangs before running a line, its rank waits for a batch forever,
    the other rank in its next allreduce (gloo's timeout is 30 minutes). Beside a CPU hog it
    hung 2 of 14 two-rank Lightning runs. The fork server is single-threaded, so forking from
    it is safe (and Python 3.14 makes it the default for this reason); one process alone runs
    no gloo threads and keeps plain fork. The price: the server imports the script once per
    rank (about 6 s of CPU for the Lightning one, 4 of them lightning's own import).
    """
    if under_ranks():
        multiprocessing.set_start_method("forkserver")


def under_ranks() -> bool:
    """Whether this runs as one of several ranks (torchrun). Their DataLoaders keep their
    workers between epochs (``persistent_workers``): each start of a worker from the fork
    server cost ~2 s here, three epochs of two workers on each rank ~13 s a run."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1
