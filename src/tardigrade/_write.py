"""Writing a save: streams of staged bytes -> data files -> manifest -> atomic commit.

A stager (the caller's live tensors for a synchronous save, ``_async``'s host slabs for an
asynchronous one) feeds each data file's writer a stream of Segments or Blocks ending in END
(or ABORT). ``write_and_commit`` writes every file in parallel threads, hashing as it goes,
fsyncs it, then writes the manifest last and makes the checkpoint visible atomically.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from ._open import holds_save
from ._plan import DEFAULT_MAX_FILES, PER_RANK, REPLICATED, FilePlan, GlobalPlan, is_candidate
from ._save_job import (
    SaveJob,
    SaveResult,
    check_target,
    contiguous_cpu,
    file_header,
    item_source,
)
from ._stager import Stager
from ._tree import as_bytes
from .errors import DistributedError, SaveError, StorageError, TardigradeError
from .format import limits
from .format import safetensors as st
from .format.checksum import Hasher, Identity, checksum
from .format.jsonio import check_parse_cost, dumps, gc_paused, parse_cost
from .format.manifest import (
    COLUMNAR_VERSION,
    MANIFEST,
    PACKED_VERSION,
    SHARED_KEY,
    SHARED_VERSION,
    data_path,
    seal,
    shared_name,
    validate,
)

log = logging.getLogger("tardigrade")


@dataclass(frozen=True)
class Segment:
    """Bytes of one item of a file, in file order; ``done`` releases their staging buffer."""

    item: int  # index into the file's items
    data: memoryview
    done: Callable[[], None] | None = None


@dataclass(frozen=True)
class Block:
    """A run of a data file's bytes, header included, in file order (an async save's slab).

    ``ranges`` are the ``(item, start, stop)`` spans of ``data`` holding each item's bytes, for
    the checksums; ``done`` releases the staging buffer.
    """

    data: memoryview
    ranges: tuple[tuple[int, int, int], ...]
    done: Callable[[], None] | None = None


# End of a file's segment stream; ABORT ends it because staging failed.
END: Any = None
ABORT: Any = object()


# Writer threads of a save that shares data, at least (``write_files``).
SHARED_WRITERS = 4

# An accelerator tensor is copied to host in pieces of this size as its writer takes them.
DEVICE_PIECE_BYTES = 64 * 1024 * 1024


def _borrowed(entries: list[Any], fp: FilePlan) -> Iterator[Any]:
    for i, item in enumerate(fp.items):
        src = item_source(entries, item)
        if src.device.type == "cpu":
            yield Segment(i, memoryview(as_bytes(contiguous_cpu(src)).numpy()))  # type: ignore[arg-type]  # numpy arrays are buffers; its stubs say so from Python 3.12
            continue
        # Copied to host piece by piece while the file is written: host memory holds one
        # piece per writer thread, not a host copy of the whole state.
        t = src.detach()
        if t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg()
        flat = as_bytes(t.contiguous())
        stager = Stager()
        for lo in range(0, flat.numel(), DEVICE_PIECE_BYTES):
            piece = stager.to_host(flat[lo : lo + DEVICE_PIECE_BYTES])
            yield Segment(i, memoryview(piece.numpy()))  # type: ignore[arg-type]  # numpy arrays are buffers; its stubs say so from Python 3.12
    yield END


def stream_borrowed(job: SaveJob) -> list[Iterator[Any]]:
    """Synchronous staging: segments that point straight at the live tensors (the caller waits);
    accelerator tensors are copied to host a bounded piece at a time, as each file is written."""
    entries = job.entries
    return [_borrowed(entries, fp) for fp in job.plan.files]


@dataclass(frozen=True)
class WrittenFile:
    """What the manifest records of one data file."""

    size: int
    header_checksum: str
    checksums: str  # every item's checksum (16 hex digits), in file order, back to back
    # A shared object's name (the file's name in the manifest), and whether this save wrote
    # it (False: the target held it already, and the manifest references it).
    shared: str | None = None
    written: bool = True


class _Layout:
    """A data file's layout, which its header fixes, checked against what the writer is given.

    The file is the header, then every item's bytes back to back. Each run of bytes handed to
    the writer must land where the header says it belongs: header bytes equal to the header,
    each item's bytes (the ones hashed for it) at that item's offset, nothing missing, nothing
    extra. A stream that breaks this (a header sent twice, a span hashed for the wrong item, a
    byte too many) would commit a file that contradicts its own header and that no reader can
    load; the writer fails the save instead. Only bookkeeping per run, plus comparing the header.
    """

    def __init__(self, where: str, head: bytes, fp: FilePlan) -> None:
        self.where = where
        self.head = head
        self.starts: list[int] = []
        offset = len(head)
        for it in fp.items:
            self.starts.append(offset)
            offset += it.nbytes
        self.end = offset
        self.nbytes = [it.nbytes for it in fp.items]
        self.got = [0] * len(fp.items)  # bytes of each item received so far
        self.pos = 0  # bytes received so far: the file offset of the next one

    def bad(self, what: str) -> SaveError:
        return SaveError(
            f"{self.where}: {what}; the file would not match its own header, so nothing was "
            "committed. This is a bug in Tardigrade; please report it."
        )

    def header(self, data: memoryview) -> None:
        """``data`` is about to be written at ``pos``: its header bytes must be the header's."""
        k = min(data.nbytes, len(self.head) - self.pos)
        if k > 0 and data[:k] != self.head[self.pos : self.pos + k]:
            raise self.bad(f"bytes {self.pos}..{self.pos + k} differ from the file's header")

    def item(self, item: int, at: int, n: int) -> None:
        """``n`` bytes of ``item`` are about to be written at file offset ``at``."""
        expect = self.starts[item] + self.got[item]
        if at != expect or self.got[item] + n > self.nbytes[item]:
            raise self.bad(
                f"{n} bytes of item {item} staged at byte {at}, but the header places its "
                f"next bytes at {expect} and it has {self.nbytes[item] - self.got[item]} left"
            )
        self.got[item] += n

    def advance(self, n: int) -> None:
        self.pos += n
        if self.pos > self.end:
            raise self.bad(f"{self.pos} bytes staged, but header and tensors are {self.end}")

    def finish(self) -> None:
        short = [i for i, (g, n) in enumerate(zip(self.got, self.nbytes, strict=True)) if g != n]
        if self.pos != self.end or short:
            raise self.bad(
                f"{self.pos} bytes staged, but header and tensors are {self.end} bytes"
                + (f" (items {short} incomplete)" if short else "")
            )


