"""PyTorch Lightning: atomic, verified, pickle-free checkpoints that resume bit-exactly.

Two pieces, both Lightning's own extension points:

* :class:`TardigradeCheckpointIO` (a ``CheckpointIO`` plugin) writes each checkpoint Lightning
  makes (``ModelCheckpoint``, ``trainer.save_checkpoint``) as a Tardigrade checkpoint directory,
  reads it back for ``Trainer.fit(ckpt_path=...)``, and removes the ones ``ModelCheckpoint``'s
  retention (``save_top_k``) drops. Importing this module also teaches
  ``LightningModule.load_from_checkpoint`` to read Tardigrade checkpoints.
* :class:`TardigradeCallback` adds what Lightning's checkpoint lacks for an exact resume: every
  RNG (python, numpy, torch CPU and CUDA) and the data position of a :class:`tg.ResumableSampler`
  counted in batches *training got* (Lightning fetches a batch ahead, workers more), and makes
  ``len(loader)`` a whole epoch so ``current_epoch`` and ``global_step`` stay right after a
  mid-epoch resume::

    sampler = tg.ResumableSampler(len(ds), seed=0)
    loader = DataLoader(tg.SeededDataset(ds), batch_size=32, sampler=sampler,
                        num_workers=2, generator=sampler.generator)
    trainer = L.Trainer(
        plugins=[TardigradeCheckpointIO()],
        callbacks=[TardigradeCallback(sampler), ModelCheckpoint(every_n_train_steps=100)],
    )
    trainer.fit(model, loader, ckpt_path=None)   # or the path of a checkpoint to resume

Under DDP (``strategy="ddp"``, also launched by ``torchrun``) Lightning writes its checkpoint
from rank 0 alone and reads it on every rank: the callback gives the plugin a process group of
each rank alone for that, and gathers every rank's RNGs into rank 0's checkpoint (each rank
gets its own back). Build the Trainer with ``use_distributed_sampler=False``; the sampler takes
the job's rank and world size itself. Without the callback the plugin refuses a multi-process
job rather than hang. FSDP and DeepSpeed strategies write their own sharded checkpoints.
"""

from __future__ import annotations

import os
import random
import warnings
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.core import saving

from .. import Catalog, ResumableSampler, RNGState, load, save
from ..data import BatchCount
from ..errors import InvalidArgumentError
from ._plain import check_unknown, storable

__all__ = ["TardigradeCallback", "TardigradeCheckpointIO", "is_tardigrade_checkpoint"]

# Keys of Lightning's checkpoint dict that hold the user's own values.
_HPARAMS_KEYS = ("hyper_parameters", "datamodule_hyper_parameters")


def is_tardigrade_checkpoint(path: Any) -> bool:
    """Whether ``path`` is a local Tardigrade checkpoint directory (it holds a manifest)."""
    return isinstance(path, (str, os.PathLike)) and Catalog.is_checkpoint(path)


def _distributed() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _single_process() -> None:
    if _distributed():
        raise InvalidArgumentError(
            "TardigradeCheckpointIO: under a multi-process strategy Lightning writes its "
            "checkpoint from rank 0 alone; add TardigradeCallback(...) to the Trainer's "
            "callbacks, which prepares the plugin for that on every rank"
        )


def _plugin_of(trainer: pl.Trainer) -> TardigradeCheckpointIO | None:
    io: Any = trainer.strategy.checkpoint_io
    for _ in range(4):  # Lightning may wrap the plugin (async saving)
        if isinstance(io, TardigradeCheckpointIO):
            return io
        io = getattr(io, "checkpoint_io", None)
    return None


# Every RNG of one process (python, numpy, torch CPU) as one fixed-size byte tensor, so the
# ranks' states can be gathered with a plain all_gather (no pickled objects on the wire).
_PY_WORDS, _NP_WORDS = 625, 624


def _rng_bytes() -> torch.Tensor:
    version, words, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    head = np.array([version, pos, has_gauss], dtype=np.int64)
    floats = np.array([np.nan if gauss is None else gauss, cached], dtype=np.float64)
    parts = [
        np.asarray(words, dtype=np.uint32).tobytes(),
        np.asarray(keys, dtype=np.uint32).tobytes(),
        head.tobytes(),
        floats.tobytes(),
        torch.get_rng_state().numpy().tobytes(),
    ]
    if torch.cuda.is_available():  # the rank's own device, after the CPU state (fixed size)
        parts.append(torch.cuda.get_rng_state().numpy().tobytes())
    return torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)


