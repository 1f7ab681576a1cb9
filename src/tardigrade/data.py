"""ResumableSampler: a data position that survives a restart, on any number of ranks.

The position is (epoch, samples consumed globally in that epoch). The order of epoch ``e`` is
a permutation drawn from ``(seed, e)`` alone, so it is the same for every world size; rank
``r`` of ``W`` takes global positions ``consumed + r, consumed + r + W, ...``. A run saved on
N ranks therefore resumes on M ranks with no sample skipped or repeated.

Every rank hands out the same number of indices in every pass, as ``DistributedSampler`` does,
so data-parallel ranks take the same number of steps (a rank with a batch fewer would leave the
others waiting in an all-reduce), and after every step every rank holds the same position (a
collective ``tg.save`` stores it once and refuses ranks that disagree). When the ``n - c``
samples left from position ``c`` do not split evenly over ``W`` ranks:

* ``drop_last=False`` (default): the pass is padded to ``ceil((n - c) / W)`` indices per rank.
  Global positions ``p >= n`` are *padding*: they repeat the epoch's first indices,
  ``order[(p - n) % n]``. That is fewer than ``W`` padding indices per pass, at most one per
  rank, all in the pass's last batch, each a :class:`SampleIndex` with ``padding=True``.
* ``drop_last=True`` (with ``batch_size=``): the pass hands out whole global steps of
  ``W * batch_size`` positions only; the fewer than ``W * batch_size`` positions after the last
  whole step are skipped, and the next epoch starts.

Positions ``< n`` are *real*. The resume guarantee is about them: however often a run is saved
and resumed, on whichever world sizes, each real position of an epoch is handed out exactly
once (with ``drop_last=True``: each one before the dropped tail), in global order. "Repeated"
means a real position handed out twice. Padding indices are not real positions: they duplicate
indices of the same epoch on purpose, and how many there are depends on where the pass started
and on its world size (a pass resumed at ``c`` on ``M`` ranks pads ``-(n - c) % M``), so a
resumed run may hand out other padding than an uninterrupted one, never other real samples.
With ``drop_last=True`` the dropped tail likewise depends on the world size of the pass that
ends the epoch. With one rank nothing is ever padded.

How the position stays exact:

* ``num_workers=0``: the DataLoader pulls indices from the sampler exactly when the training
  loop asks for the next batch, so counting the indices the sampler yielded *is* the position.
  This is the default mode; nothing to do.
* ``num_workers>0``: the loader prefetches batches ahead of training, so the sampler has
  yielded more than training consumed. Iterate through ``sampler.track(loader)`` instead of
  ``loader``: it advances the position when a batch is *delivered to the training loop*, and
  the sampler's own yields stop counting.
* Either way, ``sampler.loader(dataset, batch_size=..., num_workers=...)`` builds the
  ``DataLoader`` with this sampler and its generator, iterating through ``track()`` when it
  has workers: nothing to remember. Saving a state that holds a sampler (or ``tg.RNGState``)
  warns when a live loader is set up in one of the ways that resume inexactly (untracked
  workers, no ``generator=``, a ``shuffle=True`` loader of its own).

The epoch advances the moment its last sample is consumed (handed out, or with ``track()``
delivered), not when the loader's iterator is exhausted: loops that stop after exactly
``len(loader)`` batches without draining the iterator (PyTorch Lightning, any loop that counts
batches) would otherwise start the next pass at the end of the old epoch and get nothing.
With a ``DataLoader(drop_last=True)``, pass ``batch_size=`` and ``drop_last=True`` to the
sampler too: it then hands out only the full batches of each epoch, so the epoch ends with the
loader's last batch (``track()`` reads both from the loader itself).

Bit-exact resume also needs the DataLoader not to draw from the global torch RNG: each new
loader iterator draws a base seed for its workers, from the loader's ``generator`` or else from
the global RNG, and a resumed run creates its iterator at another point of the global random
stream (so dropout would diverge). Pass the sampler's own generator, which is reseeded from
(seed, epoch, position) whenever the position jumps::

    DataLoader(ds, batch_size=B, sampler=sampler, generator=sampler.generator)

Random augmentation inside ``Dataset.__getitem__`` (``random``, ``numpy``, ``torch``) runs in
worker processes whose random streams are in no checkpoint and depend on the worker count and
on which worker got which batch. To make it resumable, its randomness must be a function of
the sample, not of the process: the sampler yields :class:`SampleIndex` objects (plain ``int``
indices that also carry ``epoch`` and ``seed``), and :class:`SeededDataset` (or the
:func:`seed_sample` context manager) seeds ``random``, NumPy's global RNG and torch's CPU RNG
from ``(seed, epoch, index)`` around each ``__getitem__``. The same sample of the same epoch is
then augmented the same way whatever the worker count, the world size, persistent workers or
where the run was resumed. The epoch travels inside the index because a worker holds a copy of
the dataset made when its iterator started (for the whole run with ``persistent_workers=True``),
so no attribute set on the dataset in the main process would reach it.
"""

