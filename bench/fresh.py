"""The first save of a fresh process, one process per tool.

Every first save must start from the same state: a process that has built its training state and
saved nothing yet, with nothing of another tool's in its allocator. Each runs in a child forked
from a ``multiprocessing`` fork server that has imported the tools but never run a tensor
operation, so the child is fresh (and fork-safe) without paying the ~5 s of a new interpreter
importing torch once per tool.
"""

from __future__ import annotations

import functools
import multiprocessing
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from .measure import measure, settle
from .raw import Scratch, memcpy, raw_write, remove
from .state import build_state, state_nbytes, width_for
from .tools import SAVES, async_checkpointer

RAW_WRITE = "raw_write"
ASYNC = "tardigrade_async"


def first_save(tool: str, target_bytes: int, root: Path, settle_s: float) -> dict[str, Any]:
    """Build the state, idle, and measure the process's first save with ``tool``.

    The raw write needs no state, only a pre-faulted buffer of the same byte count. The async
    save is set up as in training: the checkpointer is created and reserves its staging memory
    (in the background, timed as ``reserve_s``) while training would run its first steps; the
    save follows once that is done, next to a memcpy of the same bytes into pre-faulted memory
    in this same process (``memcpy``), each after the same settle.
    """
    t0 = time.perf_counter()
    if tool == RAW_WRITE:
        nbytes = state_nbytes(width_for(target_bytes))
        scratch = Scratch(nbytes)
        scratch.buf.fill_(0xA5)  # pre-faults the buffer the write streams from
    else:
        state = build_state(target_bytes)
        nbytes = state.nbytes
    build_s = time.perf_counter() - t0
    extra: dict[str, Any] = {}
    if tool == ASYNC:
        t = time.perf_counter()
        async_checkpointer(state).wait_reserved()
        extra["reserve_s"] = time.perf_counter() - t
        scratch = Scratch(nbytes)
        scratch.fill_from(state)  # pre-faults the reference buffer
        settle(settle_s)
        extra["memcpy"] = measure(functools.partial(memcpy, scratch, state)).to_json()
        del scratch
    root.mkdir(parents=True, exist_ok=True)
    path = root / tool
    remove(path)
    if tool == RAW_WRITE:
        op = functools.partial(raw_write, scratch, path)
    else:
        op = functools.partial(SAVES[tool], state, path)
    settle(settle_s)
    sample = measure(op)
    remove(path)
    return {
        "tool": tool,
        "state_bytes": nbytes,
        "build_s": build_s,
        "sample": sample.to_json(),
        **extra,
    }


def _child(conn: Connection, *args: Any) -> None:
    try:
        conn.send(("ok", first_save(*args)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


_SERVER = multiprocessing.get_context("forkserver")
_SERVER.set_forkserver_preload(["bench.fresh", "bench.frozen"])


def first_save_in_fresh_process(
    tool: str, target_bytes: int, root: Path, settle_s: float, timeout_s: float
) -> dict[str, Any]:
    """Run ``first_save`` in a new child process; raise with its traceback if it fails."""
    ours, theirs = _SERVER.Pipe(duplex=False)
    proc = _SERVER.Process(
        target=_child,
        args=(theirs, tool, target_bytes, root, settle_s),
        name=f"bench-first-{tool}",
    )
    proc.start()
    theirs.close()
    try:
        if not ours.poll(timeout_s):
            proc.kill()
            raise RuntimeError(f"first save of {tool!r} did not finish within {timeout_s:.0f} s")
        try:
            status, payload = ours.recv()
        except EOFError:
            status, payload = "error", "the child process died without a result"
    finally:
        proc.join()
        ours.close()
    if status != "ok":
        raise RuntimeError(
            f"first save of {tool!r} failed in its process (exit {proc.exitcode}):\n{payload}"
        )
    return payload
