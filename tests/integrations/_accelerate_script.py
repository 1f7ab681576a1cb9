"""Train with accelerate through Tardigrade, for test_accelerate.py.

    python _accelerate_script.py OUT PROJECT EPOCHS [--kill-at STEP] [--workers N]

A plain accelerate loop over a prepared model, optimizer, scheduler and DataLoader (a
tg.ResumableSampler inside, iterated through sampler.track()), a registered step counter, and
accelerator.save_state() every 4 steps into PROJECT/checkpoints (automatic naming, total_limit
3). It always calls accelerator.load_state() first: a fresh project starts from scratch, a
killed one resumes from its newest complete checkpoint. --kill-at SIGKILLs the process after
that step. Each step's loss goes to OUT/steps.log; the final state to OUT/final.

Under torchrun (several processes, DDP over gloo) the loader is not prepared: accelerate would
split its batches over the processes, which a saved position does not follow. The sampler is
built after the Accelerator, so it takes its rank and world size from the process group and
hands each rank its own share, and it is registered for checkpointing (its position is the
same on every rank). Each rank draws its own dropout masks; rank 0 logs the steps.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from accelerate.utils import ProjectConfiguration
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).parent))
import _common

import tardigrade as tg
from tardigrade.integrations.accelerate import TardigradeAccelerator


class Counter:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = sd["step"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("project")
    p.add_argument("epochs", type=int)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--workers", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(1)
    _common.use_forkserver_under_ranks()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)

    accelerator = TardigradeAccelerator(
        cpu=True,
        project_config=ProjectConfiguration(
            project_dir=a.project, automatic_checkpoint_naming=True, total_limit=3
        ),
    )
    model = _common.net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
    sampler = tg.ResumableSampler(_common.N, seed=3)  # this rank's share under torchrun
    loader = DataLoader(
        tg.SeededDataset(_common.Augmented()),
        batch_size=_common.BATCH,
        sampler=sampler,
        num_workers=a.workers,
        generator=sampler.generator,
        persistent_workers=_common.under_ranks(),
    )
    counter = Counter()
    ranks = accelerator.num_processes
    if ranks == 1:
        model, opt, sched, loader = accelerator.prepare(model, opt, sched, loader)
    else:
        model, opt, sched = accelerator.prepare(model, opt, sched)
        accelerator.register_for_checkpointing(sampler)
        torch.manual_seed(1000 + accelerator.process_index)  # each rank its own dropout
    accelerator.register_for_checkpointing(counter)
    accelerator.load_state()  # the newest complete checkpoint, or nothing on a fresh project

    total = a.epochs * (_common.N // (_common.BATCH * ranks))
    model.train()
    while counter.step < total:
        for x, y in sampler.track(loader):
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            counter.step += 1
            if accelerator.is_main_process:
                _common.log_step(out, step=counter.step, epoch=sampler.epoch, loss=loss.item())
            if counter.step % 4 == 0:
                accelerator.save_state()
            if counter.step == a.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if counter.step == total:
                break
    tg.save(
        out / "final",
        {
            "model": accelerator.unwrap_model(model).state_dict(),
            "optim": opt.optimizer.state_dict(),
            "step": counter.step,
            "epoch": sampler.epoch,
        },
    )


if __name__ == "__main__":
    main()
