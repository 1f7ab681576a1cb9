"""Collectives of one checkpoint operation: the same result or the same error on every rank.

Every distributed phase of save and load (planning, the commit vote, the preemption flag) moves
its bytes through a :class:`Ranks`. Three rules keep a group of ranks in step when things fail:

1. The callables that compute a rank's contribution run inside a ``try``. Their outcome, bytes
   or an error, travels with the data, so a rank that fails still takes part in every exchange
   and the group never desynchronizes; then every rank raises the same error.
2. Every collective starts with a small fixed-size header from every rank: status, payload length
   and a tag derived from the call (``reduce`` + its ``what``). Ranks that disagree about which
   call this is find out there, before any payload is paired with the wrong one.
3. Every wait for the other ranks is bounded by the timeout. A rank that died, hangs, or never
   made the call becomes a :class:`~tardigrade.errors.DistributedError` on the ranks that did,
   instead of a hang.

Payloads are bytes (JSON the callers encode) moved as CPU uint8 tensors: never pickle, never the
``*_object`` collectives, which unpickle what peers send.

>>> ranks = Ranks.current()  # None when torch.distributed is not initialized  # doctest: +SKIP
>>> names = ranks.all_gather("save 'ckpt/step-100': keys", lambda: json.dumps(keys).encode())  # doctest: +SKIP
"""

from __future__ import annotations

import atexit
import builtins
import collections
import datetime
import functools
import json
import operator
import threading
import time
import traceback
import weakref
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from .. import _probes, errors
from .._staging import populate
from ..errors import DistributedError, InvalidArgumentError, StorageError, TardigradeError

__all__ = ["DEFAULT_TIMEOUT", "Ranks"]

# torch.distributed.nn.functional binds ``group.WORLD`` as a default argument of its functions
# when first imported; torch._dynamo imports it, and a program's first optimizer imports
# torch._dynamo. Imported after init_process_group(), it holds the default group for good and
# destroy_process_group() cannot free it (see the note on process groups at exit below).
# Imported now, before the program initializes its group, it binds None. (Not when a group
# exists already: then this import would be the one to hold it.)
if dist.is_available() and not dist.is_initialized():
    try:
        import torch.distributed.nn.functional
    except ImportError:  # a build without it has nothing to hold the group either
        pass

DEFAULT_TIMEOUT: float = 600.0
"""Seconds any one wait for the other ranks may take before it becomes a DistributedError."""

# An error crosses the wire as a class *name*; the receiving ranks rebuild it only from this
# table, so a peer can never make a rank instantiate an arbitrary class.
_WIRE_ERRORS: dict[str, type[TardigradeError]] = {
    cls.__name__: cls
    for cls in vars(errors).values()
    if isinstance(cls, type) and issubclass(cls, TardigradeError)
}

# The built-in OSError classes an error keeps across ranks, by name (the same table rule as
# _WIRE_ERRORS). A plain one arrives on every rank as a StorageError that is also that class,
# so ``except PermissionError`` and ``e.errno`` behave on every rank as on the failing one.
_OS_ERRORS: dict[str, type[OSError]] = {
    cls.__name__: cls
    for cls in (
        OSError,
        BlockingIOError,
        ChildProcessError,
        ConnectionError,
        BrokenPipeError,
        ConnectionAbortedError,
        ConnectionRefusedError,
        ConnectionResetError,
        FileExistsError,
        FileNotFoundError,
        InterruptedError,
        IsADirectoryError,
        NotADirectoryError,
        PermissionError,
        ProcessLookupError,
        TimeoutError,
    )
}


def _storage_error_like(builtin: type[OSError]) -> type[StorageError]:
    if builtin is OSError:
        return StorageError
    return type(
        f"Storage{builtin.__name__}",
        (StorageError, builtin),
        {
            "__module__": __name__,
            "__doc__": f"A {builtin.__name__} raised on another rank (a StorageError here).",
        },
    )


_STORAGE_ERRORS: dict[str, type[StorageError]] = {
    name: _storage_error_like(cls) for name, cls in _OS_ERRORS.items()
}

# One rank's cause in an error message; bounds what a failing rank can make the others hold.
_MAX_CAUSE_CHARS = 2000

_OK = 0
_FAILED = 1


def _tag(op: str, what: str) -> int:
    return zlib.crc32(f"{op}\0{what}".encode())