from __future__ import annotations

import contextlib
import hashlib
import operator
import random
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeVar

import numpy as np
import torch

from ._loader_audit import audit_live_loaders
from .errors import InvalidArgumentError, StateMismatchError


def _dist_default() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class SampleIndex(int):
    """A dataset index that also says which epoch and sampler seed it was drawn for.

    It *is* an ``int`` (equal to, hashing and indexing like the plain index; ``str()`` gives
    the digits), so datasets that know nothing of it keep working. :class:`ResumableSampler`
    yields these; :func:`seed_sample` and :class:`SeededDataset` read ``epoch`` and ``seed``
    from them, in whichever worker process the index lands. ``padding`` is true for an index
    that only pads the epoch's last step so every rank gets as many samples (see
    :class:`ResumableSampler`); an evaluation loop can leave those out of its metrics::

        >>> i = tg.SampleIndex(7, epoch=2, seed=0)
        >>> i == 7, i.epoch, i.padding, f"img-{i}.png"
        (True, 2, False, 'img-7.png')
    """

    epoch: int
    seed: int
    padding: bool

    def __new__(cls, index: int, epoch: int, seed: int, padding: bool = False) -> SampleIndex:
        self = super().__new__(cls, index)
        self.epoch = epoch
        self.seed = seed
        self.padding = padding
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        # DataLoader pickles indices into its workers; int's default reduce would drop the
        # epoch and seed (and call __new__ with one argument).
        return (SampleIndex, (int(self), self.epoch, self.seed, self.padding))

    def __repr__(self) -> str:
        pad = ", padding=True" if self.padding else ""
        return f"SampleIndex({int(self)}, epoch={self.epoch}, seed={self.seed}{pad})"

    # int's __str__ would fall back to __repr__; datasets build file names from indices.
    __str__ = int.__repr__


def _check_int(name: str, value: Any, minimum: int | None = None) -> int:
    # Any integer (NumPy's, a 0-d tensor's) is an index; bools and floats would be silent bugs.
    try:
        number = None if isinstance(value, (bool, np.bool_)) else operator.index(value)
    except TypeError:
        number = None
    if number is None or (minimum is not None and number < minimum):
        bound = f" >= {minimum}" if minimum is not None else ""
        raise InvalidArgumentError(f"seed_sample(): {name} must be an int{bound}, got {value!r}")
    return number


def _sample_seeds(seed: int, epoch: int, index: int) -> tuple[int, int, int, int]:
    """Four independent 64-bit seeds (the user's, python, numpy, torch) for one sample.

    A keyed hash, not arithmetic: neighbouring (epoch, index) pairs get unrelated streams, and
    the libraries get different seeds because Python's ``random`` and NumPy's legacy RNG are
    both MT19937 seeded the same way (one seed would make their draws equal). The derivation
    is part of the contract: it does not depend on platform, process or library version, so
    a run resumed by a newer Tardigrade augments its samples as the original did.
    """
    key = f"{seed}:{epoch}:{index}".encode()
    digest = hashlib.blake2b(key, digest_size=32, person=b"tg.seed_sample").digest()
    a, b, c, d = (int.from_bytes(digest[i : i + 8], "little") for i in range(0, 32, 8))
    return a, b, c, d


