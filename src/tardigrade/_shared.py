"""Shared data: chunks written once as objects of the root, referenced by every checkpoint that
holds the same bytes (format 7; ``format.manifest.shared_name``).

A save with sharing on (``SaveOptions.shared``) writes each chunk of at least
``SHARE_MIN_BYTES`` as a shared object of its own: a safetensors file of that one chunk under
``<root>/.shared/``, named by the xxh3-128 of the whole file (``Identity``), so equal bytes of
equal dtype and shape always get one name. Before writing one, the writer hashes it; when the
save's :class:`SharedIndex` (the objects its base, a committed checkpoint of the same root,
references) holds that name, nothing is written and the manifest references the object.
Smaller chunks go into the save's own data files as always.

An object is deleted only when no committed manifest references it: retention deletes a
checkpoint's manifest and its own files; ``Catalog.collect`` sweeps ``.shared/`` by
reachability, past the grace period, never an object a save of this process has in flight
(:func:`pinned`: a save pins what it references or writes until it ended).
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from .format.manifest import SHARED_DIR, Manifest, is_shared

__all__ = [
    "SHARE_CHUNK_BYTES",
    "SHARE_HEADER_BYTES",
    "SHARE_MIN_BYTES",
    "Changes",
    "Held",
    "SharedIndex",
    "abandon",
    "abandoned",
    "forget_abandoned",
    "pin",
    "shared_root",
    "sweeping",
    "unpin",
]

# Chunks this large or larger are shared objects; smaller ones (biases, norms, scalars, an
# adapter's small matrices) cost less to write again than an object each.
SHARE_MIN_BYTES = 1 << 20
# A tensor is split into shared objects of at most this many bytes: a writer holds one whole
# before deciding (its name is its hash), and a row block of a table changes alone.
SHARE_CHUNK_BYTES = 64 << 20
# Of those bytes, what an object's safetensors header may take: its chunk is at most the rest,
# so the object's whole image fits in one staging slab of SHARE_CHUNK_BYTES (an async save
# then hands it to the writer, and to O_DIRECT, as one block).
SHARE_HEADER_BYTES = 64 << 10


@dataclass(frozen=True)
class Held:
    """A shared object a committed manifest references: what a new manifest records of it."""

    size: int
    header_checksum: str
    checksum: str  # its one chunk's


class Changes:
    """Which chunks held new bytes at the last save, by their planned file (the same file of
    the same plan holds the same chunk from save to save): a save writes such a chunk at once,
    hashing it as it writes, rather than hashing it first and writing it then (a second pass
    over its bytes). Training changes the same tensors every step, and leaves frozen ones
    alone: a guess wrong either way costs a write or a pass, never a wrong checkpoint."""

    def __init__(self) -> None:
        self._new: dict[str, bool] = {}
        self._lock = threading.Lock()

    def was_new(self, file: str) -> bool:
        with self._lock:
            return self._new.get(file, False)

    def record(self, file: str, new: bool) -> None:
        with self._lock:
            self._new[file] = new


class SharedIndex:
    """The shared objects a save may reference instead of writing them: those its base
    checkpoints reference (an empty index: a first save, which writes every object). Given
    ``load`` instead, they are read at the first ``get``: a save with no chunk large enough to
    share never reads its base. ``changes``: what the saves before found new (a manager's),
    which this one's writers consult and update."""

    def __init__(
        self,
        held: dict[str, Held] | None = None,
        *,
        load: Callable[[], dict[str, Held]] | None = None,
        changes: Changes | None = None,
    ) -> None:
        self._held = held
        self._load = load
        self._lock = threading.Lock()
        self.changes = changes

    @staticmethod
    def held_by(manifests: Iterable[Manifest]) -> dict[str, Held]:
        held: dict[str, Held] = {}
        for m in manifests:
            for t in m.tensors:
                for c in t.chunks:
                    if is_shared(c.file) and c.file not in held:
                        held[c.file] = Held(m.files[c.file], m.header_checksums[c.file], c.checksum)
        return held

    @classmethod
    def of(cls, manifests: Iterable[Manifest]) -> SharedIndex:
        return cls(cls.held_by(manifests))

    @property
    def held(self) -> dict[str, Held]:
        with self._lock:
            if self._held is None:
                self._held = self._load() if self._load is not None else {}
            return self._held

    def get(self, name: str) -> Held | None:
        return self.held.get(name)

    def __len__(self) -> int:
        return len(self.held)


# Shared objects saves of this process reference or write, by storage root, until each save
# ended: the sweep spares them (a save in flight may reference an object whose last committed
# referrer retention just deleted, or have written one no manifest references yet).
_pins: dict[str, Counter[str]] = {}
_pins_lock = threading.Lock()


def shared_root(url_of: Callable[[str], str], name: str) -> str:
    """The key of the ``.shared`` directory checkpoint ``name`` references: its URL
    (``url_of``: the storage's ``url``), what ``pin`` and ``pinned`` take."""
    parent = name.rpartition("/")[0]
    return url_of(f"{parent}/{SHARED_DIR}" if parent else SHARED_DIR)


def pin(root: str, name: str) -> None:
    """Pin shared object ``name`` under storage root ``root`` (a save in flight holds it)."""
    with _pins_lock:
        _pins.setdefault(root, Counter())[name] += 1


def unpin(root: str, names: Iterable[str]) -> None:
    """Undo ``pin`` for each of ``names`` (the save ended)."""
    with _pins_lock:
        held = _pins.get(root)
        if held is None:
            return
        for n in names:
            held[n] -= 1
            if held[n] <= 0:
                del held[n]


# Shared objects saves of this process published and then failed (nothing committed): a sweep
# need not wait out the grace period for them, as for a failed save's own files on a store.
_abandoned: dict[str, set[str]] = {}


def abandon(root: str, names: Iterable[str]) -> None:
    """Record that a failed save of this process published shared objects ``names``."""
    with _pins_lock:
        _abandoned.setdefault(root, set()).update(names)


def abandoned(root: str) -> frozenset[str]:
    """The shared objects under ``root`` failed saves of this process published."""
    with _pins_lock:
        return frozenset(_abandoned.get(root, ()))


def forget_abandoned(root: str, names: Iterable[str]) -> None:
    """``names`` are gone (swept): no longer recorded."""
    with _pins_lock:
        left = _abandoned.get(root)
        if left is not None:
            left.difference_update(names)


@contextlib.contextmanager
def sweeping(root: str) -> Iterator[frozenset[str]]:
    """The shared objects under ``root`` saves of this process have in flight, no save
    pinning another until the block ends: a sweep marks and deletes inside it, so a save
    either pinned an object before (spared) or finds it gone after (and writes it again)."""
    with _pins_lock:
        yield frozenset(_pins.get(root, ()))
