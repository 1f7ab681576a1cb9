"""State trees: flatten live state into a JSON skeleton plus tensor entries, and back.

The skeleton is what ``manifest.json`` stores under ``"tree"``. Every node is a small dict with
a type tag ``"t"``, so each Python type round-trips exactly (tuple stays tuple, int stays int,
``-0.0`` and NaN survive). Tensors and arrays appear as references into the manifest's tensor
table; tensors that share storage are written once and come back sharing.
"""

from __future__ import annotations

import base64
import json
import math
from collections import Counter, OrderedDict
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from ._loader_audit import deferred_audit
from ._sharding import Box, PerRank, Sharded, box_of, is_dtensor
from ._validate import class_name
from .errors import UnsupportedTypeError
from .format import limits
from .format.dtypes import (
    COMPLEX_NAMES,
    DTYPE_NAMES,
    NUMPY_DTYPES,
    NUMPY_NAMES,
    NUMPY_SCALAR_DTYPES,
    NUMPY_SCALAR_NAMES,
    TORCH_DTYPES,
)
from .format.sparse import SPARSE_PARTS

# Decoding needs no torch and lives in format.tree; re-exported for the library's modules.
from .format.tree import DEVICE_TYPES, PACKED_DTYPES, float_node
from .format.tree import SparseRef as SparseRef
from .format.tree import TensorRef as TensorRef
from .format.tree import TensorView as TensorView
from .format.tree import decode as decode
from .format.tree import loaded_as as loaded_as
from .format.tree import path_str as path_str
from .format.tree import tensor_ref as tensor_ref

# Sparse layouts and the component tensors each is stored as, in order.
_TORCH_LAYOUTS = {
    "coo": torch.sparse_coo,
    "csr": torch.sparse_csr,
    "csc": torch.sparse_csc,
    "bsr": torch.sparse_bsr,
    "bsc": torch.sparse_bsc,
}
SPARSE_LAYOUTS: dict[str, tuple[torch.layout, tuple[str, ...]]] = {
    k: (_TORCH_LAYOUTS[k], parts) for k, parts in SPARSE_PARTS.items()
}
SPARSE_NAMES: dict[torch.layout, str] = {v[0]: k for k, v in SPARSE_LAYOUTS.items()}


@runtime_checkable
class Stateful(Protocol):
    """Anything saved through ``state_dict()`` and restored through ``load_state_dict()``.

    On save Tardigrade calls ``state_dict()`` once. On ``load(into=...)``, in this order:

    1. ``state_dict()``, to find the live tensors the checkpoint's bytes are read into;
    2. ``validate_state_dict(tree)``, if the object has it (optional, not part of the
       protocol's required methods): raise any exception to refuse the checkpoint's state.
       It runs before a byte is read into any live tensor, so a refusal leaves the whole live
       state untouched. Tensors in ``tree`` are stand-ins: meta tensors (numpy: read-only
       zero-stride arrays) with the checkpoint's shape and dtype, values not read yet. It
       should check what ``load_state_dict`` would refuse (e.g. a sampler's dataset length);
       ``tg.ResumableSampler`` has one, and optimizers get a built-in check of their
       parameter groups;
    3. (the tensor bytes are read, straight into the live tensors from step 1);
    4. ``load_state_dict(tree)``.

    Under ``strict=True`` the object's class must also be the one that was saved, compared by
    name (``__name__``; module and enclosing scope may differ, so ``__main__.Counter`` loads
    into ``train.Counter``). ``nn.Module`` is exempt: its keys, shapes and dtypes are matched
    strictly instead.
    """

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> Any: ...


