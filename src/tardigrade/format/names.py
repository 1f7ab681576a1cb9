"""The format's dtype names that need no torch: numpy dtypes and the complex dtypes.

``dtypes`` re-exports these next to the torch dtypes; the manifest-only code paths (decoding
a state tree for ``tardigrade inspect``) take them from here so they do not import torch.
"""

from __future__ import annotations

import numpy as np

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
# complex name so the load gives back the complex tensor. complex name -> stored real name.
COMPLEX_STORED: dict[str, str] = {"C32": "F16", "C64": "F32", "C128": "F64"}

# NumPy scalars (np.float32(1.5), np.int64(5), np.bool_) keep their exact type and bits.
NUMPY_SCALAR_DTYPES: dict[str, np.dtype] = {
    **NUMPY_DTYPES,
    "C64": np.dtype(np.complex64),
    "C128": np.dtype(np.complex128),
}
NUMPY_SCALAR_NAMES: dict[np.dtype, str] = {v: k for k, v in NUMPY_SCALAR_DTYPES.items()}
