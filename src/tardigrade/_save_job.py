"""A save job: what a save writes and where, decided before any byte moves.

``make_job`` checks the arguments and what is at the path, flattens the state and lays out its
files (``_plan``); the byte sources below tell the stagers which bytes each planned item is.
Nothing here writes: ``_write`` moves the bytes, ``_async`` stages them for a background save.
"""

from __future__ import annotations

import numbers
import os
import platform
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import torch

from . import _shared
from ._commit import Commit, commit_for, what_is_at
from ._plan import (
    DEFAULT_MAX_FILES,
    FilePlan,
    GlobalPlan,
    LocalEntry,
    SavePlan,
    WriteItem,
    global_plan,
    local_plan,
)
from ._shared import SharedIndex, abandon, pin, shared_root, unpin
from ._tree import Entry, Flat, flatten
from ._units import gbps
from ._version import __version__
from .errors import CheckpointExistsError, InvalidArgumentError, SaveError
from .format import limits
from .format import safetensors as st
from .format.checksum import ALGORITHM
from .format.jsonio import dumps, gc_paused
from .format.manifest import FORMAT_NAME, FORMAT_VERSION, LEASE_GENERATION
from .storage import Storage, storage_for


@dataclass(frozen=True)
class SaveResult:
    """What a committed save did: where, how many bytes, how long the caller was blocked.

    Unlike :class:`~tardigrade.SaveStats` (one attempt of a ``CheckpointManager``, failed ones
    included, without path or files), it describes one save that committed. ``nbytes`` and
    ``files``: what it wrote (a save sharing data counts no object it referenced).
    """

    path: str
    step: int | None
    nbytes: int
    files: int
    blocking_seconds: float
    total_seconds: float

    @property
    def throughput_gbps(self) -> float:
        return gbps(self.nbytes, self.total_seconds)


@dataclass(frozen=True, kw_only=True)
class SaveOptions:
    """The knobs of one save, as ``tg.save`` takes them, passed through the pipeline as one.

    Checked where the job is made (``make_job``, a collective save's ``describe``), not here:
    a bad value raises the same message whichever entry point it came through.
    """

    overwrite: bool = False
    metadata: Mapping[str, Any] | None = None
    step: int | None = None
    epoch: int | None = None
    metrics: Mapping[str, float] | None = None
    max_files: int = DEFAULT_MAX_FILES  # data files per rank (tests make more, smaller ones)
    # For the backend of the save's location (endpoint, credentials); not compared across
    # ranks: each rank may reach the store with its own credentials.
    storage_options: Mapping[str, Any] | None = None
    # The generation of the lease a manager holds on the location (recorded in the manifest,
    # so that a commit made after losing the lease can be told apart: Catalog.fence).
    lease_generation: int | None = None
    # A collective save whose every rank commits the checkpoint (its own data files and the
    # manifest) in a storage of its own: the manager's saves into the RAM tiers alone.
    each_rank_commits: bool = False
    # Share data (format 7): chunks of SHARE_MIN_BYTES or more as shared objects, those this
    # index holds referenced rather than written. None: a plain save.
    shared: SharedIndex | None = None
    # The largest chunk of a shared object (a writer holds one whole before deciding; under a
    # staging budget, a fraction of it: ``AsyncCheckpointer.submit``).
    share_chunk_bytes: int = field(default_factory=lambda: _shared.SHARE_CHUNK_BYTES)
    # An async save: copy to host memory in the background while training goes on, the
    # optimizers' step() waiting for the copy (``_overlap``); the rest snapshotted first.
    overlap: bool = False


_claiming = threading.Lock()