def is_stateful(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A zero-copy flat uint8 view of a dense tensor's bytes (the one definition: the writers
    take their bytes through it, the readers fill tensors through it)."""
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def check_dims(shape: Any, path: tuple[Any, ...], what: str = "tensor") -> None:
    """Refuse up front a shape no reader accepts (the format's dimension limit)."""
    if len(shape) > limits.MAX_DIMS:
        raise UnsupportedTypeError(
            f"{path_str(path)}: {what} has {len(shape)} dimensions; a checkpoint holds at most "
            f"{limits.MAX_DIMS}. Reshape it (e.g. flatten the leading dimensions) before saving "
            "and restore the shape after loading."
        )


def tensor_dtype_name(t: torch.Tensor, path: tuple[Any, ...]) -> str:
    name = DTYPE_NAMES.get(t.dtype)
    if name is None:
        raise UnsupportedTypeError(
            f"{path_str(path)}: tensor dtype {t.dtype} cannot be stored (supported: "
            f"{', '.join(str(d) for d in [*TORCH_DTYPES.values(), *COMPLEX_NAMES])}). "
            "Convert it to one of these before saving."
        )
    if t.layout != torch.strided or t.is_quantized or t.is_meta:
        raise UnsupportedTypeError(
            f"{path_str(path)}: only dense and sparse (COO, CSR, CSC, BSR, BSC) tensors can be "
            f"stored, got layout {t.layout}"
            f"{' (quantized)' if t.is_quantized else ''}{' (meta)' if t.is_meta else ''}; "
            "convert it with .to_dense() / .dequantize() first."
        )
    return name


@dataclass
class Entry:
    """One stored tensor: written once, referenced by one or more leaves."""

    tensor: torch.Tensor  # what gets written (a leaf, or a span covering aliasing views)
    dtype: str
    paths: list[tuple[Any, ...]] = field(default_factory=list)
    numpy: bool = False
    # A sharded leaf's place in its global tensor (``tensor`` is then only this rank's piece).
    box: Box | None = None


@dataclass
class Flat:
    tree: dict[str, Any]
    entries: list[Entry]
    # Each ``tg.PerRank`` subtree, flattened on its own (its entries numbered from 0): the
    # tree holds ``{"t": "per_rank", "i": k}`` in its place, identical on every rank.
    per_rank: list[Flat] = field(default_factory=list)
    packed: bool = False  # the tree holds a packed list or tuple (format 6), per-rank parts aside

    @property
    def uses_packed(self) -> bool:
        """Whether this tree or a per-rank part holds a packed list: the manifest is format 6."""
        return self.packed or any(sub.packed for sub in self.per_rank)

    def own_entries(self) -> list[Entry]:
        """The per-rank subtrees' entries, in order: what only this rank writes."""
        return [e for sub in self.per_rank for e in sub.entries]


# What a dict key or a set element may be: values that are hashable by their contents, so the
# loaded key equals (and hashes like) the saved one.
_KEY_KINDS = (
    "None, bool, int, float, complex, str, bytes, numpy scalars, torch.dtype, torch.device, "
    "torch.Size, and tuples and frozensets of those"
)


# Lists and tuples this long whose items are all ints (within int64) or all floats are stored
# packed: their items' little-endian bytes in one base64 string. A node per item costs ~25
# bytes of JSON and ~200 bytes of parsed objects, so a permutation of a few million sample ids
# made a manifest no reader would parse; packed, it takes 11 bytes per item and parses as one
# string. Shorter ones stay readable in the manifest (and by format 4/5 readers).
PACK_MIN_ITEMS = 64


def _packed(items: list[Any] | tuple[Any, ...], tag: str) -> dict[str, Any] | None:
    """``items`` as a packed node, or None when they are not all ints or all floats."""
    kind = type(items[0])
    if kind not in (int, float) or not all(type(x) is kind for x in items):
        return None  # bool is not int here: type() is exact
    of = "i8" if kind is int else "f8"
    try:
        # Python floats are C doubles: -0.0 and NaN payloads keep their bits.
        raw = np.array(items, dtype=PACKED_DTYPES[of]).tobytes()
    except OverflowError:  # an int beyond int64: one node per item
        return None
    return {"t": "packed", "as": tag, "of": of, "v": base64.b64encode(raw).decode()}


def _canonical(node: dict[str, Any]) -> str:
    """A stable text of a node, to order set elements (mixed types may not compare)."""
    return json.dumps(node, sort_keys=True, separators=(",", ":"))


def _overlapping(
    group: list[tuple[tuple[Any, ...], dict[str, Any]]],
) -> list[list[tuple[tuple[Any, ...], dict[str, Any]]]]:
    """Split views of one storage into clusters whose byte ranges overlap (sorted by start)."""
    spans = []
    for sig, node in group:
        dtype, offset, shape, stride = sig
        size = dtype.itemsize
        extent = sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) + 1
        spans.append((offset * size, (offset + extent) * size, sig, node))
    spans.sort(key=lambda x: (x[0], x[1]))
    clusters: list[list[tuple[tuple[Any, ...], dict[str, Any]]]] = []
    end = -1
    for lo, hi, sig, node in spans:
        if clusters and lo < end:
            clusters[-1].append((sig, node))
            end = max(end, hi)
        else:
            clusters.append([(sig, node)])
            end = hi
    return clusters


