"""Terminal output for the CLI: byte sizes, aligned tables and a stdlib progress bar."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Sequence
from typing import TextIO


def error(message: str) -> None:
    """Report an error the way every command does: one line on stderr."""
    print(f"tardigrade: error: {message}", file=sys.stderr)


def human_bytes(n: int | float) -> str:
    """``1536`` -> ``1.5 KiB``; exact bytes below 1 KiB."""
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def table(rows: Sequence[Sequence[str]], header: Sequence[str], indent: str = "") -> str:
    """Left-aligned columns, two spaces apart; the last column is never padded."""
    all_rows = [list(header), *[list(r) for r in rows]]
    widths = [max(len(r[i]) for r in all_rows) for i in range(len(header))]
    lines = []
    for r in all_rows:
        cells = [c.ljust(w) for c, w in zip(r[:-1], widths[:-1], strict=True)] + [r[-1]]
        lines.append(indent + "  ".join(cells).rstrip())
    return "\n".join(lines)


class ProgressBar:
    """A one-line ``\\r`` progress bar; draws only on a terminal unless ``enabled`` is forced."""

    def __init__(
        self,
        total: int,
        label: str,
        *,
        stream: TextIO | None = None,
        enabled: bool | None = None,
        width: int = 30,
    ) -> None:
        self.total = max(1, total)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.width = width
        self.n = 0
        self.note = ""
        self._last_draw = 0.0

    def update(self, n: int, note: str | None = None) -> None:
        self.n = min(n, self.total)
        if note is not None:
            self.note = note
        now = time.monotonic()
        # Redraw at most ~30 times a second: a fast loop must not be slowed by its own bar.
        if now - self._last_draw >= 0.03 or self.n == self.total or note is not None:
            self._last_draw = now
            self._draw()

    def close(self, note: str | None = None) -> None:
        if note is not None:
            self.note = note
        if self.enabled:
            self._draw()
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self) -> None:
        if not self.enabled:
            return
        filled = self.width * self.n // self.total
        bar = "#" * filled + "-" * (self.width - filled)
        line = f"\r{self.label} [{bar}] {self.n:>{len(str(self.total))}}/{self.total}"
        if self.note:
            line += f"  {self.note}"
        self.stream.write(line + "\x1b[K")  # clear what a longer previous line left behind
        self.stream.flush()


def _bytes_read() -> int | None:
    """Bytes this process has read so far (Linux ``/proc/self/io``), or None if unknown."""
    try:
        with open("/proc/self/io", "rb") as f:
            for line in f:
                if line.startswith(b"rchar:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


class ReadProgress:
    """A progress bar for a library call that reads ``total`` bytes and reports nothing.

    A thread samples the bytes this process has read (``/proc/self/io``) ten times a second,
    so ``tg.verify`` needs no progress hook. Draws on a terminal only (stderr), with
    ``enabled``; does nothing where the count is not available.
    """

    def __init__(self, total: int, label: str, *, enabled: bool = True) -> None:
        start = _bytes_read() if enabled and total > 0 and sys.stderr.isatty() else None
        self.start = start
        self.total = total
        self.bar = ProgressBar(-(-total // 2**20), label + " (MiB)", enabled=start is not None)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True, name="tg-progress")

    def _poll(self) -> None:
        while not self._stop.wait(0.1):
            now = _bytes_read()
            if now is not None and self.start is not None:
                done = min(self.total, now - self.start)
                self.bar.update(done // 2**20, human_bytes(done))

    def __enter__(self) -> ReadProgress:
        if self.start is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.start is not None:
            self._stop.set()
            self._thread.join()
            self.bar.update(self.bar.total if exc[0] is None else self.bar.n)
            self.bar.close()
