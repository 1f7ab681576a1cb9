"""Asynchronous saves: consistency, bounded and reused staging memory, one save in flight, close.

The contract (DESIGN.md §1.2, §5 "Consistent under async", the Rust ``AsyncCheckpointer``):
``save`` blocks only for a host copy of the state, then training may mutate every tensor while
the background thread writes; the committed bytes are the values at call time. Staging memory is
bounded by ``max_staging_bytes`` and reused from save to save; at most one save is in flight
(the next waits, or is skipped with a warning); ``close()`` waits for in-flight work.

Where a test must know that the background write is still running, it holds the writer at a
gate (``LocalWriter.write`` blocks until the test opens it), so the outcome never depends on how
fast the disk happens to be.
"""

from __future__ import annotations

import copy
import json
import os
import queue
import re
import shutil
import threading
import time
import types
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import tardigrade as tg
from tardigrade import _async
from tardigrade._commit import RenameCommit
from tardigrade.errors import InvalidArgumentError, TardigradeError
from tardigrade.storage.local import LocalWriter

MiB = 1024 * 1024


# ----------------------------------------------------------------------------------------------
# helpers


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's raw bytes (NaN-safe, -0.0-safe comparison)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_same(actual: Any, expected: Any, where: str = "state") -> None:
    """Bit-exact equality of two state trees: same containers, types, dtypes, shapes, bytes."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: {type(actual).__name__}, not a tensor"
        assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{where}: shape {actual.shape} != {expected.shape}"
        assert torch.equal(bits(actual), bits(expected)), f"{where}: tensor bytes differ"
    elif isinstance(expected, np.ndarray):
        assert isinstance(actual, np.ndarray), f"{where}: {type(actual).__name__}, not ndarray"
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert actual.tobytes() == expected.tobytes(), f"{where}: array bytes differ"
    elif isinstance(expected, Mapping):
        assert isinstance(actual, Mapping), f"{where}: {type(actual).__name__}, not a mapping"
        assert list(actual) == list(expected), f"{where}: keys {list(actual)} != {list(expected)}"
        for k in expected:
            assert_same(actual[k], expected[k], f"{where}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected), f"{where}: {type(actual)} != {type(expected)}"
        assert len(actual) == len(expected), f"{where}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{where}[{i}]")
    else:
        assert type(actual) is type(expected), f"{where}: {type(actual)} != {type(expected)}"
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def snapshot(obj: Any) -> Any:
    """A deep copy of what a save of ``obj`` must hold: state_dicts expanded, tensors cloned."""
    if callable(getattr(obj, "state_dict", None)):
        return snapshot(obj.state_dict())
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if isinstance(obj, Mapping):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(snapshot(v) for v in obj)
    return copy.deepcopy(obj)


def tensors_of(tree: Any) -> Iterator[torch.Tensor | np.ndarray]:
    if isinstance(tree, (torch.Tensor, np.ndarray)):
        yield tree
    elif isinstance(tree, Mapping):
        for v in tree.values():
            yield from tensors_of(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from tensors_of(v)


def clobber(t: torch.Tensor | np.ndarray) -> None:
    """Overwrite every byte of a (contiguous) tensor or array in place."""
    if isinstance(t, np.ndarray):
        assert t.flags.c_contiguous
        if t.dtype == np.bool_:
            np.logical_not(t, out=t)
        else:
            raw = t.view(np.uint8)
            np.bitwise_not(raw, out=raw)
        return
    with torch.no_grad():
        t = t.detach()
        assert t.is_contiguous(), "clobber the base of a strided view, not the view"
        if t.dtype == torch.bool:
            t.logical_not_()
        elif t.numel():
            t.reshape(-1).view(torch.uint8).bitwise_not_()


def state_nbytes(state: Any) -> int:
    return sum(
        t.nbytes if isinstance(t, np.ndarray) else t.numel() * t.element_size()
        for t in tensors_of(snapshot(state))
    )


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def small_state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 1024, generator=g), "n": seed}


def make_training_state() -> tuple[dict[str, Any], Callable[[dict[str, Any]], None]]:
    """About 90 MB of realistic training state, and a function that mutates all of it in place.

    Model parameters, AdamW moments and step counters, plain tensors of several dtypes (one a
    strided view, one 0-d, one empty, one referenced twice), numpy arrays, and plain Python
    containers. The mutator flips every byte of every tensor and array, and edits the dicts,
    lists and counters, so a save that read anything after ``save`` returned cannot match.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 1024))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 1024)).square().mean().backward()
    opt.step()
    strided_base = torch.randn(1000, 1000)
    shared = torch.randn(1000)
    rng = np.random.default_rng(0)
    state: dict[str, Any] = {
        "model": model,
        "optim": opt,
        "plain": {
            "big": torch.randn(4_000_000),
            "bf16": torch.randn(2048, 1024).to(torch.bfloat16),
            "ints": torch.arange(1_000_000, dtype=torch.int64),
            "mask": torch.rand(100_000) > 0.5,
            "scalar": torch.tensor(3.5, dtype=torch.float64),
            "empty": torch.empty(0, 7),
            "strided": strided_base[:, ::2],
            "shared_a": shared,
            "shared_b": shared,
        },
        "np": {
            "f64": rng.standard_normal(1_000_000),
            "i32": np.arange(2_000_000, dtype=np.int32),
            "flags": np.array([True, False] * 500),
        },
        "step": 100,
        "epoch": 3,
        "hist": [0.5, 0.25, (1, 2)],
        "cfg": {"name": "run", "lr": 1e-3, "milestones": [10, 20]},
        "blob": b"\x00\x01",
    }

    def mutate(s: dict[str, Any]) -> None:
        for p in model.parameters():
            clobber(p)
        for per_param in opt.state.values():
            for v in per_param.values():
                if isinstance(v, torch.Tensor):
                    clobber(v)
        opt.param_groups[0]["lr"] = 123.0
        plain = s["plain"]
        for k in ("big", "bf16", "ints", "mask", "scalar", "shared_a"):
            clobber(plain[k])
        clobber(strided_base)
        for a in s["np"].values():
            clobber(a)
        s["step"] += 1
        s["epoch"] = 99
        s["hist"].append(9.0)
        s["hist"][0] = -1.0
        s["cfg"]["lr"] = 0.5
        s["cfg"]["milestones"].clear()
        del s["blob"]
        s["new"] = "added after save"

    return state, mutate