def _set_rng_bytes(raw: torch.Tensor) -> None:
    data = raw.numpy().tobytes()
    at = 0

    def take(n: int) -> bytes:
        nonlocal at
        at += n
        return data[at - n : at]

    words = np.frombuffer(take(4 * _PY_WORDS), dtype=np.uint32)
    keys = np.frombuffer(take(4 * _NP_WORDS), dtype=np.uint32)
    version, pos, has_gauss = np.frombuffer(take(24), dtype=np.int64).tolist()
    gauss, cached = np.frombuffer(take(16), dtype=np.float64).tolist()
    random.setstate((version, tuple(words.tolist()), None if gauss != gauss else gauss))
    np.random.set_state(("MT19937", keys.copy(), pos, has_gauss, cached))
    cpu = torch.get_rng_state().numel()  # MT19937: the same size in every process
    torch.set_rng_state(torch.frombuffer(bytearray(take(cpu)), dtype=torch.uint8))
    if at < len(data) and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(data[at:]), dtype=torch.uint8))


class TardigradeCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` that writes and reads Tardigrade checkpoint directories.

    ``unknown_hparams``: what to do with a hyperparameter (``save_hyperparameters()``) whose
    type the format cannot store: ``"error"`` (default) refuses the save naming the key;
    ``"str"`` stores its ``str()``. Tensors, numbers, strings, lists, tuples and dicts are
    stored with their types.

    >>> trainer = L.Trainer(plugins=[TardigradeCheckpointIO()])  # doctest: +SKIP
    """

    def __init__(self, *, unknown_hparams: str = "error") -> None:
        self.unknown_hparams = check_unknown(unknown_hparams)
        # Under a multi-process strategy: a group of this rank alone, made by
        # TardigradeCallback.setup() on every rank. Lightning writes from rank 0 only and
        # reads on every rank, each on its own, so neither may be collective over the job.
        self._own_group: Any = None
        self._warned = False  # about a checkpoint without TardigradeCallback's state

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise InvalidArgumentError(
                f"TardigradeCheckpointIO: storage_options is not supported; got {storage_options!r}"
            )
        if self._own_group is None:
            _single_process()
        callbacks = checkpoint.get("callbacks")
        if not self._warned and not (
            isinstance(callbacks, dict) and any("TardigradeCallback" in str(k) for k in callbacks)
        ):
            self._warned = True
            warnings.warn(
                "tardigrade: TardigradeCheckpointIO saves this checkpoint without the state of "
                "TardigradeCallback: the RNGs and the exact data position are not in it, so a "
                "resumed run differs from an uninterrupted one. Add the callback: "
                "L.Trainer(plugins=[TardigradeCheckpointIO()], callbacks=[TardigradeCallback()]).",
                UserWarning,
                stacklevel=2,  # Lightning's call of save_checkpoint
            )
        tree = storable(checkpoint, self.unknown_hparams, free_keys=_HPARAMS_KEYS)
        step, epoch = checkpoint.get("global_step"), checkpoint.get("epoch")
        save(
            os.fspath(path),
            tree,
            overwrite=True,  # ModelCheckpoint rewrites last.ckpt; the swap is atomic
            step=step if type(step) is int else None,
            epoch=epoch if type(epoch) is int else None,
            process_group=self._own_group,
        )

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        # Tensors come back on the CPU; Lightning moves the model and optimizer state to their
        # devices itself. (weights_only: nothing here can run code, whatever it says.)
        tree: dict[str, Any] = load(os.fspath(path), process_group=self._own_group)
        if isinstance(map_location, (str, torch.device)):
            tree = _to_device(tree, torch.device(map_location))
        return tree

    def remove_checkpoint(self, path: Any) -> None:
        """Remove a checkpoint ``ModelCheckpoint`` no longer keeps, as retention does: renamed
        out of view first, so a crash never leaves a half-deleted checkpoint looking whole."""
        parent, name = os.path.split(os.path.abspath(os.fspath(path)))
        catalog = Catalog(parent)
        if catalog.storage.is_dir(name):
            catalog.retire(name)
        else:  # a file (or link) some other CheckpointIO wrote
            catalog.storage.delete(name)


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return type(obj)((k, _to_device(v, device)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj


class TardigradeCallback(pl.Callback):
    """Save and restore every RNG and the exact data position with Lightning's checkpoint.

    ``sampler``: the :class:`tg.ResumableSampler` of the training ``DataLoader`` (build the
    loader with ``generator=sampler.generator``; any ``num_workers``). Its position is counted
    in batches that reached ``training_step``, so Lightning's prefetching does not move it,
    and ``len(loader)`` is a whole epoch's batches, so a run resumed mid-epoch trains the rest
    of that epoch and then whole epochs (``current_epoch``/``global_step`` as uninterrupted).
    The RNGs are put back right before the first batch after a resume, where the run that
    saved them would have drawn next. With ``sampler=None`` only the RNGs are saved.
    """

    def __init__(self, sampler: ResumableSampler | None = None) -> None:
        if sampler is not None and not isinstance(sampler, ResumableSampler):
            raise InvalidArgumentError(
                f"TardigradeCallback(sampler=...) takes a tg.ResumableSampler, got "
                f"{type(sampler).__name__}; build the DataLoader with "
                "sampler=tg.ResumableSampler(len(dataset), seed=...)"
            )
        self.sampler = sampler
        self._count: BatchCount | None = None
        self._rng_to_restore: Any = None  # RNGState's dict, or one rank's bytes (DDP)
        self._distributed = False

    def _counter(self, trainer: pl.Trainer) -> BatchCount | None:
        if self.sampler is None:
            return None
        if self._count is None:
            loader = trainer.train_dataloader
            batch_size = getattr(loader, "batch_size", None)
            if type(batch_size) is not int:
                raise InvalidArgumentError(
                    "TardigradeCallback: the training DataLoader has no batch_size; build it "
                    "with DataLoader(dataset, batch_size=B, sampler=sampler)"
                )
            drop_last = getattr(loader, "drop_last", False) is True
            self._count = self.sampler._hand_over(batch_size, drop_last)
        return self._count

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if _distributed():
            self._setup_ranks(trainer)
        if self.sampler is not None:
            # Before Lightning sizes and first iterates the loader: its prefetching must not
            # move the position, and len() must be a whole epoch.
            self.sampler._hooked = True
            self.sampler._tracked = True
            # Lightning warns that a mid-epoch resume of a loader without state_dict() is
            # unreliable; the position is in this callback's state, so it is not.
            warnings.filterwarnings(
                "ignore", message=r"You're resuming from a checkpoint that ended before the epoch"
            )

    def _setup_ranks(self, trainer: pl.Trainer) -> None:
        dist = torch.distributed
        rank, world = dist.get_rank(), dist.get_world_size()
        # new_group() is collective: every rank makes every rank's group, and keeps its own.
        groups = [dist.new_group([r], backend="gloo") for r in range(world)]
        plugin = _plugin_of(trainer)
        if plugin is not None:
            plugin._own_group = groups[rank]
        self._distributed = True
        sampler = self.sampler
        if sampler is None:
            return
        if trainer._accelerator_connector.use_distributed_sampler:
            raise InvalidArgumentError(
                "TardigradeCallback: build the Trainer with use_distributed_sampler=False: "
                "Lightning would wrap the tg.ResumableSampler in a DistributedSampler, whose "
                "position is in no checkpoint; the ResumableSampler splits the data over the "
                "ranks itself"
            )
        if sampler.world_size == 1:
            # Built before Lightning started the process group: take this job's ranks.
            sampler.rank, sampler.world_size = rank, world
            sampler._pass = None
        elif (sampler.rank, sampler.world_size) != (rank, world):
            raise InvalidArgumentError(
                f"TardigradeCallback: the sampler was built for rank {sampler.rank} of "
                f"{sampler.world_size}, this process is rank {rank} of {world}"
            )

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._rng_to_restore is not None:
            if isinstance(self._rng_to_restore, torch.Tensor):
                _set_rng_bytes(self._rng_to_restore)
            else:
                RNGState().load_state_dict(self._rng_to_restore)
            self._rng_to_restore = None
        count = self._counter(trainer)
        if count is not None:
            count.before_batch()

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        count = self._counter(trainer)
        if count is not None:
            count.after_batch()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        count = self._counter(trainer)
        if count is not None:
            count.epoch_end()

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any]
        if self._distributed:
            # Lightning asks every rank for its state and writes rank 0's: gather the ranks'
            # RNGs there (the sampler's position is the same on every rank).
            mine = _rng_bytes()
            every = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size())]
            torch.distributed.all_gather(every, mine)
            out = {"rng_per_rank": every}
        else:
            out = {"rng": RNGState().state_dict()}
        if self.sampler is not None:
            out["data"] = self.sampler.state_dict()
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        per_rank = state_dict.get("rng_per_rank")
        if per_rank is not None and self._distributed:
            rank = torch.distributed.get_rank()
            # A rank the saving job did not have takes rank 0's (as tg.PerRank does).
            self._rng_to_restore = per_rank[rank] if rank < len(per_rank) else per_rank[0]
        else:
            self._rng_to_restore = state_dict.get("rng")
        if self.sampler is not None and "data" in state_dict:
            self.sampler.load_state_dict(state_dict["data"])
            if self._count is not None:
                self._count.restart()


# LightningModule.load_from_checkpoint reads the file itself (not through CheckpointIO); a
# Tardigrade checkpoint is a directory it cannot open. Read those here, anything else as before.
_lightning_load = saving.pl_load


def _load_checkpoint(path_or_url: Any, map_location: Any = None, weights_only: Any = None) -> Any:
    if isinstance(path_or_url, (str, os.PathLike)) and is_tardigrade_checkpoint(path_or_url):
        return TardigradeCheckpointIO().load_checkpoint(path_or_url)
    return _lightning_load(path_or_url, map_location=map_location, weights_only=weights_only)


if getattr(saving.pl_load, "__module__", None) != __name__:
    saving.pl_load = _load_checkpoint