@contextlib.contextmanager
def seed_sample(index: int, *, seed: int | None = None, epoch: int | None = None) -> Iterator[int]:
    """Seed ``random``, NumPy's global RNG and torch's CPU RNG for one sample, then put them back.

    Inside the block every draw is a function of ``(seed, epoch, index)`` alone (seed and epoch
    come from a :class:`SampleIndex`, or pass them for a plain ``int``); the block yields a
    64-bit seed of that sample for generators of your own (``np.random.default_rng(s)``,
    ``torch.Generator().manual_seed(s)``). On exit the three global RNG states are restored,
    so with ``num_workers=0`` the main process's streams (dropout, ...) do not move. CUDA RNGs
    are not touched. The global RNGs are process-wide: another thread drawing from them during
    the block would draw from the sample's stream. Use it in a ``__getitem__`` of your own, or
    wrap the dataset in :class:`SeededDataset`, which does this for you::

        >>> class Augmented(torch.utils.data.Dataset):
        ...     def __getitem__(self, i):
        ...         with tg.seed_sample(i):                  # i: a tg.SampleIndex
        ...             return self.x[i] + 0.1 * torch.randn(16)
        >>> with tg.seed_sample(7, seed=0, epoch=2) as s:   # a plain int: say seed and epoch
        ...     a = random.random()
        >>> with tg.seed_sample(tg.SampleIndex(7, epoch=2, seed=0)):
        ...     assert random.random() == a
    """
    if isinstance(index, SampleIndex):
        seed = index.seed if seed is None else seed
        epoch = index.epoch if epoch is None else epoch
    elif seed is None or epoch is None:
        raise InvalidArgumentError(
            f"seed_sample(): index {index!r} is a plain {type(index).__name__}, which does not "
            "say its epoch and seed; draw indices from a tg.ResumableSampler (it yields "
            "tg.SampleIndex), or pass seed=... and epoch=... explicitly"
        )
    index = _check_int("index", index)
    seed = _check_int("seed", seed)
    epoch = _check_int("epoch", epoch, minimum=0)
    mine, py_seed, np_seed, torch_seed = _sample_seeds(seed, epoch, index)
    saved_py, saved_np, saved_torch = (
        random.getstate(),
        np.random.get_state(),
        torch.get_rng_state(),
    )
    try:
        random.seed(py_seed)
        # The legacy global RNG takes 32-bit words; two keep the whole 64-bit seed.
        np.random.seed(np.array([np_seed & 0xFFFFFFFF, np_seed >> 32], dtype=np.uint32))
        # Not torch.manual_seed: it would reseed every CUDA device too, which is not restored.
        torch.default_generator.manual_seed(torch_seed)
        yield mine
    finally:
        random.setstate(saved_py)
        np.random.set_state(saved_np)
        torch.set_rng_state(saved_torch)


_T_co = TypeVar("_T_co", covariant=True)


