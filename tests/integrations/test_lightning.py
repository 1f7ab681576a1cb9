"""PyTorch Lightning through tardigrade.integrations.lightning: exact resume and the plugin."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import tardigrade as tg
from tardigrade.errors import UnsupportedTypeError
from tardigrade.integrations.lightning import (
    TardigradeCallback,
    TardigradeCheckpointIO,
    is_tardigrade_checkpoint,
)

from ._runs import assert_same_run, run, steps

# Each test runs whole training scripts in fresh interpreters (three runs, some on two ranks):
# minutes on a loaded 2-core machine, not the default two.
pytestmark = pytest.mark.timeout(360)


@pytest.mark.slow
@pytest.mark.crash
def test_a_run_killed_mid_epoch_resumes_bit_identically(tmp_path: Path) -> None:
    # 10 steps an epoch, 3 epochs, 2 workers, augmentation, dropout; a checkpoint every 4
    # steps; killed after step 14 (epoch 1, batch 4), resumed from step 12 (mid-epoch).
    script = "_lightning_script.py"
    run(script, tmp_path / "full", tmp_path / "ck_full", 3)
    run(script, tmp_path / "killed", tmp_path / "ck", 3, "--kill-at", 14, expect_kill=True)
    resume = tmp_path / "ck" / "step=12.ckpt"
    assert is_tardigrade_checkpoint(resume)
    assert tg.verify(resume).tensors > 0
    run(script, tmp_path / "resumed", tmp_path / "ck", 3, "--resume", resume)
    assert_same_run(tmp_path / "full", tmp_path / "killed", tmp_path / "resumed", saved_at=12)
    final = tg.load(tmp_path / "resumed" / "final")
    assert (final["epoch"], final["step"]) == (3, 30)

    # Resumed from the checkpoint saved with an epoch's last batch (step 20, end of epoch 1):
    # the next epoch starts whole, as in the uninterrupted run.
    boundary = tmp_path / "ck_full" / "step=20.ckpt"
    run(script, tmp_path / "from20", tmp_path / "ck20", 3, "--resume", boundary)
    want, got = steps(tmp_path / "full"), steps(tmp_path / "from20")
    assert sorted(got) == list(range(21, 31))
    assert all(got[s] == want[s] for s in got), [s for s in got if got[s] != want[s]]


@pytest.mark.slow
@pytest.mark.crash
def test_two_gloo_ranks_killed_mid_epoch_resume_bit_identically(tmp_path: Path) -> None:
    # torchrun, strategy="ddp" on 2 CPU ranks with their own dropout streams: 5 steps an
    # epoch; rank 0 is SIGKILLed after step 11, the newest checkpoint is step 8 (mid-epoch 1).
    # Lightning writes from rank 0 alone; the callback gathers every rank's RNGs into it.
    script = "_lightning_script.py"
    run(script, tmp_path / "full", tmp_path / "ck_full", 3, ranks=2)
    run(script, tmp_path / "killed", tmp_path / "ck", 3, "--kill-at", 11, ranks=2, expect_kill=True)
    resume = tmp_path / "ck" / "step=8.ckpt"
    run(script, tmp_path / "resumed", tmp_path / "ck", 3, "--resume", resume, ranks=2)
    assert_same_run(tmp_path / "full", tmp_path / "killed", tmp_path / "resumed", saved_at=8)


class Tiny(pl.LightningModule):
    def __init__(self, width: int = 4, note: Any = "plain") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(width, 2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.mse_loss(self.layer(batch[0]), torch.zeros(len(batch[0]), 2))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(
    tmp_path: Path, model: pl.LightningModule, *, callback: bool = True, **ckpt: Any
) -> pl.Trainer:
    sampler = tg.ResumableSampler(16, seed=0)
    loader = DataLoader(
        TensorDataset(torch.randn(16, 4)),
        batch_size=4,
        sampler=sampler,
        generator=sampler.generator,
    )
    trainer = pl.Trainer(
        max_epochs=2,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[TardigradeCheckpointIO(**ckpt.pop("io", {}))],
        callbacks=[
            *([TardigradeCallback(sampler)] if callback else []),
            ModelCheckpoint(dirpath=tmp_path, **ckpt),
        ],
    )
    trainer.fit(model, loader)
    return trainer


def test_load_from_checkpoint_reads_a_tardigrade_checkpoint(tmp_path: Path) -> None:
    model = Tiny(width=4)
    _fit(tmp_path, model, filename="last", every_n_train_steps=8)
    loaded = Tiny.load_from_checkpoint(tmp_path / "last.ckpt")
    assert loaded.hparams.width == 4 and loaded.hparams.note == "plain"
    assert torch.equal(loaded.layer.weight, model.layer.weight)


def test_the_checkpoint_io_without_its_callback_warns_once_at_the_users_line(
    tmp_path: Path,
) -> None:
    """Without TardigradeCallback the RNGs and data position are in no checkpoint: a resumed
    run differs silently. The plugin says so once, naming the fix."""
    with pytest.warns(UserWarning, match=r"without the state of TardigradeCallback") as caught:
        _fit(tmp_path / "a", Tiny(), callback=False, every_n_train_steps=2)
    ours = [w for w in caught if "TardigradeCallback" in str(w.message)]
    assert len(ours) == 1 and "callbacks=[TardigradeCallback()]" in str(ours[0].message)
    assert "/src/tardigrade/" not in ours[0].filename  # the caller's line, not ours
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message=r"(?!tardigrade)")  # Lightning's own
        _fit(tmp_path / "b", Tiny(), every_n_train_steps=2)  # with the callback: quiet


def test_retention_removes_what_model_checkpoint_drops(tmp_path: Path) -> None:
    _fit(tmp_path, Tiny(), filename="{step}", every_n_train_steps=2, save_top_k=1)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["step=8.ckpt"], left  # no half-deleted .tmp-deleting-* either
    assert is_tardigrade_checkpoint(tmp_path / "step=8.ckpt")


def test_a_hyperparameter_of_unknown_type_is_refused_by_name_unless_opted_in(
    tmp_path: Path,
) -> None:
    with pytest.raises(UnsupportedTypeError, match=r"\['hyper_parameters'\]\['note'\].*'str'"):
        _fit(tmp_path / "a", Tiny(note=Path("/data")), every_n_train_steps=8)
    _fit(
        tmp_path / "b",
        Tiny(note=Path("/data")),
        filename="x",
        every_n_train_steps=8,
        io={"unknown_hparams": "str"},
    )
    assert (
        tg.load(tmp_path / "b" / "x.ckpt", keys=["hyper_parameters"])["hyper_parameters"]["note"]
        == "/data"
    )


def test_a_ranks_rngs_round_trip_through_the_bytes_gathered_under_ddp() -> None:
    import random

    import numpy as np

    from tardigrade.integrations.lightning import _rng_bytes, _set_rng_bytes

    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in python's state
    np.random.randn()  # ... and in numpy's
    saved = _rng_bytes()
    want = (random.random(), random.gauss(0, 1), np.random.randn(), torch.rand(3))
    _set_rng_bytes(saved)
    got = (random.random(), random.gauss(0, 1), np.random.randn(), torch.rand(3))
    assert want[:3] == got[:3] and torch.equal(want[3], got[3])
