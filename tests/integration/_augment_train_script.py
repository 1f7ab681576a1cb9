"""A training run with random augmentation in DataLoader workers, for test_augmentation_resume.py.

    python _augment_train_script.py CKPT_DIR OUT_PATH TOTAL_STEPS NUM_WORKERS [--unseeded]

The dataset jitters, flips and scales every sample with ``torch``, ``random`` and ``numpy``
inside ``__getitem__``, the way real pipelines augment. It is wrapped in ``tg.SeededDataset``
(``--unseeded``: not, the way it was before the hook existed), loaded by ``NUM_WORKERS``
workers (persistent ones when there are workers) through ``sampler.track(loader)``. The run
restores the newest checkpoint in CKPT_DIR (if any), trains to TOTAL_STEPS with a checkpoint
every 6 steps, then saves its final state to OUT_PATH. It prints ``RESUMED <step|None>`` once
and ``STEP <n>`` after every step.

Environment (for the test only):
  TG_TEST_PAUSE_AT   after that step, print ``PAUSED <n>`` and block on stdin until killed
"""

from __future__ import annotations

import os
import random
import sys
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import tardigrade as tg

EVERY = 6


class Augmented(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """60 samples; every read draws from all three global RNGs."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(60, 16, generator=g)
        self.y = (self.x @ torch.randn(16, 4, generator=g)).argmax(1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[i] + 0.3 * torch.randn(16)  # torch: jitter
        if random.random() < 0.5:  # random: flip
            x = x.flip(0)
        x = x * float(np.random.uniform(0.7, 1.3))  # numpy: scale
        return x, self.y[i]


def main() -> None:
    ckpt_dir, out_path, total, workers = (
        sys.argv[1],
        sys.argv[2],
        int(sys.argv[3]),
        int(sys.argv[4]),
    )
    seeded = "--unseeded" not in sys.argv[5:]
    pause_at = int(os.environ.get("TG_TEST_PAUSE_AT", "0"))
    torch.set_num_threads(1)

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=7, gamma=0.7)
    ds = Augmented()
    sampler = tg.ResumableSampler(len(ds), shuffle=True, seed=5)
    state: dict[str, Any] = {
        "model": model,
        "optim": optim,
        "sched": sched,
        "rng": tg.RNGState(),
        "data": sampler,
        "step": 0,
        "losses": [],
        "inputs": [],  # the sum of each step's augmented batch: where inputs diverge, if they do
    }
    mgr = tg.CheckpointManager(ckpt_dir, state, every_steps=EVERY, async_save=False)
    start = mgr.restore()
    print(f"RESUMED {start}", flush=True)
    step = state["step"]
    assert step == (start or 0) and len(state["losses"]) == step, (start, step)

    loader = DataLoader(
        tg.SeededDataset(ds) if seeded else ds,
        batch_size=4,
        sampler=sampler,
        num_workers=workers,
        persistent_workers=workers > 0,
        generator=sampler.generator,
    )
    model.train()
    while step < total:
        for xb, yb in sampler.track(loader):
            step += 1
            loss = F.cross_entropy(model(xb), yb)
            optim.zero_grad()
            loss.backward()
            optim.step()
            sched.step()
            state["step"] = step
            state["losses"].append(loss.item())
            state["inputs"].append(xb.double().sum().item())
            mgr.step(step)
            print(f"STEP {step}", flush=True)
            if step == pause_at:
                print(f"PAUSED {step}", flush=True)
                sys.stdin.read()  # the parent SIGKILLs us here, workers running, mid-epoch
            if step >= total:
                break
    mgr.close()

    final = {k: state[k] for k in ("model", "optim", "sched", "data", "step", "losses", "inputs")}
    final["rng"] = tg.RNGState()
    tg.save(out_path, final, overwrite=True)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
