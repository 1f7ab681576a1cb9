"""A manifest's state tree, decoded without torch.

The tree is untrusted input: :func:`decode` checks every node while it rebuilds the Python
values. It imports torch only to build torch values (a ``torch.dtype``, ``Size``, ``device``,
``Generator``, a complex or sparse tensor); with ``stand_ins=True`` those come back as
:class:`TorchValue` stand-ins instead, checked the same way, so the CLI's manifest-only
commands (``tardigrade inspect``) start without importing torch (a second or more). Encoding
(``tardigrade._tree.flatten``) needs torch and lives in the library, which re-exports these.
"""

from __future__ import annotations

import array
import base64
import math
import struct
import sys
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from ..errors import CorruptCheckpointError
from . import limits, names
from .names import COMPLEX_STORED, NUMPY_SCALAR_DTYPE_NAMES
from .sizes import ITEMSIZE
from .sparse import SPARSE_PARTS, sparse_problem

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = [
    "DEVICE_TYPES",
    "PACKED_DTYPES",
    "SparseRef",
    "TensorRef",
    "TensorView",
    "decode",
    "float_node",
    "loaded_as",
    "path_str",
    "tensor_ref",
]

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


def path_str(path: tuple[Any, ...]) -> str:
    """``('optim', 'param_groups', 0)`` -> ``state['optim']['param_groups'][0]``."""
    return "state" + "".join(f"[{p!r}]" for p in path)


def float_node(x: float) -> dict[str, Any]:
    if x != x:  # NaN: keep sign and payload bits, which float.hex() drops
        return {"t": "float", "bits": struct.pack(">d", x).hex()}
    return {"t": "float", "v": x.hex()}


# A packed list's items: little-endian int64 or float64 (numpy's dtype strings, for the writer;
# the reader decodes them with the array module, so inspect needs no numpy).
PACKED_DTYPES = {"i8": "<i8", "f8": "<f8"}
_PACKED_ARRAY = {"i8": "q", "f8": "d"}


def _unpacked(
    node: dict[str, Any], where: str, path: tuple[Any, ...]
) -> list[Any] | tuple[Any, ...]:
    code = _PACKED_ARRAY.get(str(node.get("of")))
    if code is None or node.get("as") not in ("list", "tuple") or type(node.get("v")) is not str:
        raise _bad(where, path, "malformed packed list")
    raw = base64.b64decode(node["v"], validate=True)
    if len(raw) % 8:
        raise _bad(where, path, f"packed {node['of']} list of {len(raw)} bytes")
    values = array.array(code)
    values.frombytes(raw)
    if sys.byteorder == "big":
        values.byteswap()
    items = values.tolist()
    return items if node["as"] == "list" else tuple(items)


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
_DTYPE_LEAVES: dict[str, Any] = {}  # name -> torch.dtype, filled when torch is first needed


def _torch() -> Any:
    """torch, imported on first need (a tree of plain values, or stand-ins, needs none)."""
    import torch

    if not _DTYPE_LEAVES:
        _DTYPE_LEAVES.update(
            (str(d).removeprefix("torch."), d)
            for d in (torch.__dict__.get(n) for n in _DTYPE_NAMES)  # older torch lacks a few
            if isinstance(d, torch.dtype)
        )
    return torch


def _is_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")  # not imported: x cannot be a tensor
    return torch is not None and isinstance(x, torch.Tensor)


@dataclass(frozen=True)
class TorchValue:
    """A torch value of a state tree (a dtype, Size, device or Generator) decoded with
    ``stand_ins=True``: its kind and the text torch's ``repr`` gives the value."""

    kind: str  # "dtype", "size", "device" or "generator"
    text: str

    def __repr__(self) -> str:
        return self.text


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
    *,
    stand_ins: bool = False,
) -> Any:
    """Rebuild Python values from a skeleton; ``leaf(node, path)`` supplies tensors and arrays.

    Stateful nodes decode to their state_dict tree. Complex tensors are viewed back as complex
    and sparse tensors rebuilt from their parts when ``leaf`` returns tensors (a sparse node
    whose parts are anything else decodes to a :class:`SparseRef`). Every malformed node
    raises CorruptCheckpointError naming ``where`` and the path. With ``stand_ins``, torch
    values decode to :class:`TorchValue` (checked alike) and torch is not imported.
    """
    return _decode(node, leaf, where, path, depth, stand_ins)


