"""Strict JSON for untrusted headers: UTF-8 only, no duplicate keys, no NaN, bounded depth."""

from __future__ import annotations

import gc
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import CorruptCheckpointError, InsufficientMemoryError
from . import limits

__all__ = [
    "check_parse_cost",
    "dumps",
    "gc_paused",
    "loads_strict",
    "parse_cost",
]


@contextmanager
def gc_paused() -> Iterator[None]:
    """Keep the cycle collector out while building millions of acyclic containers.

    Each collection it starts during a big parse walks every object the process holds (the
    parse's own included), which made a 10 MB manifest take twice as long to read.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


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


# A colon can be escaped in a JSON string only as \u003a / \u003A.
_ESCAPED_COLON = re.compile(rb"\\u003[aA]")


def loads_strict(raw: bytes, where: str) -> Any:
    """Parse untrusted JSON bytes, raising CorruptCheckpointError that names ``where``."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorruptCheckpointError(
            f"{where}: header is not valid UTF-8 ({e}); the file is damaged. "
            "Delete this checkpoint or restore it from a backup."
        ) from None
    check_parse_cost(raw, where)
    try:
        with gc_paused():
            doc = json.loads(text, parse_constant=_reject_constant)
            dup = _may_have_duplicates(raw, doc)
        if dup:
            # Parse again, pair by pair, to name the duplicate key.
            doc = json.loads(
                text, object_pairs_hook=_no_duplicates(where), parse_constant=_reject_constant
            )
        return doc
    except MemoryError:
        raise InsufficientMemoryError(
            f"{where}: ran out of memory parsing {len(raw)} bytes of JSON. Free memory (or "
            "raise this process's memory limit) and load again."
        ) from None
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


def parse_cost(raw: bytes) -> int:
    """An upper estimate of the bytes of Python objects ``json.loads(raw)`` builds (counting
    ',' ':' '{' '[' inside strings too, which only errs high)."""
    return (
        256 * raw.count(b"{")
        + 96 * raw.count(b"[")
        + 48 * (raw.count(b",") + raw.count(b":"))
        + 3 * len(raw)  # the decoded text, the re-encoding that checks for duplicates
    )


def check_parse_cost(raw: bytes, where: str) -> None:
    """Refuse JSON whose parse would build far more memory than its size (checked unparsed).

    Readers run it before parsing a header or manifest; a writer runs it on the manifest it is
    about to commit, so nothing is committed that a reader would refuse.
    """
    cost = parse_cost(raw)
    if cost > limits.PARSE_AMPLIFICATION * len(raw) and cost > limits.MAX_PARSE_BYTES:
        raise CorruptCheckpointError(
            f"{where}: {len(raw)} bytes of JSON so dense in objects and lists that parsing them "
            f"would take about {cost >> 20} MiB (over {limits.PARSE_AMPLIFICATION}x their size "
            f"and over {limits.MAX_PARSE_BYTES >> 20} MiB); no checkpoint writer makes such a "
            "file. Refusing to parse it; delete this checkpoint or restore it from a backup."
        )


def _may_have_duplicates(raw: bytes, doc: Any) -> bool:
    """True unless every key of ``raw`` survived into ``doc`` (a duplicate silently wins).

    Python's JSON parser keeps the last of two equal keys. Handing it a hook that sees every
    pair (``object_pairs_hook``) takes it off its fast path (twice the time and memory on a
    big manifest), so count instead: each key is followed by one ':' and ':' is never escaped
    elsewhere, so the document re-encoded holds as many ':' as ``raw`` exactly when no pair was
    dropped. An escaped colon (``\\u003a``) in a string would skew the count: parse pair by
    pair then.
    """
    if _ESCAPED_COLON.search(raw):
        return True
    again = json.dumps(doc, separators=(",", ":"), check_circular=False)
    return again.count(":") != raw.count(b":")


def dumps(obj: Any) -> bytes:
    """Compact, deterministic JSON (NaN is never written: floats are encoded as hex strings)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
