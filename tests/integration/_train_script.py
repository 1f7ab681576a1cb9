"""A small training run for test_exact_resume.py, written the way a user would write it.

    python _train_script.py CKPT_DIR OUT_PATH TOTAL_STEPS

It restores the newest checkpoint in CKPT_DIR (if any), trains to TOTAL_STEPS steps with a
checkpoint every 5 steps, then saves its final state to OUT_PATH with ``tg.save``. It prints
``RESUMED <step|None>`` once and ``STEP <n>`` after every step, so the parent can SIGKILL it at
a chosen point.

Environment (for the test only):
  TG_TEST_STEP_SLEEP       seconds to sleep after each step, so a kill lands near a chosen step
  TG_TEST_SLOW_SAVE_STEP   stall the writer of that step's save (prints ``SAVE_STARTED <n>``)
"""

from __future__ import annotations

import os
import random
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tardigrade as tg


def stall_save_of(step: int) -> None:
    """Make the background writer hang in the first data write of ``step``'s save."""
    from tardigrade.storage import local

    real_write = local.LocalWriter.write
    marker = f"step-{step:09d}"

    def write(self: local.LocalWriter, data: memoryview | bytes, **kw: Any) -> None:
        if marker in self.path:
            # One write call: the training thread prints too.
            sys.stdout.write(f"SAVE_STARTED {step} {self.path}\n")
            sys.stdout.flush()
            time.sleep(600)  # the parent kills us here
        real_write(self, data, **kw)

    local.LocalWriter.write = write  # type: ignore[method-assign]


def main() -> None:
    ckpt_dir, out_path, total = sys.argv[1], sys.argv[2], int(sys.argv[3])
    step_sleep = float(os.environ.get("TG_TEST_STEP_SLEEP", "0"))
    if os.environ.get("TG_TEST_SLOW_SAVE_STEP"):
        stall_save_of(int(os.environ["TG_TEST_SLOW_SAVE_STEP"]))
    torch.set_num_threads(1)

    g = torch.Generator().manual_seed(1234)
    x = torch.randn(203, 16, generator=g)  # 25 full batches and a short one per epoch
    y = (x @ torch.randn(16, 4, generator=g)).argmax(1)
    ds = TensorDataset(x, y)

    # Seed every RNG, as for any reproducible run; a resumed run then restores them all.
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=7, gamma=0.7)
    sampler = tg.ResumableSampler(len(ds), shuffle=True, seed=5)
    state = {
        "model": model,
        "optim": optim,
        "sched": sched,
        "rng": tg.RNGState(),
        "data": sampler,
        "step": 0,
        "losses": [],
    }
    mgr = tg.CheckpointManager(ckpt_dir, state, every_steps=5, keep_last=3, async_save=True)
    start = mgr.restore()
    print(f"RESUMED {start}", flush=True)
    step = state["step"]
    assert step == (start or 0) and len(state["losses"]) == step, (start, step)

    # The loader gets its own generator: without one, every new DataLoader iterator draws a
    # seed from the global torch RNG, and a resumed run creates its iterator at a different
    # point of that stream than the uninterrupted run (see test_sampler.py).
    loader = DataLoader(ds, batch_size=8, sampler=sampler, generator=torch.Generator())
    model.train()
    while step < total:
        for xb, yb in loader:
            step += 1
            loss = F.cross_entropy(model(xb), yb)
            optim.zero_grad()
            loss.backward()
            optim.step()
            sched.step()
            state["step"] = step
            state["losses"].append(loss.item())
            mgr.step(step)
            sys.stdout.write(f"STEP {step}\n")
            sys.stdout.flush()
            if step_sleep:
                time.sleep(step_sleep)
            if step >= total:
                break
    mgr.close()

    final = {
        "model": model,
        "optim": optim,
        "sched": sched,
        "rng": tg.RNGState(),
        "data": sampler,
        "step": step,
        "losses": state["losses"],
    }
    tg.save(out_path, final, overwrite=True)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
