"""The format's dtype names that need no torch: numpy dtypes and the complex dtypes.

``dtypes`` re-exports these next to the torch dtypes; the manifest-only code paths (decoding
a state tree for ``tardigrade inspect``) take them from here so they do not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "COMPLEX_STORED",
    "NUMPY_DTYPES",
    "NUMPY_NAMES",
    "NUMPY_SCALAR_DTYPES",
    "NUMPY_SCALAR_DTYPE_NAMES",
    "NUMPY_SCALAR_NAMES",
]

# Complex tensors are stored as their real view (torch.view_as_real: a trailing dimension of 2,
# real and imaginary parts) under the real dtype a safetensors file holds; the tree records the
# complex name so the load gives back the complex tensor. complex name -> stored real name.
COMPLEX_STORED: dict[str, str] = {"C32": "F16", "C64": "F32", "C128": "F64"}

# numpy arrays are stored with the same names; these are the numpy dtypes we accept. The numpy
# dtype objects are made on first use (module __getattr__ below): `tardigrade inspect` decodes
# a tree without importing numpy unless the tree holds a numpy scalar.
_NUMPY_TYPES = {
    "BOOL": "bool_", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16",
    "I32": "int32", "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16",
    "F32": "float32", "F64": "float64",
}  # fmt: skip
# NumPy scalars (np.float32(1.5), np.int64(5), np.bool_) keep their exact type and bits.
_NUMPY_SCALAR_TYPES = {**_NUMPY_TYPES, "C64": "complex64", "C128": "complex128"}
NUMPY_SCALAR_DTYPE_NAMES = frozenset(_NUMPY_SCALAR_TYPES)

NUMPY_DTYPES: dict[str, np.dtype]
NUMPY_NAMES: dict[np.dtype, str]
NUMPY_SCALAR_DTYPES: dict[str, np.dtype]
NUMPY_SCALAR_NAMES: dict[np.dtype, str]


def __getattr__(name: str) -> Any:
    if name not in ("NUMPY_DTYPES", "NUMPY_NAMES", "NUMPY_SCALAR_DTYPES", "NUMPY_SCALAR_NAMES"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import numpy as np

    dtypes = {k: np.dtype(getattr(np, v)) for k, v in _NUMPY_TYPES.items()}
    scalars = {k: np.dtype(getattr(np, v)) for k, v in _NUMPY_SCALAR_TYPES.items()}
    tables = {
        "NUMPY_DTYPES": dtypes,
        "NUMPY_NAMES": {v: k for k, v in dtypes.items()},
        "NUMPY_SCALAR_DTYPES": scalars,
        "NUMPY_SCALAR_NAMES": {v: k for k, v in scalars.items()},
    }
    globals().update(tables)  # the next access is a plain lookup
    return tables[name]
