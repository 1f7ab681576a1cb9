"""Host staging for asynchronous saves: a pool of reused slabs and a bounded byte budget.

An async save copies every tensor's bytes into slabs (large uint8 host buffers, pinned when
CUDA is present) so training may mutate its tensors as soon as ``save`` returns. Slabs go back
to the pool once their bytes are on disk, and the same slabs serve the next save: in steady
state a save allocates nothing. With ``max_staging_bytes`` the pool never holds more than the
budget; staging then waits for the writers to drain slabs, so the caller blocks longer but
memory stays bounded.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from dataclasses import dataclass
from typing import Any

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
    """Reused staging slabs under an optional byte budget, optionally reserved ahead of use.

    ``reserve(sizes)`` faults in, on a background thread, the slabs a save of a known state
    will ask for, so the first save copies into touched memory (on this kind of VM a fresh
    page faults in at ~0.5 GB/s, 25x slower than a copy into a touched one). A save racing
    the reservation takes what is ready, waits for a slab being faulted in right now, and
    faults in a reserved slab not yet started itself (the two threads fault side by side);
    nothing is allocated twice and the budget counts every byte from the moment it is
    decided on.
    """

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
        self.allocated_bytes = 0  # slabs allocated plus slabs being allocated right now
        self.in_use_bytes = 0
        self.peak_in_use_bytes = 0
        self.allocations = 0
        self._capacities: list[int] = []  # of every slab allocated or being allocated
        self._pending: list[int] = []  # reserved sizes nobody has started to allocate
        self._making: list[int] = []  # sizes being faulted in by the reservation thread
        self._reserver: threading.Thread | None = None
        self._closed = False

    def size_for(self, want: int | None) -> int:
        """The capacity of the slab ``acquire(want)`` asks for."""
        size = self.slab_bytes
        if want is not None:
            size = max(MIN_SLAB_BYTES, min(size, -(-want // SLAB_ROUND) * SLAB_ROUND))
        return size

    def plan(self, images: list[int]) -> list[int]:
        """The slab sizes a save of files of ``images`` bytes each acquires, in order.

        Mirrors the stager: each file's image fills whole slabs, then a slab sized to its
        tail. Under a budget, only as many as the budget holds (staging then cycles them).
        """
        sizes = []
        for image in images:
            left = image
            while left > 0:
                size = self.size_for(left)
                sizes.append(size)
                left -= min(left, size)
        if self.max_bytes is not None:
            kept, total = [], 0
            for size in sizes:
                if total + size > self.max_bytes:
                    break
                kept.append(size)
                total += size
            sizes = kept
        return sizes

    def reserve(self, sizes: list[int]) -> int:
        """Fault in slabs of ``sizes`` in the background, beyond those the pool already holds.

        Returns the bytes newly reserved. Idempotent: slabs already held or reserved are not
        reserved again.
        """
        with self._cond:
            if self._closed:
                return 0
            have = sorted([*self._capacities, *self._pending])
            missing = []
            for size in sorted(sizes, reverse=True):
                # The smallest held slab that fits serves this size, as ``acquire`` picks.
                fit = next((i for i, c in enumerate(have) if c >= size), None)
                if fit is None:
                    missing.append(size)
                else:
                    have.pop(fit)
            if not missing:
                return 0
            order = {size: i for i, size in enumerate(sizes)}
            self._pending.extend(sorted(missing, key=lambda s: order[s]))
            if self._reserver is None or not self._reserver.is_alive():
                self._reserver = threading.Thread(
                    target=self._reserve_loop, name="tardigrade-reserve", daemon=True
                )
                self._reserver.start()
            return sum(missing)

    def _reserve_loop(self) -> None:
        while True:
            with self._cond:
                if self._closed or not self._pending:
                    self._pending.clear()
                    self._cond.notify_all()
                    return
                size = self._pending.pop(0)
                if self.max_bytes is not None and self.allocated_bytes + size > self.max_bytes:
                    continue  # the budget is taken (e.g. by a save under way): skip it
                self._start_allocation(size)
                self._making.append(size)
            try:
                # One thread touching a byte per page: no OpenMP team competing with training.
                buf = _allocate(size, touch="pages")
            except BaseException:
                with self._cond:
                    self._making.remove(size)
                    self._undo_allocation(size)
                    self._cond.notify_all()
                raise
            with self._cond:
                self._making.remove(size)
                self._free.append(Slab(self, buf))
                self._cond.notify_all()

    def wait_reserved(self, timeout: float | None = None) -> bool:
        """Block until no reservation is pending or being faulted in; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and not self._making, timeout)

    def close(self) -> None:
        """Stop reserving (slabs being faulted in right now still land in the pool)."""
        with self._cond:
            self._closed = True
            self._pending.clear()
            self._cond.notify_all()

    def _start_allocation(self, size: int) -> None:
        self.allocated_bytes += size
        self.allocations += 1
        self._capacities.append(size)

    def _undo_allocation(self, size: int) -> None:
        self.allocated_bytes -= size
        self.allocations -= 1
        self._capacities.remove(size)

    def acquire(self, want: int | None = None) -> Slab:
        """A free slab for about ``want`` bytes, reused when one fits; blocks on the budget.

        Slabs are at most ``slab_bytes``; a smaller ``want`` (the tail of a file) gets a slab
        sized to it, so staging memory tracks the state size instead of rounding up to slabs.
        """
        size = self.size_for(want)
        make = 0
        with self._cond:
            while True:
                fits = [s for s in self._free if s.capacity >= size]
                if fits:
                    slab = min(fits, key=lambda s: s.capacity)
                    self._free.remove(slab)
                    break
                reserved = [p for p in self._pending if p >= size]
                if reserved:
                    # Reserved but not started: fault it in here, beside the reservation thread
                    # (unless the budget has no room left for it: then it is dropped).
                    pick = min(reserved)
                    self._pending.remove(pick)
                    if self.max_bytes is None or self.allocated_bytes + pick <= self.max_bytes:
                        make = pick
                        self._start_allocation(make)
                        break
                    continue
                if any(m >= size for m in self._making):
                    self._cond.wait()  # a fitting slab is being faulted in: take it when ready
                    continue
                if self._free and (
                    self.max_bytes is None or self.allocated_bytes + size > self.max_bytes
                ):
                    # Free slabs too small for this request would linger unused: drop one.
                    dropped = min(self._free, key=lambda s: s.capacity)
                    self._free.remove(dropped)
                    self.allocated_bytes -= dropped.capacity
                    self._capacities.remove(dropped.capacity)
                    continue
                if self.max_bytes is None or self.allocated_bytes + size <= self.max_bytes:
                    make = size
                    self._start_allocation(make)
                    break
                self._cond.wait()
            if make:
                self.in_use_bytes += make
            else:
                self.in_use_bytes += slab.capacity
            self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        if make:
            # Faulting in happens outside the lock: writers keep giving slabs back meanwhile.
            try:
                slab = Slab(self, _allocate(make))
            except BaseException:
                with self._cond:
                    self.in_use_bytes -= make
                    self._undo_allocation(make)
                    self._cond.notify_all()
                raise
        slab.refs, slab.sealed = 0, False
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


