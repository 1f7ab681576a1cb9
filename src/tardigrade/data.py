"""ResumableSampler: a data position that survives a restart, on any number of ranks.

The position is (epoch, samples consumed globally in that epoch). The order of epoch ``e`` is
a permutation drawn from ``(seed, e)`` alone, so it is the same for every world size; rank
``r`` of ``W`` takes global positions ``consumed + r, consumed + r + W, ...``. A run saved on
N ranks therefore resumes on M ranks with no sample skipped or repeated.

How the position stays exact:

* ``num_workers=0``: the DataLoader pulls indices from the sampler exactly when the training
  loop asks for the next batch, so counting the indices the sampler yielded *is* the position.
  This is the default mode; nothing to do.
* ``num_workers>0``: the loader prefetches batches ahead of training, so the sampler has
  yielded more than training consumed. Iterate through ``sampler.track(loader)`` instead of
  ``loader``: it advances the position when a batch is *delivered to the training loop*, and
  the sampler's own yields stop counting.

Bit-exact resume also needs the DataLoader not to draw from the global torch RNG: each new
loader iterator draws a base seed for its workers, from the loader's ``generator`` or else from
the global RNG, and a resumed run creates its iterator at another point of the global random
stream (so dropout would diverge). Pass the sampler's own generator, which is reseeded from
(seed, epoch, position) whenever the position jumps::

    DataLoader(ds, batch_size=B, sampler=sampler, generator=sampler.generator)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from .errors import InvalidArgumentError, StateMismatchError


def _dist_default() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class ResumableSampler(torch.utils.data.Sampler[int]):
    """An index sampler whose position (epoch, samples consumed) is saved and restored exactly.

    >>> sampler = tg.ResumableSampler(len(ds), shuffle=True, seed=0)       # doctest: +SKIP
    >>> loader = DataLoader(ds, batch_size=32, sampler=sampler,
    ...                     generator=sampler.generator)                    # doctest: +SKIP
    >>> state = {"model": model, "optim": opt, "data": sampler}            # doctest: +SKIP
    >>> for batch in loader: ...   # runs to the end of the epoch, then advances the epoch

    With ``num_workers > 0`` iterate ``sampler.track(loader)`` (see the module docs).
    """

    def __init__(
        self,
        dataset_len: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        if type(dataset_len) is not int or dataset_len < 0:
            raise InvalidArgumentError(f"dataset_len must be an int >= 0, got {dataset_len!r}")
        if type(seed) is not int:
            raise InvalidArgumentError(f"seed must be an int, got {seed!r}")
        d_rank, d_world = _dist_default()
        self.rank = d_rank if rank is None else rank
        self.world_size = d_world if world_size is None else world_size
        if type(self.world_size) is not int or self.world_size < 1:
            raise InvalidArgumentError(f"world_size must be an int >= 1, got {world_size!r}")
        if type(self.rank) is not int or not 0 <= self.rank < self.world_size:
            raise InvalidArgumentError(f"rank must be in [0, {self.world_size}), got {rank!r}")
        self.dataset_len = dataset_len
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.consumed = 0  # samples consumed globally in self.epoch
        self._tracked = False
        self.generator = torch.Generator()
        self._reseed()

    def _reseed(self) -> None:
        """Make the loader's worker seeds a function of the position, not of global RNG draws."""
        mix = self.seed * 0x9E3779B97F4A7C15 + self.epoch * 0xBF58476D1CE4E5B9 + self.consumed
        self.generator.manual_seed(mix % (2**63))

    def order(self, epoch: int) -> torch.Tensor:
        """The global order of indices for ``epoch`` (identical on every rank and world size)."""
        if not self.shuffle:
            return torch.arange(self.dataset_len)
        g = torch.Generator()
        g.manual_seed((self.seed * 0x9E3779B97F4A7C15 + epoch) % (2**63))
        return torch.randperm(self.dataset_len, generator=g)

    def _mine(self) -> list[int]:
        # Slicing skips consumed samples without iterating them.
        return self.order(self.epoch)[self.consumed + self.rank :: self.world_size].tolist()

    def __len__(self) -> int:
        remaining = max(0, self.dataset_len - self.consumed - self.rank)
        return -(-remaining // self.world_size)

    def __iter__(self) -> Iterator[int]:
        start_epoch, start = self.epoch, self.consumed
        for k, idx in enumerate(self._mine(), 1):
            if not self._tracked:
                # Handed out = consumed (num_workers=0); ranks move in lockstep, so the
                # global position is this rank's count times the world size.
                self.consumed = min(self.dataset_len, start + k * self.world_size)
            yield idx
        if not self._tracked and self.epoch == start_epoch:
            self._next_epoch()

    def _next_epoch(self) -> None:
        self.epoch += 1
        self.consumed = 0
        self._reseed()

    def track(self, loader: Iterable[Any], batch_size: int | None = None) -> Iterator[Any]:
        """Iterate ``loader`` (which uses this sampler), advancing the position per delivered batch.

        Exact with prefetching workers: a batch counts only once the training loop has it.
        """
        bs = batch_size if batch_size is not None else getattr(loader, "batch_size", None)
        if type(bs) is not int or bs < 1:
            raise InvalidArgumentError(
                "track() needs the loader's batch_size (pass batch_size=... explicitly)"
            )
        self._tracked = True
        try:
            start_epoch = self.epoch
            for batch in loader:
                self.consumed = min(self.dataset_len, self.consumed + bs * self.world_size)
                yield batch
            if self.epoch == start_epoch:
                self._next_epoch()
        finally:
            self._tracked = False

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "consumed": self.consumed,
            "dataset_len": self.dataset_len,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for key in ("dataset_len", "seed", "shuffle"):
            if state_dict.get(key) != getattr(self, key):
                raise StateMismatchError(
                    f"ResumableSampler: checkpoint has {key}={state_dict.get(key)!r}, this sampler "
                    f"has {getattr(self, key)!r}; the data order would differ. Build the sampler "
                    "with the same dataset length, seed and shuffle."
                )
        epoch, consumed = state_dict.get("epoch"), state_dict.get("consumed")
        if type(epoch) is not int or epoch < 0:
            raise StateMismatchError(
                f"ResumableSampler: checkpoint has epoch={epoch!r}; expected an int >= 0"
            )
        if type(consumed) is not int or not 0 <= consumed <= self.dataset_len:
            raise StateMismatchError(
                f"ResumableSampler: checkpoint has consumed={consumed!r}; expected an int in "
                f"[0, {self.dataset_len}]"
            )
        self.epoch, self.consumed = epoch, consumed
        self._reseed()
