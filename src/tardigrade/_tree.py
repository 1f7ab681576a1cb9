"""State trees: flatten live state into a JSON skeleton plus tensor entries, and back.

The skeleton is what ``manifest.json`` stores under ``"tree"``. Every node is a small dict with
a type tag ``"t"``, so each Python type round-trips exactly (tuple stays tuple, int stays int,
``-0.0`` and NaN survive). Tensors and arrays appear as references into the manifest's tensor
table; tensors that share storage are written once and come back sharing.
"""

from __future__ import annotations

import base64
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from .errors import CorruptCheckpointError, UnsupportedTypeError
from .format import limits
from .format.dtypes import DTYPE_NAMES, NUMPY_DTYPES, NUMPY_NAMES, TORCH_DTYPES


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


def tensor_dtype_name(t: torch.Tensor, path: tuple[Any, ...]) -> str:
    name = DTYPE_NAMES.get(t.dtype)
    if name is None:
        raise UnsupportedTypeError(
            f"{path_str(path)}: tensor dtype {t.dtype} cannot be stored (supported: "
            f"{', '.join(str(d) for d in TORCH_DTYPES.values())}). Convert it before saving, "
            "e.g. torch.view_as_real() for complex tensors."
        )
    if t.layout != torch.strided or t.is_quantized or t.is_meta:
        raise UnsupportedTypeError(
            f"{path_str(path)}: only dense tensors can be stored, got layout {t.layout}"
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


@dataclass
class Flat:
    tree: dict[str, Any]
    entries: list[Entry]


class _Flattener:
    def __init__(self) -> None:
        self.entries: list[Entry] = []
        # storage key -> [(view signature, node)] for dedup of tensors that share memory
        self.by_storage: dict[tuple[str, int], list[tuple[tuple[Any, ...], dict[str, Any]]]] = {}
        self.nodes = 0
        self.seen: set[int] = set()
        self.refs: list[dict[str, Any]] = []  # every node that refers to an entry

    def node(self, obj: Any, path: tuple[Any, ...], depth: int = 0) -> dict[str, Any]:
        self.nodes += 1
        if depth > limits.MAX_TREE_DEPTH:
            raise UnsupportedTypeError(
                f"{path_str(path)}: state is nested more than {limits.MAX_TREE_DEPTH} levels deep"
            )
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
            if obj != obj:  # NaN: keep sign and payload bits, which float.hex() drops
                return {"t": "float", "bits": struct.pack(">d", obj).hex()}
            return {"t": "float", "v": obj.hex()}
        if t is str:
            return {"t": "str", "v": obj}
        if t is bytes:
            return {"t": "bytes", "v": base64.b64encode(obj).decode()}
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj, path)
        if t is np.ndarray:
            return self.ndarray(obj, path)
        if isinstance(obj, torch.dtype):
            return {"t": "dtype", "v": str(obj).removeprefix("torch.")}
        if t in (list, tuple):
            return self.container(obj, path, depth, "list" if t is list else "tuple")
        if t in (dict, OrderedDict):
            return self.mapping(obj, path, depth)
        if is_stateful(obj):
            if id(obj) in self.seen:
                raise UnsupportedTypeError(
                    f"{path_str(path)}: the same {t.__name__} object appears twice in the state; "
                    "include each stateful object once."
                )
            self.seen.add(id(obj))
            sd = obj.state_dict()
            cls = f"{t.__module__}.{t.__qualname__}"
            return {"t": "stateful", "cls": cls, "v": self.node(sd, path, depth + 1)}
        hint = ""
        if isinstance(obj, (int, float, str, bytes, np.generic)):
            hint = " Convert it to the plain Python type first (e.g. int(x), float(x), str(x))."
        raise UnsupportedTypeError(
            f"{path_str(path)}: cannot store a value of type {t.__module__}.{t.__qualname__}. "
            "Supported leaves: tensors, numpy arrays, int, float, bool, str, bytes, None, "
            "torch.dtype, lists/tuples/dicts of those, and objects with state_dict()/"
            f"load_state_dict().{hint}"
        )

    def container(self, obj: Any, path: tuple[Any, ...], depth: int, tag: str) -> dict[str, Any]:
        return {"t": tag, "v": [self.node(v, (*path, i), depth + 1) for i, v in enumerate(obj)]}

    def mapping(self, obj: Any, path: tuple[Any, ...], depth: int) -> dict[str, Any]:
        items = []
        for k, v in obj.items():
            if (
                type(k) not in (str, int, bool, float, bytes)
                and k is not None
                and type(k) is not tuple
            ):
                raise UnsupportedTypeError(
                    f"{path_str(path)}: dict key {k!r} of type {type(k).__name__} cannot be "
                    "stored; use str, int, float, bool, bytes, None or tuples of those."
                )
            items.append([self.node(k, (*path, k), depth + 1), self.node(v, (*path, k), depth + 1)])
        node: dict[str, Any] = {"t": "dict" if type(obj) is dict else "odict", "v": items}
        meta = getattr(obj, "_metadata", None)
        if isinstance(meta, dict):
            # nn.Module state_dicts carry per-submodule versions load_state_dict relies on.
            node["meta"] = self.node(dict(meta), (*path, "_metadata"), depth + 1)
        return node

    def tensor(self, t: torch.Tensor, path: tuple[Any, ...]) -> dict[str, Any]:
        name = tensor_dtype_name(t, path)
        t = t.detach()
        node: dict[str, Any] = {"t": "tensor"}
        self.refs.append(node)
        if t.numel() == 0:
            node["e"] = self.new_entry(t, name, path)
            return node
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        sig = (t.dtype, t.storage_offset(), tuple(t.shape), t.stride())
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
        """Views that overlap one storage but differ in shape/offset: store the span once."""
        moved: dict[int, tuple[int, dict[str, Any]]] = {}  # old entry -> (span entry, view)
        for group in self.by_storage.values():
            if len(group) < 2 or len({sig[0] for sig, _ in group}) != 1:
                continue  # reinterpreting views (other dtypes) are saved by value each
            lo = min(sig[1] for sig, _ in group)
            hi = max(
                sig[1] + sum((n - 1) * s for n, s in zip(sig[2], sig[3], strict=True)) + 1
                for sig, _ in group
            )
            first = self.entries[group[0][1]["e"]]
            span = Entry(first.tensor.as_strided((hi - lo,), (1,), lo), first.dtype, [])
            self.entries.append(span)
            for sig, node in group:
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