def write_file(job: SaveJob, fp: FilePlan, staging: str, segments: Iterable[Any]) -> WrittenFile:
    """Write data file ``fp`` of the save from its stream (see ``_write_data``); a candidate
    shared object (``is_candidate``) of a save that shares data is hashed first, and written
    only where its target does not hold it yet (``_write_shared``)."""
    if job.shared is not None and is_candidate(fp.name):
        return _write_shared(job, fp, staging, segments)
    stored = job.commit.data_name(fp.name, job.header["save_id"])
    return _write_data(job, fp, f"{staging}/{stored}", segments)


def _write_shared(job: SaveJob, fp: FilePlan, staging: str, segments: Iterable[Any]) -> WrittenFile:
    """One chunk as a shared object: its whole stream is taken (one chunk of at most
    ``SHARE_CHUNK_BYTES`` x 2), its file hashed (``Identity``: the object's name), then
    referenced when the save's index holds that object and it is there, else written under
    staging and published under ``.shared/`` (``Commit.publish_shared``) before the commit.
    A chunk that held new bytes at the last save (``Changes``) is written at once instead,
    hashed as it is written (``_write_unnamed``)."""
    assert job.shared is not None
    changes = job.shared.changes
    if changes is not None and changes.was_new(fp.name):
        target = job.commit.unnamed_object(staging, fp.name)
        if target is not None:
            written = _write_unnamed(job, fp, staging, target, segments)
            changes.record(fp.name, written.written)
            return written
    written = _hash_then_write(job, fp, staging, segments)
    if changes is not None:
        changes.record(fp.name, written.written)
    return written


