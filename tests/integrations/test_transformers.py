"""transformers.Trainer through tardigrade.integrations.transformers: exact resume, no pickles."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

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


@pytest.mark.slow
@pytest.mark.crash
def test_best_model_tracking_survives_a_kill_and_resume(tmp_path: Path) -> None:
    # Evaluation at every checkpoint, load_best_model_at_end, save_total_limit=2; the best is
    # checkpoint-4 (greater_is_better on a falling loss). Killed after step 14, resumed from
    # checkpoint-12, whose trainer_state.json carries the best so far.
    run(SCRIPT, tmp_path / "full", tmp_path / "run_full", 3, "--best")
    run(
        SCRIPT,
        tmp_path / "killed",
        tmp_path / "run",
        3,
        "--best",
        "--kill-at",
        14,
        expect_kill=True,
    )
    run(SCRIPT, tmp_path / "resumed", tmp_path / "run", 3, "--best", "--resume")
    # Same steps, and the same final model: the best one, loaded at the end.
    assert_same_run(tmp_path / "full", tmp_path / "killed", tmp_path / "resumed", saved_at=12)
    best = json.loads((tmp_path / "resumed" / "best.json").read_text())
    assert best == json.loads((tmp_path / "full" / "best.json").read_text())
    assert (best["checkpoint"], best["step"]) == ("checkpoint-4", 4)
    # Rotation kept the best checkpoint besides the newest; it is a complete Tardigrade
    # checkpoint, and the model loaded at the end is the one it holds.
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoint-30", "checkpoint-4"]
    held = tmp_path / "run" / "checkpoint-4" / "tardigrade"
    assert tg.verify(held).step == 4
    final = tg.load(tmp_path / "resumed" / "final")["model"]
    saved = tg.load(held, keys=["model"])["model"]
    assert final.keys() == saved.keys()
    assert all(torch.equal(final[k], saved[k]) for k in final)


def test_load_best_model_reads_the_verified_tardigrade_checkpoint(tmp_path: Path) -> None:
    # The best checkpoint's safetensors files are gone: the plain Trainer would only warn and
    # keep the last model; the Tardigrade checkpoint is what is loaded.
    from transformers import TrainingArguments

    from tardigrade.integrations.transformers import TardigradeTrainer

    best = tmp_path / "checkpoint-4"
    tg.save(best / "tardigrade", {"model": torch.nn.Linear(3, 2)}, step=4)  # as the mixin saves
    model = torch.nn.Linear(3, 2)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    trainer = TardigradeTrainer(model=model, args=args)
    trainer.state.best_model_checkpoint = str(best)
    trainer._load_best_model()
    want = tg.load(best / "tardigrade")["model"]
    assert torch.equal(model.weight, want["weight"]) and torch.equal(model.bias, want["bias"])


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": torch.nn.functional.cross_entropy(self.fc(x), labels)}


class _FakeHub:
    """Stands in for the Hub API the Trainer calls: records what each upload would send, as
    the folder is when the upload starts (a real one lists it in a background job)."""

    def __init__(self) -> None:
        self.uploads: list[tuple[str | None, list[str]]] = []

    def create_repo(self, name: str, **kw: Any) -> Any:
        return SimpleNamespace(repo_id=f"local/{name}")

    def upload_folder(self, *, folder_path: str, path_in_repo: str | None = None, **kw: Any) -> Any:
        root = Path(folder_path)
        files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
        self.uploads.append((path_in_repo, files))
        done: Future[None] = Future()
        done.set_result(None)
        return done


def test_push_to_hub_uploads_each_checkpoint_after_its_tardigrade_checkpoint_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers.trainer
    from transformers import TrainingArguments

    from tardigrade.integrations.transformers import TardigradeTrainer

    hub = _FakeHub()
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: hub)
    g = torch.Generator().manual_seed(0)
    data = [{"x": torch.randn(4, generator=g), "labels": torch.tensor(i % 2)} for i in range(8)]
    args = TrainingArguments(
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=4,
        num_train_epochs=1,
        save_strategy="steps",
        save_steps=1,
        push_to_hub=True,
        hub_strategy="checkpoint",  # also upload each checkpoint folder, as last-checkpoint
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
    )
    TardigradeTrainer(model=_Tiny(), args=args, train_dataset=data).train()
    pushed = [files for where, files in hub.uploads if where == "last-checkpoint"]
    assert len(pushed) == 2  # steps 1 and 2
    for files in pushed:
        # The whole Tardigrade checkpoint, committed (its manifest), nothing half-written.
        assert "tardigrade/manifest.json" in files
        assert any(f.startswith("tardigrade/data-") for f in files)
        assert not any(".tmp" in f for f in files), files


def test_an_incomplete_or_missing_run_has_no_complete_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "checkpoint-4").mkdir()  # an incomplete save
    assert last_complete_checkpoint(str(tmp_path)) is None
    assert last_complete_checkpoint(str(tmp_path / "missing")) is None
