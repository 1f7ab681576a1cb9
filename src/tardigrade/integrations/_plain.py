"""Framework checkpoint dicts as trees Tardigrade stores: no pickle, nothing guessed.

Frameworks put a few dict subclasses into their checkpoints (Lightning's ``AttributeDict`` of
hyperparameters); those become plain dicts, which is what the framework reads back. Values of
other types are stored only where the format knows them; under a key that holds the user's own
hyperparameters an unknown value is refused, naming the key, unless the caller opted in to
storing its ``str()``.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..errors import InvalidArgumentError, UnsupportedTypeError
from ..format.tree import path_str


def _stateful(obj: object) -> bool:
    """Saved through its own ``state_dict()`` (``tg.Stateful``, whose methods are callable)."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


_LEAVES = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    torch.Tensor,
    np.ndarray,
    np.generic,
    torch.dtype,
    torch.device,
    torch.Size,
    torch.Generator,
)

UNKNOWN_CHOICES = ("error", "str")


def check_unknown(value: str) -> str:
    if value not in UNKNOWN_CHOICES:
        raise InvalidArgumentError(
            f"unknown_hparams={value!r}: expected 'error' (refuse a value of a type the format "
            "cannot store) or 'str' (store its str())"
        )
    return value


def storable(obj: Any, unknown: str, *, free_keys: tuple[str, ...]) -> Any:
    """``obj`` with dict subclasses made dicts; under ``free_keys`` (top-level keys holding
    user values) unknown leaves are refused (``unknown="error"``) or stored as ``str()``."""
    if not isinstance(obj, Mapping):
        return _walk(obj, (), unknown=None)
    return {k: _walk(v, (k,), unknown=unknown if k in free_keys else None) for k, v in obj.items()}


def _walk(obj: Any, path: tuple[Any, ...], unknown: str | None, depth: int = 0) -> Any:
    t = type(obj)
    if t in (OrderedDict, Counter):
        return t((k, _walk(v, (*path, k), unknown, depth + 1)) for k, v in obj.items())
    if isinstance(obj, Mapping) and not _stateful(obj):
        return {k: _walk(v, (*path, k), unknown, depth + 1) for k, v in obj.items()}
    if t in (list, tuple):
        return t(_walk(v, (*path, i), unknown, depth + 1) for i, v in enumerate(obj))
    if unknown is None or t in _LEAVES or isinstance(obj, _LEAVES[7:]) or _stateful(obj):
        return obj  # tg.save stores it or names the path of what it cannot
    if t in (set, frozenset) and all(type(x) in _LEAVES for x in obj):
        return obj
    if unknown == "str":
        return str(obj)
    raise UnsupportedTypeError(
        f"{path_str(path)}: a hyperparameter of type {t.__module__}.{t.__qualname__} "
        f"({obj!r:.60}) has no checkpoint format; Tardigrade stores no pickle. Save it as a "
        "plain value (int, float, str, list, dict, tensor), leave it out with "
        "save_hyperparameters(ignore=[...]), or pass unknown_hparams='str' to store its str()."
    )
