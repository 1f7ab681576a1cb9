"""Run a test function on N real processes joined by a gloo process group, on loopback only.

``run_ranks(check, 2, "x")`` starts two processes, joins them into a gloo group through a store
this process serves on 127.0.0.1, calls ``check(rank, world_size, "x")`` in each and returns
what each returned, in rank order::

    def check(rank: int, world_size: int, text: str) -> int:   # top level of a test module
        return Ranks.current().agree_max(rank)

    def test_agree_max() -> None:
        assert run_ranks(check, 2, "x") == [1, 1]

A rank's result is its return value (anything ``json.dumps`` accepts), ``{"error": type name,
"message": str}`` when ``check`` raised (the traceback goes to that rank's stderr), or
``{"died": exit code}`` when the process ended without a result, e.g. a rank that SIGKILLs
itself on purpose. A run that outlives ``timeout`` kills every rank and fails the test, naming
the ranks that had not finished.

The ranks of ``run_ranks`` are forked from a server process ("forkserver") that imported torch,
tardigrade and this harness once, and they leave with ``os._exit`` once their result is sent:
importing torch in a fresh interpreter is most of a short rank's CPU time, and the suite starts
about 150 ranks. ``run_ranks_and_exits``, which reports how ranks exit, spawns fresh
interpreters that tear down like a user's program (``test_clean_exit``).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tardigrade
from tardigrade.distributed._launch import loopback_store
from tardigrade.format.manifest import MANIFEST, Manifest, parse

# The loopback interface gloo is told to use, so ranks never touch a real network.
LOOPBACK = "lo0" if sys.platform == "darwin" else "lo"

# Grace period for ranks that reported a result to finish tearing down before they are killed.
_EXIT_GRACE = 10.0


def run_ranks(
    target: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """``target(rank, world_size, *args)`` on ``world_size`` processes; their results by rank.

    ``target`` must be a top-level function of an importable module (a test module is); ``args``
    travel to the ranks pickled. ``env`` adds variables to the ranks' environment (set as a rank
    starts: nothing read while importing torch or tardigrade). Each rank runs with one torch
    thread and a gloo default group whose own timeout is ``timeout``.
    """
    return _run(target, world_size, args, timeout, env, fresh=False)[0]


def run_ranks_and_exits(
    target: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
) -> tuple[list[Any], list[int | None]]:
    """:func:`run_ranks` in fresh interpreters, and each rank's exit code once it left after
    reporting its result (an interpreter's teardown, as a user's program ends).

    An exit code is None for a rank still alive ``_EXIT_GRACE`` seconds after the results were
    in (it was then killed): a rank whose teardown hangs.
    """
    return _run(target, world_size, args, timeout, env, fresh=True)


def _run(
    target: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    timeout: float,
    env: dict[str, str] | None,
    *,
    fresh: bool,
) -> tuple[list[Any], list[int | None]]:
    module = sys.modules.get(target.__module__)
    if module is None or getattr(module, target.__qualname__, None) is not target:
        raise ValueError(
            f"run_ranks needs a top-level function of an importable module, got {target!r}: "
            "the ranks import it by name"
        )
    if fresh:
        ctx = multiprocessing.get_context("spawn")
    else:
        ctx = multiprocessing.get_context("forkserver")
        _start_fork_server(target)
    # The store is served from here on loopback only, and it outlives any rank that dies.
    with loopback_store(timeout) as port:
        return _start_and_collect(ctx, target, world_size, args, port, timeout, env)


# What the fork server imports once; every rank forked from it starts with these loaded.
_PRELOAD = ["torch", "torch.distributed", "tardigrade", "tardigrade.distributed", __name__]


def _start_fork_server(target: Callable[..., Any]) -> None:
    """Start this process's fork server if it is not running, with the harness's environment
    and import paths only: whatever a run adds (``env``) is set in each rank, never left in
    the server for the next run's ranks."""
    from multiprocessing import forkserver

    forkserver.set_forkserver_preload(_PRELOAD)
    with _importable_by_ranks(target, None):
        forkserver.ensure_running()


def _start_and_collect(
    ctx: Any,
    target: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    port: int,
    timeout: float,
    env: dict[str, str] | None,
) -> tuple[list[Any], list[int | None]]:
    procs: list[Any] = []
    readers: list[multiprocessing.connection.Connection] = []
    exit_codes: list[int | None] = []
    try:
        with _importable_by_ranks(target, env) as environ:
            for rank in range(world_size):
                reader, writer = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=_rank_main,
                    args=(rank, world_size, port, timeout, writer, environ, target, args),
                    name=f"rank-{rank}",
                    daemon=True,
                )
                proc.start()
                writer.close()  # the rank holds the only writer: its death reads as EOF here
                procs.append(proc)
                readers.append(reader)
        results = _collect(procs, readers, timeout)
        grace = time.monotonic() + _EXIT_GRACE
        for proc in procs:
            proc.join(timeout=max(0.0, grace - time.monotonic()))
            exit_codes.append(proc.exitcode)
        return results, exit_codes
    finally:
        for proc in procs:
            _kill(proc)
        for reader in readers:
            reader.close()


