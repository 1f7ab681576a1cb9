"""Time one operation and the peak resident memory it adds above what was live before it.

Peak RSS comes from the kernel's high-water mark (``VmHWM``), reset just before the operation by
writing ``5`` to ``/proc/self/clear_refs``, so no short spike is missed. A thread also samples
``VmRSS``/``RssAnon`` every 2 ms: the fallback where the reset is not allowed, and the source of
the anonymous-memory peak (page-cache pages a tool maps, e.g. safetensors' mmap, count in RSS but
are not memory the tool allocated).
"""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

SAMPLE_INTERVAL_S = 0.002


@dataclass(frozen=True)
class Sample:
    """One timed run of one operation."""

    seconds: float
    rss_before: int  # bytes resident just before the operation (the live state and buffers)
    peak_rss_above: int  # peak RSS during the operation minus rss_before, bytes
    peak_anon_above: int  # the same for anonymous memory only (sampled), bytes
    hwm_exact: bool  # True when peak_rss_above comes from the kernel's reset high-water mark
    extra: dict[str, float] = field(default_factory=dict)  # whatever the operation returned
    # CPU time of this process (all threads) during the operation: far below the wall time
    # times the threads at work means other processes had the cores (the figure is noisy).
    cpu_seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _status_fields(fd: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in os.pread(fd, 8192, 0).decode().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class _Sampler(threading.Thread):
    def __init__(self, fd: int) -> None:
        super().__init__(name="bench-rss-sampler", daemon=True)
        self.fd = fd
        self.stop = threading.Event()
        self.max_rss = 0
        self.max_anon = 0

    def run(self) -> None:
        while True:
            s = _status_fields(self.fd)
            self.max_rss = max(self.max_rss, s.get("VmRSS", 0))
            self.max_anon = max(self.max_anon, s.get("RssAnon", 0))
            if self.stop.wait(SAMPLE_INTERVAL_S):
                return


def measure(op: Callable[[], dict[str, float] | None]) -> Sample:
    """Run ``op`` once; return its wall time and the memory it added at its peak.

    ``op`` may return a dict of extra numbers (e.g. an async save's blocking seconds); they are
    kept in ``Sample.extra``.
    """
    fd = os.open("/proc/self/status", os.O_RDONLY)
    try:
        before = _status_fields(fd)
        exact = _reset_hwm()
        sampler = _Sampler(fd)
        sampler.start()
        start, cpu_start = time.perf_counter(), time.process_time()
        try:
            extra = op()
        finally:
            seconds = time.perf_counter() - start
            cpu = time.process_time() - cpu_start
            sampler.stop.set()
            sampler.join()
        after = _status_fields(fd)
    finally:
        os.close(fd)
    peak = max(sampler.max_rss, after.get("VmRSS", 0))
    if exact:
        peak = max(peak, after.get("VmHWM", 0))
    return Sample(
        seconds=seconds,
        rss_before=before.get("VmRSS", 0),
        peak_rss_above=max(0, peak - before.get("VmRSS", 0)),
        peak_anon_above=max(
            0, max(sampler.max_anon, after.get("RssAnon", 0)) - before.get("RssAnon", 0)
        ),
        hwm_exact=exact,
        extra=dict(extra or {}),
        cpu_seconds=cpu,
    )


def freeze_imports() -> None:
    """Take what is alive now (the imported libraries' modules, classes and functions, which
    live as long as the process) out of the collector's reach.

    Every :func:`settle` runs a full collection, and with torch, DCP and the other tools imported
    that scans ~250k objects: 0.3-0.5 s each time here, dozens of times a run. Frozen, the
    collection scans only what the run allocated since, which is where a tool's garbage lies.
    Called once a process has imported what it measures, before it builds any state.
    """
    gc.collect()
    gc.freeze()


def settle(seconds: float, *, since: float | None = None) -> None:
    """Collect garbage and idle until ``seconds`` after ``since`` (a ``time.monotonic()``; now
    by default), so memory freed before then has gone back to the host.

    On this VM freed memory is handed back after ~2 s and then faults in slowly; idling before
    every save and load gives each tool the same start, as between two real checkpoints.
    """
    start = time.monotonic() if since is None else since
    gc.collect()
    left = start + seconds - time.monotonic()
    if left > 0:
        time.sleep(left)
