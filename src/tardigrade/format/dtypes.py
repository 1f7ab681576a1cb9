"""The dtypes the format can hold, by their safetensors names."""

from __future__ import annotations

import torch

from .names import COMPLEX_STORED as COMPLEX_STORED  # re-exported from the torch-free names
from .names import NUMPY_DTYPES as NUMPY_DTYPES
from .names import NUMPY_NAMES as NUMPY_NAMES
from .names import NUMPY_SCALAR_DTYPES as NUMPY_SCALAR_DTYPES
from .names import NUMPY_SCALAR_NAMES as NUMPY_SCALAR_NAMES
from .sizes import ITEMSIZE as ITEMSIZE  # re-exported: torch-free for the manifest

__all__ = [
    "COMPLEX_DTYPES",
    "COMPLEX_NAMES",
    "DTYPE_NAMES",
    "ITEMSIZE",
    "NUMPY_DTYPES",
    "NUMPY_NAMES",
    "NUMPY_SCALAR_DTYPES",
    "NUMPY_SCALAR_NAMES",
    "TORCH_DTYPES",
]

# safetensors name -> torch dtype. Order matters only for readability.
TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}


# Complex tensors are stored as their real view (torch.view_as_real: a trailing dimension of 2,
# real and imaginary parts) under the real dtype a safetensors file holds; the tree records the
# complex name so the load gives back the complex tensor. name -> (complex dtype, stored name).
COMPLEX_DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "C32": (torch.complex32, COMPLEX_STORED["C32"]),
    "C64": (torch.complex64, COMPLEX_STORED["C64"]),
    "C128": (torch.complex128, COMPLEX_STORED["C128"]),
}
COMPLEX_NAMES: dict[torch.dtype, str] = {v[0]: k for k, v in COMPLEX_DTYPES.items()}
