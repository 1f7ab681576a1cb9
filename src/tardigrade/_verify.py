"""``tg.verify``: a full checksum pass over one checkpoint, reading no tensor into memory.

Separate from the load pipeline: it checks every data file whole (``_read._verify_file``) and
selects, matches and restores nothing. ``load(verify="all")`` does the same checks inside a load.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ._open import _check_refs, open_manifest
from ._read import DEFAULT_READ_THREADS, _verify_file
from ._units import gbps
from .distributed._collectives import DEFAULT_TIMEOUT, Ranks
from .errors import ChecksumMismatchError, CorruptCheckpointError
from .format.jsonio import gc_paused
from .format.manifest import Chunk, Manifest
from .storage import Storage

__all__ = ["VerifyReport", "verify"]


@dataclass(frozen=True)
class VerifyReport:
    """The result of a full checksum pass over one checkpoint."""

    path: str
    step: int | None
    files: int
    tensors: int
    nbytes: int
    seconds: float

    @property
    def throughput_gbps(self) -> float:
        return gbps(self.nbytes, self.seconds)

    @classmethod
    def total(cls, path: str, reports: Sequence[VerifyReport]) -> VerifyReport:
        """One report for several passes (e.g. every checkpoint of a directory): sums of their
        files, tensors, bytes and seconds, under ``path``.

        >>> everything = tg.VerifyReport.total("ckpt", [tg.verify(p) for p in paths])  # doctest: +SKIP
        """
        return cls(
            path,
            None,
            sum(r.files for r in reports),
            sum(r.tensors for r in reports),
            sum(r.nbytes for r in reports),
            sum(r.seconds for r in reports),
        )


def verify(
    path: Any,
    *,
    workers: int = DEFAULT_READ_THREADS,
    process_group: Any = None,
    timeout: float = DEFAULT_TIMEOUT,
    storage_options: Mapping[str, Any] | None = None,
) -> VerifyReport:
    """Check every byte of a checkpoint against its checksums; raise CorruptCheckpointError if any fail.

    ``path`` is the checkpoint directory; ``workers`` data files are checked side by side
    (threads). Returns a :class:`VerifyReport` (files, tensors, bytes, seconds, GB/s). Damage
    raises ``ChecksumMismatchError`` (changed bytes) or ``CorruptCheckpointError`` (anything
    else), naming every damaged file.

    When ``torch.distributed`` is initialized the pass is collective: every rank of
    ``process_group`` calls it, each checks a share of the files (balanced by bytes), and
    every rank returns the same report or raises the same error. ``timeout`` bounds the wait
    for the other ranks. ``path`` may be a URL (``memory://``, ``s3://``, any fsspec URL),
    with ``storage_options`` for its backend (see ``tg.save``).

    >>> report = tg.verify("ckpt/step-100")     # doctest: +SKIP
    >>> print(report.nbytes, report.throughput_gbps)  # doctest: +SKIP
    """
    start = time.perf_counter()
    ranks = Ranks.current(process_group, timeout=timeout)
    seen: dict[str, Any] = {}

    def local() -> bytes:
        storage, name, m = open_manifest(path, storage_options)
        return str(_check_checkpoint(storage, name, m, workers, ranks, seen)).encode()

    if ranks is None:
        nbytes = int(local())
    else:
        # The exchange makes damage found by any rank fail the pass on every rank.
        nbytes = sum(int(d) for d in ranks.all_gather("tg.verify", local))
    return _report(seen, nbytes, start)


def verify_opened(storage: Storage, name: str, m: Manifest, workers: int) -> VerifyReport:
    """``verify`` of a checkpoint already opened (``open_manifest``), in this process alone."""
    start = time.perf_counter()
    seen: dict[str, Any] = {}
    return _report(seen, _check_checkpoint(storage, name, m, workers, None, seen), start)


def _report(seen: dict[str, Any], nbytes: int, start: float) -> VerifyReport:
    return VerifyReport(
        seen["where"],
        seen["step"],
        seen["files"],
        seen["tensors"],
        nbytes,
        time.perf_counter() - start,
    )


def _check_checkpoint(
    storage: Storage, name: str, m: Manifest, workers: int, ranks: Ranks | None,
    seen: dict[str, Any],
) -> int:  # fmt: skip
    """Check the tree's references and this process's share of the data files (all of them
    without ``ranks``); record what the report names in ``seen``; return the bytes checked."""
    where = storage.url(name)
    by_file: dict[str, list[tuple[int, Chunk]]] = {f: [] for f in m.files}
    with gc_paused():  # an object per node and chunk: see gc_paused
        for rank in range(m.world_size if "per_rank" in m.raw else 1):
            _check_refs(m.tree_for(rank, "error", where), m, where)
        for i, info in enumerate(m.tensors):
            for c in info.chunks:
                by_file[c.file].append((i, c))

    def one(file: str) -> int:
        return _verify_file(storage, name, file, m, by_file[file])

    files = sorted(m.files)
    if ranks is not None:
        # Largest first to the least loaded rank: every rank computes the same shares.
        loads = [0] * ranks.size
        mine = []
        for f in sorted(files, key=lambda f: (-m.files[f], f)):
            r = loads.index(min(loads))
            loads[r] += m.files[f]
            if r == ranks.rank:
                mine.append(f)
        files_checked = mine
    else:
        files_checked = files
    seen.update(where=where, step=m.step, files=len(files), tensors=len(m.tensors))
    return _check_files(files_checked, one, workers, where)


def verify_files(storage: Storage, name: str, m: Manifest, files: Sequence[str]) -> int:
    """Check data files ``files`` of checkpoint ``name`` (``m``: its manifest) whole, against
    the manifest: a share of a checkpoint held apart from the rest (a peer's replica)."""
    by_file: dict[str, list[tuple[int, Chunk]]] = {f: [] for f in files}
    for i, info in enumerate(m.tensors):
        for c in info.chunks:
            if c.file in by_file:
                by_file[c.file].append((i, c))

    def one(file: str) -> int:
        return _verify_file(storage, name, file, m, by_file[file])

    return _check_files(list(files), one, DEFAULT_READ_THREADS, storage.url(name))


def _check_files(files: list[str], one: Callable[[str], int], workers: int, where: str) -> int:
    """Verify ``files`` side by side; raise one error naming every damaged file."""
    errors: list[CorruptCheckpointError] = []
    nbytes = 0
    with ThreadPoolExecutor(max(1, min(workers, len(files) or 1))) as pool:
        futures = [pool.submit(one, f) for f in files]
        for f in futures:
            try:
                nbytes += f.result()
            except CorruptCheckpointError as e:
                errors.append(e)
    if errors:
        only_sums = all(isinstance(e, ChecksumMismatchError) for e in errors)
        exc = ChecksumMismatchError if only_sums else CorruptCheckpointError
        raise exc(
            f"{where}: {len(errors)} of {len(files)} data file(s) failed verification:\n  "
            + "\n  ".join(str(e) for e in errors)
        )
    return nbytes
