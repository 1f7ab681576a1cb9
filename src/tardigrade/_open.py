"""Opening a committed checkpoint: find and parse its manifest, check its tree's references.

Every reader starts with ``open_manifest`` (``load``, ``verify``, ``CheckpointManager``, the
CLI): a path without a manifest is no checkpoint. Readers that walk the state tree then call
``_check_refs``, which refuses a tree that refers to a tensor the manifest does not list or
holds a view that does not fit its tensor, and returns the tensors the tree needs. Neither
touches a data file. Separate from the load pipeline because the manager and the CLI open
checkpoints without loading them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, TypeGuard

from ._commit import committed
from .errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InsufficientMemoryError,
    TardigradeError,
)
from .format import limits
from .format.jsonio import loads_strict
from .format.manifest import MANIFEST, Manifest, TensorInfo, parse
from .format.sizes import ITEMSIZE
from .format.sparse import SPARSE_PARTS, sparse_problem
from .storage import Storage, storage_for

__all__ = ["holds_save", "manifest_at", "open_manifest", "read_manifest", "save_id_at"]


def open_manifest(
    path: Any, storage_options: Mapping[str, Any] | None = None
) -> tuple[Storage, str, Manifest]:
    """The checkpoint's storage, its name there and its parsed, validated manifest."""
    storage, name = storage_for(path, storage_options)
    return storage, name, manifest_at(storage, name)


def manifest_at(storage: Storage, name: str) -> Manifest:
    """The parsed, validated manifest of checkpoint ``name`` in ``storage``."""
    # Anything named like a commit record is read: reading it says precisely what is wrong
    # with it (a link out of the checkpoint, a directory, damage). ``committed`` is stricter.
    if not storage.exists(f"{name}/{MANIFEST}"):
        if storage.exists(name) and not storage.is_dir(name):
            raise CheckpointNotFoundError(f"{storage.url(name)}: {_foreign_file(storage, name)}")
        if storage.exists(name):
            inside = _checkpoints_in(storage, name)
            if inside:
                raise CheckpointNotFoundError(
                    f"{storage.url(name)}: a directory of {len(inside)} checkpoint(s), not a "
                    f"checkpoint itself; name one (e.g. {storage.url(f'{name}/{inside[-1]}')}), "
                    "or restore the newest with tg.CheckpointManager(directory, state).restore()"
                )
        what = (
            "it has no manifest.json, so the save that wrote it never committed"
            if storage.exists(name)
            else "nothing exists at this path"
        )
        raise CheckpointNotFoundError(
            f"{storage.url(name)}: no committed checkpoint here ({what}). Check the path, or use "
            "CheckpointManager.restore() to pick the newest complete checkpoint."
        )
    where = storage.url(f"{name}/{MANIFEST}")
    try:
        raw = storage.read_bytes(f"{name}/{MANIFEST}", limits.MAX_MANIFEST_BYTES)
        return parse(raw, where)
    except MemoryError as e:
        if isinstance(e, TardigradeError):
            raise
        raise InsufficientMemoryError(
            f"{where}: ran out of memory reading the manifest. Free memory (or raise this "
            "process's memory limit) and load again."
        ) from None


def save_id_at(storage: Storage, name: str) -> str | None:
    """The save id the manifest of checkpoint ``name`` records (None: it records none).

    Read without validating the rest (the one field is what tells two saves of a name apart:
    a copy in another tier, a replaced checkpoint); raises what reading it raises."""
    where = f"{name}/{MANIFEST}"
    doc = loads_strict(storage.read_bytes(where, limits.MAX_MANIFEST_BYTES), storage.url(where))
    save_id = doc.get("save_id") if isinstance(doc, dict) else None
    return save_id if isinstance(save_id, str) else None


def holds_save(storage: Storage, name: str, save_id: str) -> bool | None:
    """Whether checkpoint ``name`` is committed by save ``save_id`` (its manifest, the commit
    record, names that save); None when storage cannot tell.

    How a save that failed learns its outcome: the commit point is one rename or one
    conditional create, which this process (or rank 0 of a collective save, or a copy's
    writer) may have passed before the error. Guarded as every reader's parse: what is at
    the path may be anything, and this runs while handling another error."""
    try:
        if not committed(storage, name):
            return False
        return save_id_at(storage, name) == save_id
    except (OSError, TardigradeError, ValueError, MemoryError, RecursionError):
        return None


def _checkpoints_in(storage: Storage, name: str, most: int = 1000) -> list[str]:
    """The committed checkpoints directly under ``name`` (a run directory given where one
    checkpoint was meant), sorted; only the first ``most`` entries are looked at."""
    try:
        children = storage.list(name)[:most]
        return sorted(c for c in children if committed(storage, f"{name}/{c}"))
    except (OSError, TardigradeError):
        return []  # only a better message was at stake


def _foreign_file(storage: Storage, name: str) -> str:
    """What a file found where a checkpoint directory should be is, and what to do with it."""
    head = bytearray(8)
    try:
        reader = storage.open_reader(name)
        try:
            reader.readinto(0, memoryview(head))
        finally:
            reader.close()
    except Exception:  # too short or unreadable: it is still not a checkpoint
        head = bytearray()
    end = "A Tardigrade checkpoint is a directory holding manifest.json, written by tg.save()."
    # torch.save writes a zip archive since torch 1.6, a bare pickle (protocol 2) before.
    if head[:4] == b"PK\x03\x04" or head[:2] == b"\x80\x02":
        return (
            "this is a file written by torch.save (a pickle), not a Tardigrade checkpoint; "
            "Tardigrade never unpickles. Convert it once with `tardigrade convert FILE DEST` "
            "(tensors and plain values only, read with weights_only=True), then load DEST; or "
            "load it yourself with torch.load(path, weights_only=True) from a source you trust "
            "and tg.save(new_dir, state). " + end
        )
    if len(head) == 8 and int.from_bytes(head, "little") < 100_000_000:
        return (
            "this is a file, not a checkpoint directory (a single .safetensors file? read it "
            "with safetensors.torch.load_file). " + end
        )
    return f"this is a file, not a checkpoint directory. {end}"