def _collect(
    procs: list[Any], readers: list[multiprocessing.connection.Connection], timeout: float
) -> list[Any]:
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    while len(results) < len(procs):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        waiting = [r for r in range(len(procs)) if r not in results]
        handles: dict[Any, int] = {readers[r]: r for r in waiting}
        handles.update({procs[r].sentinel: r for r in waiting})
        for ready in multiprocessing.connection.wait(list(handles), timeout=remaining):
            rank = handles[ready]
            if rank in results:
                continue
            if ready is readers[rank] or readers[rank].poll():
                try:
                    results[rank] = json.loads(readers[rank].recv_bytes())
                    continue
                except EOFError:
                    pass
            procs[rank].join(timeout=_EXIT_GRACE)
            results[rank] = {"died": procs[rank].exitcode}
    if len(results) < len(procs):
        late = [r for r in range(len(procs)) if r not in results]
        for proc in procs:
            _kill(proc)
        pytest.fail(
            f"run_ranks: rank(s) {late} of {len(procs)} did not finish within {timeout:g} s "
            f"(all ranks were killed); results so far: {results}"
        )
    return [results[r] for r in range(len(procs))]


def _kill(proc: Any) -> None:
    if proc.is_alive():
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=5)


@contextlib.contextmanager
def _importable_by_ranks(
    target: Callable[..., Any], env: dict[str, str] | None
) -> Iterator[dict[str, str]]:
    """While ranks start: the paths and environment they need to import this and ``target``;
    yields the whole environment a rank gets (a forked rank sets it itself: it inherits the
    fork server's, from when that started).

    A rank takes ``sys.path`` from this process and imports its entry point and ``target`` by
    module name, which pytest may have made importable without any path entry.
    """
    roots = [
        str(Path(tardigrade.__file__).resolve().parents[1]),
        _import_root(sys.modules[__name__]),
        _import_root(sys.modules[target.__module__]),
    ]
    extra = {
        "PYTHONPATH": os.pathsep.join([*roots, *filter(None, [os.environ.get("PYTHONPATH")])]),
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": LOOPBACK,
        **(env or {}),
    }
    saved_path = list(sys.path)
    saved_env = {k: os.environ.get(k) for k in extra}
    sys.path[:0] = [r for r in dict.fromkeys(roots) if r not in sys.path]
    os.environ.update(extra)
    try:
        yield dict(os.environ)
    finally:
        sys.path[:] = saved_path
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _import_root(module: Any) -> str:
    """The directory from which ``module`` imports under its name (``a.b.c`` -> 3 levels up)."""
    return str(Path(module.__file__).resolve().parents[module.__name__.count(".")])


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    timeout: float,
    writer: multiprocessing.connection.Connection,
    environ: dict[str, str],
    target: Callable[..., Any],
    args: tuple[Any, ...],
) -> None:
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)
    try:
        torch.set_num_threads(1)
        pg_timeout = datetime.timedelta(seconds=timeout)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=pg_timeout)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=pg_timeout
        )
        report = json.dumps(target(rank, world_size, *args))
    except BaseException as exc:
        traceback.print_exc()
        report = json.dumps({"error": type(exc).__name__, "message": str(exc)})
    # Reported before tearing down: a teardown stuck on a dead peer must not lose the result.
    writer.send_bytes(report.encode())
    writer.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def manifest_of(ckpt: str | Path) -> Manifest:
    """A checkpoint's manifest as readers see it (chunk columns made into Chunk objects)."""
    path = Path(ckpt) / MANIFEST
    return parse(path.read_bytes(), str(path))


SMALL_ROWS = 12


def make_state(rank: int, world: int, value: float) -> dict[str, Any]:
    """A small state of every leaf class, ``value`` everywhere: a row-sharded table, a
    replicated tensor, a per-rank value and a plain value."""
    lo, hi = rank * SMALL_ROWS // world, (rank + 1) * SMALL_ROWS // world
    return {
        "emb": tardigrade.Sharded(torch.full((hi - lo, 4), value), (lo, 0), (SMALL_ROWS, 4)),
        "w": torch.full((8, 8), value),
        "mine": tardigrade.PerRank(rank),
        "step": int(value),
    }


def caught(call: Callable[[], Any], *, timed: bool = False) -> dict[str, Any]:
    """What ``call()`` raised, as JSON a rank can return: its class and class tree, errno,
    message and the failing ranks it names (``causes``); with ``timed``, also how long the
    call took (left out otherwise, so that ranks' reports compare equal)."""
    start = time.monotonic()
    out: dict[str, Any] = {"type": None}
    try:
        call()
    except Exception as exc:
        out = {
            "type": type(exc).__name__,
            "mro": [k.__name__ for k in type(exc).__mro__],
            "errno": getattr(exc, "errno", None),
            "message": str(exc),
            "causes": sorted(getattr(exc, "causes", {})),
        }
    if timed:
        out["seconds"] = time.monotonic() - start
    return out