@pytest.fixture(autouse=True)
def clean_default_checkpointer() -> Iterator[None]:
    """Each test starts and ends with an idle process-wide checkpointer (errors do not leak)."""
    yield
    ckpt = _async._default
    if ckpt is not None:
        try:
            ckpt.close()
        except TardigradeError:
            pass


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Hold every background write until the test sets the returned event."""
    opened = threading.Event()
    original = LocalWriter.write

    def gated_write(self: LocalWriter, data: Any) -> None:
        if not opened.wait(60):
            raise TimeoutError("test gate was never opened")
        original(self, data)

    monkeypatch.setattr(LocalWriter, "write", gated_write)
    yield opened
    opened.set()  # never leave a writer thread blocked


# ----------------------------------------------------------------------------------------------
# 1. consistency: the checkpoint holds the values at call time


@pytest.mark.parametrize(
    "how, budget",
    [
        ("tg.save", None),
        ("checkpointer", None),
        ("checkpointer", 4 * MiB),
        ("overlap", None),
        ("two-in-flight", None),
        ("two-in-flight", 4 * MiB),
        ("overlap-two-in-flight", None),
    ],
    ids=[
        "default-checkpointer",
        "unbounded",
        "budget-4MiB",
        "overlap",
        "two-in-flight",
        "two-in-flight-budget-4MiB",
        "overlap-two-in-flight",
    ],
)
def test_mutating_everything_after_staging_does_not_change_the_checkpoint(
    tmp_path: Path,
    how: str,
    budget: int | None,
    checkpointers: Callable[..., tg.AsyncCheckpointer],
    request: pytest.FixtureRequest,
) -> None:
    state, mutate = make_training_state()
    expected = snapshot(state)
    path = tmp_path / "step-100"
    # Unbounded staging copies everything before save returns, so the writer can be held until
    # the state is mutated: a save that borrowed a live tensor would then write mutated bytes.
    # A budget needs the writer to drain slabs while staging, so it cannot be held.
    gate = request.getfixturevalue("gate") if budget is None else None

    if how == "tg.save":
        fut = tg.save(path, state, async_=True, step=100)
        ckpt = None
    else:
        two = how.endswith("two-in-flight")
        ckpt = checkpointers(max_staging_bytes=budget, max_in_flight=2 if two else 1)
        if two:  # another save still in flight (held at the gate, or writing under a budget)
            other = ckpt.save(tmp_path / "other", small_state(7), overlap=how.startswith("overlap"))
            assert other is not None
        fut = ckpt.save(path, state, step=100, overlap=how.startswith("overlap"))
        if two and gate is not None:
            assert not other.done(), "the other save should still be in flight"
    assert isinstance(fut, tg.SaveFuture)
    if how.startswith("overlap"):
        # The copy of what the optimizer owns runs in the background; the mutations below
        # are not the optimizer's step, so they wait for it themselves (the fence).
        assert fut.wait_staged(60)
    assert fut.staged(), "save() returned before the state was staged"
    if gate is not None:
        assert not fut.done(), "the write should still be held at the gate"

    mutate(state)
    after = snapshot(state)
    unchanged = [
        i
        for i, (a, e) in enumerate(zip(tensors_of(after), tensors_of(expected), strict=True))
        if (a.size if isinstance(a, np.ndarray) else a.numel())
        and (
            a.tobytes() == e.tobytes()
            if isinstance(a, np.ndarray)
            else torch.equal(bits(a), bits(e))
        )
    ]
    assert not unchanged, f"test bug: tensors {unchanged} were not mutated"
    if gate is not None:
        gate.set()

    result = fut.result(timeout=60)
    assert result.step == 100
    assert_same(tg.load(path), expected)
    if how.endswith("two-in-flight"):
        assert_same(tg.load(tmp_path / "other"), snapshot(small_state(7)))
    tg.verify(path)
    assert len(tg.read_manifest(path)["files"]) >= 2, "state should span several data files"
    if ckpt is not None:
        stats = ckpt.staging
        assert stats.allocations >= 2, "state should span several staging slabs"
        if budget is not None:
            assert stats.peak_in_use_bytes <= budget
            assert stats.allocated_bytes <= budget


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_state_is_staged_consistently(
    tmp_path: Path, checkpointers: Callable[..., tg.AsyncCheckpointer]
) -> None:
    """Device-to-host copies into pinned slabs are asynchronous: the bytes the writer reads,
    and the bytes left after training overwrites the device tensors, must be the call-time ones.
    The writer is not held here, so it races the copies as it would in training."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 4096), nn.Linear(4096, 2048)).cuda()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(16, 2048, device="cuda")).square().mean().backward()
    opt.step()
    state = {
        "model": model,
        "optim": opt,
        "big": torch.randn(64 * MiB // 4, device="cuda"),
        "strided": torch.randn(2048, 2048, device="cuda")[:, ::2],
    }
    expected = snapshot(state)
    for budget in (None, 8 * MiB):
        path = tmp_path / f"budget-{budget}"
        fut = checkpointers(max_staging_bytes=budget).save(path, state)
        assert fut is not None and fut.staged()
        with torch.no_grad():
            for t in [*model.parameters(), state["big"]]:
                t.add_(1.0)
            for per_param in opt.state.values():
                for v in per_param.values():
                    v.add_(1.0)
        fut.result(timeout=120)
        assert_same(tg.load(path), expected)
        with torch.no_grad():  # back to the call-time values for the next round
            for t in [*model.parameters(), state["big"]]:
                t.sub_(1.0)
            for per_param in opt.state.values():
                for v in per_param.values():
                    v.sub_(1.0)
        expected = snapshot(state)


@pytest.mark.parametrize("problem", ["exists", "unsupported-leaf"])
def test_errors_found_before_staging_are_raised_by_save_itself(
    tmp_path: Path, problem: str, checkpointers: Callable[..., tg.AsyncCheckpointer]
) -> None:
    ckpt = checkpointers()
    path = tmp_path / "ckpt"
    first = small_state(1)
    tg.save(path, first)
    if problem == "exists":
        with pytest.raises(tg.CheckpointExistsError, match=re.escape(str(path))):
            ckpt.save(path, small_state(2))
    else:
        with pytest.raises(tg.UnsupportedTypeError, match="bad"):
            ckpt.save(tmp_path / "other", {"bad": object()})
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert_same(tg.load(path), snapshot(first))
    fut = ckpt.save(tmp_path / "next", small_state(3))  # the checkpointer is still usable
    assert fut is not None
    fut.result(timeout=30)
    ckpt.close()  # nothing left to report


# ----------------------------------------------------------------------------------------------
# 2. no leak: staging buffers are reused, memory stays flat over many saves


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fifty_async_saves_reuse_staging_memory(
    tmp_path: Path, checkpointers: Callable[..., tg.AsyncCheckpointer]
) -> None:
    torch.manual_seed(0)
    per = 50 * MiB // 4
    state = {
        "layers": [torch.randn(per) for _ in range(4)],  # 4 x 50 MiB
        "tiny": {"a": torch.arange(10), "b": torch.tensor(1.0), "c": torch.ones(3, 5)},
        "step": 0,
    }
    nbytes = state_nbytes(state)
    assert nbytes >= 200 * MiB
    ckpt = checkpointers()
    rss_after: list[int] = []
    allocations_after: list[int] = []
    previous: Path | None = None
    started = time.perf_counter()
    for i in range(50):
        state["step"] = i
        path = tmp_path / f"step-{i:03d}"
        fut = ckpt.save(path, state, step=i)
        assert fut is not None
        fut.result(timeout=60)
        rss_after.append(rss_bytes())
        stats = ckpt.staging
        allocations_after.append(stats.allocations)
        assert stats.allocated_bytes <= 1.05 * nbytes + 2 * MiB, (
            f"save {i}: {stats.allocated_bytes} staging bytes for a {nbytes}-byte state"
        )
        if previous is not None:
            shutil.rmtree(previous)
        previous = path
    elapsed = time.perf_counter() - started

    assert allocations_after[-1] == allocations_after[1], (
        f"staging allocated new buffers after the second save: {allocations_after}"
    )
    assert rss_after[-1] <= 1.2 * rss_after[1], (
        f"RSS grew from {rss_after[1] / MiB:.0f} MiB after save 2 to "
        f"{rss_after[-1] / MiB:.0f} MiB after save 50 ({elapsed:.1f} s for 50 saves)"
    )
    loaded = tg.load(previous)
    assert loaded["step"] == 49
    assert_same(loaded["layers"], state["layers"])


# ----------------------------------------------------------------------------------------------
# 3. a staging budget bounds host memory


def test_staging_budget_bounds_host_memory(
    tmp_path: Path, checkpointers: Callable[..., tg.AsyncCheckpointer]
) -> None:
    torch.manual_seed(1)
    state = {f"t{i}": torch.randn(2 * MiB) for i in range(8)}  # 8 x 8 MiB = 64 MiB
    state["tail"] = torch.arange(1000, dtype=torch.int16)
    expected = snapshot(state)
    budget = 8 * MiB
    ckpt = checkpointers(max_staging_bytes=budget)
    for name in ("a", "b"):  # the second save reuses the pool under the same budget
        fut = ckpt.save(tmp_path / name, state)
        assert fut is not None
        fut.result(timeout=60)
        stats = ckpt.staging
        assert 0 < stats.peak_in_use_bytes <= budget, stats
        assert stats.allocated_bytes <= budget, stats
        assert_same(tg.load(tmp_path / name), expected)
    assert len(tg.read_manifest(tmp_path / "a")["files"]) >= 2


@pytest.mark.parametrize("budget", [0, -1, 1, 1024, 8.0 * MiB, "8MiB", True])
def test_invalid_staging_budget_is_rejected(budget: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="max_staging_bytes"):
        tg.AsyncCheckpointer(max_staging_bytes=budget)


def test_invalid_if_busy_is_rejected() -> None:
    with pytest.raises(InvalidArgumentError, match="if_busy"):
        tg.AsyncCheckpointer(if_busy="drop")


# ----------------------------------------------------------------------------------------------
# 3b. reserve(): the first save's staging memory is faulted in ahead, in the background


def _slab_buffers(ckpt: tg.AsyncCheckpointer) -> list[torch.Tensor]:
    with ckpt.pool._cond:
        return [s.buf for s in ckpt.pool._free]


def _pages_not_resident(buf: torch.Tensor) -> int:
    """How many of the buffer's pages are not in RAM, from /proc/self/pagemap (bit 63)."""
    page = os.sysconf("SC_PAGE_SIZE")
    first = buf.data_ptr() // page
    last = (buf.data_ptr() + buf.numel() - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        raw = f.read((last - first + 1) * 8)
    entries = np.frombuffer(raw, dtype=np.uint64)
    return int(np.count_nonzero((entries >> np.uint64(63)) == 0))


def _three_file_state() -> dict[str, Any]:
    torch.manual_seed(3)
    return {
        "w": [torch.randn(3 * MiB) for _ in range(3)],  # 3 x 12 MiB, over several files
        "small": torch.arange(1000, dtype=torch.int16),
        "step": 7,
    }


def test_reserve_faults_in_exactly_what_the_first_save_stages(
    tmp_path: Path, checkpointers: Callable[..., tg.AsyncCheckpointer]
) -> None:
    state = _three_file_state()
    ckpt = checkpointers()
    reserved = ckpt.reserve(state)
    assert reserved >= state_nbytes(state)
    assert ckpt.wait_reserved(timeout=60)
    before = ckpt.staging
    assert before.allocated_bytes == reserved
    # Every page of every slab is in RAM already: the save copies into touched memory.
    for buf in _slab_buffers(ckpt):
        assert _pages_not_resident(buf) == 0
    assert ckpt.reserve(state) == 0, "a second reserve of the same state reserves nothing"

    fut = ckpt.save(tmp_path / "a", state)
    assert fut is not None
    fut.result(timeout=60)
    after = ckpt.staging
    assert (after.allocations, after.allocated_bytes) == (
        before.allocations,
        before.allocated_bytes,
    ), f"the first save allocated staging memory after reserve(): {before} -> {after}"
    assert_same(tg.load(tmp_path / "a"), state)


def test_reserve_by_byte_count_and_budget(
    tmp_path: Path, checkpointers: Callable[..., tg.AsyncCheckpointer]
) -> None:
    state = _three_file_state()
    ckpt = checkpointers()
    assert ckpt.reserve(5 * MiB + 1) == 5 * MiB + 64 * 1024  # one slab, in 64 KiB rounds
    assert ckpt.wait_reserved(timeout=60)

    budget = 8 * MiB
    bounded = checkpointers(max_staging_bytes=budget)
    assert 0 < bounded.reserve(state) <= budget
    assert bounded.wait_reserved(timeout=60)
    assert bounded.staging.allocated_bytes <= budget
    fut = bounded.save(tmp_path / "b", state)
    assert fut is not None
    fut.result(timeout=60)
    assert bounded.staging.allocated_bytes <= budget
    assert_same(tg.load(tmp_path / "b"), state)

    with pytest.raises(InvalidArgumentError, match="byte count"):
        ckpt.reserve(-1)
    with pytest.raises(tg.UnsupportedTypeError):
        ckpt.reserve({"bad": object()})
    ckpt.close()
    with pytest.raises(InvalidArgumentError, match="closed"):
        ckpt.reserve(state)


def test_save_racing_the_reservation_allocates_each_slab_once(
    tmp_path: Path,
    checkpointers: Callable[..., tg.AsyncCheckpointer],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A save that starts while the reservation thread is still faulting slabs in waits for
    the slab being made, makes reserved ones not started yet itself, and allocates nothing
    twice: the pool ends as big as one reservation, and later saves allocate nothing."""
    from tardigrade import _staging

    state = _three_file_state()
    ckpt = checkpointers()
    pool = ckpt.pool
    pool.slab_bytes = 8 * MiB  # several slabs for a small state
    expected = pool.plan(_async.image_sizes(state))
    assert len(expected) >= 3

    gate, reserving = threading.Event(), threading.Event()
    original = _staging._allocate

    makers: list[str] = []

    def held(nbytes: int, touch: str = "all") -> torch.Tensor:
        makers.append(threading.current_thread().name)
        if makers[-1] == "tardigrade-reserve":
            reserving.set()
            assert gate.wait(60)
        return original(nbytes, touch)

    monkeypatch.setattr(_staging, "_allocate", held)

    class Watched(threading.Condition):
        def wait(self, timeout: float | None = None) -> bool:
            gate.set()  # the save waits for the slab being made: let the reservation go on
            return super().wait(timeout)

    pool._cond = Watched()
    ckpt.reserve(state)
    assert reserving.wait(60)  # the reservation thread is faulting in its first slab
    fut = ckpt.save(tmp_path / "a", state)
    assert fut is not None
    fut.result(timeout=60)
    assert gate.is_set(), "the save did not wait for the slab being faulted in"
    # Reserved slabs not started yet were faulted in by the saving thread itself.
    assert "MainThread" in makers and "tardigrade-reserve" in makers, makers
    assert ckpt.wait_reserved(timeout=60)
    stats = ckpt.staging
    assert stats.allocations == len(expected) and stats.allocated_bytes == sum(expected), stats
    fut = ckpt.save(tmp_path / "b", state)
    assert fut is not None
    fut.result(timeout=60)
    assert ckpt.staging.allocations == len(expected)
    assert_same(tg.load(tmp_path / "a"), state)
    assert_same(tg.load(tmp_path / "b"), state)


@pytest.mark.slow
def test_reserved_staging_stays_resident_while_idle(
    checkpointers: Callable[..., tg.AsyncCheckpointer],
) -> None:
    """This VM hands memory the guest frees back to the host after ~2 s idle (and faults it
    back in at ~0.5 GB/s). The pool keeps its slabs allocated, so they stay in RAM."""
    ckpt = checkpointers()
    ckpt.reserve(64 * MiB)
    assert ckpt.wait_reserved(timeout=60)
    bufs = _slab_buffers(ckpt)
    assert sum(b.numel() for b in bufs) >= 64 * MiB
    time.sleep(3.0)  # the idle time itself is what is tested, not a synchronisation
    assert [_pages_not_resident(b) for b in bufs] == [0] * len(bufs)


def test_manager_reserves_staging_for_its_state_at_construction(tmp_path: Path) -> None:
    state = _three_file_state()
    with tg.CheckpointManager(tmp_path / "ckpt", state, save_on_signals=()) as mgr:
        ckpt = mgr._async
        assert ckpt is not None
        assert ckpt.wait_reserved(timeout=60)
        before = ckpt.staging
        assert before.allocated_bytes >= state_nbytes(state)
        mgr.save(1)
        mgr.wait()
        assert ckpt.staging.allocations == before.allocations
    assert_same(tg.load(mgr.path(1)), state)


class _CountingModel(nn.Module):
    """A model that counts its ``state_dict()`` calls: how often the state is sized."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(512, 512)
        self.sized = 0

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        self.sized += 1
        return super().state_dict(*args, **kwargs)


def _train_step(model: _CountingModel, optim: torch.optim.Optimizer) -> None:
    optim.zero_grad()
    model.lin(torch.randn(4, 512)).square().mean().backward()
    optim.step()


def test_manager_reserves_the_optimizer_state_created_after_it(tmp_path: Path) -> None:
    """A fresh run builds the manager before the first optimizer step, when Adam has no moments
    yet: the construction reserves the parameters only. ``step()`` sizes the state again (on
    its 1st, 2nd, 4th, ... call, until a save), so the moments are reserved in the background
    before the first save, which then copies into reserved memory only, and ``step()`` does
    not walk the state at every call."""
    model = _CountingModel()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"model": model, "optim": optim}
    with tg.CheckpointManager(
        tmp_path / "ckpt", state, every_steps=1000, save_on_signals=()
    ) as mgr:
        ckpt = mgr._async
        assert ckpt is not None
        assert ckpt.wait_reserved(timeout=60)
        at_construction = ckpt.staging.allocated_bytes
        # The first step() comes before any optimizer step (a gradient scaler skipped it).
        assert not mgr.step(1)
        _train_step(model, optim)  # the moments appear: the state is ~3x what was reserved
        needed = ckpt.pool.plan(_async.image_sizes(state, share=True))  # as the manager saves
        assert sum(needed) > 2 * at_construction
        sized = model.sized
        assert not mgr.step(2)  # the 2nd call sizes the state again and reserves the moments
        assert ckpt.wait_reserved(timeout=60)
        reserved = ckpt.staging
        assert reserved.allocated_bytes >= sum(needed), (reserved, needed)
        assert model.sized == sized + 1
        for step in range(3, 16):
            _train_step(model, optim)
            assert not mgr.step(step)
        # Sized on the 4th and 8th calls only (of 2 more to the 15th).
        assert model.sized == sized + 3
        mgr.save(16)
        mgr.wait()
        after = ckpt.staging
        assert (after.allocations, after.allocated_bytes) == (
            reserved.allocations,
            reserved.allocated_bytes,
        ), f"the first save faulted in staging memory after step() reserved it: {after}"
        for step in range(17, 40):  # after a save, step() sizes nothing any more
            assert not mgr.step(step)
        assert model.sized == sized + 4  # the save's own flatten
    loaded = tg.load(mgr.path(16))
    assert_same(loaded["model"], model.state_dict())
    assert_same(loaded["optim"]["state"], optim.state_dict()["state"])


def test_a_staging_reservation_grows_with_the_state_until_a_save_stages_it(
    tmp_path: Path,
) -> None:
    """The reservation the manager keeps, on a bare AsyncCheckpointer: ``tick()`` sizes the
    state on its 1st, 2nd, 4th, 8th, ... call, nothing after a save staged it, and
    ``restart()`` (after a restore) reserves at once and grows again."""
    model = _CountingModel()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"model": model, "optim": optim}
    with tg.AsyncCheckpointer() as ckpt:
        reservation = _async.StagingReservation(ckpt, state)
        reservation.restart()
        assert model.sized == 1
        _train_step(model, optim)  # the moments appear
        for _ in range(9):
            reservation.tick()
        assert model.sized == 1 + 4  # ticks 1, 2, 4 and 8
        assert ckpt.wait_reserved(timeout=60)
        reserved = ckpt.staging
        assert reserved.allocated_bytes >= sum(ckpt.pool.plan(_async.image_sizes(state)))
        ckpt.save(tmp_path / "a", state)
        ckpt.wait()
        assert ckpt.staging.allocations == reserved.allocations
        sized = model.sized
        for _ in range(20):
            reservation.tick()
        assert model.sized == sized
        reservation.restart()
        reservation.tick()
        assert model.sized == sized + 2


def _file_sizes_match_headers(path: Path) -> None:
    """Every data file is exactly its header plus the tensors its header lists."""
    for f in tg.read_manifest(path)["files"]:
        raw = (path / f["name"]).read_bytes()
        head_len = 8 + int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:head_len])
        end = max(
            (v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0
        )
        assert len(raw) == head_len + end == f["size"], (f["name"], len(raw), head_len, end)


def test_writers_started_before_staging_write_each_file_image_once(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    checkpointers: Callable[..., tg.AsyncCheckpointer],
) -> None:
    """Under a budget the writers start before staging, and the stager fills their streams
    while they run. Here staging is held until every writer waits on its stream: the
    interleaving that a loaded machine produced about one run in three. The writers used to
    decide whether to write the header themselves from a flag the stager set only once it
    began; a writer that looked first wrote the header a second time in front of the staged
    image (header included), and the save committed files that no reader can load."""
    waiting = threading.Semaphore(0)

    class WatchedQueue(queue.SimpleQueue):  # type: ignore[type-arg]
        def get(self, *args: Any, **kwargs: Any) -> Any:
            waiting.release()  # a writer asks for its next block
            return super().get(*args, **kwargs)

    original = _async.stage_copy

    def stage_once_writers_wait(job: Any, pool: Any, streams: list[Any]) -> None:
        for _ in streams:
            assert waiting.acquire(timeout=30), "a writer never started reading its stream"
        original(job, pool, streams)

    monkeypatch.setattr(_async, "queue", types.SimpleNamespace(SimpleQueue=WatchedQueue))
    monkeypatch.setattr(_async, "stage_copy", stage_once_writers_wait)
    torch.manual_seed(2)
    state = {f"t{i}": torch.randn(MiB // 2 + 17 * i) for i in range(6)}  # ~12 MiB
    expected = snapshot(state)
    ckpt = checkpointers(max_staging_bytes=4 * MiB)
    fut = ckpt.save(tmp_path / "ckpt", state, step=1)
    assert fut is not None
    fut.result(timeout=60)
    _file_sizes_match_headers(tmp_path / "ckpt")
    tg.verify(tmp_path / "ckpt")
    assert_same(tg.load(tmp_path / "ckpt"), expected)
    assert ckpt.staging.allocations >= 2, "the state should span several staging slabs"


def test_blocking_time_is_the_callers_even_when_the_writer_commits_first(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    checkpointers: Callable[..., tg.AsyncCheckpointer],
) -> None:
    """Under a budget the writers may commit before ``save`` has stopped the caller's clock
    (forced here: staging returns only after the commit). The result must still report the
    time the caller was blocked, not fall back to the save's total time."""
    committed = threading.Event()
    original_commit = RenameCommit.commit

    def commit(self: RenameCommit, *args: Any, **kwargs: Any) -> None:
        original_commit(self, *args, **kwargs)
        committed.set()

    original_stage = _async.stage_copy

    def stage_then_wait_for_the_commit(job: Any, pool: Any, streams: list[Any]) -> None:
        original_stage(job, pool, streams)
        assert committed.wait(30), "the writer never committed"

    monkeypatch.setattr(RenameCommit, "commit", commit)
    monkeypatch.setattr(_async, "stage_copy", stage_then_wait_for_the_commit)
    ckpt = checkpointers(max_staging_bytes=4 * MiB)
    fut = ckpt.save(tmp_path / "ckpt", small_state(3))
    assert fut is not None
    result = fut.result(timeout=60)
    assert result.blocking_seconds == fut.blocking_seconds
    assert 0 < result.blocking_seconds <= result.total_seconds


# ----------------------------------------------------------------------------------------------
# 4. at most one save in flight


def test_second_save_waits_for_the_first(
    tmp_path: Path, gate: threading.Event, checkpointers: Callable[..., tg.AsyncCheckpointer]
) -> None:
    ckpt = checkpointers()
    first_state, second_state = small_state(1), small_state(2)
    first = ckpt.save(tmp_path / "first", first_state)
    assert first is not None and first.staged() and not first.done()
    with pytest.raises(TimeoutError, match="in flight"):
        first.result(timeout=0.05)

    seen: dict[str, Any] = {}

    def save_second() -> None:
        seen["future"] = ckpt.save(tmp_path / "second", second_state)
        seen["first_done"] = first.done()

    thread = threading.Thread(target=save_second)
    thread.start()
    thread.join(0.5)
    assert thread.is_alive(), "the second save returned while the first was still in flight"
    gate.set()
    thread.join(30)
    assert not thread.is_alive()
    assert seen["first_done"] is True, "the second save returned before the first finished"
    seen["future"].result(timeout=30)
    assert_same(tg.load(tmp_path / "first"), snapshot(first_state))
    assert_same(tg.load(tmp_path / "second"), snapshot(second_state))


def test_if_busy_skip_skips_with_a_warning_while_one_is_in_flight(
    tmp_path: Path, gate: threading.Event, checkpointers: Callable[..., tg.AsyncCheckpointer]
) -> None:
    ckpt = checkpointers(if_busy="skip")
    first = ckpt.save(tmp_path / "first", small_state(1))
    assert first is not None and not first.done()
    skipped = tmp_path / "skipped"
    with pytest.warns(UserWarning, match=f"(?s)skipping.*{re.escape(str(skipped))}.*in flight"):
        assert ckpt.save(skipped, small_state(2)) is None
    gate.set()
    first.result(timeout=30)
    assert not skipped.exists() and not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())

    # Idle again: the next save goes through without a warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        third = ckpt.save(tmp_path / "third", small_state(3))
    assert third is not None
    third.result(timeout=30)
    assert_same(tg.load(tmp_path / "third"), snapshot(small_state(3)))


# ----------------------------------------------------------------------------------------------
# 6. wait() and close()


def test_wait_blocks_until_the_save_is_committed(
    tmp_path: Path, gate: threading.Event, checkpointers: Callable[..., tg.AsyncCheckpointer]
) -> None:
    ckpt = checkpointers()
    fut = ckpt.save(tmp_path / "ckpt", small_state(4))
    assert fut is not None and not fut.done()
    threading.Timer(0.3, gate.set).start()
    ckpt.wait()
    assert fut.done()
    assert_same(tg.load(tmp_path / "ckpt"), snapshot(small_state(4)))


def test_close_waits_for_in_flight_work_and_is_idempotent(
    tmp_path: Path, gate: threading.Event
) -> None:
    ckpt = tg.AsyncCheckpointer()
    fut = ckpt.save(tmp_path / "ckpt", small_state(5))
    assert fut is not None and not fut.done()
    threading.Timer(0.3, gate.set).start()
    ckpt.close()
    assert fut.done(), "close() returned while the save was still in flight"
    assert_same(tg.load(tmp_path / "ckpt"), snapshot(small_state(5)))

    ckpt.close()  # idempotent: raises nothing
    with pytest.raises(InvalidArgumentError, match="closed"):
        ckpt.save(tmp_path / "again", small_state(6))
    assert not (tmp_path / "again").exists()


def test_context_manager_closes_and_waits(tmp_path: Path, gate: threading.Event) -> None:
    with tg.AsyncCheckpointer() as ckpt:
        assert isinstance(ckpt, tg.AsyncCheckpointer)
        fut = ckpt.save(tmp_path / "ckpt", small_state(7))
        assert fut is not None and not fut.done()
        threading.Timer(0.3, gate.set).start()
    assert fut.done()
    assert_same(tg.load(tmp_path / "ckpt"), snapshot(small_state(7)))
    with pytest.raises(InvalidArgumentError, match="closed"):
        ckpt.save(tmp_path / "again", small_state(8))


# ----------------------------------------------------------------------------------------------
# 10. the synchronous and the asynchronous save write the same checkpoint


def test_sync_and_async_saves_write_identical_checkpoints(
    tmp_path: Path, checkpointers: Callable[..., tg.AsyncCheckpointer]
) -> None:
    state, _ = make_training_state()
    expected = snapshot(state)
    sync_path, async_path = tmp_path / "sync", tmp_path / "async"
    tg.save(sync_path, state, step=5, epoch=1)
    fut = checkpointers().save(async_path, state, step=5, epoch=1)
    assert fut is not None
    fut.result(timeout=60)

    for path in (sync_path, async_path):
        report = tg.verify(path)
        assert report.tensors > 0 and report.files >= 2
        assert_same(tg.load(path), expected, where=path.name)
    sync_m, async_m = tg.read_manifest(sync_path), tg.read_manifest(async_path)
    assert sync_m["tensors"] == async_m["tensors"]  # same layout and chunk checksums
    assert sync_m["tree"] == async_m["tree"]
    assert sync_m["files"] == async_m["files"]
    for f in sync_m["files"]:
        name = f["name"]
        assert (sync_path / name).read_bytes() == (async_path / name).read_bytes(), name
    assert sorted(os.listdir(sync_path)) == sorted(os.listdir(async_path))
