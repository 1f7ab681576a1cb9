"""The manager's arguments, checked where they are given: each refusal names the argument."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .._catalog import Catalog
from ..errors import InvalidArgumentError
from ..format.manifest import MANIFEST
from ._policy import SavePolicy
from ._retention import Retention


def check_directory(v: Any) -> str | os.PathLike[str]:
    if not isinstance(v, (str, os.PathLike)):
        raise InvalidArgumentError(f"directory must be a path or URL, got {v!r}")
    return v


def check_run_directory(catalog: Catalog) -> Catalog:
    """``catalog``, unless its root is one checkpoint (a manager's saves would nest in it)."""
    if catalog.storage.exists(MANIFEST):
        parent = os.path.dirname(catalog.root.rstrip("/"))
        raise InvalidArgumentError(
            f"{catalog.root}: this is one checkpoint (it holds {MANIFEST}), not a directory of "
            f"checkpoints; give the manager its parent directory (the run's), e.g. "
            f"CheckpointManager({parent!r}, ...)"
        )
    return catalog


def check_positive(name: str, v: Any, kind: type = int) -> Any:
    """``v`` if it is a positive ``kind`` (an int also passes for a float) or None."""
    if v is None:
        return None
    ok = (type(v) is int or (kind is float and type(v) is float)) and v > 0
    if not ok:
        raise InvalidArgumentError(f"{name} must be a positive {kind.__name__} or None, got {v!r}")
    return v


def check_non_negative(name: str, v: Any) -> float | None:
    """``v`` if it is a number of seconds >= 0, or None."""
    if v is None:
        return None
    if type(v) not in (int, float) or not 0 <= v < float("inf"):
        raise InvalidArgumentError(f"{name} must be a number of seconds >= 0 or None, got {v!r}")
    return float(v)


def check_count(name: str, v: Any) -> int:
    """``v`` if it is an int >= 0 (a count, such as ``peer_replicas``)."""
    if type(v) is not int or v < 0:
        raise InvalidArgumentError(f"{name} must be an int >= 0, got {v!r}")
    return v


def check_one_of(name: str, v: Any, choices: tuple[str, ...]) -> str:
    if v not in choices:
        allowed = " or ".join(repr(c) for c in choices)
        raise InvalidArgumentError(f"{name} must be {allowed}, got {v!r}")
    return v


def check_flag(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise InvalidArgumentError(f"{name} must be a bool, got {v!r}")
    return v


def check_best_metric(keep_best: int | None, metric: Any) -> str | None:
    """The metric ``keep_best`` ranks by; required with it."""
    if keep_best is not None and not isinstance(metric, str):
        raise InvalidArgumentError("keep_best needs best_metric: the metric name to rank by")
    return metric


def check_signals(signals: Iterable[int]) -> tuple[int, ...]:
    """``save_on_signals`` as a tuple, each a signal a handler can catch."""
    try:
        out = tuple(signals)
    except TypeError:
        raise InvalidArgumentError(
            f"save_on_signals must be a tuple of signals, got {signals!r}"
        ) from None
    valid = signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}
    for sig in out:
        if sig not in valid:
            raise InvalidArgumentError(
                f"save_on_signals: {sig!r} is not a signal that can be caught (SIGKILL and "
                "SIGSTOP cannot be)"
            )
    return out


def check_step(v: Any) -> int:
    if type(v) is not int or v < 0:
        raise InvalidArgumentError(f"step must be a non-negative int, got {v!r}")
    return v


def check_policy(every_steps: Any, every_epochs: Any, every_seconds: Any) -> SavePolicy:
    """The save policy of the manager's ``every_*`` arguments."""
    return SavePolicy(
        every_steps=check_positive("every_steps", every_steps),
        every_epochs=check_positive("every_epochs", every_epochs),
        every_seconds=check_positive("every_seconds", every_seconds, float),
    )


def check_retention(
    keep_last: Any, keep_every_steps: Any, keep_best: Any, best_metric: Any, best_mode: Any
) -> Retention:
    """The retention policy of the manager's ``keep_*`` and ``best_*`` arguments."""
    return Retention(
        keep_last=check_positive("keep_last", keep_last),
        keep_every_steps=check_positive("keep_every_steps", keep_every_steps),
        keep_best=check_positive("keep_best", keep_best),
        best_mode=check_one_of("best_mode", best_mode, ("min", "max")),
        best_metric=check_best_metric(keep_best, best_metric),
    )


# Where launchers put the id of one job, kept across its restarts: torchrun's elastic agent
# (``--rdzv-id``, the same for every restart of the workers) and SLURM (kept by ``--requeue``).
RUN_ID_VARIABLES = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")


def check_run_id(v: Any) -> str | None:
    """``run_id=``: the id of this job across its restarts; None: the launcher's (see
    ``RUN_ID_VARIABLES``) where one is set, else none (the checkpoint directory names the run).
    A launcher's value is checked as one given here."""
    source = "run_id"
    if v is None:
        source, v = next(
            ((k, os.environ[k]) for k in RUN_ID_VARIABLES if os.environ.get(k)), ("", None)
        )
        if v is None:
            return None
    if not isinstance(v, str) or not v or len(v) > 256 or "\x00" in v:
        shown = repr(v) if len(repr(v)) <= 80 else f"{repr(v)[:60]}... ({len(v)} characters)"
        where = "run_id" if source == "run_id" else f"the run id in ${source}"
        raise InvalidArgumentError(
            f"{where} must be a non-empty string of at most 256 characters without NUL (the id "
            f"of this job across its restarts, e.g. the scheduler's job id), got {shown}; pass "
            "run_id= to name the run yourself"
        )
    return v


@dataclass(frozen=True)
class Uploads:
    """The remote tier's settings (``upload_to=``): its retention (``keep_last_remote``), how
    long ``close()`` waits for it (``upload_timeout``) and its own cadence (``upload_every``:
    every N-th step the directory commits, by step number; None: every one)."""

    keep_last_remote: int | None = None
    upload_timeout: float = 600.0
    upload_every: int | None = None

    @classmethod
    def check(cls, upload_to: Any, keep_last: Any, timeout: Any, every: Any) -> Uploads:
        if upload_to is None and every is not None:
            raise InvalidArgumentError(
                f"upload_every={every!r} was given without upload_to=: it is the cadence of "
                "the remote tier; pass upload_to= too, or use every_steps= for the directory"
            )
        return cls(
            check_positive("keep_last_remote", keep_last),
            check_positive("upload_timeout", timeout, float),
            check_positive("upload_every", every),
        )
