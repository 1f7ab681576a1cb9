"""Train with transformers.Trainer through Tardigrade, for test_transformers.py.

    python _transformers_script.py OUT RUN EPOCHS [--kill-at STEP] [--resume] [--workers N]
                                   [--best]

RUN is the Trainer's output_dir: a checkpoint every 4 steps, save_total_limit=3. With
--kill-at the process SIGKILLs itself after that step; --resume passes
resume_from_checkpoint=True. Each step's loss goes to OUT/steps.log; at the end the model and
optimizer state go to OUT/final with the Trainer's step and epoch.

--best evaluates on a fixed set at every checkpoint and tracks the best model
(load_best_model_at_end; metric_for_best_model="eval_loss" with greater_is_better, so the
first checkpoint is the best; save_total_limit=2: rotation keeps the best besides the
newest); OUT/best.json records where the Trainer found it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import TrainerCallback, TrainingArguments

sys.path.insert(0, str(Path(__file__).parent))
import _common

import tardigrade as tg
from tardigrade.integrations.transformers import TardigradeTrainer


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = _common.net()
        self.last_loss = float("nan")

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        loss = F.cross_entropy(self.net(x), labels)
        if self.training:
            self.last_loss = loss.item()
        return {"loss": loss}


class AsDict(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        self.inner = _common.Augmented()

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, y = self.inner[i]
        return {"x": x, "labels": y}


class Fixed(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """An evaluation set without augmentation: the same loss for the same model, every run."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(99)
        self.x = torch.randn(12, _common.FEATURES, generator=g)
        self.y = torch.randint(0, _common.CLASSES, (12,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class StepLog(TrainerCallback):
    def __init__(self, out: Path, kill_at: int) -> None:
        self.out, self.kill_at = out, kill_at

    def on_step_end(
        self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any
    ) -> None:
        if args.process_index != 0:  # under torchrun: rank 0's losses stand for the run
            return
        _common.log_step(
            self.out, step=state.global_step, epoch=f"{state.epoch:.4f}", loss=model.last_loss
        )

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == self.kill_at:  # after that step (and any save it made)
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("run")
    p.add_argument("epochs", type=int)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--best", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    _common.use_forkserver_under_ranks()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    args = TrainingArguments(
        output_dir=a.run,
        per_device_train_batch_size=_common.BATCH,
        num_train_epochs=a.epochs,
        learning_rate=0.01,
        save_strategy="steps",
        save_steps=4,
        save_total_limit=2 if a.best else 3,
        **(
            {
                "eval_strategy": "steps",
                "eval_steps": 4,
                "per_device_eval_batch_size": 4,
                "load_best_model_at_end": True,
                "metric_for_best_model": "eval_loss",
                # The loss falls over this run, so the best checkpoint is the first one: it
                # must outlive rotation and the resume, and loading it at the end matters.
                "greater_is_better": True,
            }
            if a.best
            else {}
        ),
        logging_strategy="no",
        report_to="none",
        dataloader_num_workers=a.workers,
        dataloader_persistent_workers=_common.under_ranks(),
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        remove_unused_columns=False,
    )
    torch.manual_seed(0)
    model = Model()
    trainer = TardigradeTrainer(
        model=model,
        args=args,
        train_dataset=tg.SeededDataset(AsDict()),
        eval_dataset=Fixed() if a.best else None,
        callbacks=[StepLog(out, a.kill_at)],
    )
    # Each rank its own random streams (dropout differs per rank), as in real jobs: a resume
    # must give every rank back its own RNGs, not rank 0's.
    torch.manual_seed(1000 + args.process_index)
    trainer.train(resume_from_checkpoint=True if a.resume else None)
    if a.best:
        best = {
            "checkpoint": os.path.basename(trainer.state.best_model_checkpoint),
            "metric": float(trainer.state.best_metric).hex(),
            "step": trainer.state.best_global_step,
        }
        (out / "best.json").write_text(json.dumps(best))
    tg.save(
        out / "final",
        {
            "model": model.state_dict(),
            "optim": trainer.optimizer.optimizer.state_dict(),
            "step": trainer.state.global_step,
            "epoch": trainer.state.epoch,
        },
    )


if __name__ == "__main__":
    main()