def _seconds(timeout: float | datetime.timedelta) -> float:
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise InvalidArgumentError(
            f"timeout={timeout!r}: expected a positive number of seconds or a datetime.timedelta"
        )
    return float(seconds)


def _ranks_phrase(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


@dataclass(frozen=True)
class _Failure:
    """What failed, as it travels between ranks: class names from the tables and each cause.

    ``type`` is the nearest Tardigrade class of the exception (None: DistributedError);
    ``os_type`` and ``errno`` are, for an OSError, its nearest built-in OSError class and its
    ``errno``, so a plain ``PermissionError`` stays one and an ``ENOSPC`` keeps its number.
    """

    type: str | None  # a key of _WIRE_ERRORS, or None for DistributedError
    causes: dict[int, str]
    os_type: str | None = None  # a key of _OS_ERRORS, or None when not an OSError
    errno: int | None = None

    @classmethod
    def of(cls, rank: int, exc: BaseException, during: str = "") -> _Failure:
        # The nearest Tardigrade class in the MRO, so a private subclass still arrives as its
        # public parent (and a ValueError as DistributedError).
        mro = type(exc).__mro__
        name = next((k.__name__ for k in mro if _WIRE_ERRORS.get(k.__name__) is k), None)
        os_type = next((k.__name__ for k in mro if _OS_ERRORS.get(k.__name__) is k), None)
        number = getattr(exc, "errno", None) if os_type is not None else None
        try:
            text = f"{type(exc).__name__}: {exc}{during}"
        except Exception:  # a __str__ that raises must not keep this rank out of the exchange
            text = f"{type(exc).__name__}: (its message could not be formatted){during}"
        if len(text) > _MAX_CAUSE_CHARS:
            text = text[: _MAX_CAUSE_CHARS - 16] + " ...(truncated)"
        return cls(name, {rank: text}, os_type, number if type(number) is int else None)

    def encode(self) -> bytes:
        causes = {str(r): c for r, c in self.causes.items()}
        doc = {"type": self.type, "causes": causes, "os_type": self.os_type, "errno": self.errno}
        return json.dumps(doc).encode()

    @classmethod
    def decode(cls, data: bytes, rank: int) -> _Failure:
        try:
            doc = json.loads(data)
            name, os_type, number = doc["type"], doc.get("os_type"), doc.get("errno")
            causes = {int(r): str(c) for r, c in doc["causes"].items()}
            if (
                (name is not None and not isinstance(name, str))
                or (os_type is not None and not isinstance(os_type, str))
                or (number is not None and type(number) is not int)
                or not causes
            ):
                raise ValueError(name)
        except (ValueError, TypeError, KeyError, AttributeError):
            return cls(None, {rank: f"(an error report that could not be read: {data[:200]!r})"})
        return cls(name, causes, os_type, number)

    @classmethod
    def merge(cls, failures: list[_Failure]) -> _Failure:
        causes: dict[int, str] = {}
        for failure in failures:
            causes.update(failure.causes)
        lowest = min(failures, key=lambda f: min(f.causes))
        return cls(lowest.type, dict(sorted(causes.items())), lowest.os_type, lowest.errno)

    def error_class(self) -> builtins.type[TardigradeError]:  # ``type``: a field here
        """The class every rank raises: the Tardigrade class, made to keep the OSError class.

        A plain OSError becomes the StorageError that is also its built-in class; a
        StorageError raised as a PermissionError subclass stays a PermissionError too.
        """
        cls = _WIRE_ERRORS.get(self.type or "")
        builtin = _OS_ERRORS.get(self.os_type or "")
        if builtin is not None and (cls is None or cls is StorageError):
            return _STORAGE_ERRORS[builtin.__name__]
        return cls or DistributedError

    def error(self, what: str, size: int) -> TardigradeError:
        """The exception every rank raises: same class, same message, same ``causes``."""
        failed = sorted(self.causes)
        message = (
            f"{what} failed on {_ranks_phrase(failed)} of {size}; every rank raises this error:\n"
            + "\n".join(f"  rank {r}: {self.causes[r]}" for r in failed)
        )
        cls = self.error_class()
        err: TardigradeError
        try:
            err = cls(message)
        except Exception:  # a class whose constructor wants more than a message
            err = DistributedError(message)
        if isinstance(err, OSError) and self.errno is not None:
            err.errno = self.errno  # str(err) stays the message: strerror is left unset
        err.causes = dict(self.causes)  # type: ignore[attr-defined]  # every class raised here takes it, as DistributedError has it
        return err


@dataclass(frozen=True)
class _Outcome:
    """One rank's result of running a callable: its bytes, or its failure and the exception."""

    payload: bytes = b""
    failure: _Failure | None = None
    exc: Exception | None = None

    @property
    def wire(self) -> bytes:
        return self.failure.encode() if self.failure is not None else self.payload


def _run_callable(rank: int, role: str, fn: Callable[[], Any], during: str = "") -> _Outcome:
    try:
        out = fn()
        if not isinstance(out, (bytes, bytearray, memoryview)):
            raise TypeError(f"{role} returned {type(out).__name__}, expected bytes")
        return _Outcome(payload=out if isinstance(out, bytes) else bytes(out))
    except Exception as exc:
        return _Outcome(failure=_Failure.of(rank, exc, during), exc=exc)


def _to_tensor(data: bytes, size: int) -> torch.Tensor:
    """``data`` in a uint8 tensor of ``size`` bytes, zero padded."""
    out = torch.empty(size, dtype=torch.uint8)
    view = out.numpy()
    view[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    view[len(data) :] = 0
    return out


class Outgoing(Protocol):
    """A payload sent by ``Ranks.exchange`` that is read piece by piece as it goes (the
    sender never holds the whole of it)."""

    nbytes: int

    def read_into(self, start: int, into: memoryview) -> None: ...


class _Pieces:
    """What ``exchange`` sends one rank: a tensor's slices, or an ``Outgoing`` read into two
    piece buffers in turn (the next one is read while the previous one is on the wire)."""

    def __init__(self, payload: torch.Tensor | Outgoing, chunk: int) -> None:
        self.tensor = payload.reshape(-1) if isinstance(payload, torch.Tensor) else None
        self.payload = payload
        self.nbytes = self.tensor.numel() if self.tensor is not None else payload.nbytes
        size = min(chunk, self.nbytes) if self.tensor is None else 0
        self.buffers = [torch.empty(size, dtype=torch.uint8) for _ in range(2)]

    def piece(self, start: int, end: int, turn: int) -> torch.Tensor:
        if self.tensor is not None:
            return self.tensor[start:end]
        buf = self.buffers[turn % 2][: min(end, self.nbytes) - start]
        self.payload.read_into(start, _view(buf))  # type: ignore[union-attr]  # not a tensor
        return buf


def _populate(buffers: list[torch.Tensor], chunk: int) -> None:
    for buf in buffers:
        for start in range(0, buf.numel(), chunk):
            if not populate(buf, start, min(start + chunk, buf.numel())):
                return


def _view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a CPU uint8 tensor, without a copy."""
    return memoryview(tensor.numpy()).cast("B")  # type: ignore[arg-type]  # an ndarray is a buffer


def _to_bytes(tensor: torch.Tensor, size: int) -> bytes:
    return tensor[:size].numpy().tobytes()


def _carries_cpu_over_gloo(group: Any) -> bool:
    """Whether ``group`` moves CPU tensors with gloo ("gloo", "cpu:gloo,cuda:nccl")."""
    try:
        config = str(dist.get_backend_config(group))
    except (AttributeError, ValueError, RuntimeError):
        config = str(dist.get_backend(group))
    backends = [
        e.split(":")[-1] for e in config.lower().split(",") if e.startswith("cpu:") or ":" not in e
    ]
    return "gloo" in backends


# Process groups and interpreter exit. Freeing a process group (its last reference going) is
# what stops its gloo worker threads; torch.distributed.destroy_process_group() only drops
# torch's own references. A gloo worker that outlives the interpreter's finalization may still
# free the last reference to a finished operation, whose tensors' Python objects then need the
# GIL: a thread taking the GIL during finalization is ended with pthread_exit, which unwinds
# through a noexcept C++ destructor and aborts the process ("terminate called without an
# active exception", SIGABRT) after all its work is done. So Tardigrade never keeps a group
# alive: a Ranks refers to the group it was given weakly (a reference cycle or a traceback that
# holds a Ranks cannot keep the group's threads running past destroy_process_group()), and the
# groups it creates itself are freed with their owner or, at the latest, at exit.

# A program's own objects may hold its group past destroy_process_group() (a DDP module does),
# so its threads can outlive the interpreter whatever Tardigrade holds. What must not happen is
# a gloo thread dropping the last reference to one of our finished operations during teardown:
# when wait() returns, the worker that ran it may still hold it a while (with each rank on one
# CPU, until the scheduler runs that thread again), and our references would go first. So the
# last few operations of each group (their Work and tensors) stay referenced from here until
# later ones replace them, or the group is freed (destroy_process_group() with nothing else
# holding it: the Work holds gloo's context, whose thread must stop then too), or the
# interpreter's teardown clears this module (in the main thread). Not at atexit: freed there,
# as the program exits, the aborts came back (the reproducer: a DDP module held past destroy,
# each rank pinned to one CPU, a save or a load as the last collective: 19 of 24 runs aborted
# with the last operation's tensors alone kept; 0 of 24 with this; 13 of 24 freed at atexit).
_RECENT_OPS = 4
_RECENT: dict[int, collections.deque[Any]] = {}
_RECENT_LOCK = threading.Lock()


def _hold(group: Any, op: Any) -> None:
    """Keep ``op`` (an operation's Work and tensors) referenced, as the note above says."""
    key = id(group)
    with _RECENT_LOCK:
        recent = _RECENT.get(key)
        if recent is None:
            recent = _RECENT[key] = collections.deque()
            weakref.finalize(group, _forget, key).atexit = False  # see the note
        recent.append(op)
        old = recent.popleft() if len(recent) > _RECENT_OPS else None
    del old  # freed here, outside the lock


def _forget(key: int) -> None:
    """Drop what ``_hold`` keeps of group ``key`` (it was freed)."""
    with _RECENT_LOCK:
        gone = _RECENT.pop(key, None)
    del gone


# A gloo group beside each non-gloo (NCCL) group, created on its first collective and kept
# while that group exists: creating one is itself a collective, so it must happen once.
_GLOO_SIBLINGS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_GLOO_SIBLINGS_LOCK = threading.Lock()


@atexit.register
def _free_gloo_siblings() -> None:
    """Free the sibling groups (joining their threads) while the interpreter is fully alive."""
    with _GLOO_SIBLINGS_LOCK:
        _GLOO_SIBLINGS.clear()


class Ranks:
    """The processes of one group taking part in one collective checkpoint operation.

    Every method is a collective: every rank of the group must call it, in the same order, with
    the same ``what`` (a short description such as ``"save 'ckpt/step-100': plan"`` that also
    names the step in errors). The callables passed in run inside a ``try``: when one raises on
    any rank, every rank raises the same error. Its class follows the lowest failing rank's
    exception: a Tardigrade error keeps its class (``SaveError`` stays ``SaveError``,
    ``CheckpointNotFoundError`` stays a ``FileNotFoundError``); a plain ``OSError`` becomes the
    :class:`~tardigrade.errors.StorageError` that is also its built-in class (a
    ``PermissionError`` stays a ``PermissionError``), and an OSError keeps its ``errno``;
    anything else becomes :class:`~tardigrade.errors.DistributedError`. Its message lists each
    failing rank's cause, and its ``causes`` attribute maps those ranks to them. (Only
    ``Exception`` is caught: a ``KeyboardInterrupt`` stops its rank at once, and the others see
    that rank as gone.)

    Each wait for the other ranks is bounded by ``timeout`` seconds. When a rank died, hangs or
    did not make the call, the others raise ``DistributedError`` within that time; the process
    group is then in an unknown state and should not be used for further collectives. The
    operation given up on stays queued in the group (gloo cannot cancel one), so destroying the
    group, or the process's exit, waits until the missing ranks leave or the group's own
    ``init_process_group(timeout=...)`` passes, whichever comes first.

    Payloads travel as CPU tensors. On a gloo group (or one mapping CPU to gloo) the group itself
    carries them; on any other (NCCL) group the first collective call creates a gloo group over
    the same ranks, cached per group, so that first call must be made by every rank of the group
    (as every collective must). A ``Ranks`` is used by one thread at a time; for coordination in
    a background thread, :meth:`fork` one.

    A ``Ranks`` does not keep the group it was given alive (it holds it weakly): once the
    program has destroyed the group and dropped it, using the ``Ranks`` raises
    ``DistributedError``, and ``torch.distributed.destroy_process_group()`` frees the group
    whatever Tardigrade objects remain.

    >>> ranks = Ranks.current()  # doctest: +SKIP
    >>> if ranks is not None:  # doctest: +SKIP
    ...     sizes = ranks.all_gather("save: sizes", lambda: str(nbytes).encode())
    ...     stop = ranks.agree_max(int(preempted))
    """

    rank: int
    """This process's rank within the group."""
    size: int
    """How many ranks the group has."""
    coordinator: bool
    """Whether this rank is the group's rank 0, the one that runs ``combine`` and ``produce``."""
    timeout: float
    """Seconds any one wait for the other ranks may take."""

    def __init__(
        self,
        process_group: Any = None,
        *,
        timeout: float | datetime.timedelta = DEFAULT_TIMEOUT,
    ) -> None:
        """Wrap ``process_group`` (the default group when None), already initialized."""
        if not (dist.is_available() and dist.is_initialized()):
            raise InvalidArgumentError(
                "Ranks needs an initialized torch.distributed process group: call "
                "torch.distributed.init_process_group() first (Ranks.current() returns None "
                "when there is none)"
            )
        self.timeout = _seconds(timeout)
        self._wait = datetime.timedelta(seconds=self.timeout)
        group = process_group if process_group is not None else dist.group.WORLD
        rank = dist.get_rank(group)
        if rank < 0:
            raise InvalidArgumentError(
                f"this process (global rank {dist.get_rank()}) is not a member of the process "
                "group given to Ranks: pass a group this rank belongs to"
            )
        self.rank = rank
        self.size = dist.get_world_size(group)
        self.coordinator = rank == 0
        self._group: Callable[[], Any]
        try:
            self._group = weakref.ref(group)
        except TypeError:  # a group type without weak references: held, as before
            self._group = lambda: group
        self._owned: Any = None  # the group itself, only when this Ranks made it (fork())
        self._transport: weakref.ref[Any] | None = None
        self._root = 0  # the coordinator's global rank, which the gather/broadcast ops want

    @classmethod
    def current(
        cls,
        process_group: Any = None,
        timeout: float | datetime.timedelta = DEFAULT_TIMEOUT,
    ) -> Ranks | None:
        """The ranks of ``process_group`` (default group), or None in a single-process program.

        >>> Ranks.current() is None  # no init_process_group() in this process
        True
        """
        if not (dist.is_available() and dist.is_initialized()):
            return None
        return cls(process_group, timeout=timeout)

    def __repr__(self) -> str:
        return f"Ranks(rank={self.rank}, size={self.size}, timeout={self.timeout:g})"

    @property
    def group(self) -> Any:
        """The process group, while the program keeps it (raises DistributedError after)."""
        group = self._group()
        if group is None:
            raise DistributedError(
                f"{self!r}: its process group no longer exists (it was destroyed and freed, "
                "e.g. by torch.distributed.destroy_process_group()). Create the Ranks, manager "
                "or save again once a process group is initialized."
            )
        return group

    # -- the collectives -------------------------------------------------------------------

    def all_gather(self, what: str, local: Callable[[], bytes]) -> list[bytes]:
        """Every rank's ``local()`` bytes, in rank order, on every rank."""
        _probes.entering_phase(what)
        mine = _run_callable(self.rank, "local()", local)
        if self.size == 1:
            self._raise_if_failed(what, [mine])
            return [mine.payload]
        headers = self._open(what, _tag("all_gather", what), mine)
        return self._all_gather_bytes(
            what, "gathering payloads", mine.payload, [h[1] for h in headers]
        )

    def reduce(
        self,
        what: str,
        local: Callable[[], bytes],
        combine: Callable[[list[bytes]], bytes],
    ) -> bytes:
        """``combine`` of every rank's ``local()`` bytes, run on the coordinator, on every rank.

        The payloads are gathered on the coordinator only (it may receive large plans), each
        padded to the longest one for the transfer; the combined bytes, or the error ``combine``
        raised there, are then sent to every rank.
        """
        _probes.entering_phase(what)
        mine = _run_callable(self.rank, "local()", local)
        if self.size == 1:
            self._raise_if_failed(what, [mine])
            result = _run_callable(
                0, "combine()", lambda: combine([mine.payload]), " (raised by combine)"
            )
            self._raise_if_failed(what, [result])
            return result.payload
        headers = self._open(what, _tag("reduce", what), mine)
        lengths = [h[1] for h in headers]
        longest = max(lengths)
        payloads = [b""] * self.size
        if longest:
            sent = _to_tensor(mine.payload, longest)
            received = (
                [torch.empty(longest, dtype=torch.uint8) for _ in range(self.size)]
                if self.coordinator
                else None
            )
            self._issue(
                what,
                "gathering payloads on the coordinator",
                lambda group: dist.gather(sent, received, self._root, group, async_op=True),
                sent,
                received,
            )
            if received is not None:
                payloads = [_to_bytes(t, n) for t, n in zip(received, lengths, strict=True)]
        result = _Outcome()
        if self.coordinator:
            result = _run_callable(
                self.rank, "combine()", lambda: combine(payloads), " (raised by combine)"
            )
        body = result.wire
        status = _OK if result.failure is None else _FAILED
        header = torch.tensor([status, len(body)], dtype=torch.int64)
        self._issue(
            what,
            "receiving the combined result",
            lambda group: dist.broadcast(header, src=self._root, group=group, async_op=True),
            header,
        )
        status, nbytes = (int(x) for x in header.tolist())
        data = self._broadcast_bytes(what, "receiving the combined result", body, nbytes)
        if status != _OK:
            raise _Failure.decode(data, 0).error(what, self.size) from result.exc
        return data

    def broadcast(self, what: str, produce: Callable[[], bytes], src: int = 0) -> bytes:
        """Rank ``src``'s ``produce()`` bytes (the coordinator's by default), on every rank
        (``produce`` runs only there)."""
        _probes.entering_phase(what)
        mine = _run_callable(self.rank, "produce()", produce) if self.rank == src else _Outcome()
        if self.size == 1:
            self._raise_if_failed(what, [mine])
            return mine.payload
        headers = self._open(what, _tag("broadcast", what), mine)
        return self._broadcast_bytes(
            what, "receiving the payload", mine.payload, headers[src][1], src
        )

    def exchange(
        self,
        what: str,
        out: Mapping[int, torch.Tensor | Outgoing],
        sources: list[int],
        *,
        chunk: int = 64 * 1024 * 1024,
        go: Callable[[], object] | None = None,
    ) -> dict[int, memoryview]:
        """Point to point: send ``out[r]`` (a uint8 tensor, or an ``Outgoing`` read as it is
        sent) to each rank ``r`` and receive one payload from each rank of ``sources``;
        returns them by source (views of the received tensors: no copy). Only the ranks of a
        pair take part (both must call it, each naming the other), in pieces of at most
        ``chunk`` bytes, the next piece read while the previous is in flight; ``go()`` is
        called before each piece (a background sender pausing for training). Every wait is
        bounded by the timeout; a peer gone raises DistributedError."""
        _probes.entering_phase(what)
        group = self._transport_group(what)
        peer = functools.partial(dist.get_global_rank, group)
        sent = {r: _Pieces(p, chunk) for r, p in out.items()}
        sizes = {r: torch.tensor([p.nbytes], dtype=torch.int64) for r, p in sent.items()}
        lengths = {r: torch.empty(1, dtype=torch.int64) for r in sources}
        works = [dist.isend(t, peer(r), group) for r, t in sizes.items()]
        works += [dist.irecv(t, peer(r), group) for r, t in lengths.items()]
        _hold(group, (works, sizes, lengths))  # as _issue's
        self._wait_all(what, "exchanging sizes", works)
        got = {r: torch.empty(int(t.item()), dtype=torch.uint8) for r, t in lengths.items()}
        # Fresh memory: its pages are faulted in beside the receive, not by it, piece by piece.
        faulting = threading.Thread(
            target=_populate, args=(list(got.values()), chunk), name="tardigrade-receive"
        )
        faulting.start()
        longest = max(
            [p.nbytes for p in sent.values()] + [t.numel() for t in got.values()], default=0
        )

        def pieces(start: int, turn: int) -> dict[int, torch.Tensor]:
            return {
                r: p.piece(start, start + chunk, turn) for r, p in sent.items() if start < p.nbytes
            }

        ready = pieces(0, 0)
        for turn, start in enumerate(range(0, longest, chunk)):
            if go is not None:
                go()
            end = start + chunk
            works = [dist.isend(t, peer(r), group) for r, t in ready.items()] + [
                dist.irecv(t[start:end], peer(r), group) for r, t in got.items() if start < len(t)
            ]
            ready = pieces(end, turn + 1) if end < longest else {}
            self._wait_all(what, "sending and receiving payloads", works)
        faulting.join()
        return {r: _view(t) for r, t in got.items()}

    def _wait_all(self, what: str, step: str, works: list[Any]) -> None:
        start = time.monotonic()
        try:
            for work in works:
                if not work.wait(timeout=self._wait):
                    raise TimeoutError("Operation timed out!")
        except Exception as exc:
            traceback.clear_frames(exc.__traceback__)
            raise self._transport_error(what, step, exc, time.monotonic() - start) from exc

    def agree_max(self, value: int, what: str = "agree_max") -> int:
        """The largest ``value`` any rank passed, on every rank: one tiny all-reduce, no header.

        Cheap enough to call every training step (e.g. "did any rank get SIGTERM?"). ``what``
        names the call in the error a rank that waited too long raises (there is no header,
        so ranks in different calls are not told apart here).
        """
        _probes.entering_phase(what)
        try:
            tensor = torch.tensor([operator.index(value)], dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
            raise InvalidArgumentError(
                f"agree_max({value!r}): expected an int that fits in 64 bits"
            ) from exc
        if self.size == 1:
            return int(tensor.item())
        self._issue(
            what,
            "agreeing on the largest value",
            lambda group: dist.all_reduce(tensor, dist.ReduceOp.MAX, group, async_op=True),
            tensor,
        )
        return int(tensor.item())

    def barrier(self, what: str) -> None:
        """Return once every rank has reached the same ``barrier(what)``."""
        _probes.entering_phase(what)
        if self.size > 1:
            self._open(what, _tag("barrier", what), _Outcome())

    def fork(self) -> Ranks:
        """A new gloo group over the same ranks, for a background thread's collectives.

        Collective now: every rank of the group calls ``fork()`` at the same point. The new
        group's collectives never interleave with this one's, so a background save can agree
        with its peers while training runs collectives on the original group. Each fork is a
        new process group: fork once, not per operation. The returned ``Ranks`` owns it (the
        only Ranks that holds its group strongly): the group lives while that ``Ranks`` or
        its ``group`` is referenced; drop both when done, at the latest before exit (freeing
        a group stops its threads; see the note on process groups at exit above).
        """
        group = self._new_gloo_group("fork()", "creating a gloo process group")
        forked = Ranks(group, timeout=self.timeout)
        forked._owned = group
        return forked

    def _new_gloo_group(self, what: str, during: str) -> Any:
        """A new gloo group over this group's ranks (collective: every member calls it)."""
        ranks = dist.get_process_group_ranks(self.group)
        start = time.monotonic()
        try:
            return dist.new_group(
                ranks=ranks,
                backend="gloo",
                timeout=self._wait,
                # A subgroup's members alone call this: the others must not be waited for.
                use_local_synchronization=len(ranks) != dist.get_world_size(),
            )
        except Exception as exc:
            raise self._transport_error(what, during, exc, time.monotonic() - start) from exc

    # -- the steps they are made of --------------------------------------------------------

    def _open(self, what: str, tag: int, mine: _Outcome) -> list[tuple[int, int, int]]:
        """Exchange headers; raise on every rank if the calls differ or any rank failed.

        Returns every rank's (status, payload length, tag) when all ranks succeeded.
        """
        status = _OK if mine.failure is None else _FAILED
        sent = torch.tensor([status, len(mine.wire), tag], dtype=torch.int64)
        received = [torch.empty(3, dtype=torch.int64) for _ in range(self.size)]
        self._issue(
            what,
            "exchanging headers",
            lambda group: dist.all_gather(received, sent, group=group, async_op=True),
            received,
            sent,
        )
        headers = [(int(s), int(n), int(t)) for s, n, t in (h.tolist() for h in received)]
        others = [r for r, h in enumerate(headers) if h[2] != tag]
        if others:
            raise DistributedError(
                f"{what}: {_ranks_phrase(others)} of {self.size} made a different collective "
                f"call than rank {self.rank}, which called {what!r}. Every rank of the group must "
                "make the same collective calls in the same order (does some rank skip a step, "
                "or save/load with different arguments?)"
            ) from mine.exc
        failed = [r for r, h in enumerate(headers) if h[0] != _OK]
        if failed:
            # Only the failing ranks' error reports are exchanged, never the payloads.
            lengths = [h[1] if h[0] != _OK else 0 for h in headers]
            reports = self._all_gather_bytes(
                what, "exchanging errors", mine.wire if mine.failure else b"", lengths
            )
            failure = _Failure.merge([_Failure.decode(reports[r], r) for r in failed])
            raise failure.error(what, self.size) from mine.exc
        return headers

    def _raise_if_failed(self, what: str, outcomes: list[_Outcome]) -> None:
        failures = [o for o in outcomes if o.failure is not None]
        if failures:
            merged = _Failure.merge([o.failure for o in failures if o.failure is not None])
            raise merged.error(what, self.size) from failures[0].exc

    def _all_gather_bytes(
        self, what: str, step: str, data: bytes, lengths: list[int]
    ) -> list[bytes]:
        longest = max(lengths)
        if not longest:
            return [b""] * self.size
        sent = _to_tensor(data, longest)
        received = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.size)]
        self._issue(
            what,
            step,
            lambda group: dist.all_gather(received, sent, group=group, async_op=True),
            received,
            sent,
        )
        return [_to_bytes(t, n) for t, n in zip(received, lengths, strict=True)]

    def _broadcast_bytes(
        self, what: str, step: str, data: bytes, nbytes: int, src: int = 0
    ) -> bytes:
        if not nbytes:
            return b""
        sending = self.rank == src
        tensor = _to_tensor(data, nbytes) if sending else torch.empty(nbytes, dtype=torch.uint8)

        def op(group: Any) -> Any:
            root = self._root if src == 0 else dist.get_global_rank(group, src)
            return dist.broadcast(tensor, src=root, group=group, async_op=True)

        self._issue(what, step, op, tensor)
        return data if sending else _to_bytes(tensor, nbytes)

    def _transport_group(self, what: str) -> Any:
        """The group that carries the payloads: the group itself, or its gloo sibling."""
        transport = self._transport() if self._transport is not None else None
        if transport is None:
            group = self.group
            if _carries_cpu_over_gloo(group):
                transport = group
            else:
                with _GLOO_SIBLINGS_LOCK:
                    transport = _GLOO_SIBLINGS.get(group)
                    if transport is None:
                        transport = self._new_gloo_group(
                            what, "creating the gloo group for CPU payloads"
                        )
                        _GLOO_SIBLINGS[group] = transport
            self._transport = weakref.ref(transport)
            self._root = dist.get_global_rank(transport, 0)
        return transport

    def _issue(self, what: str, step: str, op: Callable[[Any], Any], *tensors: Any) -> None:
        """Run ``op(group)``, one async collective op on ``tensors``, and wait for it, at most
        ``timeout`` s.

        The group is passed in rather than held in callers' locals: the frames a traceback
        keeps must not keep the group alive (see the note on process groups at exit).
        """
        start = time.monotonic()
        try:
            group = self._transport_group(what)
            work = op(group)
            _hold(group, (work, tensors))  # dropped later, never by a gloo thread at exit
            del group  # a traceback keeps no group
            if not work.wait(timeout=self._wait):
                raise TimeoutError("Operation timed out!")
        except Exception as exc:
            traceback.clear_frames(exc.__traceback__)
            raise self._transport_error(what, step, exc, time.monotonic() - start) from exc

    def _transport_error(
        self, what: str, step: str, exc: Exception, waited: float
    ) -> DistributedError:
        text = " ".join(str(exc).split()) or type(exc).__name__
        if len(text) > 300:
            text = text[:300] + "..."
        advice = (
            f"A rank died, hangs, or did not call {what}; every rank of the group must call it. "
            "Look for the first error in the other ranks' logs; this process group is now in an "
            "unknown state and should not be used for further collectives."
        )
        if (
            isinstance(exc, TimeoutError)
            or "timed out" in text.lower()
            or "timeout" in text.lower()
        ):
            return DistributedError(
                f"{what}: rank {self.rank} of {self.size} gave up after {waited:.1f} s waiting "
                f"for the other ranks ({step}; the timeout is {self.timeout:g} s). {advice}"
            )
        return DistributedError(
            f"{what}: rank {self.rank} of {self.size} lost the other ranks ({step}): {text}. "
            f"{advice}"
        )
