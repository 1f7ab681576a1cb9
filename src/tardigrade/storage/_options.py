"""What every backend's ``storage_options`` share: the gc grace period, and which keys may
hold a secret (their values are never echoed in a message)."""

from __future__ import annotations

from typing import Any

from ..errors import InvalidArgumentError

# Words that mark an option (or a command-line pair) as possibly secret: access keys, tokens,
# passwords, SAS signatures, connection strings.
_SECRET_WORDS = ("secret", "token", "password", "passwd", "key", "credential", "auth", "sas",
                 "signature", "connection_string")  # fmt: skip


def secret_option(text: str) -> bool:
    """Whether an option named ``text`` (or text holding one) may carry a secret."""
    lowered = text.lower()
    return any(word in lowered for word in _SECRET_WORDS)


def shown(key: str, value: Any) -> str:
    """``value`` of option ``key`` as a message may show it: a secret's is withheld."""
    return "(a value, not shown)" if secret_option(key) else repr(value)


def grace_seconds(root: str, value: Any) -> float:
    """Storage option ``gc_grace_seconds``: seconds >= 0 (text of a number too: the CLI gives
    text), else an error naming the root and the option."""
    try:
        seconds = float(value) if not isinstance(value, bool) else -1.0
    except (TypeError, ValueError):
        seconds = -1.0
    if not 0 <= seconds <= 10**9:
        raise InvalidArgumentError(
            f"{root}: storage option gc_grace_seconds={value!r}: give a number of seconds >= 0 "
            "(e.g. gc_grace_seconds=3600)"
        )
    return seconds
