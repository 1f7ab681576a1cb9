"""Train with PyTorch Lightning through Tardigrade, for test_lightning.py.

    python _lightning_script.py OUT CKPTS EPOCHS [--kill-at STEP] [--resume CKPT] [--workers N]

A checkpoint every 4 steps into CKPTS (ModelCheckpoint + TardigradeCheckpointIO); with
--kill-at the process SIGKILLs itself after that step (mid-epoch); --resume continues from a
checkpoint. Each step is logged to OUT/steps.log; at the end the model and optimizer state go
to OUT/final (a Tardigrade checkpoint) with the trainer's epoch and step.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).parent))
import _common

import tardigrade as tg
from tardigrade.integrations.lightning import (
    TardigradeCallback,
    TardigradeCheckpointIO,
)


class Model(pl.LightningModule):
    def __init__(self, lr: float = 0.01, out: str = "") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = _common.net()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        if self.global_rank != 0:  # under torchrun: rank 0's losses stand for the run
            return loss
        _common.log_step(
            Path(self.hparams.out),
            step=self.global_step + 1,
            epoch=self.current_epoch,
            batch=batch_idx,
            loss=loss.item(),
        )
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.global_step == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)]


KILL_AT = -1


def main() -> None:
    global KILL_AT
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("ckpts")
    p.add_argument("epochs", type=int)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--resume", default=None)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    KILL_AT = args.kill_at
    torch.set_num_threads(1)
    _common.use_forkserver_under_ranks()
    # Each rank its own random streams (dropout differs per rank), as in real jobs: a resume
    # must give every rank back its own RNGs, not rank 0's. (DDP starts every rank from rank
    # 0's parameters.)
    pl.seed_everything(int(os.environ.get("RANK", "0")), verbose=False)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    sampler = tg.ResumableSampler(_common.N, seed=7)
    loader = DataLoader(
        tg.SeededDataset(_common.Augmented()),
        batch_size=_common.BATCH,
        sampler=sampler,
        num_workers=args.workers,
        generator=sampler.generator,
        persistent_workers=_common.under_ranks(),
    )
    model = Model(out=str(out))
    world = int(os.environ.get("WORLD_SIZE", "1"))  # under torchrun: DDP over gloo
    trainer = pl.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        devices=world,
        strategy="ddp" if world > 1 else "auto",
        use_distributed_sampler=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        plugins=[TardigradeCheckpointIO()],
        callbacks=[
            TardigradeCallback(sampler),
            ModelCheckpoint(
                dirpath=args.ckpts, filename="{step}", every_n_train_steps=4, save_top_k=-1
            ),
        ],
    )
    trainer.fit(model, loader, ckpt_path=args.resume)
    opt = trainer.optimizers[0]
    tg.save(
        out / "final",
        {
            "model": model.state_dict(),
            "optim": opt.state_dict(),
            "epoch": trainer.current_epoch,
            "step": trainer.global_step,
        },
    )


if __name__ == "__main__":
    main()