def read_manifest(path: Any, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Read and validate a checkpoint's manifest without touching any tensor bytes.

    ``path`` is the checkpoint directory or its URL, with ``storage_options`` for a URL's
    backend (see ``tg.save``). Returns the manifest as a dict (format version, step,
    epoch, files, tensors, the state tree, metrics, metadata); its checksum is verified.
    ``tg.Checkpoint.open(path)`` gives the same as typed values, and reads tensors on demand.

    >>> info = tg.read_manifest("ckpt/step-100")   # doctest: +SKIP
    >>> info["step"], len(info["tensors"])           # doctest: +SKIP
    """
    return open_manifest(path, storage_options)[2].raw


_SCALAR_TAGS = frozenset(("none", "bool", "int", "float", "str", "bytes", "dtype"))


def _check_refs(tree: dict[str, Any], m: Manifest, where: str) -> set[int]:
    """Every tensor reference must name a listed tensor, and views must fit inside it."""
    refs: set[int] = set()
    stack: list[Any] = [tree]
    count = 0
    while stack:
        node = stack.pop()
        count += 1
        if count > limits.MAX_TREE_NODES:
            raise CorruptCheckpointError(
                f"{where}: state tree has more than {limits.MAX_TREE_NODES} nodes"
            )
        if isinstance(node, dict):
            t = node.get("t")
            if type(t) is str and t in _SCALAR_TAGS:
                continue  # no tensor below (decode() rejects a scalar node holding one)
            if t in ("tensor", "ndarray"):
                e = node.get("e")
                if type(e) is not int or not 0 <= e < len(m.tensors):
                    raise CorruptCheckpointError(
                        f"{where}: tree refers to tensor #{e!r}, which the manifest does not list"
                    )
                view = node.get("view")
                if view is not None:
                    _check_view(view, m.tensors[e], where)
                refs.add(e)
            else:
                if t == "sparse":
                    _check_sparse(node, m, where)
                stack.extend(v for k, v in node.items() if k in ("v", "meta"))
        elif isinstance(node, list):
            stack.extend(node)
    return refs


def _check_sparse(node: dict[str, Any], m: Manifest, where: str) -> None:
    """A sparse node's parts must fit together (shapes, index dtypes) and its size: refused
    here, before any byte is read, and by ``verify``. A node malformed otherwise is left to
    ``decode``, which refuses it."""
    layout, size, parts = node.get("layout"), node.get("size"), node.get("v")
    if (
        type(layout) is not str
        or layout not in SPARSE_PARTS
        or type(size) is not list
        or not all(type(n) is int for n in size)
        or type(parts) is not list
        or len(parts) != len(SPARSE_PARTS[layout])
    ):
        return
    found = []
    for p in parts:
        e = p.get("e") if isinstance(p, dict) and p.get("t") == "tensor" else None
        if type(e) is not int or not 0 <= e < len(m.tensors):
            return
        info = m.tensors[e]
        view = p.get("view")
        if view is not None:
            _check_view(view, info, where)  # before its shape is trusted here
        shape = tuple(view["shape"]) if view is not None else info.shape
        if "complex" in p:  # stored as its real view: a trailing dimension of 2
            found.append((shape[:-1], f"complex {info.dtype}"))
        else:
            found.append((shape, info.dtype))
    problem = sparse_problem(layout, size, found)
    if problem is not None:
        raise CorruptCheckpointError(
            f"{where}: a sparse {layout} tensor whose {problem}. The manifest is damaged; "
            "restore the checkpoint from a backup or delete it."
        )


def _extents(x: Any) -> TypeGuard[list[int]]:
    """A view's shape or stride: a list of ints torch can hold."""
    return isinstance(x, list) and all(
        type(i) is int and 0 <= i <= limits.MAX_TORCH_EXTENT for i in x
    )


def _check_view(view: Any, info: TensorInfo, where: str) -> None:
    ok = isinstance(view, dict) and type(view.get("offset")) is int and view["offset"] >= 0
    shape, stride = (view.get("shape"), view.get("stride")) if ok else (None, None)
    if (
        ok
        and _extents(shape)
        and _extents(stride)
        and len(shape) == len(stride) <= limits.MAX_DIMS
        # torch.as_strided refuses shapes whose sizes overflow int64, even empty ones.
        and limits.fits_torch(shape, ITEMSIZE[info.dtype])
        and view["offset"] <= math.prod(info.shape)
    ):
        if math.prod(shape):
            extent = view["offset"] + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))
            # Nor may it hold more elements than its storage: only a view that overlaps itself
            # (a stride of 0) could, and writers store those by value. Forged, it would load
            # as a tensor claiming terabytes over a few bytes, which any copy of it allocates.
            ok = extent + 1 <= math.prod(info.shape) and math.prod(shape) <= math.prod(info.shape)
    else:
        ok = False
    if not ok:
        raise CorruptCheckpointError(
            f"{where}: a tensor view {view!r} does not fit its storage of {list(info.shape)} "
            "elements; the manifest is damaged. Restore the checkpoint from a backup or delete it."
        )
