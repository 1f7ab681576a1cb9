"""Bytes per element of each dtype the format holds, by safetensors name, without torch.

The manifest parser and the CLI's manifest-only commands need the sizes but not torch (whose
import takes a second or more); ``dtypes`` re-exports this table and a test checks it against
torch's own element sizes.
"""

from __future__ import annotations

__all__ = [
    "ITEMSIZE",
]

ITEMSIZE: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "I16": 2,
    "U16": 2,
    "I32": 4,
    "U32": 4,
    "I64": 8,
    "U64": 8,
    "F16": 2,
    "BF16": 2,
    "F32": 4,
    "F64": 8,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
