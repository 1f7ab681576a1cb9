"""The dtypes the format can hold, by their safetensors names."""

from __future__ import annotations

import numpy as np
import torch

from .sizes import ITEMSIZE as ITEMSIZE  # re-exported: torch-free for the manifest

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

# numpy arrays are stored with the same names; these are the numpy dtypes we accept.
NUMPY_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "I16": np.dtype(np.int16),
    "U16": np.dtype(np.uint16),
    "I32": np.dtype(np.int32),
    "U32": np.dtype(np.uint32),
    "I64": np.dtype(np.int64),
    "U64": np.dtype(np.uint64),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
}
NUMPY_NAMES: dict[np.dtype, str] = {v: k for k, v in NUMPY_DTYPES.items()}

# Complex tensors are stored as their real view (torch.view_as_real: a trailing dimension of 2,
# real and imaginary parts) under the real dtype a safetensors file holds; the tree records the
# complex name so the load gives back the complex tensor. name -> (complex dtype, stored name).
COMPLEX_DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "C32": (torch.complex32, "F16"),
    "C64": (torch.complex64, "F32"),
    "C128": (torch.complex128, "F64"),
}
COMPLEX_NAMES: dict[torch.dtype, str] = {v[0]: k for k, v in COMPLEX_DTYPES.items()}

# NumPy scalars (np.float32(1.5), np.int64(5), np.bool_) keep their exact type and bits.
NUMPY_SCALAR_DTYPES: dict[str, np.dtype] = {
    **NUMPY_DTYPES,
    "C64": np.dtype(np.complex64),
    "C128": np.dtype(np.complex128),
}
NUMPY_SCALAR_NAMES: dict[np.dtype, str] = {v: k for k, v in NUMPY_SCALAR_DTYPES.items()}
