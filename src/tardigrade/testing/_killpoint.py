# mypy: disable-error-code="safe-super"
# (_Killing is mixed in before a concrete backend: its super() calls reach that backend.)
"""Kill points: SIGKILL this process at a chosen moment of its checkpoint storage traffic.

``kill_during`` sets ``TARDIGRADE_KILL_POINT`` (a JSON :class:`KillPoint`) in a child's
environment; ``import tardigrade`` in the child sees it and calls :func:`install`, which makes
every storage backend that Tardigrade opens from then on (every scheme of the URL registry)
count its operations and kill the process when the moment comes. The user's script changes
nothing. The moments are named in storage-contract terms (``storage/base.py``), so they mean
the same on every backend:

- ``"write"``: once ``after_bytes`` bytes went to checkpoint storage (streamed writes and
  small puts): the write that crosses the count writes only its part up to it, then the
  process dies (a data file ends mid-tensor). A put, which is all-or-nothing, is not done.
  The bytes are counted as the backend's writers take them: a local file written with
  O_DIRECT (4 MiB and more) may still hold the last of them in its aligned buffer;
- ``"staging"``: the ``nth`` save has created its staging location (``begin``: a ``.tmp-*``
  directory, or its save-unique names on a store) and written nothing into it yet;
- ``"commit"``: inside the ``nth`` commit, at its first write: the manifest is half written,
  nothing is visible yet (a backend that writes nothing there dies as the commit ends);
- ``"committed"``: the ``nth`` commit has returned (the checkpoint exists) and the save has
  not yet returned to its caller;
- ``"operation"``: before the ``nth`` storage operation of any kind (the kinds of
  ``FaultyStorage``: open_writer, write, close, open_reader, read, put, stat, list, delete,
  move, begin, commit, abort), or the ``nth`` of kind ``op`` if given;
- ``"phase"``: as this rank enters its ``nth`` collective phase (of those named ``phase``,
  matched as a substring, if given), after every rank finished the one before: between the
  ranks' phases of a collective save (``"tg.save (begin)"``, ``"(comparing state trees)"``,
  ``"(planning)"``, ``"(write and commit)"``), load or manager call;
- ``"never"``: only count (the counts are reported when the process exits).

``rank`` counts only in that rank of a ``torch.distributed`` job (``RANK`` before the group
exists). ``scope="job"`` kills the whole process group (the script and every process it
started, like a machine going down); ``"process"`` only the process that reached the moment.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from .. import _probes
from .._commit import Commit
from ..errors import InvalidArgumentError
from ..storage import _BACKENDS as _SCHEMES  # the registry's factories, to wrap each
from ..storage import Reader, Storage, Writer, register_scheme
from ..storage.base import Hashes

ENV = "TARDIGRADE_KILL_POINT"
MOMENTS = ("write", "staging", "commit", "committed", "operation", "phase", "never")
OPS = (
    "open_writer", "write", "close", "open_reader", "read", "put", "stat", "list", "delete",
    "move", "begin", "commit", "abort",
)  # fmt: skip
KILLED_FILE = "killed.json"


@dataclass(frozen=True)
class KillPoint:
    """Where to die: a moment (see the module docstring) and its parameters."""

    at: str
    nth: int = 1
    after_bytes: int | None = None
    op: str | None = None
    phase: str | None = None
    rank: int | None = None
    scope: str = "process"
    report: str | None = None  # a directory: killed.json, exit-<pid>.json, ready-<pid>

    def __post_init__(self) -> None:
        if self.at not in MOMENTS:
            raise InvalidArgumentError(
                f"kill point must be one of {list(MOMENTS)}, got {self.at!r}"
            )
        if self.at == "write" and (type(self.after_bytes) is not int or self.after_bytes < 1):
            raise InvalidArgumentError(
                f"at='write' needs after_bytes, a positive int, got {self.after_bytes!r}"
            )
        if type(self.nth) is not int or self.nth < 1:
            raise InvalidArgumentError(f"nth must be a positive int, got {self.nth!r}")
        if self.op is not None and self.op not in OPS:
            raise InvalidArgumentError(f"op must be one of {list(OPS)}, got {self.op!r}")
        if self.phase is not None and (not isinstance(self.phase, str) or not self.phase):
            raise InvalidArgumentError(
                f"phase must be a non-empty part of a phase's name, got {self.phase!r}"
            )
        if self.scope not in ("process", "job"):
            raise InvalidArgumentError(f"scope must be 'process' or 'job', got {self.scope!r}")

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls, text: str) -> KillPoint:
        try:
            fields = json.loads(text)
            return cls(**fields)
        except (ValueError, TypeError) as e:
            raise InvalidArgumentError(f"{ENV}={text!r} is not a kill point: {e}") from None


class _Hook:
    """The counting and killing shared by every storage of this process."""

    def __init__(self, point: KillPoint) -> None:
        self.point = point
        self.counts: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.local = threading.local()  # .commit: the commit this thread is inside, if any
        self.fired = False
        self.off = 0  # inside uncounted(): nothing counts, nothing kills

    def mine(self) -> bool:
        if self.off:
            return False
        if self.point.rank is None:
            return True
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        return rank == self.point.rank

    def op(self, kind: str, where: str) -> None:
        """Count one operation; die first if it is the chosen one."""
        p = self.point
        with self.lock:
            self.counts[kind] += 1
            self.counts["operation"] += 1
            n = self.counts[kind] if p.op is not None else self.counts["operation"]
        if p.at == "operation" and (p.op in (None, kind)) and n == p.nth and self.mine():
            self.die(f"operation #{n} ({kind} {where})")

    def entering_phase(self, what: str) -> None:
        """Count one collective phase of this rank; die before it if it is the chosen one."""
        p = self.point
        if p.phase is not None and p.phase not in what:
            return
        with self.lock:
            self.counts["phase"] += 1
            n = self.counts["phase"]
        if p.at == "phase" and n == p.nth and self.mine():
            self.die(f"phase #{n}: rank {_rank()} entering {what!r}")

    def take(self, n: int, where: str) -> tuple[int, str | None]:
        """Of ``n`` bytes about to be written: how many go, and where the process dies after
        writing them (None: it lives on)."""
        p = self.point
        if p.at == "commit" and getattr(self.local, "commit", None) is not None:
            return n // 2, f"commit #{self.counts['commit']}: {n // 2} of {n} bytes of {where}"
        with self.lock:
            if p.at != "write" or not self.mine():
                self.counts["bytes"] += n
                return n, None
            assert p.after_bytes is not None
            take = min(n, max(0, p.after_bytes - self.counts["bytes"]))
            self.counts["bytes"] += take
            if self.counts["bytes"] < p.after_bytes:
                return take, None
            return take, f"write: {self.counts['bytes']} bytes written ({take} of {n} to {where})"

    def die(self, where: str) -> None:
        """Record where, then SIGKILL this process (or its whole process group)."""
        self.fired = True
        report = self.point.report
        if report:
            record = {
                "where": where,
                "at": self.point.at,
                "pid": os.getpid(),
                "rank": _rank(),
                "counts": dict(self.counts),
            }
            try:
                fd = os.open(
                    os.path.join(report, KILLED_FILE), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644
                )
                try:
                    os.write(fd, json.dumps(record).encode())
                finally:
                    os.close(fd)
            except OSError:
                pass  # another process of the job got there first: it is dying too
        if self.point.scope == "job":
            try:
                os.killpg(os.getpgrp(), signal.SIGKILL)
            except OSError:
                pass
        os.kill(os.getpid(), signal.SIGKILL)

    def write_exit_report(self) -> None:
        report = self.point.report
        if not report or self.fired:
            return
        record = {"pid": os.getpid(), "rank": _rank(), "counts": dict(self.counts)}
        try:
            with open(os.path.join(report, f"exit-{os.getpid()}.json"), "w") as f:
                json.dump(record, f)
        except OSError:
            pass


def _rank() -> int | None:
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            return int(dist.get_rank())
    except Exception:
        pass
    r = os.environ.get("RANK")
    return int(r) if r is not None and r.isdigit() else None


_hook: _Hook | None = None


class _KillWriter(Writer):
    def __init__(self, hook: _Hook, where: str, inner: Writer) -> None:
        self._hook = hook
        self._where = where
        self._inner = inner

    def write(self, data: memoryview | bytes, *, hasher: Hashes | None = None) -> None:
        h = self._hook
        h.op("write", self._where)
        view = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
        took, death = h.take(view.nbytes, self._where)
        if took == view.nbytes:
            self._inner.write(data, hasher=hasher)
        elif took:
            self._inner.write(view[:took])
        if death is not None:
            h.die(death)

    def close(self) -> None:
        self._hook.op("close", self._where)
        self._inner.close()

    def abort(self) -> None:
        self._inner.abort()


class _KillReader(Reader):
    def __init__(self, hook: _Hook, inner: Reader) -> None:
        self._hook = hook
        self._inner = inner
        self.name = inner.name
        self.size = inner.size

    def readinto(self, offset: int, buf: memoryview) -> None:
        self._hook.op("read", self.name)
        self._inner.readinto(offset, buf)

    def close(self) -> None:
        self._inner.close()


class _Killing(Storage):
    """Mixed in before a backend's own class: each primitive counted, then the backend's own.

    Mixed into the instance's class (not wrapped around it), so the backend's calls to its own
    primitives, e.g. the manifest write inside a local commit, are counted too.
    """

    def open_writer(self, name: str, *, size_hint: int | None = None) -> Writer:
        assert _hook is not None
        _hook.op("open_writer", self.url(name))
        return _KillWriter(_hook, self.url(name), super().open_writer(name, size_hint=size_hint))

    def open_reader(self, name: str) -> Reader:
        assert _hook is not None
        _hook.op("open_reader", self.url(name))
        return _KillReader(_hook, super().open_reader(name))

    def put(self, name: str, data: bytes, **kw: Any) -> str:
        assert _hook is not None
        h = _hook
        where = self.url(name)
        h.op("put", where)
        took, death = h.take(len(data), where)
        if death is not None and took < len(data):
            h.die(f"{death}; a put is all or nothing: not done")
        version = super().put(name, data, **kw)
        if death is not None:
            h.die(death)
        return version

    def stat(self, name: str) -> Any:
        assert _hook is not None
        _hook.op("stat", self.url(name))
        return super().stat(name)

    def list(self, name: str = "") -> list[str]:
        assert _hook is not None
        _hook.op("list", self.url(name))
        return super().list(name)

    def delete(self, name: str) -> None:
        assert _hook is not None
        _hook.op("delete", self.url(name))
        super().delete(name)

    def move(self, src: str, dst: str) -> None:
        assert _hook is not None
        _hook.op("move", self.url(src))
        super().move(src, dst)  # type: ignore[misc]  # mixed into a Directories backend only (the only one that moves)

    def wrap_commit(self, commit: Any) -> Any:
        commit = super().wrap_commit(commit)
        commit.__class__ = _killing_class(type(commit), _KillingCommit)
        return commit


class _KillingCommit(Commit):
    """Mixed in before a commit strategy's class: its ``begin`` and ``commit`` counted, and
    killed at (the moments ``staging``, ``commit`` and ``committed``); the primitives they
    are made of are counted by the storage's own mixin."""

    def begin(self, name: str, save_id: str) -> str:
        assert _hook is not None
        h = _hook
        h.op("begin", self.storage.url(name))
        staging = super().begin(name, save_id)
        p = h.point
        if p.at == "staging" and h.counts["begin"] == p.nth and h.mine():
            h.die(f"staging #{p.nth}: {self.storage.url(staging)} created, nothing written")
        return staging

    def commit(
        self, staging: str, name: str, manifest: bytes, *, save_id: str, replace: bool
    ) -> None:
        assert _hook is not None
        h = _hook
        h.op("commit", self.storage.url(name))
        p = h.point
        n = h.counts["commit"]
        inside = p.at == "commit" and n == p.nth and h.mine()
        if inside:
            h.local.commit = name  # its first write (the manifest's) dies half done
        try:
            super().commit(staging, name, manifest, save_id=save_id, replace=replace)
        finally:
            h.local.commit = None
        if inside:
            h.die(f"commit #{n}: at its end, {self.storage.url(name)} ({type(self).__name__})")
        if p.at == "committed" and n == p.nth and h.mine():
            h.die(f"committed #{n}: {self.storage.url(name)} exists, the save has not returned")

    def abort(self, staging: str, name: str, save_id: str) -> None:
        assert _hook is not None
        _hook.op("abort", self.storage.url(staging))
        super().abort(staging, name, save_id)


