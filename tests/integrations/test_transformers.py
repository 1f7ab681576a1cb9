"""transformers.Trainer through tardigrade.integrations.transformers: exact resume, no pickles."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import tardigrade as tg
from tardigrade.integrations.transformers import last_complete_checkpoint

from ._runs import assert_same_run, run

# Each test runs whole training scripts in fresh interpreters (three runs, some on two ranks):
# minutes on a loaded 2-core machine, not the default two.
pytestmark = pytest.mark.timeout(360)

SCRIPT = "_transformers_script.py"


@pytest.mark.slow
@pytest.mark.crash
def test_a_run_killed_mid_epoch_resumes_bit_identically_from_the_last_complete_checkpoint(
    tmp_path: Path,
) -> None:
    # 10 steps an epoch, 3 epochs, 2 workers, augmentation, dropout, linear LR decay; a
    # checkpoint every 4 steps, save_total_limit=3; killed after step 14, mid-epoch 1.
    run(SCRIPT, tmp_path / "full", tmp_path / "run_full", 3)
    finished = sorted(p.name for p in (tmp_path / "run_full").iterdir())
    assert finished == ["checkpoint-24", "checkpoint-28", "checkpoint-30"]  # rotation kept
    for ckpt in (tmp_path / "run_full").iterdir():
        assert sorted(p.name for p in ckpt.iterdir()) == [
            "model.safetensors",
            "tardigrade",
            "trainer_state.json",
        ]  # no optimizer.pt, scheduler.pt, rng_state.pth, training_args.bin: no pickle
        assert tg.verify(ckpt / "tardigrade").tensors > 0

    run(SCRIPT, tmp_path / "killed", tmp_path / "run", 3, "--kill-at", 14, expect_kill=True)
    # A save killed before its Tardigrade checkpoint committed leaves a folder without it.
    shutil.copytree(tmp_path / "run" / "checkpoint-12", tmp_path / "run" / "checkpoint-16")
    shutil.rmtree(tmp_path / "run" / "checkpoint-16" / "tardigrade")
    assert last_complete_checkpoint(str(tmp_path / "run")) == str(
        tmp_path / "run" / "checkpoint-12"
    )

    run(SCRIPT, tmp_path / "resumed", tmp_path / "run", 3, "--resume")
    assert_same_run(tmp_path / "full", tmp_path / "killed", tmp_path / "resumed", saved_at=12)


@pytest.mark.slow
@pytest.mark.crash
def test_two_gloo_ranks_killed_mid_epoch_resume_bit_identically(tmp_path: Path) -> None:
    # torchrun, 2 CPU ranks (DDP over gloo): 5 steps an epoch; rank 0 is SIGKILLed after
    # step 10, the newest checkpoint is step 8 (mid-epoch 1); every rank's RNGs are PerRank.
    run(SCRIPT, tmp_path / "full", tmp_path / "run_full", 3, ranks=2)
    run(
        SCRIPT, tmp_path / "killed", tmp_path / "run", 3, "--kill-at", 10, ranks=2, expect_kill=True
    )
    assert last_complete_checkpoint(str(tmp_path / "run")) == str(tmp_path / "run" / "checkpoint-8")
    run(SCRIPT, tmp_path / "resumed", tmp_path / "run", 3, "--resume", ranks=2)
    assert_same_run(tmp_path / "full", tmp_path / "killed", tmp_path / "resumed", saved_at=8)


def test_an_incomplete_or_missing_run_has_no_complete_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "checkpoint-4").mkdir()  # an incomplete save
    assert last_complete_checkpoint(str(tmp_path)) is None
    assert last_complete_checkpoint(str(tmp_path / "missing")) is None