def flatten(state: Any, root: tuple[Any, ...] = ()) -> Flat:
    """Encode ``state`` into a skeleton and the tensors to write. Raises UnsupportedTypeError."""
    f = _Flattener()
    tree = f.node(state, root)
    f.merge_partial_aliases()
    return Flat(tree, f.entries)


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

    Stateful nodes decode to their state_dict tree. Every malformed node raises
    CorruptCheckpointError naming ``where`` and the path.
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
        if tag in ("tensor", "ndarray"):
            return leaf(node, path)
        if tag in ("list", "tuple") and type(v) is list:
            items = [decode(x, leaf, where, (*path, i), depth + 1) for i, x in enumerate(v)]
            return items if tag == "list" else tuple(items)
        if tag in ("dict", "odict") and type(v) is list:
            out: dict[Any, Any] = {} if tag == "dict" else OrderedDict()
            for item in v:
                if type(item) is not list or len(item) != 2:
                    raise _bad(where, path, "dict item is not a [key, value] pair")
                k = decode(item[0], leaf, where, path, depth + 1)
                if type(k) in (list, dict, OrderedDict) or isinstance(
                    k, (torch.Tensor, np.ndarray)
                ):
                    raise _bad(where, path, f"dict key of unhashable type {type(k).__name__}")
                out[k] = decode(item[1], leaf, where, (*path, k), depth + 1)
            if "meta" in node and tag == "odict":
                out._metadata = decode(node["meta"], leaf, where, path, depth + 1)  # type: ignore[attr-defined]
            return out
        if tag == "stateful" and type(node.get("cls")) is str:
            return decode(v, leaf, where, path, depth + 1)
    except CorruptCheckpointError:
        raise
    except (ValueError, TypeError, OverflowError) as e:
        raise _bad(where, path, f"bad {tag!r} value ({e})") from None
    raise _bad(where, path, f"unknown or malformed node of type {tag!r}")