_classes: dict[type, type] = {}


def _killing_class(cls: type, mixin: type | None = None) -> type:
    mixin = mixin or _Killing
    if cls not in _classes:
        _classes[cls] = type(f"Killing{cls.__name__}", (mixin, cls), {})
    return _classes[cls]


def _counted(make: Any) -> Any:
    def open_counted(root: str, options: Any) -> Storage:
        storage = make(root, options)
        if not isinstance(storage, _Killing):
            storage.__class__ = _killing_class(type(storage))
        return storage

    return open_counted


@contextlib.contextmanager
def uncounted() -> Iterator[None]:
    """Storage operations made inside are neither counted nor killed at: the harness's own
    (``save_final``), which are no moment of the script's training."""
    hook = _hook
    if hook is None:
        yield
        return
    with hook.lock:
        saved = Counter(hook.counts)
        hook.off += 1
    try:
        yield
    finally:
        with hook.lock:
            hook.off -= 1
            hook.counts = saved


def install(point: KillPoint) -> None:
    """Arm ``point`` in this process: every storage opened from now on counts and kills."""
    global _hook
    if _hook is not None:
        raise InvalidArgumentError("a kill point is already installed in this process")
    _hook = _Hook(point)
    _probes.phase_hook = _hook.entering_phase
    for scheme, make in list(_SCHEMES.items()):
        register_scheme(scheme, _counted(make))
    if point.report:
        atexit.register(_hook.write_exit_report)
        try:
            open(os.path.join(point.report, f"ready-{os.getpid()}"), "w").close()
        except OSError:
            pass


def counts() -> dict[str, int]:
    """The storage operations counted in this process so far (empty without a kill point)."""
    return dict(_hook.counts) if _hook is not None else {}


def install_from_environment() -> None:
    """What ``import tardigrade`` runs when ``TARDIGRADE_KILL_POINT`` is set."""
    text = os.environ.get(ENV)
    if text and _hook is None:
        install(KillPoint.from_env(text))
