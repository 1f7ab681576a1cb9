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
import struct
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np
import torch

from ._sharding import Box, PerRank, Sharded, box_of, is_dtensor
from ._validate import class_name
from .errors import CorruptCheckpointError, UnsupportedTypeError
from .format import limits
from .format.dtypes import (
    COMPLEX_DTYPES,
    COMPLEX_NAMES,
    DTYPE_NAMES,
    NUMPY_DTYPES,
    NUMPY_NAMES,
    NUMPY_SCALAR_DTYPES,
    NUMPY_SCALAR_NAMES,
    TORCH_DTYPES,
)
from .format.sparse import SPARSE_PARTS, sparse_problem

# Device types a torch.device leaf may name. Decoding checks the recorded type against this
# fixed set (never a lookup of a file-chosen name); saving refuses any other type so every
# checkpoint written can be read back.
DEVICE_TYPES = frozenset(
    {
        "cpu",
        "cuda",
        "mps",
        "xpu",
        "meta",
        "hpu",
        "mtia",
        "xla",
        "lazy",
        "ipu",
        "maia",
        "vulkan",
        "ve",
        "fpga",
        "hip",
        "privateuseone",
    }
)

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


def path_str(path: tuple[Any, ...]) -> str:
    """``('optim', 'param_groups', 0)`` -> ``state['optim']['param_groups'][0]``."""
    return "state" + "".join(f"[{p!r}]" for p in path)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A zero-copy flat uint8 view of a dense tensor's bytes (the one definition: the writers
    take their bytes through it, the readers fill tensors through it)."""
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


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


def _float(x: float) -> dict[str, Any]:
    if x != x:  # NaN: keep sign and payload bits, which float.hex() drops
        return {"t": "float", "bits": struct.pack(">d", x).hex()}
    return {"t": "float", "v": x.hex()}


# Lists and tuples this long whose items are all ints (within int64) or all floats are stored
# packed: their items' little-endian bytes in one base64 string. A node per item costs ~25
# bytes of JSON and ~200 bytes of parsed objects, so a permutation of a few million sample ids
# made a manifest no reader would parse; packed, it takes 11 bytes per item and parses as one
# string. Shorter ones stay readable in the manifest (and by format 4/5 readers).
PACK_MIN_ITEMS = 64
_PACKED_DTYPES = {"i8": np.dtype("<i8"), "f8": np.dtype("<f8")}


def _packed(items: list[Any] | tuple[Any, ...], tag: str) -> dict[str, Any] | None:
    """``items`` as a packed node, or None when they are not all ints or all floats."""
    kind = type(items[0])
    if kind not in (int, float) or not all(type(x) is kind for x in items):
        return None  # bool is not int here: type() is exact
    of = "i8" if kind is int else "f8"
    try:
        # Python floats are C doubles: -0.0 and NaN payloads keep their bits.
        raw = np.array(items, dtype=_PACKED_DTYPES[of]).tobytes()
    except OverflowError:  # an int beyond int64: one node per item
        return None
    return {"t": "packed", "as": tag, "of": of, "v": base64.b64encode(raw).decode()}


def _unpacked(
    node: dict[str, Any], where: str, path: tuple[Any, ...]
) -> list[Any] | tuple[Any, ...]:
    dtype = _PACKED_DTYPES.get(node.get("of"))  # type: ignore[arg-type]
    if dtype is None or node.get("as") not in ("list", "tuple") or type(node.get("v")) is not str:
        raise _bad(where, path, "malformed packed list")
    raw = base64.b64decode(node["v"], validate=True)
    if len(raw) % dtype.itemsize:
        raise _bad(where, path, f"packed {node['of']} list of {len(raw)} bytes")
    items = np.frombuffer(raw, dtype=dtype).tolist()
    return items if node["as"] == "list" else tuple(items)


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
    def __init__(self, per_rank: bool = False) -> None:
        self.entries: list[Entry] = []
        self.in_per_rank = per_rank  # flattening a PerRank subtree: no nested per-rank parts
        self.per_rank: list[Flat] = []
        self.sharded: dict[tuple[Any, ...], int] = {}  # (piece's memory, box) -> entry
        self.alive: list[Any] = []  # objects whose id() is a key in ``sharded``
        # storage key -> [(view signature, node)] for dedup of tensors that share memory
        self.by_storage: dict[tuple[str, int], list[tuple[tuple[Any, ...], dict[str, Any]]]] = {}
        self.seen: set[int] = set()
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
            return _float(obj)
        if t is str:
            return {"t": "str", "v": obj}
        if t is bytes:
            return {"t": "bytes", "v": base64.b64encode(obj).decode()}
        if t is complex:
            self.check_depth(path, depth + 1)  # its parts are nodes one level down
            return {"t": "complex", "v": [_float(obj.real), _float(obj.imag)]}
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
            self.per_rank.append(flatten(obj.value, path, per_rank=True, depth=depth))
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
        tag = {dict: "dict", OrderedDict: "odict", Counter: "counter"}[type(obj)]
        node: dict[str, Any] = {"t": tag, "v": items}
        meta = getattr(obj, "_metadata", None)
        if isinstance(meta, dict):
            # nn.Module state_dicts carry per-submodule versions load_state_dict relies on.
            node["meta"] = self.node(dict(meta), (*path, "_metadata"), depth + 1)
        return node

    def tensor(self, t: torch.Tensor, path: tuple[Any, ...]) -> dict[str, Any]:
        t = t.detach()
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
        key = (str(t.device), t.data_ptr() - t.storage_offset() * t.element_size())
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
    state: Any, root: tuple[Any, ...] = (), *, per_rank: bool = False, depth: int = 0
) -> Flat:
    """Encode ``state`` into a skeleton and the tensors to write. Raises UnsupportedTypeError.

    ``depth``: the level ``state`` sits at in the whole tree (a ``tg.PerRank`` part's place).
    """
    f = _Flattener(per_rank)
    tree = f.node(state, root, depth)
    f.merge_partial_aliases()
    return Flat(tree, f.entries, f.per_rank, f.packed)


# ----------------------------------------------------------------------------------------------
# decoding

# Every torch.dtype a state may hold, by the name flatten() writes (str(dtype) minus "torch.").
# A fixed list: looking a name from the file up on the torch module instead would let the file
# pick any attribute, and torch imports submodules lazily on attribute access ("_inductor"
# pulls in hundreds of modules) or hands back functions ("has_cuda").
_DTYPE_NAMES = (
    "bfloat16", "bits16", "bits1x8", "bits2x4", "bits4x2", "bits8", "bool", "complex128",
    "complex32", "complex64", "float16", "float32", "float4_e2m1fn_x2", "float64",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
    "int1", "int16", "int2", "int3", "int32", "int4", "int5", "int6", "int64", "int7", "int8",
    "qint32", "qint8", "quint2x4", "quint4x2", "quint8", "uint1", "uint16", "uint2", "uint3",
    "uint32", "uint4", "uint5", "uint6", "uint64", "uint7", "uint8",
)  # fmt: skip
_DTYPE_LEAVES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (torch.__dict__.get(n) for n in _DTYPE_NAMES)  # older torch lacks a few
    if isinstance(d, torch.dtype)
}


def _bad(where: str, path: tuple[Any, ...], what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{where}: state tree at {path_str(path)}: {what}. The manifest is damaged; restore the "
        "checkpoint from a backup or delete it."
    )


def decode(
    node: Any,
    leaf: Callable[[dict[str, Any], tuple[Any, ...]], Any],
    where: str,
    path: tuple[Any, ...] = (),
    depth: int = 0,
) -> Any:
    """Rebuild Python values from a skeleton; ``leaf(node, path)`` supplies tensors and arrays.

    Stateful nodes decode to their state_dict tree. Complex tensors are viewed back as complex
    and sparse tensors rebuilt from their parts when ``leaf`` returns tensors (a sparse node
    whose parts are anything else decodes to a :class:`SparseRef`). Every malformed node
    raises CorruptCheckpointError naming ``where`` and the path.
    """
    if depth > limits.MAX_TREE_DEPTH:
        raise _bad(where, path, f"nested more than {limits.MAX_TREE_DEPTH} levels deep")
    if not isinstance(node, dict) or not isinstance(node.get("t"), str):
        raise _bad(where, path, "node is not an object with a type tag")
    tag = node["t"]
    v = node.get("v")
    try:
        if tag == "none":
            return None
        if tag == "bool" and type(v) is bool:
            return v
        if tag == "int" and type(v) is str and len(v) <= 4300:
            return int(v)
        if tag == "int" and type(node.get("x")) is str and len(node["x"]) <= 1_000_000:
            return int(node["x"], 16)
        if tag == "float" and type(v) is str:
            return float.fromhex(v)
        if tag == "float" and type(node.get("bits")) is str and len(node["bits"]) == 16:
            return struct.unpack(">d", bytes.fromhex(node["bits"]))[0]
        if tag == "str" and type(v) is str:
            return v
        if tag == "bytes" and type(v) is str:
            return base64.b64decode(v, validate=True)
        if tag == "dtype" and type(v) is str and v in _DTYPE_LEAVES:
            return _DTYPE_LEAVES[v]
        if tag == "tensor" and "complex" in node:
            return _complex_tensor(node, leaf(node, path), where, path)
        if tag in ("tensor", "ndarray"):
            return leaf(node, path)
        if tag == "sparse" and type(v) is list:
            return _sparse(node, [decode(x, leaf, where, path, depth + 1) for x in v], where, path)
        if tag == "complex" and type(v) is list and len(v) == 2:
            re, im = (decode(x, leaf, where, path, depth + 1) for x in v)
            if type(re) is not float or type(im) is not float:
                raise _bad(where, path, "complex parts are not floats")
            return complex(re, im)  # keeps -0.0 and NaN payloads of both parts
        if tag == "npscalar" and type(v) is str and node.get("dtype") in NUMPY_SCALAR_DTYPES:
            return _npscalar(NUMPY_SCALAR_DTYPES[node["dtype"]], v, where, path)
        if tag == "size" and type(v) is list and all(type(n) is int for n in v):
            return torch.Size(v)
        if tag == "device" and node.get("type") in DEVICE_TYPES:
            index = node.get("index")
            if index is None:
                return torch.device(node["type"])
            if type(index) is int and 0 <= index < 2**15:
                return torch.device(node["type"], index)
        if tag == "generator" and type(v) is str:
            device = decode(node.get("device"), leaf, where, path, depth + 1)
            if type(device) is not torch.device:
                raise _bad(where, path, "a generator's device is not a device")
            raw = base64.b64decode(v, validate=True)
            g = torch.Generator(device=device)
            g.set_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
            return g
        if tag in ("set", "frozenset") and type(v) is list:
            items = [decode(x, leaf, where, path, depth + 1) for x in v]
            for x in items:
                _check_hashable(x, "set element", where, path)
            return set(items) if tag == "set" else frozenset(items)
        if tag == "packed":
            return _unpacked(node, where, path)
        if tag in ("list", "tuple") and type(v) is list:
            items = [decode(x, leaf, where, (*path, i), depth + 1) for i, x in enumerate(v)]
            return items if tag == "list" else tuple(items)
        if tag in ("dict", "odict", "counter") and type(v) is list:
            out: dict[Any, Any] = {"dict": dict, "odict": OrderedDict, "counter": Counter}[tag]()
            for item in v:
                if type(item) is not list or len(item) != 2:
                    raise _bad(where, path, "dict item is not a [key, value] pair")
                kn = item[0]
                if (
                    type(kn) is dict
                    and kn.get("t") == "str"
                    and type(kn.get("v")) is str
                    and depth < limits.MAX_TREE_DEPTH
                ):
                    k = kn["v"]  # most keys: what decode() returns for them, without a call
                else:
                    k = decode(kn, leaf, where, path, depth + 1)
                    _check_hashable(k, "dict key", where, path)
                out[k] = decode(item[1], leaf, where, (*path, k), depth + 1)
            if "meta" in node and tag == "odict":
                out._metadata = decode(node["meta"], leaf, where, path, depth + 1)  # type: ignore[attr-defined]
            return out
        if tag == "stateful" and type(node.get("cls")) is str:
            return decode(v, leaf, where, path, depth + 1)
    except CorruptCheckpointError:
        raise
    except (ValueError, TypeError, OverflowError, RuntimeError, IndexError) as e:
        raise _bad(where, path, f"bad {tag!r} value ({e})") from None
    raise _bad(where, path, f"unknown or malformed node of type {tag!r}")


def _check_hashable(k: Any, what: str, where: str, path: tuple[Any, ...]) -> None:
    if isinstance(k, (torch.Tensor, np.ndarray, SparseRef, TensorRef)):
        raise _bad(where, path, f"{what} is a {type(k).__name__}")
    try:
        hash(k)
    except TypeError:
        raise _bad(where, path, f"{what} of unhashable type {type(k).__name__}") from None


def _npscalar(dtype: np.dtype, hexbytes: str, where: str, path: tuple[Any, ...]) -> np.generic:
    raw = bytes.fromhex(hexbytes)
    if len(raw) != dtype.itemsize:
        raise _bad(where, path, f"numpy {dtype} scalar of {len(raw)} bytes")
    if dtype == np.bool_ and raw not in (b"\x00", b"\x01"):
        raise _bad(where, path, f"numpy bool scalar with byte {raw!r}")
    value: np.generic = np.frombuffer(raw, dtype=dtype.newbyteorder("<")).astype(dtype)[0]
    return value


def _complex_tensor(node: dict[str, Any], t: Any, where: str, path: tuple[Any, ...]) -> Any:
    """View a stored real tensor (trailing dimension 2) back as the complex tensor it was."""
    name = node.get("complex")
    if name not in COMPLEX_DTYPES:
        raise _bad(where, path, f"unknown complex dtype {name!r}")
    if not isinstance(t, torch.Tensor):
        return t  # a tool's stand-in for the stored tensor
    real = TORCH_DTYPES[COMPLEX_DTYPES[name][1]]
    if t.dtype != real or t.dim() == 0 or t.shape[-1] != 2:
        raise _bad(
            where,
            path,
            f"a {name} tensor is stored as {t.dtype}{list(t.shape)}, not {real}[..., 2]",
        )
    return torch.view_as_complex(t)


class TensorView(NamedTuple):
    """Which elements of its stored tensor a view saved as such holds (``Tensor.as_strided``)."""

    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(frozen=True)
class TensorRef:
    """A tensor of a checkpoint's state, not read: what it loads as, and where its bytes are.

    ``tg.Checkpoint.tree()`` puts one in the place of each tensor and array; read its bytes
    with ``Checkpoint.read_into({ref.entry: buffer})``. Tied tensors and views of one tensor
    share an ``entry`` (the stored tensor, ``Checkpoint.tensors[entry]``).
    """

    entry: int  # the stored tensor holding the bytes (an index into Checkpoint.tensors)
    dtype: str  # as it loads, by its format name: "F32", "BF16", ... ("C64": complex)
    shape: tuple[int, ...]  # as it loads
    ndarray: bool  # loads as a numpy array (else a torch tensor)
    # The elements of the stored tensor this one is, for a view saved as such (in elements
    # of the stored tensor: a complex tensor is stored as its real view, trailing dim 2).
    view: TensorView | None = None

    @property
    def complex(self) -> bool:
        return self.dtype in COMPLEX_DTYPES

    @property
    def torch_dtype(self) -> torch.dtype:
        return COMPLEX_DTYPES[self.dtype][0] if self.complex else TORCH_DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.torch_dtype.itemsize


def loaded_as(
    node: dict[str, Any], stored_shape: tuple[int, ...], stored_dtype: str
) -> tuple[tuple[int, ...], str]:
    """The shape and dtype name a (checked) tensor node loads as, given its stored tensor's: a
    view's own shape; a complex tensor's, not its stored real view's (``[..., 2]``)."""
    view = node.get("view")
    shape = tuple(view["shape"]) if view else stored_shape
    if node.get("complex") in COMPLEX_DTYPES:
        return shape[:-1], node["complex"]
    return shape, stored_dtype


def tensor_ref(node: dict[str, Any], stored_shape: tuple[int, ...], stored_dtype: str) -> TensorRef:
    """The :class:`TensorRef` of a (checked) tensor node of a stored tensor's shape and dtype."""
    view = node.get("view")
    shape, dtype = loaded_as(node, stored_shape, stored_dtype)
    return TensorRef(
        node["e"],
        dtype,
        shape,
        node["t"] == "ndarray",
        TensorView(view["offset"], tuple(view["shape"]), tuple(view["stride"])) if view else None,
    )


@dataclass(frozen=True)
class SparseRef:
    """A sparse tensor of a checkpoint's state, not read: its layout, size and parts (each a
    :class:`TensorRef`, or whatever stand-in a tool decoded its parts to)."""

    layout: str
    size: tuple[int, ...]
    coalesced: bool | None
    parts: tuple[Any, ...]


def _sparse(node: dict[str, Any], parts: list[Any], where: str, path: tuple[Any, ...]) -> Any:
    layout, size, coalesced = node.get("layout"), node.get("size"), node.get("coalesced")
    if layout not in SPARSE_LAYOUTS:
        raise _bad(where, path, f"unknown sparse layout {layout!r}")
    torch_layout, names = SPARSE_LAYOUTS[layout]
    if (
        not isinstance(size, list)
        or len(size) > limits.MAX_DIMS
        or not all(type(n) is int and 0 <= n < 2**63 for n in size)
    ):
        raise _bad(where, path, f"sparse tensor size {size!r} is not a list of sizes")
    if (layout == "coo") != (type(coalesced) is bool):
        raise _bad(where, path, "only a sparse COO tensor records (and must record) coalesced")
    if len(parts) != len(names) or any(x.get("t") != "tensor" for x in node["v"]):
        raise _bad(where, path, f"a sparse {layout} tensor has {', '.join(names)}")
    if not all(isinstance(p, torch.Tensor) for p in parts):
        return SparseRef(layout, tuple(size), coalesced, tuple(parts))
    problem = sparse_problem(
        layout, size, [(tuple(p.shape), DTYPE_NAMES.get(p.dtype, str(p.dtype))) for p in parts]
    )
    if problem is not None:
        raise _bad(where, path, f"a sparse {layout} tensor whose {problem}")
    # Stand-ins (meta tensors) hold no values to check; real parts come from an untrusted file,
    # and an index out of bounds would make later sparse kernels read out of bounds: check.
    check = not any(p.is_meta for p in parts)
    if layout == "coo":
        return torch.sparse_coo_tensor(
            parts[0], parts[1], size, is_coalesced=coalesced, check_invariants=check
        )
    return torch.sparse_compressed_tensor(
        parts[0], parts[1], parts[2], size, layout=torch_layout, check_invariants=check
    )