def _write_unnamed(
    job: SaveJob, fp: FilePlan, staging: str, target: str, segments: Iterable[Any]
) -> WrittenFile:
    """Write a candidate to ``target`` in staging, hashing its name on the way (one pass over
    its bytes), then: publish it under that name; or, when the save's base holds that object
    after all (the chunk did not change), delete it and reference the object; or, a chunk
    another file of the save holds too, keep it as a plain data file of the save."""
    assert job.shared is not None
    identity = Identity()
    written = _write_data(job, fp, target, segments, identity=identity)
    name = shared_name(identity.hexdigest())
    if not job.claim(name, fp.name):
        job.commit.keep_unnamed(target, f"{staging}/{job.stored_name(fp.name)}")
        return written
    job.pin(name)
    referenced = _reference(job, name)
    if referenced is not None:
        job.storage.delete(target)  # written for nothing: the guess was wrong
        return referenced
    job.commit.publish_shared(target, data_path(job.name, name))
    job.published.append(name)
    return dataclasses.replace(written, shared=name)


def _reference(job: SaveJob, name: str) -> WrittenFile | None:
    """What the manifest records of shared object ``name`` when the save's base holds it and
    it is there (the save references it); None when it must be written."""
    assert job.shared is not None
    known = job.shared.get(name)
    if known is None:
        return None
    where = data_path(job.name, name)
    there = job.storage.stat(where)
    if there is not None and there.size == known.size:
        return WrittenFile(known.size, known.header_checksum, known.checksum, name, False)
    log.warning(
        "tardigrade: %s, which the previous checkpoint references, is %s; writing it again",
        job.storage.url(where),
        "missing" if there is None else f"{there.size} bytes, not {known.size}",
    )
    return None


def _hash_then_write(
    job: SaveJob, fp: FilePlan, staging: str, segments: Iterable[Any]
) -> WrittenFile:
    assert job.shared is not None
    held: list[Any] = []
    stream = iter(segments)
    ended = False  # the stream's END or ABORT was taken: nothing more will come
    try:
        for seg in stream:
            if seg is END or seg is ABORT:
                ended = True
                if seg is ABORT:
                    raise SaveError(f"{job.storage.url(job.name)}: staging failed")
                break
            held.append(seg)
        ended = True
        identity = Identity()
        if not held or not isinstance(held[0], Block):
            identity.update(file_header(fp))
        for seg in held:
            identity.update(seg.data)
        name = shared_name(identity.hexdigest())
        mine = job.claim(name, fp.name)
        if mine:
            job.pin(name)
            referenced = _reference(job, name)
            if referenced is not None:
                _release(held)  # referenced, not written: the staged copy goes back
                return referenced
    except BaseException:
        _release(held)
        if not ended:  # drained to its end: every staging buffer must come back
            _discard(stream)
        raise
    if not mine:
        # Another chunk of this save holds the same bytes: this copy is a plain data file.
        stored = job.commit.data_name(fp.name, job.header["save_id"])
        return _write_data(job, fp, f"{staging}/{stored}", [*held, END])
    where = data_path(job.name, name)
    if job.commit.unnamed_object(staging, fp.name) is None:
        adopted = _adopt(job, fp, name, held)
        if adopted is not None:
            return adopted
        # A store's writer writes under the object's name: a write that fails may leave it
        # there, whole or not, and a sweep must not wait out the grace period for it.
        job.published.append(name)
    target = job.commit.shared_target(staging, where, fp.name)
    # Live tensors (a synchronous save's segments) are hashed again from the copy written,
    # as it is written: bytes changed in between (a tensor mutated by another thread) must
    # not be published under a name that is not theirs, which later saves would reference.
    again = None if held and isinstance(held[0], Block) else Identity()
    written = _write_data(job, fp, target, [*held, END], identity=again)
    if again is not None and again.hexdigest() != identity.hexdigest():
        raise SaveError(
            f"{job.storage.url(job.name)}: the bytes of {fp.name} changed while the save "
            "wrote them (a tensor modified during a synchronous save, by another thread); "
            "nothing was committed. Save when nothing modifies the state, or save "
            "asynchronously (it copies the state first)."
        )
    job.commit.publish_shared(target, where)
    if target != where:
        job.published.append(name)
    return dataclasses.replace(written, shared=name)


