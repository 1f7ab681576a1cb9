"""Asynchronous saves: block only to copy the state to host memory, write in the background.

``save`` snapshots every tensor into pooled host slabs synchronously, a background thread writes
and commits, at most ``max_in_flight`` saves are in flight per checkpointer (default one: the
next one waits for room, or is skipped with a warning), saves into one directory write and
commit one after another in the order they were made, ``wait()`` blocks until idle, errors
surface on ``result()``, on the next ``save`` and on ``wait()``/``close()``, and closing (also
at interpreter exit) waits for in-flight work.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from . import _sinks
from ._overlap import FENCE, Overlap, fenced_storages
from ._plan import global_plan, local_plan
from ._save_job import (
    SaveJob,
    SaveOptions,
    SaveResult,
    file_header,
    item_source,
    make_job,
)
from ._sinks import Sink
from ._stager import Stager
from ._staging import Slab, SlabPool, StagingStats
from ._tree import Entry, as_bytes, flatten
from ._warn import warn_user
from ._write import ABORT, END, Block, Segment, write_and_commit
from .errors import InvalidArgumentError, SaveError, TardigradeError

log = logging.getLogger("tardigrade")

_NEVER = object()


class SaveFuture:
    """The handle of an asynchronous save.

    >>> fut = tg.save("ckpt/step-100", state, async_=True)   # doctest: +SKIP
    >>> fut.staged()        # True: training may now mutate the state  # doctest: +SKIP
    >>> fut.result()        # waits for the commit; re-raises a background error  # doctest: +SKIP
    """

    def __init__(self, path: str, future: Future[SaveResult]) -> None:
        self.path = path
        self._future = future
        self._staged = threading.Event()
        self.observed = False  # whether the caller has seen the outcome
        self.blocking_seconds = 0.0  # how long save() blocked the caller
        self._overlap: Overlap | None = None  # a save staging beside training (overlap)
        self.root = ""  # the directory it saves into (saves there write in turn)

    def staged(self) -> bool:
        """True once the state has been copied and training may mutate it."""
        return self._staged.is_set() and (self._overlap is None or self._overlap.staged.is_set())

    def wait_staged(self, timeout: float | None = None) -> bool:
        """Block until the state has been copied (a save with ``overlap`` copies it in the
        background: the fence before a mutation an optimizer's ``step()`` does not cover);
        False if ``timeout`` passed first."""
        return self._overlap is None or self._overlap.wait(timeout)

    def done(self) -> bool:
        """True once the save has committed or failed."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> SaveResult:
        """Wait for the commit and return what was saved; re-raise the background error."""
        try:
            out = self._future.result(timeout)
        except FutureTimeout:
            raise TimeoutError(f"{self.path}: save still in flight after {timeout} s") from None
        except BaseException:
            self.observed = True
            raise
        self.observed = True
        return out

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)

    def _unseen_error(self) -> bool:
        """Whether the save failed and nobody has seen it fail (once done)."""
        return not self.observed and self._future.exception() is not None

    def __repr__(self) -> str:
        state = "done" if self.done() else ("writing" if self.staged() else "staging")
        return f"<SaveFuture {self.path} {state}>"


