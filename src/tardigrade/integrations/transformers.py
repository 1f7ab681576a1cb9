"""Hugging Face ``transformers.Trainer``: atomic, verified, pickle-free checkpoints, exact resume.

Mix :class:`TardigradeTrainerMixin` into your Trainer (or use :class:`TardigradeTrainer`)::

    from tardigrade.integrations.transformers import TardigradeTrainer

    trainer = TardigradeTrainer(model=model, args=TrainingArguments(..., save_steps=500,
                                save_total_limit=3), train_dataset=tg.SeededDataset(ds))
    trainer.train(resume_from_checkpoint=True)   # the newest *complete* checkpoint, if any

What changes, and what does not:

* Each ``checkpoint-N/`` the Trainer writes gets a Tardigrade checkpoint ``checkpoint-N/tardigrade``
  holding the model, optimizer, LR scheduler, grad scaler and every rank's RNGs (``tg.PerRank``),
  written atomically and verified on load. The Trainer's pickles (``optimizer.pt``,
  ``scheduler.pt``, ``scaler.pt``, ``rng_state*.pth``, ``training_args.bin``) are not written; the
  model's safetensors files and ``trainer_state.json`` are, so ``save_total_limit`` rotation,
  best-metric tracking and ``push_to_hub`` work as before.
* ``load_best_model_at_end`` loads the best model from that checkpoint's Tardigrade checkpoint
  (verified) rather than from its unverified safetensors files.
* With ``push_to_hub`` and a ``hub_strategy`` that uploads checkpoints, the upload of
  ``checkpoint-N`` starts once its Tardigrade checkpoint has committed (the plain Trainer
  starts it before), so the Hub never receives a checkpoint without it, or half-written.
* ``resume_from_checkpoint=True`` picks the newest ``checkpoint-N`` whose Tardigrade checkpoint
  committed (a run killed mid-save leaves an incomplete folder, which is skipped).
* The training sampler is a :class:`tg.ResumableSampler` (seeded with ``data_seed`` or
  ``seed``) whose indices carry epoch and seed, so a dataset wrapped in :class:`tg.SeededDataset`
  augments each sample identically in a resumed run, whatever ``dataloader_num_workers``. The
  Trainer's own fast-forward over the batches done in the resumed epoch then lands on exactly the
  batch an uninterrupted run would train next.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from transformers import Trainer

from .. import Catalog, PerRank, ResumableSampler, RNGState, load, save
from ..errors import CheckpointNotFoundError
from ..storage import open_root

__all__ = ["TardigradeTrainer", "TardigradeTrainerMixin", "last_complete_checkpoint"]

TARDIGRADE_DIR = "tardigrade"
_NAMES = "checkpoint-{step}"  # the Trainer's checkpoint folders
# What the Trainer pickles into a checkpoint folder besides the state Tardigrade holds.
_PICKLED_ARGS = "training_args.bin"


def last_complete_checkpoint(output_dir: str) -> str | None:
    """The newest ``checkpoint-N`` in ``output_dir`` whose Tardigrade checkpoint committed."""
    catalog = Catalog(output_dir, names=_NAMES)
    found = [n for _, n in catalog.numbered() if catalog.committed(f"{n}/{TARDIGRADE_DIR}")]
    return os.path.join(output_dir, found[-1]) if found else None


if TYPE_CHECKING:
    # A mixin for a Trainer: to the type checker it is one (mypy reads transformers as Any).
    from transformers import Trainer as _TrainerBase
else:
    _TrainerBase = object


class TardigradeTrainerMixin(_TrainerBase):
    """Mix into a ``transformers.Trainer`` subclass, first: ``class T(TardigradeTrainerMixin,
    Trainer)``. See the module docs for what it changes."""

    _tg_sampler: ResumableSampler | None = None

    # -- the data order ------------------------------------------------------------------

    def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
        sampler = super()._get_train_sampler(*args, **kwargs)
        if sampler is None:  # no length (an IterableDataset): nothing to position
            return None
        dataset = args[0] if args and args[0] is not None else self.train_dataset
        hf_args = self.args
        seed = hf_args.data_seed if hf_args.data_seed is not None else hf_args.seed
        # One global order; accelerate splits its batches over the processes.
        self._tg_sampler = ResumableSampler(len(dataset), seed=seed, rank=0, world_size=1)
        self._tg_sampler._position_external = True  # set from the Trainer's step on resume
        return self._tg_sampler

    def get_train_dataloader(self) -> Any:
        loader = super().get_train_dataloader()
        if self._tg_sampler is not None:
            # Worker seeds drawn from the sampler's generator, reseeded from the position,
            # not from the global RNG (which a resumed run has at another point).
            # accelerate's prepared loader iterates the DataLoader it wraps.
            getattr(loader, "base_dataloader", loader).generator = self._tg_sampler.generator
        return loader

    def _init_training_state(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        epochs_trained, steps_in_epoch = super()._init_training_state(*args, **kwargs)
        sampler = self._tg_sampler
        if sampler is not None:
            # The epoch the Trainer resumes in, from its start: the Trainer skips the batches
            # already trained in it, drawing them from the same order.
            sampler.load_state_dict(
                {
                    "epoch": epochs_trained,
                    "consumed": 0,
                    "dataset_len": sampler.dataset_len,
                    "seed": sampler.seed,
                    "shuffle": sampler.shuffle,
                }
            )
        return epochs_trained, steps_in_epoch

    # -- saving ----------------------------------------------------------------------------

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        pass  # in the Tardigrade checkpoint

    def _save_scaler(self, output_dir: str) -> None:
        pass  # in the Tardigrade checkpoint

    def _save_rng_state(self, output_dir: str) -> None:
        pass  # in the Tardigrade checkpoint

    def _tardigrade_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"model": self.model}
        if not self.args.save_only_model:
            state["optim"] = self.optimizer
            if self.lr_scheduler is not None:
                state["sched"] = self.lr_scheduler
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:
                state["scaler"] = scaler
            state["rng"] = PerRank(RNGState())
        return state

    _tg_push_held: list[str] | None = None

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        # The Trainer starts the Hub upload of the folder inside its own _save_checkpoint
        # (a background job that lists the folder when it runs): hold it until the Tardigrade
        # checkpoint below has committed, or the Hub could get the folder without it.
        self._tg_push_held = []
        try:
            super()._save_checkpoint(model, trial)
            run_dir = self._get_output_dir(trial=trial)
            step = self.state.global_step
            folder = os.path.join(run_dir, f"checkpoint-{step}")
            # Its commit is what makes checkpoint-N complete for resume_from_checkpoint=True.
            save(
                os.path.join(folder, TARDIGRADE_DIR),
                self._tardigrade_state(),
                overwrite=True,
                step=step,
            )
            if self.args.should_save:
                open_root(folder).delete(_PICKLED_ARGS)  # gone already: nothing to do
            held = self._tg_push_held
        finally:
            self._tg_push_held = None
        for checkpoint_folder in held:
            self._push_from_checkpoint(checkpoint_folder)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        if self._tg_push_held is not None:
            self._tg_push_held.append(checkpoint_folder)
            return
        super()._push_from_checkpoint(checkpoint_folder)

    # -- resuming --------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        if resume_from_checkpoint is True:
            output_dir = self.args.output_dir
            resume_from_checkpoint = last_complete_checkpoint(output_dir)
            if resume_from_checkpoint is None:
                raise CheckpointNotFoundError(
                    f"{output_dir}: no complete checkpoint to resume from (a checkpoint-N folder "
                    f"whose {TARDIGRADE_DIR}/ committed). Train without resume_from_checkpoint, "
                    "or pass the output_dir of the run to resume."
                )
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _tardigrade_checkpoint(self, checkpoint: str | None) -> str | None:
        if checkpoint is None:
            return None
        path = os.path.join(checkpoint, TARDIGRADE_DIR)
        return path if open_root(checkpoint).is_dir(TARDIGRADE_DIR) else None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        path = self._tardigrade_checkpoint(resume_from_checkpoint)
        if path is None:  # a checkpoint the plain Trainer wrote
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            return
        target = model if model is not None else self.model
        load(path, into={"model": target}, keys=["model"])

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        path = self._tardigrade_checkpoint(checkpoint)
        if path is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        into = {k: v for k, v in self._tardigrade_state().items() if k in ("optim", "sched")}
        load(path, into=into, keys=list(into))

    def _load_scaler(self, checkpoint: str | None) -> None:
        path = self._tardigrade_checkpoint(checkpoint)
        if path is None:
            super()._load_scaler(checkpoint)
            return
        scaler = self._tardigrade_state().get("scaler")
        if scaler is not None:
            load(path, into={"scaler": scaler}, keys=["scaler"])

    def _load_best_model(self) -> None:
        path = self._tardigrade_checkpoint(self.state.best_model_checkpoint)
        if path is None:  # a checkpoint the plain Trainer wrote
            super()._load_best_model()
            return
        load(path, into={"model": self.model}, keys=["model"])

    def _load_rng_state(self, checkpoint: str | None) -> None:
        path = self._tardigrade_checkpoint(checkpoint)
        if path is None:
            super()._load_rng_state(checkpoint)
            return
        load(path, into={"rng": PerRank(RNGState())}, keys=["rng"])


class TardigradeTrainer(TardigradeTrainerMixin, Trainer):
    """``transformers.Trainer`` with Tardigrade checkpoints (see :class:`TardigradeTrainerMixin`)."""