# The most view elements whose offsets _sharing lists (8 bytes each, sorted while save()
# blocks); above it, interleaved views are stored as their span.
_SHARING_CHECK_MAX = 1 << 22


def _sharing(
    cluster: list[tuple[tuple[Any, ...], dict[str, Any]]],
) -> list[list[tuple[tuple[Any, ...], dict[str, Any]]]]:
    """Split views of one dtype whose ranges overlap into groups that really share elements.

    Strided views can interleave without sharing an element (two columns of a large matrix):
    their ranges overlap, yet storing the span between them would write the whole matrix.
    When a span is much larger than its views, every view's element offsets are listed (8
    bytes per element of the views, never per element of the span) and views are grouped by
    the offsets they have in common.
    """
    lo = min(sig[1] for sig, _ in cluster)
    hi = max(
        sig[1] + sum((n - 1) * s for n, s in zip(sig[2], sig[3], strict=True)) + 1
        for sig, _ in cluster
    )
    covered = sum(math.prod(sig[2]) for sig, _ in cluster)
    if hi - lo <= 2 * covered + 4096 or covered > _SHARING_CHECK_MAX:
        # Dense enough (the span costs at most about twice the views), or too many elements to
        # list in the caller's thread: store the span.
        return [cluster]
    offsets, owners = [], []
    for i, (sig, _) in enumerate(cluster):
        o = torch.tensor(sig[1], dtype=torch.int64)
        for n, s in zip(sig[2], sig[3], strict=True):
            o = o.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * s
        offsets.append(o.reshape(-1))
        owners.append(torch.full((o.numel(),), i, dtype=torch.int64))
    off, order = torch.sort(torch.cat(offsets), stable=True)
    own = torch.cat(owners)[order]
    same = off[1:] == off[:-1]
    parent = list(range(len(cluster)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    pairs = torch.stack([own[:-1][same], own[1:][same]], dim=1).unique(dim=0)
    for a, b in pairs.tolist():
        parent[root(a)] = root(b)
    groups: dict[int, list[tuple[tuple[Any, ...], dict[str, Any]]]] = {}
    for i, member in enumerate(cluster):
        groups.setdefault(root(i), []).append(member)
    return list(groups.values())


class _Flattener:
    def __init__(self, per_rank: bool = False, seen: set[int] | None = None) -> None:
        self.entries: list[Entry] = []
        self.in_per_rank = per_rank  # flattening a PerRank subtree: no nested per-rank parts
        self.per_rank: list[Flat] = []
        self.sharded: dict[tuple[Any, ...], int] = {}  # (piece's memory, box) -> entry
        self.alive: list[Any] = []  # objects whose id() is a key in ``sharded``
        # storage key -> [(view signature, node)] for dedup of tensors that share memory
        self.by_storage: dict[tuple[str, int], list[tuple[tuple[Any, ...], dict[str, Any]]]] = {}
        # Stateful objects met so far, in the whole state (a PerRank part shares its parent's).
        self.seen: set[int] = set() if seen is None else seen
        self.refs: list[dict[str, Any]] = []  # every node that refers to an entry
        self.packed = False  # a list or tuple was stored packed (format 6)

    def node(
        self, obj: Any, path: tuple[Any, ...], depth: int = 0, key: str | None = None
    ) -> dict[str, Any]:
        """Encode ``obj``; ``key`` ("dict key", "set element") admits hashable values only."""
        self.check_depth(path, depth)
        t = type(obj)
        if obj is None:
            return {"t": "none"}
        if t is bool:
            return {"t": "bool", "v": obj}
        if t is int:
            try:
                return {"t": "int", "v": str(obj)}
            except ValueError:  # more digits than Python converts to decimal: use hex
                return {"t": "int", "x": hex(obj)}
        if t is float:
            return float_node(obj)
        if t is str:
            return {"t": "str", "v": obj}
        if t is bytes:
            return {"t": "bytes", "v": base64.b64encode(obj).decode()}
        if t is complex:
            self.check_depth(path, depth + 1)  # its parts are nodes one level down
            return {"t": "complex", "v": [float_node(obj.real), float_node(obj.imag)]}
        if isinstance(obj, np.generic):
            return self.npscalar(obj, path)
        if isinstance(obj, torch.dtype):
            return {"t": "dtype", "v": str(obj).removeprefix("torch.")}
        if t is torch.device:
            if obj.type not in DEVICE_TYPES:
                raise UnsupportedTypeError(
                    f"{path_str(path)}: torch.device type {obj.type!r} cannot be stored "
                    f"(supported: {', '.join(sorted(DEVICE_TYPES))}); store str(device) instead."
                )
            return {"t": "device", "type": obj.type, "index": obj.index}
        if t is torch.Size:
            return {"t": "size", "v": [int(n) for n in obj]}
        if t is torch.Generator and key is None:
            # Its whole state is get_state()'s bytes (CPU: MT19937, 5 KB; CUDA: seed+offset).
            device = self.node(obj.device, path, depth + 1)
            state = base64.b64encode(obj.get_state().numpy().tobytes()).decode()
            return {"t": "generator", "device": device, "v": state}
        if t is tuple:
            return self.container(obj, path, depth, "tuple", key)
        if t is frozenset or (t is set and key is None):
            items = [self.node(x, path, depth + 1, key="set element") for x in obj]
            return {"t": t.__name__, "v": sorted(items, key=_canonical)}
        if key is not None:
            raise UnsupportedTypeError(
                f"{path_str(path)}: {key} {_short_repr(obj)} of type {_type_name(t)} cannot be "
                f"stored; a {key} may be {_KEY_KINDS}."
            )
        if t is PerRank:
            if self.in_per_rank:  # already this rank's own value
                return self.node(obj.value, path, depth + 1)
            # The part takes this node's place in every rank's tree: its depth counts from here.
            part = flatten(obj.value, path, per_rank=True, depth=depth, seen=self.seen)
            self.per_rank.append(part)
            return {"t": "per_rank", "i": len(self.per_rank) - 1}
        if t is Sharded or is_dtensor(obj):
            return self.sharded_tensor(obj, path)
        if isinstance(obj, torch.Tensor):
            if obj.layout in SPARSE_NAMES:
                self.check_depth(path, depth + 1)  # its component tensors are nodes below it
            return self.tensor(obj, path)
        if t is np.ndarray:
            return self.ndarray(obj, path)
        if t is list:
            return self.container(obj, path, depth, "list", None)
        if t in (dict, OrderedDict, Counter):
            return self.mapping(obj, path, depth)
        if is_stateful(obj):
            if id(obj) in self.seen:
                raise UnsupportedTypeError(
                    f"{path_str(path)}: the same {t.__name__} object appears twice in the state; "
                    "include each stateful object once."
                )
            self.seen.add(id(obj))
            sd = obj.state_dict()
            cls = class_name(obj)  # a framework's wrapper records the class it wraps
            return {"t": "stateful", "cls": cls, "v": self.node(sd, path, depth + 1)}
        hint = ""
        if isinstance(obj, (int, float, str, bytes)):
            hint = " Convert it to the plain Python type first (e.g. int(x), float(x), str(x))."
        raise UnsupportedTypeError(
            f"{path_str(path)}: cannot store a value of type {_type_name(t)}. Supported leaves: "
            "tensors (dense, complex, sparse), numpy arrays and scalars, int, float, complex, "
            "bool, str, bytes, None, torch.dtype, torch.device, torch.Size, torch.Generator, "
            "lists, tuples, "
            "dicts, OrderedDicts, Counters, sets and frozensets of those, and objects with "
            f"state_dict()/load_state_dict().{hint}"
        )

    @staticmethod
    def check_depth(path: tuple[Any, ...], depth: int) -> None:
        """Refuse what every reader would refuse: a node deeper than the manifest allows."""
        if depth > limits.MAX_TREE_DEPTH:
            raise UnsupportedTypeError(
                f"{path_str(path)}: state is nested more than {limits.MAX_TREE_DEPTH} levels "
                "deep; flatten it (e.g. join nested keys into one string key)"
            )

    def npscalar(self, obj: np.generic, path: tuple[Any, ...]) -> dict[str, Any]:
        name = NUMPY_SCALAR_NAMES.get(obj.dtype)
        # The exact scalar type must come back: np.longlong shares int64's dtype but is not
        # np.int64, so only the one type each dtype decodes to is accepted.
        if name is None or type(obj) is not NUMPY_SCALAR_DTYPES[name].type:
            raise UnsupportedTypeError(
                f"{path_str(path)}: cannot store a numpy scalar of type {_type_name(type(obj))} "
                f"(supported: {', '.join(d.type.__name__ for d in NUMPY_SCALAR_DTYPES.values())})."
                " Convert it to the plain Python type first (e.g. int(x), float(x), str(x))."
            )
        raw = np.asarray(obj).astype(obj.dtype.newbyteorder("<")).tobytes()
        return {"t": "npscalar", "dtype": name, "v": raw.hex()}

    def container(
        self, obj: Any, path: tuple[Any, ...], depth: int, tag: str, key: str | None
    ) -> dict[str, Any]:
        if key is None and len(obj) >= PACK_MIN_ITEMS:
            packed = _packed(obj, tag)
            if packed is not None:
                self.packed = True
                return packed
        return {
            "t": tag,
            "v": [self.node(v, (*path, i), depth + 1, key) for i, v in enumerate(obj)],
        }

    def mapping(self, obj: Any, path: tuple[Any, ...], depth: int) -> dict[str, Any]:
        items = [
            [self.node(k, path, depth + 1, "dict key"), self.node(v, (*path, k), depth + 1)]
            for k, v in obj.items()
        ]
        tags: dict[type, str] = {dict: "dict", OrderedDict: "odict", Counter: "counter"}
        tag = tags[type(obj)]
        node: dict[str, Any] = {"t": tag, "v": items}
        meta = getattr(obj, "_metadata", None)
        if isinstance(meta, dict):
            # nn.Module state_dicts carry per-submodule versions load_state_dict relies on.
            node["meta"] = self.node(dict(meta), (*path, "_metadata"), depth + 1)
        return node

    def tensor(self, t: torch.Tensor, path: tuple[Any, ...]) -> dict[str, Any]:
        t = t.detach()
        check_dims(t.shape, path)
        if t.layout in SPARSE_NAMES:
            return self.sparse(t, path)
        node: dict[str, Any] = {"t": "tensor"}
        if t.is_complex() and t.dtype in COMPLEX_NAMES:
            # Stored as its real view (same memory, so sharing with other views still works);
            # the node names the complex dtype the load views it back as.
            node["complex"] = COMPLEX_NAMES[t.dtype]
            t = torch.view_as_real(t.resolve_conj().resolve_neg())
        name = tensor_dtype_name(t, path)
        self.refs.append(node)
        if t.numel() == 0:
            node["e"] = self.new_entry(t, name, path)
            return node
        # The storage's address from the tensor's own (untyped_storage() makes an object: a
        # tenth of the flatten time of a state of small tensors).
        key: tuple[Any, ...] = (
            str(t.device),
            t.data_ptr() - t.storage_offset() * t.element_size(),
        )
        shape, stride = tuple(t.shape), t.stride()
        sig = (t.dtype, t.storage_offset(), shape, stride)
        if (
            not t.is_contiguous()
            and t.numel() > sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) + 1
        ):
            # Overlaps itself (an expand()ed tensor, a stride of 0): stored by value, never as
            # a view of a span, since a reader refuses a view of more elements than its
            # storage holds (a forged one would claim terabytes over a few bytes).
            key = ("self-overlapping", *key)
        group = self.by_storage.setdefault(key, [])
        for other_sig, other in group:
            if other_sig == sig:
                node["e"] = other["e"]
                if "view" in other:
                    node["view"] = other["view"]
                self.entries[node["e"]].paths.append(path)
                return node
        node["e"] = self.new_entry(t, name, path)
        group.append((sig, node))
        return node

    def sharded_tensor(self, obj: Any, path: tuple[Any, ...]) -> dict[str, Any]:
        """A piece of a global tensor: its entry holds the local piece and where it sits."""
        if self.in_per_rank:
            raise UnsupportedTypeError(
                f"{path_str(path)}: a sharded tensor inside tg.PerRank; a per-rank value is "
                "stored whole, so pass its local tensor (or move the sharded tensor out of "
                "the PerRank)."
            )
        found = box_of(obj, path_str(path))
        assert found is not None
        local, box = found
        local = local.detach()
        check_dims(local.shape, path, "sharded tensor")
        if local.is_complex() or local.layout != torch.strided:
            raise UnsupportedTypeError(
                f"{path_str(path)}: a sharded tensor must be dense and real (got "
                f"{local.dtype}, {local.layout}); save its real view or the full tensor."
            )
        name = tensor_dtype_name(local, path)
        node: dict[str, Any] = {"t": "tensor"}
        self.refs.append(node)
        # An empty piece (an uneven FSDP shard) has no memory to tell pieces apart by: every
        # empty tensor may share one null address, so pieces of unrelated tensors would be
        # merged on this rank alone and the ranks' trees would differ. Only the same local
        # tensor object (a tied weight, perhaps in two wrappers) is the same empty piece; it
        # is kept alive meanwhile so that its id stays unique.
        key: tuple[Any, ...]
        if local.numel() == 0:
            owner = obj.local if type(obj) is Sharded else getattr(obj, "_local_tensor", obj)
            key = ("empty", id(owner), box)
            self.alive.append(owner)
        else:
            key = (local.data_ptr(), local.dtype, tuple(local.shape), local.stride(), box)
        if key in self.sharded:  # the same piece twice (tied weights): stored once
            node["e"] = self.sharded[key]
            self.entries[node["e"]].paths.append(path)
            return node
        self.entries.append(Entry(local, name, [path], box=box))
        node["e"] = self.sharded[key] = len(self.entries) - 1
        return node

    def sparse(self, t: torch.Tensor, path: tuple[Any, ...]) -> dict[str, Any]:
        """A sparse tensor: its component tensors plus a record of layout, size, coalescing."""
        layout = SPARSE_NAMES[t.layout]
        node: dict[str, Any] = {"t": "sparse", "layout": layout, "size": list(t.shape)}
        if layout == "coo":
            # _indices()/_values() also work on an uncoalesced tensor; the flag comes back as is.
            node["coalesced"] = t.is_coalesced()
            parts = [t._indices(), t._values()]
        elif layout in ("csr", "bsr"):
            parts = [t.crow_indices(), t.col_indices(), t.values()]
        else:
            parts = [t.ccol_indices(), t.row_indices(), t.values()]
        names = SPARSE_LAYOUTS[layout][1]
        node["v"] = [self.tensor(p, (*path, n)) for p, n in zip(parts, names, strict=True)]
        return node

    def ndarray(self, a: np.ndarray, path: tuple[Any, ...]) -> dict[str, Any]:
        name = NUMPY_NAMES.get(a.dtype)
        if name is None or not a.dtype.isnative:
            raise UnsupportedTypeError(
                f"{path_str(path)}: numpy dtype {a.dtype} cannot be stored (supported: native-"
                f"endian {', '.join(str(d) for d in NUMPY_DTYPES.values())})."
            )
        check_dims(a.shape, path, "array")
        # np.ascontiguousarray would turn a 0-d array into shape (1,)
        t = torch.from_numpy(a if a.flags.c_contiguous else a.copy(order="C"))
        node = {"t": "ndarray", "e": self.new_entry(t, name, path, numpy=True)}
        self.refs.append(node)
        return node

    def new_entry(
        self, t: torch.Tensor, dtype: str, path: tuple[Any, ...], numpy: bool = False
    ) -> int:
        self.entries.append(Entry(t, dtype, [path], numpy))
        return len(self.entries) - 1

    def merge_partial_aliases(self) -> None:
        """Views whose memory overlaps but differ in shape/offset: store their span once.

        Only views whose byte ranges overlap are merged, cluster by cluster: two slices at the
        ends of one large buffer are stored as two tensors (their own bytes), not as the whole
        span between them; strided views that interleave without sharing an element are split
        apart too (:func:`_sharing`). A view alone in its group keeps its own entry, stored by
        value.
        """
        complex_entries = {n["e"] for n in self.refs if "complex" in n}
        moved: dict[int, tuple[int, dict[str, Any]]] = {}  # old entry -> (span entry, view)
        for key, group in self.by_storage.items():
            if len(group) < 2 or key[0] == "self-overlapping":  # each stored by value
                continue
            clusters = [
                part
                for cluster in _overlapping(group)
                # reinterpreting views (other dtypes) are saved by value each
                if len(cluster) > 1 and len({sig[0] for sig, _ in cluster}) == 1
                for part in _sharing(cluster)
            ]
            for cluster in clusters:
                if len(cluster) < 2:
                    continue
                lo = min(sig[1] for sig, _ in cluster)
                if any(node["e"] in complex_entries for _, node in cluster):
                    lo -= lo % 2  # view_as_complex needs an even offset into the span
                hi = max(
                    sig[1] + sum((n - 1) * s for n, s in zip(sig[2], sig[3], strict=True)) + 1
                    for sig, _ in cluster
                )
                first = self.entries[cluster[0][1]["e"]]
                span = Entry(first.tensor.as_strided((hi - lo,), (1,), lo), first.dtype, [])
                self.entries.append(span)
                for sig, node in cluster:
                    old = self.entries[node["e"]]
                    span.paths.extend(old.paths)
                    old.paths = []
                    view = {"offset": sig[1] - lo, "shape": list(sig[2]), "stride": list(sig[3])}
                    moved[node["e"]] = (len(self.entries) - 1, view)
        # Point every reference (aliases of a merged view included) at its new entry, then
        # drop entries nothing refers to and renumber.
        for node in self.refs:
            if node["e"] in moved:
                node["e"], node["view"] = moved[node["e"]]
        keep = [i for i, e in enumerate(self.entries) if e.paths]
        if len(keep) != len(self.entries):
            remap = {old: new for new, old in enumerate(keep)}
            self.entries = [self.entries[i] for i in keep]
            for node in self.refs:
                node["e"] = remap[node["e"]]


def _type_name(t: type) -> str:
    return f"{t.__module__}.{t.__qualname__}"


def _short_repr(obj: Any) -> str:
    text = " ".join(repr(obj).split())  # one line, also for tensors
    return text if len(text) <= 80 else text[:77] + "..."


def flatten(
    state: Any,
    root: tuple[Any, ...] = (),
    *,
    per_rank: bool = False,
    depth: int = 0,
    seen: set[int] | None = None,
) -> Flat:
    """Encode ``state`` into a skeleton and the tensors to write. Raises UnsupportedTypeError.

    ``depth``: the level ``state`` sits at in the whole tree (a ``tg.PerRank`` part's place).
    """
    f = _Flattener(per_rank, seen)
    # The loader audit that RNGState and samplers ask for runs once the whole state is seen,
    # so that it can tell a sampler the state leaves out (a PerRank part is seen with it).
    with deferred_audit(f.seen) if not root else nullcontext():
        tree = f.node(state, root, depth)
    f.merge_partial_aliases()
    return Flat(tree, f.entries, f.per_rank, f.packed)
