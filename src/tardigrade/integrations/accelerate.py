"""Hugging Face ``accelerate``: ``save_state``/``load_state`` as one Tardigrade checkpoint.

``Accelerator.save_state`` pickles the optimizers, schedulers, samplers, RNG states and custom
objects (``torch.save``), and its hooks can only take models out of that. Here the whole state
goes into one atomic, verified, pickle-free checkpoint instead; use the drop-in subclass::

    from tardigrade.integrations.accelerate import TardigradeAccelerator

    accelerator = TardigradeAccelerator(project_config=ProjectConfiguration(
        project_dir="runs/a", automatic_checkpoint_naming=True, total_limit=3))
    model, opt, sched, loader = accelerator.prepare(model, opt, sched, loader)
    accelerator.register_for_checkpointing(my_counter)      # anything with state_dict()
    accelerator.load_state()        # newest complete checkpoint (project_dir/checkpoints), if any
    for batch in sampler.track(loader): ...                  # the loader's tg.ResumableSampler
        accelerator.save_state()

or call :func:`save_state` / :func:`load_state` with a plain ``Accelerator``. A checkpoint holds
every prepared model (unwrapped), optimizer and scheduler (restored into accelerate's wrappers
directly), the grad scaler, every ``register_for_checkpointing`` object, the
:class:`tg.ResumableSampler` of each prepared loader, every rank's RNGs (``tg.PerRank``) and the
save iteration, which ``load_state`` puts back (the next automatic name follows on).

Single process, or several with plain data parallelism (DDP; on CPU over gloo). On several
processes do not prepare the loader: accelerate would split its batches over the processes,
which the position does not follow (refused). Build the ``tg.ResumableSampler`` after the
Accelerator (it takes its rank and world size from the process group and hands each rank its
share) and ``register_for_checkpointing(sampler)``: its position is the same on every rank.
FSDP, DeepSpeed and Megatron keep their own checkpoint formats and are refused.
"""

from __future__ import annotations

import os
from typing import Any

from accelerate import Accelerator

from .. import Catalog, PerRank, ResumableSampler, RNGState, load, read_manifest, save
from ..errors import CheckpointNotFoundError, InvalidArgumentError
from ..format.manifest import MANIFEST

__all__ = ["TardigradeAccelerator", "load_state", "save_state"]

_NAMES = "checkpoint_{step}"  # accelerate's automatic_checkpoint_naming


def _samplers(accelerator: Accelerator) -> list[ResumableSampler]:
    """The ResumableSampler of each prepared DataLoader (looked for through its wrappers)."""
    out: list[ResumableSampler] = []
    for loader in accelerator._dataloaders:
        todo = [loader, getattr(loader, "base_dataloader", None)]
        seen = 0
        while todo and seen < 12:
            obj = todo.pop()
            seen += 1
            if isinstance(obj, ResumableSampler):
                if not any(obj is s for s in out):
                    out.append(obj)
                break
            if obj is not None:
                todo += [getattr(obj, "sampler", None), getattr(obj, "batch_sampler", None)]
    return out


def _state(accelerator: Accelerator) -> dict[str, Any]:
    kind = str(accelerator.distributed_type)
    if any(k in kind for k in ("FSDP", "DEEPSPEED", "MEGATRON")):
        raise InvalidArgumentError(
            f"tardigrade.integrations.accelerate: {kind} keeps its own checkpoint format; use "
            "the Accelerator's own save_state/load_state there"
        )
    custom = list(accelerator._custom_objects)
    samplers = [s for s in _samplers(accelerator) if not any(s is c for c in custom)]
    if samplers and accelerator.num_processes > 1:
        # accelerate splits the sampler's batches over the processes itself, so a position
        # counted per process is not the global one (and a sampler built with the job's
        # rank and world size would be split twice): say so, never guess.
        raise InvalidArgumentError(
            "tardigrade.integrations.accelerate: a tg.ResumableSampler in a loader prepared "
            f"for {accelerator.num_processes} processes: accelerate splits its batches, which "
            "the saved position does not follow. Do not prepare that loader: the sampler, "
            "built after the Accelerator, hands each process its own share; register it with "
            "accelerator.register_for_checkpointing(sampler)"
        )
    state: dict[str, Any] = {
        "models": [accelerator.unwrap_model(m) for m in accelerator._models],
        "optimizers": list(accelerator._optimizers),
        "schedulers": list(accelerator._schedulers),
        "samplers": samplers,
        "custom": custom,
        "rng": PerRank(RNGState()),
    }
    if accelerator.scaler is not None:
        state["scaler"] = accelerator.scaler
    return state