def _adopt(job: SaveJob, fp: FilePlan, name: str, held: list[Any]) -> WrittenFile | None:
    """On a store (objects written under their names, never renamed): when an object of
    this name and size is there already, though the base does not reference it (a save that
    failed after writing it, a checkpoint deleted since), it holds these bytes, which its
    name is the hash of; writing it again would only replace it in place under readers. Its
    checksums are computed from the staged bytes, which then go back; None: not there."""
    head = file_header(fp)
    there = job.storage.stat(data_path(job.name, name))
    if there is None or there.size != len(head) + fp.nbytes:
        return None
    hashers = [Hasher() for _ in fp.items]
    for seg in held:
        if isinstance(seg, Block):
            for item, lo, hi in seg.ranges:
                hashers[item].update(seg.data[lo:hi])
        else:
            hashers[seg.item].update(seg.data)
    _release(held)
    sums = "".join(h.hexdigest() for h in hashers)
    return WrittenFile(there.size, checksum(head), sums, name, False)


def _release(segments: list[Any]) -> None:
    for seg in segments:
        if seg.done is not None:
            seg.done()


class _Both:
    """Two hashes fed the same bytes (a chunk's checksum and its object's name)."""

    __slots__ = ("a", "b")

    def __init__(self, a: Any, b: Any) -> None:
        self.a, self.b = a, b

    def update(self, data: memoryview | bytes | bytearray) -> None:
        self.a.update(data)
        self.b.update(data)


def _write_data(
    job: SaveJob,
    fp: FilePlan,
    path: str,
    segments: Iterable[Any],
    *,
    identity: Identity | None = None,
) -> WrittenFile:
    """Stream one data file to ``path``: header, then each item's bytes, hashed on the way;
    then fsync.

    The stream holds Segments (one item's bytes; the header is written here) or, for an async
    save, Blocks (runs of the whole file image, header included). Which one is told by the
    stream itself, never by a flag another thread sets: the async stager starts filling the
    streams while this writer already runs. A Segment may point at live memory that training
    mutates while it is written (a synchronous save), so the writer hashes its own copy of the
    bytes, exactly what reaches the file: the checkpoint then always verifies, though a tensor
    mutated mid-save may hold a mix of old and new values. A Block is a private staging copy;
    it is hashed here and written without another copy. Every run is checked against the
    header's layout (``_Layout``) before it is written, and the file's size at the end.
    ``identity`` is fed every byte of the file, header included (its name, as a shared
    object), from the same copy the checksums see.
    """
    hashers = [Hasher() for _ in fp.items]
    # What a Segment's bytes feed as the writer copies them: its item's checksum (and name).
    feeds: list[Any] = hashers if identity is None else [_Both(h, identity) for h in hashers]
    failure: BaseException | None = None
    writer = None
    head = b""
    layout: _Layout | None = None
    image: bool | None = None  # whether the stream is Blocks; known at its first element
    try:
        head = file_header(fp)
        layout = _Layout(job.storage.url(f"{job.name}/{fp.name}"), head, fp)
        writer = job.storage.open_writer(path, size_hint=len(head) + fp.nbytes)
    except BaseException as e:
        failure = e
    # Drain the whole stream even after a failure: every segment must release its staging
    # buffer, or a caller blocked on the staging budget would wait forever.
    stream = iter(segments)
    while True:
        try:
            seg = next(stream)
        except StopIteration:
            break
        except BaseException as e:  # a lazy stream failed making a segment (a device copy)
            failure = failure or e
            break
        if seg is END or seg is ABORT:
            if seg is ABORT and failure is None:
                failure = SaveError(f"{job.storage.url(job.name)}: staging failed")
            break
        try:
            if failure is None:
                assert writer is not None and layout is not None
                if image is None:
                    image = isinstance(seg, Block)
                    if not image:
                        layout.advance(len(head))
                        writer.write(head)
                        if identity is not None:
                            identity.update(head)
                if isinstance(seg, Block) != image:
                    raise layout.bad("a stream mixes whole-file blocks and item segments")
                if isinstance(seg, Block):
                    layout.header(seg.data)
                    for item, lo, hi in seg.ranges:
                        if not 0 <= lo <= hi <= seg.data.nbytes:
                            raise layout.bad(f"item {item}'s span {lo}..{hi} is outside its block")
                        layout.item(item, layout.pos + lo, hi - lo)
                        for start in range(lo, hi, st.SLICE_BYTES):
                            hashers[item].update(seg.data[start : min(hi, start + st.SLICE_BYTES)])
                    if identity is not None:  # the whole run, header bytes included
                        identity.update(seg.data)
                    layout.advance(seg.data.nbytes)
                    writer.write(seg.data)
                else:
                    data = seg.data
                    layout.item(seg.item, layout.pos, data.nbytes)
                    layout.advance(data.nbytes)
                    for start in range(0, data.nbytes, st.SLICE_BYTES):
                        piece = data[start : start + st.SLICE_BYTES]
                        writer.write(piece, hasher=feeds[seg.item])
        except BaseException as e:
            failure = e
        finally:
            if seg.done is not None:
                seg.done()
    try:
        if failure is None:
            assert writer is not None and layout is not None
            if image is None:  # a file of no items: nothing but the header
                layout.advance(len(head))
                writer.write(head)
            layout.finish()
    except BaseException as e:
        failure = e
    if failure is not None:
        if writer is not None:
            writer.abort()
        raise failure
    assert writer is not None  # opened above, or the failure was raised
    writer.close()
    assert layout is not None
    # The storage says how many bytes it kept: a write that lost some without an error (a
    # faulty disk or store) is found here, before the manifest points at the file.
    kept = job.storage.stat(path)
    if kept is None or kept.size != layout.pos:
        raise StorageError(
            errno.EIO,
            f"{layout.where}: the storage holds {None if kept is None else kept.size} bytes of "
            f"this file after writing {layout.pos}; nothing was committed. Check the disk or "
            "store and save again.",
        )
    return WrittenFile(
        layout.pos,
        checksum(head),
        "".join([h.hexdigest() for h in hashers]),
    )


