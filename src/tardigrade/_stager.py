"""The one path from a tensor's bytes to host memory: every save's staging goes through it.

An async save copies each tensor into pooled slabs (``_async.stage_copy`` for a file image,
``_async.stage_entries`` for a collective save's whole tensors), and a synchronous save copies
an accelerator tensor to host a piece at a time as its writer takes it (``_write``). All three
hand each copy to a :class:`Stager`: host copies are collected and run in parallel threads,
device copies are queued on their device without blocking, and ``wait()`` is the one way of
waiting for both (each device that copied is synchronized, no other).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from .errors import SaveError

__all__ = ["COPY_PIECE", "COPY_THREADS", "Stager", "synchronize"]

# Host copies run in this many threads (the caller's included), splitting the work into pieces
# taken first come, first served: a core busy with something else slows the copy down instead
# of stalling it, as a statically split parallel copy would.
COPY_THREADS = max(1, min(4, os.cpu_count() or 1))
COPY_PIECE = 32 * 1024 * 1024
_copy_pool: ThreadPoolExecutor | None = None
_copy_pool_lock = threading.Lock()


def _copy_threads() -> ThreadPoolExecutor:
    global _copy_pool
    with _copy_pool_lock:
        if _copy_pool is None:
            _copy_pool = ThreadPoolExecutor(
                max(1, COPY_THREADS - 1), thread_name_prefix="tardigrade-copy"
            )
        return _copy_pool


class Stager:
    """Copies of tensors' bytes into host buffers, made when :meth:`wait` is called (host) or
    as soon as they are queued (device, asynchronously), and waited for there.

    >>> stager = Stager()
    >>> dst = torch.empty(8, dtype=torch.uint8)
    >>> stager.copy(dst, torch.arange(8, dtype=torch.uint8))
    >>> stager.wait()   # the bytes are in ``dst`` now
    >>> dst.tolist()
    [0, 1, 2, 3, 4, 5, 6, 7]
    """

    def __init__(self) -> None:
        self._pieces: list[tuple[Any, Any]] = []  # host copies not made yet
        self._devices: set[torch.device] = set()  # devices with copies in flight

    @property
    def pending(self) -> bool:
        """Whether some copy was queued and not waited for."""
        return bool(self._pieces or self._devices)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue a copy of ``src``'s bytes into ``dst`` (both 1-d uint8, ``dst`` on the host;
        a device ``src`` lands in ``dst``, pinned, without blocking the caller)."""
        if src.device.type == "cpu":
            d, s = dst.numpy(), src.numpy()
            for start in range(0, len(d), COPY_PIECE):
                self._pieces.append((d[start : start + COPY_PIECE], s[start : start + COPY_PIECE]))
            return
        dst.copy_(src, non_blocking=True)
        self._devices.add(src.device)

    def to_host(self, src: torch.Tensor) -> torch.Tensor:
        """A host copy of a device tensor's bytes (1-d uint8), made and waited for now (into
        pageable memory: a piece a synchronous save's writer takes, freed once written)."""
        out = torch.empty(src.numel(), dtype=torch.uint8)
        self.copy(out, src)
        self.wait()
        return out

    def wait(self, *, host: bool = True) -> None:
        """Wait for the device copies queued so far, then (``host``) make the host copies:
        afterwards every byte queued is in its buffer. ``host=False`` leaves the host copies
        queued (a caller that runs them later, in one parallel burst)."""
        if self._devices:
            devices, self._devices = self._devices, set()
            synchronize(devices)
        if host:
            self._run_host()

    def _run_host(self) -> None:
        pieces, self._pieces = self._pieces, []
        if not pieces:
            return
        work = iter(pieces)
        lock = threading.Lock()

        def drain() -> None:
            # numpy copies without holding the GIL, so the threads copy side by side.
            while True:
                with lock:
                    piece = next(work, None)
                if piece is None:
                    return
                np.copyto(*piece)

        helpers = min(COPY_THREADS - 1, len(pieces) - 1)
        running = []
        try:
            for _ in range(helpers):
                running.append(_copy_threads().submit(drain))
        except RuntimeError:
            pass  # the interpreter is exiting and takes no new work: copy in this thread
        try:
            drain()
        finally:
            for f in running:
                f.result()


def synchronize(devices: set[torch.device]) -> None:
    """Wait for the work queued on each of ``devices`` (CUDA or another accelerator)."""
    for d in devices:
        module = getattr(torch, d.type, None)
        sync = getattr(module, "synchronize", None)
        if sync is None:
            raise SaveError(
                f"cannot wait for copies from {d}: torch.{d.type}.synchronize is missing"
            )
        sync(d) if d.index is not None else sync()
