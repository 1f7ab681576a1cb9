"""Host staging for asynchronous saves: a pool of reused slabs and a bounded byte budget.

An async save copies every tensor's bytes into slabs (large uint8 host buffers, pinned when
CUDA is present) so training may mutate its tensors as soon as ``save`` returns. Slabs go back
to the pool once their bytes are on disk, and the same slabs serve the next save: in steady
state a save allocates nothing. With ``max_staging_bytes`` the pool never holds more than the
budget; staging then waits for the writers to drain slabs, so the caller blocks longer but
memory stays bounded.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from .errors import InvalidArgumentError

DEFAULT_SLAB_BYTES = 64 * 1024 * 1024
MIN_SLAB_BYTES = 1024 * 1024
SLAB_ROUND = 64 * 1024


class Slab:
    """One reusable host buffer; freed back to its pool when sealed and fully written."""

    __slots__ = ("_lock", "buf", "pool", "refs", "sealed")

    def __init__(self, pool: SlabPool, buf: torch.Tensor) -> None:
        self.pool = pool
        self.buf = buf
        self.refs = 0
        self.sealed = False
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        return self.buf.numel()

    def claim(self) -> torch.Tensor:
        """The slab's bytes, for one block of a file; released by :meth:`done_one`."""
        with self._lock:
            self.refs += 1
        return self.buf

    def done_one(self) -> None:
        """A writer finished with one segment of this slab."""
        with self._lock:
            self.refs -= 1
            free = self.sealed and self.refs == 0
        if free:
            self.pool.give_back(self)

    def seal(self) -> None:
        """No more bytes will be staged here; free once the writers are done with it."""
        with self._lock:
            self.sealed = True
            free = self.refs == 0
        if free:
            self.pool.give_back(self)


class SlabPool:
    """Reused staging slabs under an optional byte budget."""

    def __init__(
        self, *, max_bytes: int | None = None, slab_bytes: int = DEFAULT_SLAB_BYTES
    ) -> None:
        if max_bytes is not None and (type(max_bytes) is not int or max_bytes < 2 * MIN_SLAB_BYTES):
            raise InvalidArgumentError(
                f"max_staging_bytes must be None or an int of at least {2 * MIN_SLAB_BYTES} "
                f"bytes, got {max_bytes!r}"
            )
        if max_bytes is not None:
            # Two slabs at least, so staging the next one overlaps with writing the last.
            slab_bytes = max(MIN_SLAB_BYTES, min(slab_bytes, max_bytes // 2))
        self.slab_bytes = slab_bytes
        self.max_bytes = max_bytes
        self._free: list[Slab] = []
        self._cond = threading.Condition()
        self.allocated_bytes = 0
        self.in_use_bytes = 0
        self.peak_in_use_bytes = 0
        self.allocations = 0

    def acquire(self, want: int | None = None) -> Slab:
        """A free slab for about ``want`` bytes, reused when one fits; blocks on the budget.

        Slabs are at most ``slab_bytes``; a smaller ``want`` (the tail of a file) gets a slab
        sized to it, so staging memory tracks the state size instead of rounding up to slabs.
        """
        size = self.slab_bytes
        if want is not None:
            size = max(MIN_SLAB_BYTES, min(size, -(-want // SLAB_ROUND) * SLAB_ROUND))
        with self._cond:
            while True:
                fits = [s for s in self._free if s.capacity >= size]
                if fits:
                    slab = min(fits, key=lambda s: s.capacity)
                    self._free.remove(slab)
                    break
                if self._free and (
                    self.max_bytes is None or self.allocated_bytes + size > self.max_bytes
                ):
                    # Free slabs too small for this request would linger unused: drop one.
                    dropped = min(self._free, key=lambda s: s.capacity)
                    self._free.remove(dropped)
                    self.allocated_bytes -= dropped.capacity
                    continue
                if self.max_bytes is None or self.allocated_bytes + size <= self.max_bytes:
                    slab = Slab(self, _allocate(size))
                    self.allocated_bytes += size
                    self.allocations += 1
                    break
                self._cond.wait()
            slab.refs, slab.sealed = 0, False
            self.in_use_bytes += slab.capacity
            self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
            return slab

    def give_back(self, slab: Slab) -> None:
        with self._cond:
            self.in_use_bytes -= slab.capacity
            self._free.append(slab)
            self._cond.notify_all()

    def stats(self) -> StagingStats:
        return StagingStats(self.allocated_bytes, self.peak_in_use_bytes, self.allocations)


@dataclass(frozen=True)
class StagingStats:
    """Host memory held for staging: allocated (reused across saves), peak in use, allocations."""

    allocated_bytes: int
    peak_in_use_bytes: int
    allocations: int


# Slabs start at a page boundary: a writer hands a full slab to O_DIRECT straight from memory.
PAGE = 4096


def _allocate(nbytes: int) -> torch.Tensor:
    pin = torch.cuda.is_available()
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8, pin_memory=pin)
    start = -raw.data_ptr() % PAGE
    buf = raw[start : start + nbytes]
    # Fault the pages in now, once: a slab is reused for every later save, and staging into
    # touched memory runs at memcpy speed instead of page-fault speed.
    buf.zero_()
    return buf
