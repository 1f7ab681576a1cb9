"""Strict JSON for untrusted headers: UTF-8 only, no duplicate keys, no NaN, bounded depth."""

from __future__ import annotations

import json
from typing import Any

from ..errors import CorruptCheckpointError


def _no_duplicates(where: str):
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(pairs)
        if len(out) == len(pairs):  # the common case, at C speed
            return out
        out = {}
        for k, v in pairs:
            if k in out:
                raise CorruptCheckpointError(
                    f"{where}: duplicate JSON key {k!r}; the file was tampered with or "
                    "damaged. Restore it from a backup or delete this checkpoint."
                )
            out[k] = v
        return out

    return hook


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def loads_strict(raw: bytes, where: str) -> Any:
    """Parse untrusted JSON bytes, raising CorruptCheckpointError that names ``where``."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorruptCheckpointError(
            f"{where}: header is not valid UTF-8 ({e}); the file is damaged. "
            "Delete this checkpoint or restore it from a backup."
        ) from None
    try:
        return json.loads(
            text, object_pairs_hook=_no_duplicates(where), parse_constant=_reject_constant
        )
    except RecursionError:
        raise CorruptCheckpointError(
            f"{where}: JSON is nested too deeply to be a checkpoint header; refusing to parse it."
        ) from None
    except CorruptCheckpointError:
        raise
    except ValueError as e:
        raise CorruptCheckpointError(
            f"{where}: header is not valid JSON ({e}); the file is damaged or truncated. "
            "Delete this checkpoint or restore it from a backup."
        ) from None


def dumps(obj: Any) -> bytes:
    """Compact, deterministic JSON (NaN is never written: floats are encoded as hex strings)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