def stage_copy(
    job: SaveJob, pool: SlabPool, streams: list[Any], check: Callable[[], None] | None = None
) -> None:
    """Copy every data file's bytes, header included, into pool slabs; feed them to the writers.

    Each slab holds the next run of one file's image, so a writer sends a full slab to disk as
    is (with O_DIRECT, straight from the slab: no second copy) and hashes each item's span of
    it. Files are staged one after another, so at most one slab is partly filled and a budget
    of two slabs cannot deadlock against the writers draining them. Without a budget, blocks
    are handed to the writers only once everything is staged. ``streams``: one queue (anything
    with ``put``) per file. ``check()`` runs once every byte is copied, before any block is
    handed over (without a budget): raising there writes nothing.
    """
    bounded = pool.max_bytes is not None
    stager = Stager()
    held: list[tuple[queue.SimpleQueue[Any], list[Any]]] = []
    slab: Slab | None = None
    pending: list[Block] = []  # blocks not handed over yet (device copies may be in flight)
    # The current slab's bytes (a uint8 tensor), how far they are filled, and each item's span.
    buf: Any = None
    fill = 0
    ranges: list[tuple[int, int, int]] = []
    entries = job.entries
    try:
        for fp, stream in zip(job.plan.files, streams, strict=True):

            def hand_over(final: bool, stream: queue.SimpleQueue[Any] = stream) -> None:
                nonlocal pending
                # The writer must not read a block before its bytes landed: device copies
                # (asynchronous, from every device that copied) now; host copies too under a
                # budget, else in one parallel burst once everything is laid out.
                stager.wait(host=bounded)
                blocks: list[Any] = [*pending, *([END] if final else [])]
                if bounded:
                    pending = []
                    for b in blocks:
                        stream.put(b)
                else:
                    pending = []
                    held.append((stream, blocks))

            head = file_header(fp)
            remaining = len(head) + fp.nbytes

            def close_slab(final: bool, filled: int) -> None:
                """Queue the current slab's first ``filled`` bytes as a block and seal it."""
                nonlocal slab
                if slab is not None:
                    pending.append(
                        Block(memoryview(buf[:filled].numpy()), tuple(ranges), slab.done_one)
                    )
                hand_over(final)
                if slab is not None:
                    full = slab
                    slab = None
                    full.seal()

            def next_slab(want: int, filled: int) -> None:
                nonlocal slab, buf, ranges
                if slab is not None:
                    close_slab(False, filled)
                slab = pool.acquire(want)
                buf, ranges = slab.claim(), []

            sources: list[tuple[int | None, torch.Tensor]] = [
                (None, torch.frombuffer(bytearray(head), dtype=torch.uint8))
            ]
            for n, item in enumerate(fp.items):
                src = item_source(entries, item)
                if not src.is_contiguous() or src.is_conj() or src.is_neg():
                    src = src.resolve_conj().resolve_neg().contiguous()
                sources.append((n, as_bytes(src)))
            for i, flat in sources:
                pos = 0
                while pos < flat.numel():
                    if slab is None or fill == buf.numel():
                        next_slab(remaining, fill)
                        fill = 0
                    n = min(flat.numel() - pos, buf.numel() - fill)
                    stager.copy(buf[fill : fill + n], flat[pos : pos + n])
                    if i is not None:
                        ranges.append((i, fill, fill + n))
                    fill += n
                    pos += n
                    remaining -= n
            close_slab(True, fill)
        stager.wait()
        if check is not None:
            check()
    except BaseException:
        # Give back every slab this save took that no writer will release.
        for _, blocks in held:
            _release(blocks)
        _release(pending)
        if slab is not None:
            slab.seal()
        raise
    for stream, blocks in held:
        for b in blocks:
            stream.put(b)


class StagedEntries:
    """Every local tensor's bytes, copied into pool slabs: a collective async save's snapshot.

    A collective save learns which rows of which tensors this rank writes only from the global
    plan, agreed in the background; staging cannot wait for it, so it copies each tensor whole
    (packed back to back, a tensor may straddle slabs) and ``streams`` cuts the plan's items
    out of the copy once the plan is known.
    """

    def __init__(self) -> None:
        self.slabs: list[Slab] = []
        # Per entry: its bytes per row (0 for a 0-d tensor), and its runs as (byte offset, data).
        self.rows: list[int] = []
        self.spans: list[list[tuple[int, memoryview]]] = []
        self.nbytes = 0

    def streams(self, job: SaveJob) -> list[list[Any]]:
        """The writers' segment streams for ``job``'s plan, read from the staged copy."""
        out = []
        for fp in job.plan.files:
            stream: list[Any] = []
            for i, item in enumerate(fp.items):
                lo = item.start * self.rows[item.entry]
                hi = lo + item.nbytes
                for at, data in self.spans[item.entry]:
                    a, b = max(lo, at), min(hi, at + data.nbytes)
                    if a < b:
                        stream.append(Segment(i, data[a - at : b - at]))
            stream.append(END)
            out.append(stream)
        return out

    def release(self) -> None:
        """Give the slabs back to the pool (once the writers are done with them)."""
        slabs, self.slabs = self.slabs, []
        for slab in slabs:
            slab.done_one()
            slab.seal()