def in_threads(calls: Sequence[Callable[[], Any]], name: str) -> list[Any]:
    """Run ``calls`` side by side (the last in this thread); return results in order.

    Plain threads rather than an executor: an async save still writing while the interpreter
    exits must be able to start its writers after ``concurrent.futures`` refuses new work.
    """
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException | None] = [None] * len(calls)

    def one(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as e:
            errors[i] = e

    threads = [
        threading.Thread(target=one, args=(i,), name=f"{name}-{i}") for i in range(len(calls) - 1)
    ]
    for t in threads:
        t.start()
    if calls:
        one(len(calls) - 1)
    for t in threads:
        t.join()
    for e in errors:
        if e is not None:
            raise e
    return results


def _discard(stream: Iterable[Any]) -> None:
    for seg in stream:
        if seg is END or seg is ABORT:
            return
        if seg.done is not None:
            seg.done()


def shift_refs(node: Any, base: int) -> Any:
    """A copy of a skeleton with every tensor reference moved by ``base`` (per-rank subtrees
    are flattened on their own; the manifest numbers all tensors in one table)."""
    # A loop, not recursion: a tree at the depth limit is ~3 containers per level, past
    # Python's recursion limit when recursed through.
    out: list[Any] = [None]
    stack: list[tuple[Any, Any, Any]] = [(node, out, 0)]
    while stack:
        n, parent, slot = stack.pop()
        copy: Any = n
        if isinstance(n, list):
            copy = list(n)
            stack.extend((x, copy, j) for j, x in enumerate(n) if isinstance(x, (list, dict)))
        elif isinstance(n, dict):
            copy = dict(n)
            stack.extend((v, copy, k) for k, v in n.items() if isinstance(v, (list, dict)))
            if n.get("t") in ("tensor", "ndarray") and type(n.get("e")) is int:
                copy["e"] = n["e"] + base
        parent[slot] = copy
    return out[0]


def per_rank_trees(trees: list[Any], counts: list[int], base: int) -> list[Any]:
    """One rank's ``tg.PerRank`` subtrees (each flattened on its own, holding ``counts[k]``
    tensors), referring to the manifest's tensor table, whose tensors of this rank start at
    ``base``."""
    out = []
    for tree, n in zip(trees, counts, strict=True):
        out.append(shift_refs(tree, base))
        base += n
    return out


def manifest_doc(
    header: dict[str, Any],
    tree: dict[str, Any],
    per_rank: list[list[Any]],
    gplan: GlobalPlan,
    written: dict[str, WrittenFile],
    *,
    packed: bool,
    stored_name: Callable[[str], str] = str,
) -> dict[str, Any]:
    """The manifest of a save: its header, the state tree, and every chunk of every rank.

    A single-process save lists each chunk as an object (format 4, which older readers read).
    A distributed one stores each tensor's chunks as columns (format 5): a job of a thousand
    ranks has millions of chunks, and columns of integers build, encode and parse several
    times faster than an object per chunk, and take a third of the bytes. A state tree that
    holds a ``packed`` list or tuple (any rank's, ``packed``) makes it format 6, which older
    readers refuse by its version rather than misread.
    """
    # Each file's name in the manifest: a shared object's, else its stored name.
    names = [written[n].shared or stored_name(n) for n in gplan.files]
    # Each chunk's checksum, by table row: files report theirs in file order.
    sums = np.zeros(len(gplan.table), dtype="S16")
    for name, file_rows in zip(gplan.files, gplan.file_rows, strict=True):
        got = written[name].checksums.encode()
        if len(got) != 16 * len(file_rows):
            raise SaveError(f"{name}: {len(got) // 16} checksums for {len(file_rows)} chunks")
        sums[file_rows] = np.frombuffer(got, dtype="S16")
    columnar = gplan.world > 1
    bounds = gplan.tensor_rows().tolist()
    tensors: list[dict[str, Any]] = []
    for i, t in enumerate(gplan.tensors):
        record: dict[str, Any] = {"dtype": t.dtype, "shape": list(t.shape), "numpy": t.numpy}
        if t.layout != REPLICATED:
            record["layout"] = t.layout
        if t.layout == PER_RANK:
            record["rank"] = t.rank
        files, offsets, shapes = gplan.chunks(bounds[i], bounds[i + 1], len(t.shape))
        if columnar:
            record["name"] = t.name
            record["chunks"] = {
                "file": _column(files),
                "offsets": [_column(offsets[:, k]) for k in range(offsets.shape[1])],
                "shape": [_column(shapes[:, k]) for k in range(shapes.shape[1])],
                "checksum": sums[bounds[i] : bounds[i + 1]].tobytes().decode(),
            }
        else:
            assert gplan.keys is not None
            record["chunks"] = [
                {"file": names[f],
                 "key": SHARED_KEY if is_candidate(gplan.files[f]) else gplan.keys[r],
                 "offsets": o, "shape": n, "checksum": sums[r].decode()}
                for r, f, o, n in zip(range(bounds[i], bounds[i + 1]),
                                      files.tolist(), offsets.tolist(),
                                      shapes.tolist(), strict=True)
            ]  # fmt: skip
        tensors.append(record)
    shares = any(w.shared is not None for w in written.values())
    listed: dict[str, dict[str, Any]] = {}  # one entry per file: equal chunks, one object
    for planned, name in zip(gplan.files, names, strict=True):
        w = written[planned]
        listed.setdefault(
            name, {"name": name, "size": w.size, "header_checksum": w.header_checksum}
        )
    if shares:
        version = SHARED_VERSION
    elif packed:
        version = PACKED_VERSION
    else:
        version = COLUMNAR_VERSION if columnar else header["format_version"]
    doc = {
        **header,
        "format_version": version,
        "files": list(listed.values()),
        "tensors": tensors,
        "tree": tree,
    }
    if any(per_rank):
        doc["per_rank"] = per_rank
    return doc


def _column(values: np.ndarray) -> int | list[int]:
    """A chunk column: one number when every chunk has it (a row-sharded tensor's trailing
    offsets and widths, equal shards' heights), else the list."""
    if len(values) == 1 or (len(values) and bool((values == values[0]).all())):
        return int(values[0])
    return values.tolist()


def seal_checked(doc: dict[str, Any], where: str) -> bytes:
    """The sealed manifest bytes, refused unless a reader accepts them."""
    manifest = seal(dumps(doc))
    if len(manifest) > limits.MAX_MANIFEST_BYTES:
        chunks = sum(len(t["chunks"]) if isinstance(t["chunks"], list) else
                     len(t["chunks"]["checksum"]) // 16 for t in doc["tensors"])  # fmt: skip
        raise SaveError(
            f"{where}: the manifest would be {len(manifest) / 2**20:.0f} MiB ({chunks} chunks), "
            f"more than the {limits.MAX_MANIFEST_BYTES / 2**20:.0f} MiB any reader accepts; "
            "nothing was committed. Save fewer, larger tensors (e.g. flatten parameters into "
            "fewer buffers) or from fewer ranks."
        )
    # Commit only what a reader accepts: the same checks that guard every load run on this
    # save's own manifest, first the one on its bytes (the cost of parsing them), then the
    # validation of the document (unique keys, chunks tiling each tensor, sizes).
    try:
        check_parse_cost(manifest, f"{where}/{MANIFEST}")
    except TardigradeError as e:
        raise SaveError(
            f"{where}: the state holds so many small values that its manifest "
            f"({len(manifest) >> 20} MiB) would take about {parse_cost(manifest) >> 20} MiB to "
            "parse, more than any reader accepts; nothing was committed. Store large tables of "
            "values (a dict or list of millions of entries) as tensors or numpy arrays."
        ) from e
    try:
        validate(doc, f"{where}/{MANIFEST}")
    except TardigradeError as e:
        raise SaveError(
            f"{where}: refusing to commit a manifest a reader would reject "
            f"(a bug in Tardigrade; please report it): {e}"
        ) from e
    return manifest


def begin(job: SaveJob, streams: Sequence[Iterable[Any]] = ()) -> str:
    """Create the save's staging location; on failure release the streams' buffers."""
    try:
        return job.commit.begin(job.name, job.header["save_id"])
    except BaseException:
        # No writer will read the streams: release their staging buffers here, or a
        # caller staging under a byte budget would wait for them forever.
        for stream in streams:
            _discard(stream)
        raise


def write_files(
    job: SaveJob, staging: str, streams: Sequence[Iterable[Any]]
) -> dict[str, WrittenFile]:
    """Write this process's data files into ``staging``, each from its stream, in parallel."""
    files = job.plan.files
    calls = [
        functools.partial(write_file, job, fp, staging, stream)
        for fp, stream in zip(files, streams, strict=True)
    ]
    # A save sharing data writes a file per large chunk, each ending in an fsync and a
    # rename: more writers than cores overlap those waits.
    shares = job.shared is not None and any(is_candidate(fp.name) for fp in files)
    workers = max(DEFAULT_MAX_FILES, SHARED_WRITERS) if shares else DEFAULT_MAX_FILES
    results = in_workers(calls, workers, "tardigrade-write")
    return {fp.name: w for fp, w in zip(files, results, strict=True)}


def in_workers(calls: Sequence[Callable[[], Any]], workers: int, name: str) -> list[Any]:
    """``in_threads`` with at most ``workers`` threads, each taking the next call in order
    (a save sharing data has a file per large chunk; streams are staged in file order, so
    the files are written in that order too). After a failure the remaining calls still run:
    each drains its stream, whose staging buffers must come back."""
    if len(calls) <= workers:
        return in_threads(calls, name)
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []
    turn = iter(range(len(calls)))
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                i = next(turn, None)
            if i is None:
                return
            try:
                results[i] = calls[i]()
            except BaseException as e:
                with lock:
                    errors.append(e)

    in_threads([work] * workers, name)
    if errors:
        raise errors[0]
    return results


def commit_staging(job: SaveJob, staging: str, manifest: bytes) -> None:
    """Write the manifest and make the checkpoint visible atomically (the backend's strategy)."""
    check_target(job.storage, job.name, job.overwrite, racing=True)
    job.commit.commit(
        staging, job.name, manifest, save_id=job.header["save_id"], replace=job.overwrite
    )


def end_staging(job: SaveJob, staging: str, committed: bool | None) -> None:
    """After a failed save: remove what it wrote if it did not commit; never raises, so the
    save's own error is what the caller reports.

    Past the commit point (or when that is unknown) nothing is removed: on a store the data
    objects are the committed checkpoint's. What an abort that failed leaves behind, and the
    staging of an unknown outcome, are let go of (``Storage.abandon``) for ``tidy`` (gc, the
    next manager) to remove.
    """
    if committed is False:
        try:
            job.commit.abort(staging, job.name, job.header["save_id"])
            return
        except Exception as e:
            log.warning(
                "tardigrade: could not remove what the failed save of %s wrote (%s): %s; "
                "`tardigrade gc` (or the next CheckpointManager on this location) removes it",
                job.storage.url(job.name),
                job.storage.url(staging),
                e,
            )
    job.commit.abandon(staging)


def committed_here(job: SaveJob) -> bool | None:
    """Whether this save's checkpoint is committed: its commit record, the manifest at the
    checkpoint's name, is the one this save wrote (it names this save's ``save_id``).

    The outcome of a save that failed is read from storage, not inferred from where it failed:
    the commit point is one rename (or one conditional create) that this process, or rank 0 of
    a collective save, may have passed before the error. None: storage could not tell.
    """
    return holds_save(job.storage, job.name, job.header["save_id"])


def _outcome_note(url: str, committed: bool | None) -> str:
    if committed:
        return (
            f" The checkpoint {url} was committed nonetheless (committed=True): this failure "
            "came after the commit point and the checkpoint is complete; load it rather than "
            "saving it again."
        )
    if committed is None:
        return (
            f" Whether {url} was committed is unknown (committed=None): storage could not be "
            "read back to tell, or (a collective save) it was not there when this process "
            "looked but rank 0 was lost while committing it. Once the job has stopped, "
            "tg.verify() on that path (or CheckpointManager.restore()) tells."
        )
    return f" Nothing was committed at {url} (committed=False); what was there is intact."


def as_save_error(job: SaveJob, e: BaseException, committed: bool | None = False) -> BaseException:
    """What a failed save raises: our own errors as they are, anything else as a SaveError;
    marked with whether the checkpoint was committed (``committed``, ``path``, the message).
    """
    url = job.storage.url(job.name)
    if not isinstance(e, Exception):
        return e
    if isinstance(e, TardigradeError) and not isinstance(e, StorageError):
        err: TardigradeError = e
        # Only what does not already say it: our own messages before the commit point do
        # ("nothing was committed"), a lost rank's does not.
        if committed is not False or isinstance(e, DistributedError):
            note = _outcome_note(url, committed)
            if isinstance(err, OSError) and err.strerror is not None:
                err.strerror += note
            else:
                err.args = (f"{err}{note}",)
    elif committed is False:
        err = SaveError(f"{url}: save failed and nothing was committed: {e}")
        err.__cause__ = e
    else:
        err = SaveError(f"{url}: save failed: {e}.{_outcome_note(url, committed)}")
        err.__cause__ = e
    err.committed = committed
    err.path = url
    return err


def raise_save_error(job: SaveJob, e: BaseException, committed: bool | None = False) -> NoReturn:
    """Raise what a save that failed with ``e`` raises (``as_save_error``); call it from the
    ``except`` block that caught ``e``."""
    err = as_save_error(job, e, committed)
    if err is e:
        raise e
    raise err from e


def save_result(job: SaveJob, nbytes: int, files: int) -> SaveResult:
    total = time.perf_counter() - job.started
    return SaveResult(
        job.storage.url(job.name),
        job.header["step"],
        nbytes,
        files,
        job.blocking_seconds if job.blocking_seconds is not None else total,
        total,
    )


def write_and_commit(job: SaveJob, streams: Sequence[Iterable[Any]]) -> SaveResult:
    """Write every file from its segment stream, then the manifest, then commit atomically.

    On a failure before the commit point the staging location is removed and nothing becomes
    visible; after it (committed, e.g. an fsync failed after the rename), the error says so.
    """
    staging = None
    try:
        staging = begin(job, streams)
        written = write_files(job, staging, streams)
        assert job.gplan is not None
        subs = job.flat.per_rank
        base = job.gplan.own_base[0]
        # A node or chunk object per tensor, made and checked in a burst: the cycle collector
        # would walk them all again and again (nothing here makes cycles).
        with gc_paused():
            trees = [per_rank_trees([f.tree for f in subs], [len(f.entries) for f in subs], base)]
            doc = manifest_doc(
                job.header,
                job.flat.tree,
                trees,
                job.gplan,
                written,
                packed=job.flat.uses_packed,
                stored_name=job.stored_name,
            )
            manifest = seal_checked(doc, job.storage.url(job.name))
        commit_staging(job, staging, manifest)
    except BaseException as e:
        # The outcome first: past the commit point, aborting would delete the data of a
        # committed checkpoint (an object store's data objects are not in a staging dir).
        committed = committed_here(job) if staging is not None else False
        if staging is not None:
            end_staging(job, staging, committed)
        job.abandon_published()  # swept unless a committed checkpoint references them
        raise_save_error(job, e, committed)
    finally:
        job.unpin()
    mine = [w for w in written.values() if w.written]
    return save_result(job, sum(w.size for w in mine) + len(manifest), len(mine))