def _decode(
    node: Any,
    leaf: Callable[[dict[str, Any], tuple[Any, ...]], Any],
    where: str,
    path: tuple[Any, ...],
    depth: int,
    stand_ins: bool,
) -> Any:
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
        if tag == "dtype" and type(v) is str and v in _DTYPE_NAMES:
            if stand_ins:
                return TorchValue("dtype", f"torch.{v}")
            _torch()  # fills _DTYPE_LEAVES
            if v in _DTYPE_LEAVES:
                return _DTYPE_LEAVES[v]
        if tag == "tensor" and "complex" in node:
            return _complex_tensor(node, leaf(node, path), where, path)
        if tag in ("tensor", "ndarray"):
            return leaf(node, path)
        if tag == "sparse" and type(v) is list:
            return _sparse(
                node, [_decode(x, leaf, where, path, depth + 1, stand_ins) for x in v], where, path
            )
        if tag == "complex" and type(v) is list and len(v) == 2:
            re, im = (_decode(x, leaf, where, path, depth + 1, stand_ins) for x in v)
            if type(re) is not float or type(im) is not float:
                raise _bad(where, path, "complex parts are not floats")
            return complex(re, im)  # keeps -0.0 and NaN payloads of both parts
        if tag == "npscalar" and type(v) is str and node.get("dtype") in NUMPY_SCALAR_DTYPE_NAMES:
            return _npscalar(names.NUMPY_SCALAR_DTYPES[node["dtype"]], v, where, path)
        if tag == "size" and type(v) is list and all(type(n) is int for n in v):
            if stand_ins:
                return TorchValue("size", f"torch.Size({v})")
            return _torch().Size(v)
        if tag == "device" and node.get("type") in DEVICE_TYPES:
            index = node.get("index")
            if index is None:
                if stand_ins:
                    return TorchValue("device", f"device(type={node['type']!r})")
                return _torch().device(node["type"])
            if type(index) is int and 0 <= index < 2**15:
                if stand_ins:
                    return TorchValue("device", f"device(type={node['type']!r}, index={index})")
                return _torch().device(node["type"], index)
        if tag == "generator" and type(v) is str:
            device = _decode(node.get("device"), leaf, where, path, depth + 1, stand_ins)
            if stand_ins:
                if not (isinstance(device, TorchValue) and device.kind == "device"):
                    raise _bad(where, path, "a generator's device is not a device")
                base64.b64decode(v, validate=True)
                return TorchValue("generator", f"torch.Generator({device!r})")
            torch = _torch()
            if type(device) is not torch.device:
                raise _bad(where, path, "a generator's device is not a device")
            raw = base64.b64decode(v, validate=True)
            g = torch.Generator(device=device)
            g.set_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
            return g
        if tag in ("set", "frozenset") and type(v) is list:
            items = [_decode(x, leaf, where, path, depth + 1, stand_ins) for x in v]
            for x in items:
                _check_hashable(x, "set element", where, path)
            return set(items) if tag == "set" else frozenset(items)
        if tag == "packed":
            return _unpacked(node, where, path)
        if tag in ("list", "tuple") and type(v) is list:
            items = [
                _decode(x, leaf, where, (*path, i), depth + 1, stand_ins) for i, x in enumerate(v)
            ]
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
                    k = kn["v"]  # most keys: what _decode() returns for them, without a call
                else:
                    k = _decode(kn, leaf, where, path, depth + 1, stand_ins)
                    _check_hashable(k, "dict key", where, path)
                out[k] = _decode(item[1], leaf, where, (*path, k), depth + 1, stand_ins)
            if "meta" in node and tag == "odict":
                meta = _decode(node["meta"], leaf, where, path, depth + 1, stand_ins)
                out._metadata = meta  # type: ignore[attr-defined]  # an OrderedDict's state_dict metadata, as torch sets it
            return out
        if tag == "stateful" and type(node.get("cls")) is str:
            return _decode(v, leaf, where, path, depth + 1, stand_ins)
    except CorruptCheckpointError:
        raise
    except (ValueError, TypeError, OverflowError, RuntimeError, IndexError) as e:
        raise _bad(where, path, f"bad {tag!r} value ({e})") from None
    raise _bad(where, path, f"unknown or malformed node of type {tag!r}")


def _check_hashable(k: Any, what: str, where: str, path: tuple[Any, ...]) -> None:
    numpy = sys.modules.get("numpy")  # no numpy loaded: no array can be here
    is_array = numpy is not None and isinstance(k, numpy.ndarray)
    if is_array or isinstance(k, (SparseRef, TensorRef)) or _is_tensor(k):
        raise _bad(where, path, f"{what} is a {type(k).__name__}")
    try:
        hash(k)
    except TypeError:
        raise _bad(where, path, f"{what} of unhashable type {type(k).__name__}") from None


def _npscalar(dtype: np.dtype, hexbytes: str, where: str, path: tuple[Any, ...]) -> np.generic:
    import numpy as np

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
    if name not in COMPLEX_STORED:
        raise _bad(where, path, f"unknown complex dtype {name!r}")
    if not _is_tensor(t):
        return t  # a tool's stand-in for the stored tensor
    from .dtypes import TORCH_DTYPES

    torch = _torch()
    real = TORCH_DTYPES[COMPLEX_STORED[name]]
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
        return self.dtype in COMPLEX_STORED

    @property
    def torch_dtype(self) -> torch.dtype:
        from .dtypes import COMPLEX_DTYPES, TORCH_DTYPES

        return COMPLEX_DTYPES[self.dtype][0] if self.complex else TORCH_DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        if self.complex:  # real and imaginary parts
            return math.prod(self.shape) * 2 * ITEMSIZE[COMPLEX_STORED[self.dtype]]
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


def loaded_as(
    node: dict[str, Any], stored_shape: tuple[int, ...], stored_dtype: str
) -> tuple[tuple[int, ...], str]:
    """The shape and dtype name a (checked) tensor node loads as, given its stored tensor's: a
    view's own shape; a complex tensor's, not its stored real view's (``[..., 2]``)."""
    view = node.get("view")
    shape = tuple(view["shape"]) if view else stored_shape
    if node.get("complex") in COMPLEX_STORED:
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
    if layout not in SPARSE_PARTS:
        raise _bad(where, path, f"unknown sparse layout {layout!r}")
    names = SPARSE_PARTS[layout]
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
    if not all(_is_tensor(p) for p in parts):
        return SparseRef(layout, tuple(size), coalesced, tuple(parts))
    from .dtypes import DTYPE_NAMES

    torch = _torch()
    torch_layout = getattr(torch, f"sparse_{layout}")  # layout is one of SPARSE_PARTS' keys
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