def _checkpoints_dir(accelerator: Accelerator) -> str:
    return os.path.join(accelerator.project_dir, "checkpoints")


def _complete(directory: str) -> list[tuple[int, str]]:
    """(iteration, path) of each committed ``checkpoint_N`` in ``directory``, oldest first."""
    catalog = Catalog(directory, names=_NAMES)
    # None when the directory does not exist yet.
    return [(s, os.path.join(directory, n)) for s, n in catalog.numbered() if catalog.committed(n)]


def save_state(accelerator: Accelerator, output_dir: str | None = None) -> str:
    """Save everything ``accelerator.save_state`` would, as one Tardigrade checkpoint.

    Every process calls it (the save is collective in a distributed job). With
    ``automatic_checkpoint_naming`` it writes ``project_dir/checkpoints/checkpoint_<iteration>``
    and keeps ``total_limit`` of them. Returns the checkpoint's path.
    """
    config = accelerator.project_configuration
    if config.automatic_checkpoint_naming:
        root = _checkpoints_dir(accelerator)
        output_dir = os.path.join(root, f"checkpoint_{config.iteration}")
    elif output_dir is None:
        raise InvalidArgumentError(
            "save_state(): pass output_dir=..., or build the Accelerator with "
            "ProjectConfiguration(automatic_checkpoint_naming=True, project_dir=...)"
        )
    output_dir = os.fspath(output_dir)
    save(
        output_dir,
        _state(accelerator),
        overwrite=not config.automatic_checkpoint_naming,
        step=config.iteration,
        metadata={"accelerate_iteration": config.iteration},
    )
    config.iteration += 1
    if config.automatic_checkpoint_naming and config.total_limit is not None:
        if accelerator.is_main_process:
            for _, old in _complete(_checkpoints_dir(accelerator))[: -config.total_limit]:
                _retire(old)
        accelerator.wait_for_everyone()
    return output_dir


def _retire(path: str) -> None:
    # Out of view first (a crash never leaves a half-deleted checkpoint that looks whole).
    parent, name = os.path.split(path)
    Catalog(parent).retire(name)


def load_state(accelerator: Accelerator, input_dir: str | None = None) -> str | None:
    """Restore a checkpoint written by :func:`save_state` into the prepared objects, in place.

    ``input_dir=None`` with ``automatic_checkpoint_naming``: the newest complete checkpoint in
    ``project_dir/checkpoints``, or None (and nothing restored) if there is none. Sets the save
    iteration after the loaded one. Returns the path loaded.
    """
    config = accelerator.project_configuration
    if input_dir is None:
        if not config.automatic_checkpoint_naming:
            raise InvalidArgumentError(
                "load_state(): pass input_dir=..., or build the Accelerator with "
                "ProjectConfiguration(automatic_checkpoint_naming=True, project_dir=...)"
            )
        complete = _complete(_checkpoints_dir(accelerator))
        if not complete:
            return None
        input_dir = complete[-1][1]
    input_dir = os.fspath(input_dir)
    if not Catalog.is_checkpoint(input_dir):
        raise CheckpointNotFoundError(
            f"{input_dir}: no Tardigrade checkpoint here (no {MANIFEST}); pass a directory "
            "written by save_state(), or input_dir=None to take the newest complete one"
        )
    load(input_dir, into=_state(accelerator))
    saved = (read_manifest(input_dir).get("metadata") or {}).get("accelerate_iteration")
    if type(saved) is int:
        config.iteration = saved + 1  # the next automatic name follows the loaded one
    return input_dir


class TardigradeAccelerator(Accelerator):
    """An ``Accelerator`` whose ``save_state``/``load_state`` write and read Tardigrade
    checkpoints (see the module docs); everything else is accelerate's."""

    def save_state(self, output_dir: str | None = None, **kwargs: Any) -> str:
        return save_state(self, output_dir)

    def load_state(self, input_dir: str | None = None, **kwargs: Any) -> str | None:
        return load_state(self, input_dir)