@dataclass
class SaveJob:
    """Everything the write and commit phases need; owns no live state once staged."""

    storage: Storage
    name: str
    flat: Flat
    plan: SavePlan  # the files this process writes
    header: dict[str, Any]
    overwrite: bool
    started: float
    # The whole checkpoint's plan, where this process builds the manifest (the coordinator).
    gplan: GlobalPlan | None = None
    blocking_seconds: float | None = None  # set by an async save once staging is done
    # Sharing data (format 7): the shared objects this save may reference (its base's);
    # None: every chunk goes into the save's own data files.
    shared: SharedIndex | None = None
    pins: list[str] = field(default_factory=list)  # the shared objects this save pinned
    published: list[str] = field(default_factory=list)  # ... and those it wrote
    # Shared object -> the planned file that holds it in this save: a chunk held twice is
    # one object once, the other copies plain files of the save. One map for the save and
    # its copies into other tiers (``dataclasses.replace`` keeps it), so all decide alike.
    claims: dict[str, str] = field(default_factory=dict)

    @cached_property
    def commit(self) -> Commit:
        """How this save commits on its storage (a rename, or the manifest last)."""
        return commit_for(self.storage)

    def stored_name(self, file: str) -> str:
        """The name data file ``file`` of the plan has in storage (and the manifest)."""
        return self.commit.data_name(file, self.header["save_id"])

    def pin(self, name: str) -> None:
        """Pin shared object ``name`` until the save ended (``unpin``): the sweep spares it."""
        pin(shared_root(self.storage.url, self.name), name)
        self.pins.append(name)

    def claim(self, name: str, file: str) -> bool:
        """Whether planned file ``file`` is the one that holds shared object ``name`` in this
        save (the first to ask, for every tier's writer alike)."""
        with _claiming:
            return self.claims.setdefault(name, file) == file

    def unpin(self) -> None:
        unpin(shared_root(self.storage.url, self.name), self.pins)
        self.pins.clear()

    def abandon_published(self) -> None:
        """The save failed: the shared objects it wrote may be swept without waiting out the
        grace period, once no committed checkpoint references them (if the save committed
        after all, its checkpoint does)."""
        abandon(shared_root(self.storage.url, self.name), self.published)

    @property
    def entries(self) -> list[Entry]:
        """This process's tensors, numbered as the plan's items refer to them."""
        return [*self.flat.entries, *self.flat.own_entries()]


def _check_metadata(metadata: Any) -> dict[str, Any]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping) or not all(isinstance(k, str) for k in metadata):
        raise InvalidArgumentError("metadata must be a dict with str keys of JSON values")
    try:
        dumps(dict(metadata))
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(
            f"metadata must hold only JSON values (str, finite numbers, bool, None, lists, "
            f"dicts): {e}"
        ) from None
    return dict(metadata)


def _check_counter(name: str, v: Any) -> int | None:
    if v is not None and (type(v) is not int or v < 0):
        raise InvalidArgumentError(f"{name} must be a non-negative int or None, got {v!r}")
    return v


def _check_metrics(metrics: Any) -> dict[str, float]:
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise InvalidArgumentError(f"metrics must be a dict of str -> number, got {metrics!r}")
    out = {}
    for k, v in metrics.items():
        if (
            isinstance(v, torch.Tensor)
            and v.numel() == 1
            and not v.is_complex()
            and v.dtype != torch.bool
        ):
            v = v.item()  # a loss tensor, as training loops pass it (one device sync)
        # numbers.Real also admits NumPy scalars (np.float32(0.5)): metrics computed with NumPy
        if (
            not isinstance(k, str)
            or isinstance(v, (bool, np.bool_))
            or not isinstance(v, numbers.Real)
        ):
            raise InvalidArgumentError(
                f"metric {k!r}={v!r}: metrics map str names to numbers (int, float, a NumPy "
                "number or a one-element tensor)"
            )
        out[k] = float(v)
    return out


def make_job(path: str | os.PathLike[str], state: Any, options: SaveOptions) -> SaveJob:
    """Flatten ``state`` and lay out its files: everything a save needs before any byte moves.

    Cheap and done in the caller; raises before anything is written (a bad argument, a leaf
    the format cannot store, something in the way at ``path``).
    """
    started = time.perf_counter()
    storage, name = storage_for(path, options.storage_options)
    overwrite = options.overwrite
    if not isinstance(overwrite, bool):
        raise InvalidArgumentError(f"overwrite must be a bool, got {overwrite!r}")
    check_target(storage, name, overwrite)
    header = make_header(options)
    with gc_paused():  # a node and plan entry per tensor: see gc_paused
        flat = flatten(state)
        lplan = local_plan(flat)
        check_manifest_estimate([*lplan.shared, *lplan.own], storage.url(name))
        gplan = global_plan(
            [lplan],
            max_files=options.max_files,
            share=options.shared is not None,
            share_chunk_bytes=options.share_chunk_bytes,
        )
    return SaveJob(
        storage, name, flat, gplan.rank_plan(0), header, overwrite, started, gplan,
        shared=options.shared,
    )  # fmt: skip