def _allocate(nbytes: int, touch: str = "all") -> torch.Tensor:
    pin = torch.cuda.is_available()
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8, pin_memory=pin)
    start = -raw.data_ptr() % PAGE
    buf = raw[start : start + nbytes]
    # Fault the pages in now, once: a slab is reused for every later save, and staging into
    # touched memory runs at memcpy speed instead of page-fault speed. The slab stays
    # allocated (and so resident: the VM only reclaims memory the guest has freed) for the
    # checkpointer's life.
    if touch == "pages":
        # A byte per page faults each in, from this one thread (no OpenMP team).
        buf.numpy()[::PAGE] = 0
    else:
        buf.zero_()
    return buf


_MADV_POPULATE_WRITE = 23  # Linux 5.14+


@functools.cache
def _madvise() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


def populate(buf: torch.Tensor, start: int, end: int) -> bool:
    """Fault in the pages of bytes ``start:end`` of CPU tensor ``buf`` (writable, contents
    unchanged), so a later write into them, even one in flight meanwhile, runs at memcpy
    speed: what a receive into fresh memory otherwise pays page by page. False where the
    kernel cannot (then nothing changed)."""
    madvise = _madvise()
    if madvise is None:
        return False
    lo = -(-(buf.data_ptr() + start) // PAGE) * PAGE
    hi = (buf.data_ptr() + end) // PAGE * PAGE
    return hi <= lo or madvise(lo, hi - lo, _MADV_POPULATE_WRITE) == 0