class SeededDataset(torch.utils.data.Dataset[_T_co]):
    """Wrap a map-style dataset so its random augmentation resumes bit-exactly.

    Each ``dataset[i]`` runs inside :func:`seed_sample` ``(i)``: ``random``, ``np.random`` and
    ``torch`` draw from streams fixed by (sampler seed, epoch, sample index), the same for any
    ``num_workers``, any world size and any resume point, and the caller's global RNGs are left
    as they were. Use it with a :class:`ResumableSampler`, whose indices carry the epoch::

        >>> sampler = tg.ResumableSampler(len(ds), seed=0)
        >>> loader = DataLoader(tg.SeededDataset(ds), batch_size=32, sampler=sampler,
        ...                     num_workers=2, generator=sampler.generator)
        >>> for batch in sampler.track(loader): ...

    Attributes not found on the wrapper are read from the wrapped dataset (``.classes``, ...).
    Randomness outside ``__getitem__`` (a random ``collate_fn``, a ``worker_init_fn``) is not
    covered. A plain ``int`` index (another sampler, a direct ``ds[3]``) raises
    :class:`~tardigrade.InvalidArgumentError`: it does not say its epoch.
    """

    def __init__(self, dataset: torch.utils.data.Dataset[_T_co]) -> None:
        if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(
            dataset, "__getitem__"
        ):
            raise InvalidArgumentError(
                f"SeededDataset needs a map-style dataset (one with __getitem__), got "
                f"{type(dataset).__name__}; an IterableDataset draws no indices to seed from"
            )
        self.dataset = dataset

    def __getitem__(self, index: int) -> _T_co:
        with seed_sample(index):
            return self.dataset[index]

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]  # a map-style dataset has __len__; torch's Dataset type does not say so

    def __getattr__(self, name: str) -> Any:
        # Called only for names the wrapper lacks. "dataset" itself is absent while unpickling
        # in a worker: answering it here would recurse.
        if name == "dataset" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __repr__(self) -> str:
        return f"SeededDataset({self.dataset!r})"


