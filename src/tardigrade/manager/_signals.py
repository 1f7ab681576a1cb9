"""Preemption signals: one process-wide handler per signal, relayed to every manager listening.

Each manager swapping in its own handler and putting back "the one before it" cannot work:
closed out of creation order, the signal stays bound to a closed manager. Here managers join
and leave in any order; the handler that was there before the first one joined is put back
when the last one leaves, unless someone installed another handler over ours meanwhile
(theirs then stays: it is newer than anything we could put back).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import weakref
from collections.abc import Sequence
from types import FrameType
from typing import Any

log = logging.getLogger("tardigrade")

_listeners: dict[int, list[weakref.ref[Preemption]]] = {}
_before: dict[int, Any] = {}


class Preemption:
    """The signals one manager listens to, and the last one received and not yet taken.

    Held weakly by the relay: a manager garbage-collected without ``close()`` (and this with
    it) stops listening, and the signal then goes to the handler from before.
    """

    def __init__(self, budget: float = 25.0) -> None:
        self.received: int | None = None
        self.at: float | None = None  # when it was received (time.monotonic)
        self.budget = budget  # seconds from the signal to the stop (preemption_budget=)
        self.stopped: int | None = None  # the signal the manager stopped for
        self._signals: list[int] = []

    def listen(self, signals: Sequence[int]) -> None:
        """Start relaying ``signals`` here (main thread only: ``signal.signal`` requires it)."""
        if not signals:
            return
        if threading.current_thread() is not threading.main_thread():
            log.warning("tardigrade: save_on_signals ignored: manager not created in main thread")
            return
        for sig in signals:
            _listen(self, sig)
            self._signals.append(sig)

    def stop_listening(self) -> None:
        """Stop relaying; the handler from before the first listener is back after the last."""
        while self._signals:
            sig = self._signals[-1]
            try:
                _unlisten(self, sig)
            except ValueError:
                log.warning(
                    "tardigrade: close() outside the main thread cannot restore the handler of "
                    "signal %s; it now behaves as the handler from before the manager",
                    sig,
                )
            self._signals.pop()

    def take(self) -> int | None:
        """The signal received since the last call (consumed), or None."""
        signum, self.received = self.received, None
        if signum is not None:
            self.stopped = signum
        return signum

    def joined(self) -> None:
        """This rank stops for a signal another rank received (the same stop everywhere): its
        budget counts from now, and its exit code is SIGTERM's unless it received one too."""
        if self.at is None:
            self.at = time.monotonic()
        if self.stopped is None:
            self.stopped = signal.SIGTERM

    def left(self) -> float:
        """Seconds of the budget left since the signal (or since now, on a rank that learned
        of it from another)."""
        if self.at is None:
            self.at = time.monotonic()
        return self.budget - (time.monotonic() - self.at)

    @property
    def exit_code(self) -> int | None:
        """128 + the signal the manager stopped for (as a shell reports a process that the
        signal ended: what schedulers and requeue policies read), else None."""
        return None if self.stopped is None else 128 + self.stopped

    def taken(self, doing: str) -> bool:
        """Consume a pending signal, logging what the manager does about it (``doing``)."""
        signum = self.take()
        if signum is not None:
            log.warning("tardigrade: signal %s received: %s and stopping", signum, doing)
        return signum is not None


def _relay(signum: int, frame: FrameType | None) -> None:
    live = [p for r in list(_listeners.get(signum, ())) if (p := r()) is not None]
    for p in live:
        # Only a flag: saving inside a signal handler could interrupt a half-mutated state.
        p.received = signum
        if p.at is None:
            p.at = time.monotonic()
    if live:
        return
    # Every listener was garbage-collected without close(), or left from another thread that
    # could not put the old handler back: behave as that handler would.
    prev = _before.get(signum, signal.SIG_DFL)
    if callable(prev):
        prev(signum, frame)
    elif prev == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        _listeners.pop(signum, None)
        _before.pop(signum, None)
        os.kill(os.getpid(), signum)


def _listen(p: Preemption, sig: int) -> None:
    if signal.getsignal(sig) is not _relay:
        prev = signal.signal(sig, _relay)
        # Either nobody listens yet, or someone replaced our relay while managers listened:
        # in both cases the handler just displaced is the one to put back at the end.
        _before[sig] = prev
    _listeners.setdefault(sig, []).append(weakref.ref(p))


def _unlisten(p: Preemption, sig: int) -> None:
    refs = [r for r in _listeners.get(sig, ()) if r() is not None and r() is not p]
    if refs:
        _listeners[sig] = refs
        return
    if signal.getsignal(sig) is _relay:
        # Raises ValueError outside the main thread; the relay then forwards to _before.
        # None: the old handler was not installed from Python and cannot be put back.
        prev = _before[sig]
        signal.signal(sig, signal.SIG_DFL if prev is None else prev)
    _listeners.pop(sig, None)
    _before.pop(sig, None)