def stage_entries(
    entries: list[Entry], pool: SlabPool, skip: Collection[int] = ()
) -> StagedEntries:
    """Copy every entry's bytes into pool slabs, as ``stage_copy`` does for a file image.

    Host copies run in parallel and device copies land in pinned slabs asynchronously (a
    ``Stager``), all waited for before returning. The pool must hold the whole state
    (no budget): the writers start only once the global plan is agreed, after staging.
    Entries in ``skip`` (replicated tensors this rank's plan does not give it) are not copied.
    """
    staged = StagedEntries()
    stager = Stager()
    sources = []
    for k, e in enumerate(entries):
        src = e.tensor.detach()
        if k in skip:
            src = torch.empty(0, dtype=src.dtype)  # rows stay 0: no item may read it
        elif not src.is_contiguous() or src.is_conj() or src.is_neg():
            src = src.resolve_conj().resolve_neg().contiguous()
        flat = as_bytes(src)
        sources.append(flat)
        staged.rows.append(flat.numel() // src.shape[0] if src.dim() and src.shape[0] else 0)
        staged.spans.append([])
    remaining = sum(f.numel() for f in sources)
    staged.nbytes = remaining
    buf: Any = None
    fill = 0
    try:
        for k, flat in enumerate(sources):
            pos = 0
            while pos < flat.numel():
                if buf is None or fill == buf.numel():
                    slab = pool.acquire(remaining)
                    staged.slabs.append(slab)
                    buf, fill = slab.claim(), 0
                n = min(flat.numel() - pos, buf.numel() - fill)
                dst = buf[fill : fill + n]
                stager.copy(dst, flat[pos : pos + n])
                staged.spans[k].append((pos, memoryview(dst.numpy())))
                fill += n
                pos += n
                remaining -= n
        stager.wait()
    except BaseException:
        staged.release()
        raise
    return staged


def _write_staged(
    job: SaveJob,
    readers: list[Any],
    staged: threading.Event,
    sinks: Sequence[Sink] = (),
    turn: Callable[[], None] | None = None,
) -> SaveResult:
    """Write and commit in the background, once ``turn()`` returned (the saves into the same
    directory made before this one have ended); report how long staging blocked the caller.

    Under a budget the writers run while ``save`` is still staging, and may commit before the
    caller's clock stops: the blocking time is read only once staging has set it (and the save
    as a whole took at least as long as it blocked the caller). Each of ``sinks`` (the RAM
    tier's copy) writes from the same staged blocks beside the disk writers.

    Saves into one directory write one after another, not only commit in order: a save that
    shares data then finds the objects of the one before it committed, and references them
    rather than writing them again (one disk is no faster for two writers).
    """
    if turn is not None:
        turn()
    result = _sinks.around(sinks, job, lambda: write_and_commit(job, readers))
    staged.wait()
    blocking = job.blocking_seconds
    assert blocking is not None  # set before ``staged``
    return dataclasses.replace(
        result, blocking_seconds=blocking, total_seconds=max(result.total_seconds, blocking)
    )


def _stage_and_write(
    job: SaveJob,
    pool: SlabPool,
    into: list[Any],
    readers: list[Any],
    sinks: Sequence[Sink],
    overlap: Overlap,
    turn: Callable[[], None] | None,
) -> SaveResult:
    """An overlapped save's background: stage (the fence waits for it; the fenced tensors'
    versions checked), then write and commit. Training waited for what ``save`` blocked
    (``job.blocking_seconds`` so far) and for the fence."""
    try:
        stage_copy(job, pool, into, check=overlap.check)
    finally:
        overlap.staged.set()
    done = threading.Event()
    done.set()
    result = _write_staged(job, readers, done, sinks, turn)
    blocking = (job.blocking_seconds or 0.0) + overlap.waited_seconds()
    return dataclasses.replace(
        result, blocking_seconds=blocking, total_seconds=max(result.total_seconds, blocking)
    )


def _release(segments: list[Any]) -> None:
    for seg in segments:
        if seg is not END and seg.done is not None:
            seg.done()


class ImageSizes(list[int]):
    """The bytes of each data file a save stages, as ``image_sizes`` gives them: what
    ``AsyncCheckpointer.reserve`` reserves as it is."""


def image_sizes(state: Any, *, share: bool = False) -> ImageSizes:
    """The bytes of each data file a save of ``state`` stages (header included), in order.

    Flattens the state and lays out its files as a save does (``state_dict()`` calls, no
    tensor bytes copied); ``share``: as a save that shares data lays them out.
    """
    plan = global_plan([local_plan(flatten(state))], share=share).rank_plan(0)
    return ImageSizes(len(file_header(fp)) + fp.nbytes for fp in plan.files)


class _Flight:
    """The saves of one checkpointer that may still matter, oldest first: those running,
    and those that failed unseen (their error surfaces on the next call)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.saves: list[SaveFuture] = []

    def running(self) -> list[SaveFuture]:
        return [f for f in self.saves if not f.done()]

    def full(self) -> SaveFuture | None:
        """The oldest save running when ``limit`` run (None: there is room for one more)."""
        running = self.running()
        return running[0] if len(running) >= self.limit else None

    def wait_for_room(self) -> None:
        """Block until fewer than ``limit`` saves run (whichever ends first makes room: a
        fast tier's save is not held behind a slow one's)."""
        while len(running := self.running()) >= self.limit:
            futures.wait([f._future for f in running], return_when=futures.FIRST_COMPLETED)

    def wait_all(self) -> None:
        futures.wait([f._future for f in self.saves])

    def add(self, fut: SaveFuture) -> None:
        # What ended and needs no reporting any more leaves the list.
        self.saves = [f for f in self.saves if not f.done() or f._unseen_error()]
        self.saves.append(fut)

    def unseen(self) -> SaveFuture | None:
        """The oldest save that failed with nobody having seen the failure."""
        return next((f for f in self.saves if f.done() and f._unseen_error()), None)

    def turn(self, root: str) -> Callable[[], None] | None:
        """What a new save into ``root`` waits for before it writes: the newest save into the
        same directory still running (which waits for the one before it in turn)."""
        before = [f._future for f in self.running() if f.root == root]
        if not before:
            return None
        last = before[-1]

        def wait() -> None:
            futures.wait([last])  # however it ends: a failed save commits nothing

        return wait


_live: weakref.WeakSet[AsyncCheckpointer] = weakref.WeakSet()


class AsyncCheckpointer:
    """Saves in the background, one at a time by default, from reused host staging buffers.

    >>> ckpt = tg.AsyncCheckpointer(max_staging_bytes=None)   # doctest: +SKIP
    >>> fut = ckpt.save("ckpt/step-100", state)                 # returns after the host copy
    >>> train_more()                                            # mutating state is safe now
    >>> ckpt.wait()                                             # or fut.result()
    >>> ckpt.close()                                            # also waits; idempotent

    ``max_in_flight`` saves may run in the background at once (default 1). A new save finding
    them all running waits until one ends with ``if_busy="wait"`` (default), or is skipped with
    a warning with ``"skip"`` (``save`` then returns None). Saves into the same directory
    write and commit one after another, in the order they were made; a save into another
    directory (a faster tier) does not wait for them. Each save in flight holds its own staged copy (``max_staging_bytes``
    bounds them all together). ``max_staging_bytes``
    caps the host memory that staging holds (None: room for the whole state, kept between
    saves so later saves copy into memory that is already faulted in); under a cap, the
    writers drain staged slabs while the copy goes on, and ``save`` returns once the last
    byte is staged.

    The first save of a checkpointer faults its staging memory in (slow on VMs that hand
    freed memory back to the host); ``reserve(state)`` does that in the background ahead of
    time, so the first save blocks no longer than later ones.
    """

    def __init__(
        self, *, max_staging_bytes: int | None = None, if_busy: str = "wait", max_in_flight: int = 1
    ) -> None:
        if if_busy not in ("wait", "skip"):
            raise InvalidArgumentError(f"if_busy must be 'wait' or 'skip', got {if_busy!r}")
        if type(max_in_flight) is not int or max_in_flight < 1:
            raise InvalidArgumentError(
                f"max_in_flight must be an int >= 1 (saves running at once), got {max_in_flight!r}"
            )
        self.pool = SlabPool(max_bytes=max_staging_bytes)
        self.if_busy = if_busy
        self.max_in_flight = max_in_flight
        # One thread per save in flight: each writes and commits its own.
        self._executor = ThreadPoolExecutor(max_in_flight, thread_name_prefix="tardigrade-save")
        self._flight = _Flight(max_in_flight)
        self._last: SaveFuture | None = None
        # Per process group: the forked group a collective async save coordinates on.
        self._forks: dict[tuple[int, int], Any] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._staged_saves = 0  # saves staged so far (a StagingReservation stops after one)
        _live.add(self)

    def reserve(self, state_or_nbytes: Any) -> int:
        """Fault in, on a background thread, the staging memory a save of the state needs.

        >>> ckpt = tg.AsyncCheckpointer()                          # doctest: +SKIP
        >>> ckpt.reserve({"model": model, "optim": opt})            # returns at once
        >>> train_a_few_steps()                                     # faulting in meanwhile
        >>> ckpt.save("ckpt/step-100", {"model": model, "optim": opt})  # copies at memcpy speed

        ``state_or_nbytes``: the state that will be saved (its file layout is computed as a
        save would: ``state_dict()`` calls, no tensor copied; the reservation then fits the
        save exactly), or a byte count (reserved in whole slabs; a save may still allocate
        its files' tails itself). Returns the bytes newly being reserved (0 when the pool
        already holds them). Memory stays within ``max_staging_bytes``: under a budget only
        that much is reserved. A save started before the reservation is done uses the slabs
        that are ready and faults in the rest beside the reservation thread. State created
        lazily (optimizer moments, at the first ``optimizer.step()``) is not covered until
        ``reserve`` is called again once it exists. ``wait_reserved()`` blocks until it is done. Raises UnsupportedTypeError for a state
        that ``save`` would refuse.
        """
        with self._lock:
            if self._closed:
                raise InvalidArgumentError("this AsyncCheckpointer is closed; create a new one")
        if isinstance(state_or_nbytes, ImageSizes):
            images: list[int] = state_or_nbytes
        elif isinstance(state_or_nbytes, int) and not isinstance(state_or_nbytes, bool):
            if state_or_nbytes < 0:
                raise InvalidArgumentError(
                    f"reserve() takes a state or a byte count >= 0, got {state_or_nbytes}"
                )
            images = [state_or_nbytes]
        else:
            images = image_sizes(state_or_nbytes)
        return self.pool.reserve(self.pool.plan(images))

    def wait_reserved(self, timeout: float | None = None) -> bool:
        """Block until ``reserve``'s background faulting is done; False if ``timeout`` passed."""
        return self.pool.wait_reserved(timeout)

    @property
    def staging(self) -> StagingStats:
        """Host memory held for staging (reused across saves)."""
        return self.pool.stats()

    def _raise_unobserved(self) -> None:
        """Raise the error of a save that failed with nobody having seen the failure yet
        (the oldest such: the others on the next calls)."""
        last = self._flight.unseen()
        if last is None:
            return
        last.observed = True
        exc = last.exception()
        if isinstance(exc, TardigradeError):
            raise exc
        if exc is not None:
            raise SaveError(f"the async save to {last.path} failed: {exc}") from exc

    def save(
        self,
        path: str | os.PathLike[str],
        state: Any,
        *,
        overwrite: bool = False,
        metadata: Mapping[str, Any] | None = None,
        step: int | None = None,
        epoch: int | None = None,
        metrics: Mapping[str, float] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        overlap: bool = False,
    ) -> SaveFuture | None:
        """Stage ``state`` into host memory and write it in the background; see the class doc.

        ``path`` and the other arguments are ``tg.save``'s: a local path or a URL, with
        ``storage_options`` for its backend (e.g. an ``s3://`` endpoint and credentials).
        Options belong to each save, as its location does: one checkpointer may save to
        several places. ``overlap``: return before the copy, which runs beside the next
        forward and backward; every optimizer's ``step()`` waits for it, and so does
        ``wait_staged()`` (see docs/manager.md; without a staging budget only).

        >>> ckpt.save("s3://bucket/run/step-100", state,
        ...           storage_options={"endpoint": "http://127.0.0.1:8333"})  # doctest: +SKIP
        """
        options = SaveOptions(
            overwrite=overwrite,
            metadata=metadata,
            step=step,
            epoch=epoch,
            metrics=metrics,
            storage_options=storage_options,
            overlap=overlap,
        )
        return self.submit(path, state, options)

    def submit(
        self,
        path: str | os.PathLike[str],
        state: Any,
        options: SaveOptions,
        *,
        sinks: Sequence[Sink] = (),
    ) -> SaveFuture | None:
        """:meth:`save` with its options as one object (what ``tg.save`` passes on).

        ``sinks``: more destinations fed from the same staged blocks (the manager's RAM
        tier, ``_ramtier.RamMirror``), so the state is copied once whatever the tiers.
        """
        with self._lock:
            if self._closed:
                raise InvalidArgumentError("this AsyncCheckpointer is closed; create a new one")
            busy = self._flight.full()
            if busy is not None and self.if_busy == "skip":
                warn_user(
                    f"skipping save to {os.fspath(path)}: the save to {busy.path} is still "
                    f"in flight (if_busy='skip', max_in_flight={self.max_in_flight})"
                )
                return None
            self._flight.wait_for_room()  # the error of one that failed is raised just below
            self._raise_unobserved()
            if options.shared is not None and self.pool.max_bytes is not None:
                # A writer holds a shared object's chunk whole before it writes: under a
                # budget, a quarter of it at most, so staging always goes on beside it.
                limit = min(options.share_chunk_bytes, self.pool.max_bytes // 4)
                options = dataclasses.replace(options, share_chunk_bytes=limit)
            job = make_job(path, state, options)
            # What its writers wait for first: the saves into the same directory in flight.
            turn = self._flight.turn(job.storage.url(""))
            # The save's own clock starts after any wait for the previous save, so its
            # blocking and total times describe this save alone.
            job.started = time.perf_counter()
            streams: list[queue.SimpleQueue[Any]] = [queue.SimpleQueue() for _ in job.plan.files]
            # The writers read until END/ABORT, so the iterators' own sentinel never matches.
            readers = [iter(q.get, _NEVER) for q in streams]
            # The stager puts each block into the writers' queues, and the sinks' too.
            into: list[Any] = _sinks.tee(sinks, list(streams))
            # Under a budget the writers must drain slabs while staging goes on; without one
            # they start once the copy is done, so nothing competes with it for the cores.
            bounded = self.pool.max_bytes is not None
            fenced = fenced_storages(state) if options.overlap and not bounded else set()
            if fenced:  # else nothing would fence the copy: it is made here, as always
                return self._overlapped(job, fenced, into, readers, sinks, turn)
            staged = threading.Event()
            background = (
                self._executor.submit(_write_staged, job, readers, staged, sinks, turn)
                if bounded
                else None
            )
            try:
                try:
                    stage_copy(job, self.pool, into)
                finally:
                    job.blocking_seconds = time.perf_counter() - job.started
                    staged.set()
            except BaseException:
                if background is not None:
                    for s in into:
                        s.put(ABORT)
                    background.exception()  # let the writers clean up before we report
                raise
            if background is None:
                background = self._executor.submit(_write_staged, job, readers, staged, sinks, turn)
            return self._started(job, background)

    def _started(self, job: SaveJob, background: Future[SaveResult]) -> SaveFuture:
        """The future of ``job``'s save, whose background runs as ``background``, in flight."""
        fut = SaveFuture(job.storage.url(job.name), background)
        fut.root = job.storage.url("")
        fut.blocking_seconds = job.blocking_seconds or 0.0
        fut._staged.set()
        self._flight.add(fut)
        self._last = fut
        self._staged_saves += 1
        return fut

    def _overlapped(
        self,
        job: SaveJob,
        fenced: set[int],
        into: list[Any],
        readers: list[Any],
        sinks: Any,
        turn: Callable[[], None] | None,
    ) -> SaveFuture:
        """``submit`` with ``overlap``: snapshot what no optimizer fences (``fenced``: the
        storages one does), stage the rest in the background (see ``_overlap``); under the
        checkpointer's lock."""
        overlap = Overlap(job.entries, fenced)
        overlap.snapshot()
        job.blocking_seconds = time.perf_counter() - job.started
        FENCE.add(overlap)
        background = self._executor.submit(
            _stage_and_write, job, self.pool, into, readers, sinks, overlap, turn
        )
        fut = self._started(job, background)
        fut._overlap = overlap
        return fut

    def wait_staged(self, timeout: float | None = None) -> bool:
        """Block until every save in flight has copied the state (``SaveFuture.wait_staged``);
        False if ``timeout`` passed first."""
        end = None if timeout is None else time.monotonic() + timeout
        for fut in self._flight.running():
            left = None if end is None else max(0.0, end - time.monotonic())
            if not fut.wait_staged(left):
                return False
        return True

    def save_collective(
        self,
        ranks: Any,
        path: str | os.PathLike[str],
        stage: Callable[[Any, SlabPool], Callable[[], SaveResult]],
    ) -> SaveFuture:
        """A collective async save over ``ranks`` (every rank calls it); see ``tg.save``.

        ``stage(forked_ranks, pool)`` stages this rank's state in the caller's thread and
        returns the rest of the save, which runs in the background
        (``distributed._save.stage_collective``).

        Returns once this rank's tensors are copied to host memory; a background thread then
        runs the collective protocol on a fork of the group (made here, collectively, at the
        group's first async save), so the training's own collectives never interleave with
        it. Every save in flight is waited for first (one collective save at a time, whatever
        ``max_in_flight``: the ranks' fork carries one): skipping one on some ranks only would
        leave the others waiting, so ``if_busy="skip"`` is refused here.
        """
        with self._lock:
            if self._closed:
                raise InvalidArgumentError("this AsyncCheckpointer is closed; create a new one")
            if self.if_busy != "wait":
                raise InvalidArgumentError(
                    "if_busy='skip' cannot be used for a collective save: the ranks would have "
                    "to agree on which saves to skip. Use if_busy='wait' (the default)"
                )
            if self.pool.max_bytes is not None:
                raise InvalidArgumentError(
                    "max_staging_bytes is not supported for a collective async save yet: each "
                    "rank stages its whole state before the ranks agree on who writes what. "
                    "Use max_staging_bytes=None"
                )
            self._flight.wait_all()  # the error of one that failed is raised just below
            self._raise_unobserved()
            key = (id(ranks.group), ranks.size)
            group = self._forks.get(key)
            if group is None:
                group = self._forks[key] = ranks.fork().group
            started = time.perf_counter()
            background = stage(type(ranks)(group, timeout=ranks.timeout), self.pool)
            blocking = time.perf_counter() - started

            def run() -> SaveResult:
                result = background()
                return dataclasses.replace(
                    result,
                    blocking_seconds=blocking,
                    total_seconds=max(result.total_seconds, blocking),
                )

            fut = SaveFuture(os.fspath(path), self._executor.submit(run))
            fut.blocking_seconds = blocking
            fut._staged.set()
            self._flight.add(fut)
            self._last = fut
            self._staged_saves += 1
            return fut

    def forget_forks(self) -> None:
        """Drop the forked groups; the next collective save forks anew (every rank must call
        this at the same point). For forks that a lost collective left in an unknown state."""
        with self._lock:
            self._forks.clear()

    def wait(self) -> SaveResult | None:
        """Block until no save is in flight; raise a save's error if nobody has seen it; return
        the newest save's result (None: none was made, or it failed and was seen)."""
        last = self._last
        if last is None:
            return None
        self._flight.wait_all()
        self._raise_unobserved()
        return None if last.exception() is not None else last.result()

    def close(self) -> None:
        """Wait for in-flight work and release the writer thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.pool.close()  # stop reserving: nothing will be staged any more
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
            # Free the forked groups now (at exit: before the interpreter's teardown, which
            # their gloo threads must not outlive; see distributed._collectives).
            self._forks.clear()

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StagingReservation:
    """Keeps an AsyncCheckpointer's staging reserved for a state that grows lazily, until a
    save has staged it.

    In a fresh run the optimizer's moments (two thirds of an Adam state) appear at its first
    ``step()``, after a reservation made for the parameters alone; a later first save would
    fault them in while training waits. Sizing the state costs a ``state_dict()`` walk (2-5
    ms for a 250M-parameter model with Adam, 0.05-0.3 s with 4000 tensors), so ``tick()``
    (called once per training step) re-reserves on the 1st, 2nd, 4th, 8th, ... call only:
    the moments are found right after the first optimizer step, or after a few steps that a
    gradient scaler skipped. Reserving is idempotent: an unchanged state reserves nothing.
    Once a save staged the state the pool holds it whole, and ``tick()`` costs nothing. A
    save due at the first tick (step 0 of a fresh run) is not helped: the moments did not
    exist before.
    """

    def __init__(
        self, saver: AsyncCheckpointer, state: Any, need: Callable[[Any], Any] | None = None
    ) -> None:
        self._saver = saver
        self._state = state
        self._need = need if need is not None else (lambda s: s)
        self._ticks = 0
        self._since = saver._staged_saves

    def restart(self) -> None:
        """Reserve now, and grow with the state again from here (at the start, and after a
        restore replaced the state's tensors)."""
        self._ticks = 0
        self._since = self._saver._staged_saves
        self._reserve()

    def tick(self) -> None:
        """One training step passed without a save staging the state."""
        if self._saver._staged_saves != self._since:
            return  # a save staged the whole state: the pool holds it
        self._ticks += 1
        if self._ticks & (self._ticks - 1) == 0:
            self._reserve()

    def _reserve(self) -> None:
        try:
            self._saver.reserve(self._need(self._state))
        except TardigradeError as e:
            # The first save reports it (a leaf the format cannot store, ...).
            log.debug("tardigrade: not reserving staging memory: %s", e)


_default: AsyncCheckpointer | None = None
_default_lock = threading.Lock()


def default_checkpointer() -> AsyncCheckpointer:
    """The process-wide checkpointer behind ``tg.save(..., async_=True)``."""
    global _default
    with _default_lock:
        if _default is None or _default._closed:
            _default = AsyncCheckpointer()
        return _default


@atexit.register
def _close_all() -> None:
    for ckpt in list(_live):
        try:
            ckpt.close()
        except TardigradeError as e:
            log.error("tardigrade: an async save failed before exit: %s", e)
