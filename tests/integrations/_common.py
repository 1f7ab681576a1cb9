"""What the framework resume tests train: random augmentation in workers, dropout, Adam.

Small on purpose (40 samples of 8 features, batches of 4: 10 steps an epoch), so a run of a
few epochs in a fresh process costs the framework's import time and little else.
"""

from __future__ import annotations

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