class ResumableSampler(torch.utils.data.Sampler[int]):
    """An index sampler whose position (epoch, samples consumed) is saved and restored exactly.

    >>> sampler = tg.ResumableSampler(len(ds), shuffle=True, seed=0)       # doctest: +SKIP
    >>> loader = DataLoader(ds, batch_size=32, sampler=sampler,
    ...                     generator=sampler.generator)                    # doctest: +SKIP
    >>> state = {"model": model, "optim": opt, "data": sampler}            # doctest: +SKIP
    >>> for batch in loader: ...   # runs to the end of the epoch, then advances the epoch

    With ``num_workers > 0`` iterate ``sampler.track(loader)`` (see the module docs). With a
    ``DataLoader(..., drop_last=True)`` pass the same ``batch_size`` and ``drop_last=True`` here,
    so the epoch ends where the loader's does. It yields :class:`SampleIndex` values (``int``
    indices that carry the epoch and seed); wrap a dataset with random augmentation in
    :class:`SeededDataset` to make the augmentation resume exactly too.

    On several ranks every rank yields the same number of indices per pass, so ranks take the
    same number of steps and hold the same position after each. ``drop_last=False`` pads the
    epoch's last step with indices from the epoch's start (``SampleIndex.padding`` is true for
    them), as ``DistributedSampler(drop_last=False)`` does; ``drop_last=True`` skips what is left
    after the last whole step of ``world_size * batch_size`` samples, as
    ``DistributedSampler(drop_last=True)`` with ``DataLoader(drop_last=True)`` does. Resuming
    on any world size hands out every real (non-padding) position of the epoch exactly once, in
    order; the module docs define padding and what counts as a repeat.
    """

    def __init__(
        self,
        dataset_len: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        batch_size: int | None = None,
        drop_last: bool = False,
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
        if batch_size is not None and (type(batch_size) is not int or batch_size < 1):
            raise InvalidArgumentError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if type(drop_last) is not bool or (drop_last and batch_size is None):
            raise InvalidArgumentError(
                f"drop_last must be a bool and needs batch_size=... (the DataLoader's batch "
                f"size), got drop_last={drop_last!r}, batch_size={batch_size!r}"
            )
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.dataset_len = dataset_len
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.consumed = 0  # samples consumed globally in self.epoch
        self._tracked = False
        self._hooked = False  # see _hand_over()
        # A framework sets the position at each (re)start itself (integrations.transformers).
        self._position_external = False
        # (token, length) of the pass whose indices are being handed out: len() holds still.
        self._pass: tuple[object, int] | None = None
        # This rank's indices in the pass track() is under way with (see __len__).
        self._tracked_len: int | None = None
        # How the last pass was read, for the save-time warnings (see _loader_audit).
        self._pass_tracked = False
        self._foreign_seed = False
        self.generator = torch.Generator()
        self._reseed()

    def _reseed(self) -> None:
        """Make the loader's worker seeds a function of the position, not of global RNG draws."""
        mix = self.seed * 0x9E3779B97F4A7C15 + self.epoch * 0xBF58476D1CE4E5B9 + self.consumed
        self.generator.manual_seed(mix % (2**63))
        self._seed_state = self.generator.get_state()

    def order(self, epoch: int) -> torch.Tensor:
        """The global order of indices for ``epoch`` (identical on every rank and world size)."""
        if not self.shuffle:
            return torch.arange(self.dataset_len)
        g = torch.Generator()
        g.manual_seed((self.seed * 0x9E3779B97F4A7C15 + epoch) % (2**63))
        return torch.randperm(self.dataset_len, generator=g)

    def _remaining(self, consumed: int | None = None) -> int:
        """How many indices each rank still hands out in the current epoch: the same on all."""
        left = max(0, self.dataset_len - (self.consumed if consumed is None else consumed))
        if self.drop_last:
            assert self.batch_size is not None
            # Whole global steps only: a per-rank cut would leave ranks a batch apart.
            return left // (self.world_size * self.batch_size) * self.batch_size
        return -(-left // self.world_size)  # the last round is padded

    def _mine(self) -> tuple[list[int], list[int]]:
        """This rank's rest of the epoch: its real indices, then its padding (none or one)."""
        count = self._remaining()
        first = self.consumed + self.rank
        order = self.order(self.epoch)
        # Slicing skips consumed samples without iterating them.
        real = order[first :: self.world_size][:count].tolist()
        n = self.dataset_len
        padding = [
            int(order[(first + j * self.world_size - n) % n]) for j in range(len(real), count)
        ]
        return real, padding

    def __len__(self) -> int:
        """This rank's indices in the pass under way, or else in the next pass.

        While a pass hands out indices, its length is fixed: prefetching DataLoader workers
        pull indices ahead of training (moving the position when ``track()`` is not used), and
        ``len(loader)`` must not shrink under a loop that takes ``len(loader)`` batches.
        """
        if self._hooked:
            return self._remaining(0)  # see _hand_over()
        if self._tracked_len is not None:
            # track() moves the position per delivered batch, while the loader's workers may
            # have drawn every index of the pass long before: the pass's own length holds
            # until the loop asks for the batch after its last.
            return self._tracked_len
        if self._pass is not None:
            return self._pass[1]
        return self._remaining()

    def __iter__(self) -> Iterator[int]:
        """Yield this rank's rest of the current epoch as :class:`SampleIndex` (``int``) values."""
        epoch, start = self.epoch, self.consumed
        real, padding = self._mine()
        count = len(real) + len(padding)
        seed = self.seed
        me = (object(), count)
        self._pass = me
        self._pass_tracked = self._tracked
        # A DataLoader given generator=self.generator drew its seed from it just before this.
        self._foreign_seed = torch.equal(self.generator.get_state(), self._seed_state)
        try:
            for k, idx in enumerate(real + padding, 1):
                if k == count and self._pass is me:
                    # Every index is out: the next len() is the next pass's.
                    self._pass = None
                # A position moved by someone else (load_state_dict(), another pass) is theirs.
                if not self._tracked and (self.epoch, self.consumed) == (epoch, start):
                    # Handed out = consumed (num_workers=0); every rank hands out as many
                    # indices, so the global position is this rank's count times the world
                    # size. The last index ends the epoch right away: a loop that stops after
                    # len(loader) batches never comes back to exhaust this generator.
                    if k == count:
                        self._next_epoch()
                    else:
                        self.consumed = start = min(self.dataset_len, start + self.world_size)
                yield SampleIndex(idx, epoch, seed, k > len(real))
            if not count and not self._tracked and (self.epoch, self.consumed) == (epoch, start):
                self._next_epoch()  # nothing left in this epoch, on any rank
        finally:
            # Also when the loader's iterator is dropped half-way (the generator is closed).
            if self._pass is me:
                self._pass = None

    def _next_epoch(self) -> None:
        self.epoch += 1
        self.consumed = 0
        self._reseed()

    def track(self, loader: Iterable[Any], batch_size: int | None = None) -> Iterator[Any]:
        """Iterate ``loader`` (which uses this sampler), advancing the position per delivered batch.

        Exact with prefetching workers: a batch counts only once the training loop has it. The
        batch that completes the epoch advances it before it is handed over, so a loop that
        stops after ``len(loader)`` batches leaves the sampler at the start of the next epoch.
        """
        bs = batch_size if batch_size is not None else _batch_size_of(loader)
        if type(bs) is not int or bs < 1:
            raise InvalidArgumentError(
                "track() needs the loader's batch_size (pass batch_size=... explicitly)"
            )
        if self.batch_size is not None and bs != self.batch_size:
            raise InvalidArgumentError(
                f"track(): the loader's batch_size is {bs}, this sampler was built with "
                f"batch_size={self.batch_size}; pass the same batch size to both"
            )
        if self._hooked:  # a framework's hooks count the batches (see _hand_over())
            yield from loader
            return
        drop_last = self.drop_last or getattr(loader, "drop_last", False) is True
        self._tracked = True
        try:
            left = self._tracked_len = self._remaining()
            expected = left // bs if drop_last else -(-left // bs)  # batches in this pass
            epoch = self.epoch
            for delivered, batch in enumerate(loader, 1):
                if self.epoch == epoch:
                    if delivered >= expected:
                        self._next_epoch()
                    else:
                        self.consumed = min(self.dataset_len, self.consumed + bs * self.world_size)
                yield batch
            if self.epoch == epoch:
                self._next_epoch()  # nothing left in this epoch, on any rank
        finally:
            self._tracked = False
            self._tracked_len = None

    def _hand_over(self, batch_size: int, drop_last: bool) -> BatchCount:
        """Let a framework's hooks count the batches training got (``tardigrade.integrations``).

        Frameworks iterate the loader themselves and fetch ahead of training (Lightning one
        batch even without workers), so neither the sampler's yields nor :meth:`track` see what
        training consumed; their per-batch hooks do. From here on the sampler's own yields and
        ``track()`` count nothing, and ``len()`` is a whole epoch's: those frameworks count the
        batches of an epoch and restore how many of it were done.
        """
        if self.batch_size is not None and batch_size != self.batch_size:
            raise InvalidArgumentError(
                f"the loader's batch_size is {batch_size}, this sampler was built with "
                f"batch_size={self.batch_size}; pass the same batch size to both"
            )
        self._hooked = True
        self._tracked = True
        return BatchCount(self, batch_size, drop_last or self.drop_last)

    def loader(self, dataset: Any, **kwargs: Any) -> torch.utils.data.DataLoader[Any]:
        """A ``DataLoader`` over ``dataset`` wired for exact resume: this sampler, its generator,
        and (with ``num_workers > 0``) iteration through :meth:`track`.

        ``kwargs`` go to ``DataLoader`` (``batch_size``, ``num_workers``, ``collate_fn``, ...);
        ``sampler``, ``shuffle`` and ``generator`` are this sampler's to set::

            sampler = tg.ResumableSampler(len(ds), seed=0)
            loader = sampler.loader(ds, batch_size=32, num_workers=2)
            for batch in loader: ...       # exact with prefetching workers too
        """
        for taken in ("sampler", "shuffle", "generator", "batch_sampler"):
            if taken in kwargs:
                raise InvalidArgumentError(
                    f"ResumableSampler.loader(): {taken}= is set by the sampler itself; leave it "
                    "out (the loader uses this sampler and its generator)"
                )
        if self.drop_last and kwargs.get("batch_size", 1) != self.batch_size:
            raise InvalidArgumentError(
                f"ResumableSampler.loader(): this sampler drops the last partial batch of "
                f"{self.batch_size}; pass batch_size={self.batch_size}"
            )
        kwargs.setdefault("drop_last", self.drop_last)
        return _TrackedLoader(dataset, sampler=self, generator=self.generator, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        audit_live_loaders()
        return {
            "epoch": self.epoch,
            "consumed": self.consumed,
            "dataset_len": self.dataset_len,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def validate_state_dict(self, state_dict: Any) -> None:
        """Raise StateMismatchError unless ``state_dict`` is a position this sampler can take.

        ``tg.load(into=...)`` calls it before anything is loaded; ``load_state_dict`` too.
        """
        if not isinstance(state_dict, Mapping):
            raise StateMismatchError(
                f"ResumableSampler: expected a state dict, got {type(state_dict).__name__}"
            )
        for key in ("dataset_len", "seed", "shuffle"):
            value = state_dict.get(key)
            if type(value) is not type(getattr(self, key)) or value != getattr(self, key):
                raise StateMismatchError(
                    f"ResumableSampler: checkpoint has {key}={value!r}, this sampler "
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

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.validate_state_dict(state_dict)
        self._pass = None  # a pass under way no longer describes the position
        self._tracked_len = None
        self.epoch, self.consumed = state_dict["epoch"], state_dict["consumed"]
        self._reseed()


def _batch_size_of(loader: Any) -> Any:
    """A DataLoader's batch size, also where a wrapper built it from a batch sampler
    (accelerate's prepared loaders have ``batch_size=None``)."""
    bs = getattr(loader, "batch_size", None)
    if bs is None:
        bs = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    return bs


class _TrackedLoader(torch.utils.data.DataLoader[Any]):
    """A DataLoader whose iteration goes through its ResumableSampler's ``track()``."""

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # yields a Sampler's indices, typed loosely by torch
        sampler = self.sampler
        assert isinstance(sampler, ResumableSampler)
        if self.num_workers == 0:
            return super().__iter__()  # the sampler's own count is exact
        return sampler.track(_Untracked(self))


class _Untracked:
    """The loader seen by ``track()``: its plain iteration, its batch size and drop_last."""

    def __init__(self, loader: torch.utils.data.DataLoader[Any]) -> None:
        self.loader = loader
        self.batch_size = loader.batch_size
        self.drop_last = loader.drop_last

    def __iter__(self) -> Iterator[Any]:
        return torch.utils.data.DataLoader.__iter__(self.loader)


class BatchCount:
    """The position of a :class:`ResumableSampler` advanced by a framework's batch hooks.

    ``before_batch()`` and ``after_batch()`` bracket each batch training gets; ``epoch_end()``
    ends a pass the framework cut short. The batch that completes the epoch advances it, as in
    ``track()``.
    """

    def __init__(self, sampler: ResumableSampler, batch_size: int, drop_last: bool) -> None:
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.left: int | None = None  # batches left in the pass under way
        self.epoch = -1

    def restart(self) -> None:
        """The position was loaded: the next batch starts a new count."""
        self.left = None

    def before_batch(self) -> None:
        s = self.sampler
        if self.left is None or s.epoch != self.epoch:
            left, bs = s._remaining(), self.batch_size
            self.left = left // bs if self.drop_last else -(-left // bs)
            self.epoch = s.epoch

    def after_batch(self) -> None:
        s = self.sampler
        if self.left is None or s.epoch != self.epoch:
            return  # moved by someone else (a load) meanwhile: theirs
        self.left -= 1
        if self.left <= 0:
            s._next_epoch()
            self.left = None
        else:
            s.consumed = min(s.dataset_len, s.consumed + self.batch_size * s.world_size)

    def epoch_end(self) -> None:
        if self.left is not None and self.sampler.epoch == self.epoch:
            self.sampler._next_epoch()  # the framework ended the pass early
        self.left = None