# The fewest bytes one tensor adds to a format-4 manifest, beyond its key: its record with one
# chunk, empty shape and file name (``{"dtype":"U8","shape":[],"numpy":false,"chunks":[{"file":
# "","key":"","offsets":[],"shape":[],"checksum":"<16 hex>"}]},``: 126) and its tree node
# (``{"t":"tensor","e":0},``: 21), less one for ``"numpy":true`` and one for a last comma.
MIN_MANIFEST_BYTES_PER_TENSOR = 145


def check_manifest_estimate(entries: Sequence[LocalEntry], where: str) -> None:
    """Refuse, before anything is written, a state whose manifest no reader would accept.

    The manifest's size is known only once every file is written (chunk checksums); this lower
    bound of it, from the tensors and their keys, costs a pass over the keys. A state of a
    million small tensors used to write every byte for minutes, then be refused at commit.
    """
    if len(entries) > limits.MAX_TENSORS:
        raise SaveError(
            f"{where}: the state holds {len(entries)} tensors, more than the "
            f"{limits.MAX_TENSORS} a manifest may list; nothing was written. Save fewer, larger "
            "tensors (e.g. flatten parameters into fewer buffers)."
        )
    # An empty tensor may be listed without a chunk (nor its key): counted as nothing.
    named = [len(e.name) for e in entries if 0 not in e.shape]
    low = sum(named) + MIN_MANIFEST_BYTES_PER_TENSOR * len(named)
    if low > limits.MAX_MANIFEST_BYTES:
        raise SaveError(
            f"{where}: the manifest would be at least {low / 2**20:.1f} MiB ({len(entries)} "
            f"tensors), more than the {limits.MAX_MANIFEST_BYTES / 2**20:.1f} MiB any reader "
            "accepts; nothing was written. Save fewer, larger tensors (e.g. flatten parameters "
            "into fewer buffers)."
        )


def make_header(options: SaveOptions, world_size: int = 1) -> dict[str, Any]:
    """The manifest's fields that describe the save rather than the state; checks them."""
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "save_id": uuid.uuid4().hex,
        "step": _check_counter("step", options.step),
        "epoch": _check_counter("epoch", options.epoch),
        "world_size": world_size,
        "created_unix": time.time(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": {
            "tardigrade": __version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "checksum_algorithm": ALGORITHM,
        "metrics": _check_metrics(options.metrics),
        "metadata": _check_metadata(options.metadata),
        **(
            {} if options.lease_generation is None else {LEASE_GENERATION: options.lease_generation}
        ),
    }


def check_target(storage: Storage, name: str, overwrite: bool, *, racing: bool = False) -> None:
    """Refuse to save over anything but a committed checkpoint, and over that unless asked.

    ``overwrite=True`` replaces a checkpoint; it never deletes a directory of other
    checkpoints, a user's files or a regular file that happen to sit at the path.
    """
    kind = what_is_at(storage, name)
    if kind is None or (kind == "checkpoint" and overwrite):
        return
    url = storage.url(name)
    if kind == "checkpoint":
        if racing:
            raise CheckpointExistsError(
                f"{url}: another writer committed a checkpoint here while this save was "
                "running; nothing was overwritten."
            )
        raise CheckpointExistsError(
            f"{url}: a checkpoint already exists here; pass overwrite=True to replace it, or "
            "save under another name."
        )
    what = (
        "a file"
        if kind == "file"
        else "a directory that is not a committed checkpoint (it has no Tardigrade "
        "manifest.json; it may hold other checkpoints or your own files)"
    )
    raise CheckpointExistsError(
        f"{url}: {what} is in the way. Tardigrade only ever replaces a committed checkpoint, "
        "even with overwrite=True; move or delete it yourself, or save under another name."
    )


def contiguous_cpu(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a dense CPU tensor, borrowing when it already is one."""
    t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if t.device.type != "cpu":
        return t.to("cpu")
    return t if t.is_contiguous() else t.contiguous()


def item_source(entries: list[Entry], item: WriteItem) -> torch.Tensor:
    """The rows an item covers, as a tensor (possibly strided or on an accelerator)."""
    t = entries[item.entry].tensor.detach()
    if t.dim() == 0 or (item.start == 0 and item.stop == t.shape[0]):
        return t  # the whole tensor (most items): no slice to make
    return t[item.start : item.stop]


def file_header(fp: FilePlan) -> bytes:
    """The safetensors header of one data file (its tensors' keys, dtypes, shapes, offsets)."""
    return st.encode_header(fp.items, {"format": "pt", **st.SEALED_MARK})
