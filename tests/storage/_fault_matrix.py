"""Every operation fails in turn: one driver for every kind of run (a save, a load, a manager
step, a restore, a gc), on every backend.

A :class:`Family` says how to lay down the checkpoints that exist before the run
(``prepare``), how to run it (``run``, through a ``FaultyStorage``), and what cleans up after
a fault once it is gone (``tidy``, where the design has one). :func:`every_fault` runs it once
to enumerate its storage operations, then, for every operation k of that run and each error
the schedule picks for k, starts again from the same checkpoints, fails operation k and
asserts:

- the fault surfaces: the run raises a ``TardigradeError`` naming the location, or counts a
  failed save (``on_save_error="warn"``), or logs a warning naming the location where the run
  is designed to go on (a retention delete, a lease release);
- nothing committed before is modified or lost (byte for byte; a family names the
  checkpoints its run may retire by design) and whatever the run committed verifies;
- nothing is left behind once the fault is gone and ``tidy`` ran: only committed
  checkpoints and a released lease record remain;
- the next run succeeds; where the family says how (``then``), the same run also goes on
  once the fault is gone (the same manager saves its next step).

Operation k is named by its kind and its rank among the operations of that kind (``write``
#3), which is the same in every run even where writes run in parallel threads.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import tardigrade as tg
from tardigrade._catalog import Catalog
from tardigrade._commit import LOCK
from tardigrade.errors import TardigradeError
from tardigrade.format.manifest import MANIFEST, SHARED_DIR, data_path, is_shared
from tardigrade.storage import LocalStorage, Storage
from tardigrade.storage import base as storage_base
from tardigrade.testing import ERRORS, FaultyStorage

# Faults injected, per family (and backend), for the session's summary (conftest prints them).
INJECTED: Counter[str] = Counter()

RAISING = [e for e in ERRORS if e not in ("short_write", "lost_reply")]
# Operations that change what is stored: their reply can be lost after they took effect.
CHANGING = {"put", "delete", "close", "commit", "abort", "move"}


@dataclass
class Outcome:
    """What a run did: the error it raised (None: it returned), saves it counted as failed."""

    error: BaseException | None = None
    failed: int = 0
    value: Any = None


@dataclass
class Family:
    name: str
    prepare: Callable[[FaultyStorage], None]
    # run(faulty, attempt): attempt 0 is the run that a fault hits, 1 the next one after it.
    run: Callable[[FaultyStorage, int], Outcome]
    tidy: Callable[[FaultyStorage], None] = lambda faulty: None
    # Checks of the family's own (e.g. restore put the values of the step it returned).
    check: Callable[[FaultyStorage, Outcome], None] = lambda faulty, out: None
    # Checkpoints the run may delete by design (retention), by name.
    may_retire: frozenset[str] = field(default_factory=frozenset)
    # Checkpoints the run may replace by design (overwrite=True): the old one or the new one,
    # complete either way.
    may_replace: frozenset[str] = field(default_factory=frozenset)
    # What the same run goes on to do once the fault is gone (e.g. the same manager saves the
    # next step), given what ``run`` returned; its operations are not failed.
    then: Callable[[FaultyStorage, Outcome], Outcome] | None = None


def errors_for(op: str, k: int, *, sample: bool) -> list[tuple[str, bool]]:
    """The faults to inject at operation ``k`` (of kind ``op``), as (error, outage): every
    error kind failing that one operation (a lost reply where the operation changes what is
    stored), or (``sample``) one kind per k, taken in turn
    (deterministically, so every kind still hits every op kind); then one outage (operation
    k and every one after it fail, the cleanup included), its kind also taken in turn."""
    kinds = [*RAISING, "short_write"] if op == "write" else RAISING
    if op in CHANGING:
        kinds = [*kinds, "lost_reply"]
    single = [kinds[k % len(kinds)]] if sample else kinds
    return [(e, False) for e in single] + [(RAISING[k % len(RAISING)], True)]


def objects(storage: Storage, prefix: str) -> dict[str, bytes]:
    """Every object under ``prefix``, recursively, with its bytes."""
    out: dict[str, bytes] = {}
    todo = [prefix]
    while todo:
        here = todo.pop()
        for child in storage.list(here):
            name = f"{here}/{child}" if here else child
            st = storage.stat(name)
            if st is None:
                continue
            if st.is_dir:
                todo.append(name)
            else:
                out[name] = storage.read_bytes(name, 1 << 30)
    return out


def committed(storage: Storage) -> dict[str, dict[str, bytes]]:
    """Each committed checkpoint under the root, with every object under its name and every
    shared object (format 7) its manifest references."""
    catalog = Catalog(storage)
    out = {}
    for n in catalog.names():
        if catalog.committed(n):
            out[n] = objects(storage, n)
            for f in referenced(storage, n):
                out[n][f] = storage.read_bytes(f, 1 << 30) if storage.exists(f) else b"<missing>"
    return out


def referenced(storage: Storage, name: str) -> list[str]:
    """The shared objects committed checkpoint ``name`` references, by their storage names."""
    files = [f["name"] for f in tg.read_manifest(storage.url(name))["files"]]
    return [data_path(name, f) for f in files if is_shared(f)]


def wipe(storage: Storage) -> None:
    storage.delete("")


def laid_down(faulty: FaultyStorage, family: Family) -> Callable[[], None]:
    """Lay down ``family``'s checkpoints once; return what puts the root back as it was then.

    A copy, not the saves again: on a disk each save fsyncs, and the matrix starts afresh
    hundreds of times. Plain copies are enough here: nothing is crashed in between.
    """
    inner = faulty.inner
    wipe(inner)
    family.prepare(faulty)
    if isinstance(inner, LocalStorage):
        # Beside the root, in the test's own temporary directory (removed with it).
        pristine = f"{inner.root}.pristine"
        shutil.rmtree(pristine, ignore_errors=True)
        shutil.copytree(inner.root, pristine, symlinks=True)

        def again() -> None:
            shutil.rmtree(inner.root, ignore_errors=True)
            shutil.copytree(pristine, inner.root, symlinks=True)

        return again
    objs = objects(inner, "")

    def again() -> None:
        wipe(inner)
        for name, data in objs.items():
            inner.put(name, data, mode="overwrite")

    return again


@contextlib.contextmanager
def past_the_grace_period() -> Iterator[None]:
    """Inside, tidy's clock reads an hour and a minute later: a store's leftovers (of saves
    dead, failed in another process, or retired) are older than its grace period, as when
    `tardigrade gc` runs later; a save this process saw fail goes without it anyway."""
    real = storage_base._clock
    storage_base._clock = lambda: real() + storage_base.GRACE_SECONDS + 60
    try:
        yield
    finally:
        storage_base._clock = real


def leftovers(storage: Storage) -> list[str]:
    """What is under the root but a committed checkpoint (its manifest and the files it
    lists) or a released lease record."""
    catalog = Catalog(storage)
    out = []
    for n in catalog.names():
        if n == SHARED_DIR:
            continue  # its objects: below
        if n == LOCK:
            record = storage.lease(LOCK).read()
            if record is not None and record.get("released") is not True:
                out.append(f"{n} (held: {record})")
            continue
        if not catalog.committed(n):
            out.append(n)
            continue
        listed = {f["name"] for f in tg.read_manifest(storage.url(n))["files"]}
        out.extend(f"{n}/{x}" for x in storage.list(n) if x != MANIFEST and x not in listed)
    # Shared objects no committed checkpoint references (a failed save's; a retired one's).
    held = {f for n in catalog.names() if n not in (LOCK, SHARED_DIR) and catalog.committed(n)
            for f in referenced(storage, n)}  # fmt: skip
    out.extend(f for f in catalog.shared_objects() if f not in held)
    return out


@contextlib.contextmanager
def warnings_logged() -> Iterator[list[str]]:
    """The messages of the tardigrade logger at WARNING and above, while inside."""
    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("tardigrade")
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def surfaced(faulty: FaultyStorage, out: Outcome, logged: list[str]) -> str:
    """How the fault surfaced; fails the test when it did not, or not naming the location."""
    roots = (faulty.root, faulty.inner.root)
    if out.error is not None:
        assert isinstance(out.error, TardigradeError), repr(out.error)
        assert any(r in str(out.error) for r in roots), str(out.error)
        return "raised"
    if out.failed:
        assert any(any(r in m for r in roots) for m in logged), logged
        return "counted"
    reported = [m for m in logged if "injected" in m and any(r in m for r in roots)]
    assert reported, f"the fault vanished: no error, no failed save, nothing logged: {logged}"
    return "logged"


def every_fault(
    faulty: FaultyStorage, family: Family, *, sample: bool = False, label: str | None = None
) -> Counter[str]:
    """Fail every storage operation of ``family``'s run in turn; the faults injected
    (``single``, ``outage``) and how each surfaced (``raised``, ``counted``, ``logged``)."""
    inner = faulty.inner
    again_as_before = laid_down(faulty, family)
    # What every trial starts from: again_as_before() puts back these very bytes, so they are
    # read once, not before every trial (a store reads each object over the network).
    before = committed(inner)
    start = len(faulty.ops)
    probe = family.run(faulty, 0)
    ops = faulty.ops[start:]
    if family.then is not None:
        probe = family.then(faulty, probe)
    assert probe.error is None and probe.failed == 0, probe
    assert ops, f"{family.name}: the run performed no storage operation"
    seen: Counter[str] = Counter()
    how: Counter[str] = Counter()
    for k, op in enumerate(ops):
        seen[op] += 1
        for error, outage in errors_for(op, k, sample=sample):
            where = (
                f"{family.name}: {op} #{seen[op]} (operation {k + 1} of {len(ops)}), {error}"
                f"{' and an outage after it' if outage else ''}"
            )
            again_as_before()
            fired = len(faulty.injected)
            with warnings_logged() as logged:
                faulty.fail(op, nth=seen[op], error=error, outage=outage)
                try:
                    out = family.run(faulty, 0)
                    faulty.heal()
                    if family.then is not None:
                        out = family.then(faulty, out)
                except AssertionError as e:
                    raise AssertionError(f"{where}: {e}\n  log: {logged}") from e
                finally:
                    faulty.heal()
            assert len(faulty.injected) == fired + 1, f"{where}: the fault did not fire"
            how["outage" if outage else "single"] += 1
            try:
                how[surfaced(faulty, out, logged)] += 1
                family.check(faulty, out)
                after = committed(inner)
                for name, files in before.items():
                    if name in after and name in family.may_replace and after[name] != files:
                        tg.verify(faulty.inner.url(name))  # replaced whole, by the new one
                    elif name in after:
                        assert after[name] == files, f"{name} was modified"
                    else:
                        assert name in family.may_retire, f"{name} was lost"
                for name in after.keys() - before.keys():
                    tg.verify(faulty.inner.url(name))
                family.tidy(faulty)
                left = leftovers(inner)
                assert not left, f"left behind: {left}"
                again = family.run(faulty, 1)
                if family.then is not None:
                    again = family.then(faulty, again)
                assert again.error is None and again.failed == 0, f"the next run: {again}"
            except AssertionError as e:
                raise AssertionError(f"{where}: {e}\n  outcome: {out}\n  log: {logged}") from e
            except Exception as e:
                raise AssertionError(f"{where}: {e!r}\n  outcome: {out}\n  log: {logged}") from e
    INJECTED[label or family.name] += how["single"] + how["outage"]
    return how
