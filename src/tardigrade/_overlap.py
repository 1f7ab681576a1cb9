"""Staging that overlaps training: an async save copies the state to host memory while the next
forward and backward run, and the first mutation waits for that copy (the fence).

What an optimizer of the saved state owns (its parameters and its state tensors: moments,
step counts) changes only in its ``step()``; forward and backward only read it. So a save with
``overlap`` copies those tensors in the background, and every optimizer's ``step()`` first
waits for the copies in flight (a global step pre-hook: ``Fence``). Everything else is
*snapshotted first*, in the caller, before the save returns: module buffers (BatchNorm's
running statistics change in forward), parameters no optimizer of the state owns, plain
tensors, RNG states. A tensor changed by another path before the fence (an in-place update
outside ``optimizer.step()``) is found where torch can see it: each fenced tensor's version
counter is read when the save starts and again once it is copied, and a change fails the save
with a ``SaveError`` naming the leaf, never a checkpoint of mixed steps. Writes through
``.data`` or a NumPy view bypass the counter: call ``wait_staged()`` before those.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ._tree import Entry
from .errors import SaveError

__all__ = ["Fence", "Overlap", "fenced_storages"]


def _storage(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # a tensor without storage (sparse, meta)
        return 0


def fenced_storages(state: Any) -> set[int]:
    """The storages only an optimizer found in ``state`` (in its dicts, lists and tuples)
    changes: its parameters' and its state tensors'."""
    out: set[int] = set()
    seen: set[int] = set()

    def walk(x: Any) -> None:
        if id(x) in seen:
            return
        seen.add(id(x))
        if isinstance(x, torch.optim.Optimizer):
            for group in x.param_groups:
                out.update(_storage(p) for p in group["params"])
            for per_param in x.state.values():
                if isinstance(per_param, Mapping):
                    out.update(_storage(v) for v in per_param.values() if torch.is_tensor(v))
        elif isinstance(x, Mapping):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(state)
    out.discard(0)
    return out


def _name(e: Entry) -> str:
    if not e.paths:
        return "a tensor"
    return "/".join(str(k) for k in e.paths[0]) or "the root"


class Overlap:
    """One save's overlapped staging: ``snapshot`` copies what is not fenced now (in the
    caller), ``check`` compares the fenced tensors' version counters once they are copied,
    ``wait`` is the fence (it counts the seconds training waited in ``waited``)."""

    def __init__(self, entries: Iterable[Entry], fenced: set[int]) -> None:
        self.entries = list(entries)
        self._fenced = fenced
        self._versions: list[tuple[Entry, int]] = []
        self.staged = threading.Event()
        self.waited = 0.0
        self._lock = threading.Lock()

    def snapshot(self) -> int:
        """Copy every entry that is not fenced (its copy is what the background stages), and
        record the fenced ones' versions; returns the bytes copied here."""
        copied = 0
        for e in self.entries:
            t = e.tensor
            if _storage(t) in self._fenced:
                self._versions.append((e, t._version))
            else:
                e.tensor = t.detach().clone()
                copied += t.nbytes
        return copied

    def check(self) -> None:
        """Raise SaveError if a fenced tensor changed between the save's start and its copy."""
        changed = [e for e, v in self._versions if e.tensor._version != v]
        if changed:
            names = ", ".join(_name(e) for e in changed[:5])
            more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
            raise SaveError(
                f"{names}{more} changed while the save was copying it in the background "
                "(overlap): an in-place update outside optimizer.step(), before the copy was "
                "done. Call wait_staged() before such updates, or save with overlap=False; "
                "nothing was written"
            )

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the staging copy is done; False if ``timeout`` passed first."""
        if self.staged.is_set():
            return True
        start = time.perf_counter()
        done = self.staged.wait(timeout)
        with self._lock:
            self.waited += time.perf_counter() - start
        return done

    def waited_seconds(self) -> float:
        with self._lock:
            return self.waited


class Fence:
    """The overlapped stagings in flight in this process: every optimizer's ``step()`` waits
    for them first (a global step pre-hook, registered at the first)."""

    def __init__(self) -> None:
        self._open: weakref.WeakSet[Overlap] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._hook: Any = None

    def add(self, overlap: Overlap) -> None:
        with self._lock:
            if self._hook is None:
                self._hook = register_optimizer_step_pre_hook(lambda *_: self.wait())
            self._open.add(overlap)

    def wait(self) -> None:
        """Wait for every staging in flight (a no-op when none is)."""
        with self._lock:
            open_ = [o for o in self._open if not o.staged.is_set()]
        for o in open_:
            o.wait()


FENCE = Fence()
