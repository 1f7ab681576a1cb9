"""Warn, at save time, about DataLoaders that make a resume silently inexact.

The state being saved cannot show how it is fed: a ``DataLoader`` is not part of it. Three
set-ups resume inexactly while the state holds ``tg.RNGState()`` or a ``tg.ResumableSampler``
(so the user believes the run is exact):

* a loader shuffling with its own ``RandomSampler`` (``shuffle=True``): its position within the
  epoch is in no checkpoint, and each new iterator draws another order;
* a ``ResumableSampler`` read by prefetching workers without ``sampler.track(loader)``: the
  position saved is where the workers are, batches ahead of training;
* a ``ResumableSampler`` whose loader has no ``generator=sampler.generator``: each new iterator
  draws its workers' base seed from the global RNG, at another point of the stream after a
  resume (dropout diverges).

A fourth: a ``ResumableSampler`` that feeds a live loader but is left out of the state saved
(with ``tg.RNGState()`` in it): its position is in no checkpoint.

A fifth: a ``ResumableSampler`` read by workers over a dataset that is not a
``tg.SeededDataset``, which a random augmentation in ``__getitem__`` makes inexact (said as a
condition: whether ``__getitem__`` draws random numbers cannot be seen from here).

They are found by looking at the live DataLoader iterators when ``RNGState`` or a
``ResumableSampler`` is saved. Finding them walks the garbage collector's objects (about 50 ms
per 350,000 objects), so it is done only until a scan sees a loader (a training loop builds
its loaders once), at most five times per process (a load into the state counts too). Each problem is warned once.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

from torch.utils.data import RandomSampler
from torch.utils.data.dataloader import _BaseDataLoaderIter

from ._warn import warn_user

__all__ = ["audit_live_loaders"]

# Scans left in this process; a scan that finds a live loader iterator ends them.
_scans_left = 5
_last_scan = -1e9
_warned: set[tuple[str, int]] = set()


def _samplers(it: _BaseDataLoaderIter) -> list[Any]:
    """The index sampler of a loader iterator and what it wraps (a BatchSampler's sampler,
    accelerate's shard and skip wrappers' batch samplers), a few levels deep."""
    out: list[Any] = []
    todo = [getattr(it, "_index_sampler", None)]
    while todo and len(out) < 8:
        s = todo.pop()
        if s is None or any(s is o for o in out):
            continue
        out.append(s)
        todo += [getattr(s, "sampler", None), getattr(s, "batch_sampler", None)]
    return out


def _seeded(dataset: Any) -> bool:
    """Whether ``dataset`` is a tg.SeededDataset, also under a few wrappers (Subset, ...)."""
    for _ in range(4):
        if dataset is None:
            return False
        if type(dataset).__name__ == "SeededDataset" and hasattr(dataset, "dataset"):
            return True
        dataset = getattr(dataset, "dataset", None)
    return False


def _warn(kind: str, obj: object, message: str) -> None:
    if (kind, id(obj)) in _warned:
        return
    _warned.add((kind, id(obj)))
    warn_user(message)


# While a state is flattened (tg.save), audits are asked for and run once it is all seen; the
# ids of the stateful objects it holds then tell a sampler it leaves out.
_deferred: threading.local = threading.local()


def audit_live_loaders() -> None:
    """Warn about each live DataLoader iterator whose data position cannot resume exactly."""
    asked = getattr(_deferred, "asked", None)
    if asked is not None:
        asked.append(True)
        return
    _run(None)


class deferred_audit:
    """Run the audits asked for inside this block once, at its end, knowing ``saved``: the ids
    of the stateful objects in the state (filled as the block runs). A class, not a
    contextlib generator, so that a warning's frames up to the user's line are all ours."""

    def __init__(self, saved: set[int]) -> None:
        self.saved = saved
        self.asked: list[bool] = []

    def __enter__(self) -> None:
        self.outer = getattr(_deferred, "asked", None)
        _deferred.asked = self.asked

    def __exit__(self, *exc: object) -> None:
        _deferred.asked = self.outer
        if self.asked and exc[0] is None:
            _run(self.saved)


def _run(saved: set[int] | None) -> None:
    try:
        _audit(saved)
    except Exception:  # a best-effort warning must never fail the save it rides on
        pass


def _audit(saved: set[int] | None) -> None:
    global _scans_left, _last_scan
    now = time.monotonic()
    # One save calls this once per RNGState and sampler: one scan serves them all.
    if _scans_left <= 0 or now - _last_scan < 1.0:
        return
    _scans_left -= 1
    _last_scan = now
    # type(), not isinstance(): some objects warn when their __class__ is read.
    iterators = [o for o in gc.get_objects() if issubclass(type(o), _BaseDataLoaderIter)]
    if iterators:
        _scans_left = 0
    for it in iterators:
        for sampler in _samplers(it):
            if isinstance(sampler, RandomSampler):
                _warn(
                    "shuffle",
                    sampler,
                    "tardigrade: a DataLoader with shuffle=True (a RandomSampler) is being "
                    "iterated while its position is in no checkpoint: a resumed run restarts "
                    "the epoch in another order, so it is not exact (tg.RNGState does not cover "
                    "it). Use sampler = tg.ResumableSampler(len(dataset), seed=...); "
                    "DataLoader(dataset, sampler=sampler, generator=sampler.generator) and save "
                    "the sampler in the state.",
                )
            elif hasattr(sampler, "_pass_tracked"):  # a tg.ResumableSampler (data imports us)
                if saved is not None and id(sampler) not in saved:
                    _warn(
                        "missing",
                        sampler,
                        "tardigrade: a tg.ResumableSampler feeds a live DataLoader, but the state "
                        "being saved does not hold it: its data position is in no checkpoint, so "
                        "a resumed run starts the epoch over. Add it to the state (e.g. "
                        "state['data'] = sampler) or to the CheckpointManager's state.",
                    )
                workers = getattr(it, "_num_workers", 0)
                if workers > 0 and not _seeded(getattr(it, "_dataset", None)):
                    _warn(
                        "augmentation",
                        sampler,
                        f"tardigrade: a DataLoader with num_workers={workers} reads a "
                        "tg.ResumableSampler over a dataset that is not a tg.SeededDataset: if "
                        "its __getitem__ draws random numbers (augmentation), each worker draws "
                        "them from a stream that restarts with every pass, so a resumed run "
                        "augments its samples differently. Wrap the dataset: "
                        "DataLoader(tg.SeededDataset(dataset), ...) (per-sample randomness from "
                        "seed, epoch and index, whatever the worker count).",
                    )
                # _position_external: a framework restores the position itself (transformers).
                if workers > 0 and not (sampler._pass_tracked or sampler._position_external):
                    _warn(
                        "untracked",
                        sampler,
                        f"tardigrade: a DataLoader with num_workers={workers} reads a "
                        "tg.ResumableSampler outside sampler.track(loader): its workers "
                        "prefetch, so the saved position is ahead of what training consumed "
                        "and a resumed run skips those batches. Iterate "
                        "`for batch in sampler.track(loader)`, or build the loader with "
                        "sampler.loader(dataset, ...), which does both.",
                    )
                # A persistent worker pool draws its seed once, not per pass: not judged.
                if sampler._foreign_seed and not getattr(it, "_persistent_workers", False):
                    _warn(
                        "generator",
                        sampler,
                        "tardigrade: a DataLoader reads a tg.ResumableSampler but draws its seed "
                        "from the global torch RNG (no generator=sampler.generator): a resumed run "
                        "draws it at another point of the random stream, so dropout and worker "
                        "seeds differ. Pass DataLoader(..., generator=sampler.generator), or "
                        "build the loader with sampler.loader(dataset, ...).",
                    )
