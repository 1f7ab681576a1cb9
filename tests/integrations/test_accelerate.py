"""accelerate through tardigrade.integrations.accelerate: exact resume, naming, rotation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from accelerate.utils import ProjectConfiguration

import tardigrade as tg
from tardigrade.errors import CheckpointNotFoundError
from tardigrade.integrations.accelerate import TardigradeAccelerator

from ._runs import assert_same_run, run

# Each test runs whole training scripts in fresh interpreters (three runs, some on two ranks):
# minutes on a loaded 2-core machine, not the default two.
pytestmark = pytest.mark.timeout(360)

SCRIPT = "_accelerate_script.py"


@pytest.mark.slow
@pytest.mark.crash
def test_a_run_killed_mid_epoch_resumes_bit_identically(tmp_path: Path) -> None:
    # 10 steps an epoch, 3 epochs, 2 workers, augmentation, dropout, StepLR; save_state()
    # every 4 steps (automatic naming, total_limit=3); killed after step 14 (epoch 1).
    run(SCRIPT, tmp_path / "full", tmp_path / "p_full", 3)
    run(SCRIPT, tmp_path / "killed", tmp_path / "p", 3, "--kill-at", 14, expect_kill=True)
    run(SCRIPT, tmp_path / "resumed", tmp_path / "p", 3)
    assert_same_run(tmp_path / "full", tmp_path / "killed", tmp_path / "resumed", saved_at=12)
    # The resumed run went on naming from the loaded iteration (2 -> 3, ...) and rotated.
    kept = sorted(p.name for p in (tmp_path / "p" / "checkpoints").iterdir())
    assert kept == ["checkpoint_4", "checkpoint_5", "checkpoint_6"]
    for name in kept:
        assert sorted(p.name for p in (tmp_path / "p" / "checkpoints" / name).iterdir())[-1] == (
            "manifest.json"
        )  # a Tardigrade checkpoint: data-*.safetensors and the manifest, no pickle
        assert tg.verify(tmp_path / "p" / "checkpoints" / name).tensors > 0


@pytest.mark.slow
@pytest.mark.crash
def test_two_gloo_ranks_killed_mid_epoch_resume_bit_identically(tmp_path: Path) -> None:
    # torchrun, 2 CPU processes (accelerate's MULTI_CPU: DDP over gloo), each rank its own
    # dropout; the loader is not prepared (a rank-aware tg.ResumableSampler hands each rank its
    # share) and the sampler is registered for checkpointing. 5 steps an epoch; saves at steps
    # 4 and 8 (mid-epoch 1), every rank SIGKILLed after step 11.
    run(SCRIPT, tmp_path / "full", tmp_path / "p_full", 3, ranks=2)
    run(SCRIPT, tmp_path / "killed", tmp_path / "p", 3, "--kill-at", 11, ranks=2, expect_kill=True)
    run(SCRIPT, tmp_path / "resumed", tmp_path / "p", 3, ranks=2)
    assert_same_run(tmp_path / "full", tmp_path / "killed", tmp_path / "resumed", saved_at=8)
    kept = sorted(p.name for p in (tmp_path / "p" / "checkpoints").iterdir())
    assert kept == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    ckpt = tg.Checkpoint.open(tmp_path / "p" / "checkpoints" / "checkpoint_2")
    assert ckpt.world_size == 2  # one collective save, each rank's RNGs its own (tg.PerRank)
    # The registered sampler's global position at step 12: epoch 2, 2 steps x 2 ranks x 4.
    position = ckpt.read(rank=1)["custom"][0]
    assert (position["epoch"], position["consumed"]) == (2, 16)


def test_load_state_on_a_fresh_project_restores_nothing(tmp_path: Path) -> None:
    acc = TardigradeAccelerator(
        cpu=True,
        project_config=ProjectConfiguration(
            project_dir=str(tmp_path), automatic_checkpoint_naming=True
        ),
    )
    model = acc.prepare(torch.nn.Linear(2, 2))
    before = model.weight.clone()
    assert acc.load_state() is None
    assert torch.equal(model.weight, before)
    with pytest.raises(CheckpointNotFoundError, match="no Tardigrade checkpoint here"):
        acc.load_state(str(tmp_path))
