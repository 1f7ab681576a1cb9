"""Asynchronous saves under faults: failed writes, a full disk, interpreter exit, SIGKILL.

The contract (DESIGN.md §1.3, §5 and the Rust ``AsyncCheckpointer``): a background failure is
never lost and never partial. ``fut.result()`` raises ``SaveError`` naming the checkpoint and the
cause; if nobody asked, the error surfaces once on the next ``save``, ``wait()`` or ``close()``;
nothing is committed, no staging directory is left, earlier checkpoints stay intact. Leaving the
interpreter waits for the save in flight; a SIGKILL mid-save leaves only the previous checkpoints.

Writes, closes and commits are made to fail with ``tardigrade.testing.FaultyStorage`` (the tests
run as root, so permission bits would not stop them), the manifest's write inside the local
commit by patching ``LocalWriter.write``, and, for real, by filling a 16 MiB tmpfs.
"""

from __future__ import annotations

import ctypes
import errno
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

import tardigrade as tg
from tardigrade import _async, _save, _write
from tardigrade.errors import CheckpointNotFoundError, SaveError, TardigradeError
from tardigrade.storage.local import LocalWriter
from tardigrade.testing import FaultyStorage

MiB = 1024 * 1024


# ----------------------------------------------------------------------------------------------
# helpers


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same(actual: Any, expected: Any, where: str = "state") -> None:
    """Bit-exact equality of two trees of tensors and plain values."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: {type(actual).__name__}"
        assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), where
        assert torch.equal(bits(actual), bits(expected)), f"{where}: tensor bytes differ"
    elif isinstance(expected, Mapping):
        assert isinstance(actual, Mapping) and list(actual) == list(expected), where
        for k in expected:
            assert_same(actual[k], expected[k], f"{where}[{k!r}]")
    else:
        assert type(actual) is type(expected) and actual == expected, f"{where}: {actual!r}"


def make_state(seed: int, mib: int) -> dict[str, Any]:
    """``mib`` MiB of float32 in a few tensors, plus a counter."""
    g = torch.Generator().manual_seed(seed)
    n = mib * MiB // 4
    return {
        "a": torch.randn(n // 2, generator=g),
        "b": torch.randn(n - n // 2, generator=g),
        "step": seed,
    }


def causes(exc: BaseException) -> Iterator[BaseException]:
    seen: BaseException | None = exc
    while seen is not None:
        yield seen
        seen = seen.__cause__ or seen.__context__


def assert_save_error(exc: BaseException, path: Path, errno_: int, words: str) -> None:
    """A SaveError (also a RuntimeError) naming the checkpoint and the cause."""
    assert isinstance(exc, SaveError) and isinstance(exc, RuntimeError), repr(exc)
    msg = str(exc)
    assert str(path) in msg, f"message does not name the checkpoint {path}: {msg}"
    assert words in msg, f"message does not give the cause ({words!r}): {msg}"
    assert any(getattr(e, "errno", None) == errno_ for e in causes(exc)), (
        f"no errno {errno.errorcode[errno_]} in the cause chain of {exc!r}"
    )


def only_entries(parent: Path, *names: str) -> None:
    """The directory holds exactly ``names``: nothing committed and no staging dir left over."""
    assert sorted(os.listdir(parent)) == sorted(names), os.listdir(parent)


def wait_done(fut: tg.SaveFuture, timeout: float = 60) -> None:
    """Wait for a save to finish without observing its outcome."""
    deadline = time.monotonic() + timeout
    while not fut.done():
        assert time.monotonic() < deadline, "save still in flight"
        time.sleep(0.01)


@pytest.fixture(autouse=True)
def clean_default_checkpointer() -> Iterator[None]:
    yield
    ckpt = _async._default
    if ckpt is not None:
        try:
            ckpt.close()
        except TardigradeError:
            pass


@pytest.fixture
def committed(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """A checkpoint committed before the faulty save, in the same parent directory."""
    state = make_state(seed=99, mib=1)
    tg.save(tmp_path / "prev", state)
    return tmp_path / "prev", state


def assert_intact(committed: tuple[Path, dict[str, Any]]) -> None:
    path, state = committed
    tg.verify(path)
    assert_same(tg.load(path), state)


FAULTS = {
    # where the background save fails -> (errno, words in the message)
    "data-write": (errno.ENOSPC, "injected ENOSPC"),
    "manifest-write": (errno.ENOSPC, "No space left on device"),
    "fsync": (errno.EIO, "injected EIO"),  # the close that fsyncs a data file
    "commit": (errno.EIO, "injected EIO"),
}
# The FaultyStorage operation that fails for each, every time until healed.
OPERATION = {"data-write": "write", "fsync": "close", "commit": "commit"}


@pytest.fixture
def faulty(tmp_path: Path) -> FaultyStorage:
    """``tmp_path`` through a FaultyStorage: saves to ``faulty.url(name)`` land in it."""
    return FaultyStorage(str(tmp_path))


def inject(faulty: FaultyStorage, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """Make background saves through ``faulty`` fail at ``where`` (one of FAULTS) until
    :func:`heal`."""
    code, words = FAULTS[where]
    if where in OPERATION:
        faulty.fail(OPERATION[where], error=errno.errorcode[code], times=1_000_000)
        return
    # The manifest is written inside the local backend's commit, one storage operation, which
    # FaultyStorage fails as a whole ("commit"): the write of the manifest itself is patched.
    write = LocalWriter.write

    def failing_write(self: LocalWriter, data: Any, **kw: Any) -> None:
        if os.path.basename(self.path) == "manifest.json":
            raise OSError(code, words)
        write(self, data, **kw)

    monkeypatch.setattr(LocalWriter, "write", failing_write)


def heal(faulty: FaultyStorage, monkeypatch: pytest.MonkeyPatch) -> None:
    faulty.heal()
    monkeypatch.undo()


# ----------------------------------------------------------------------------------------------
# subprocesses

CHILD_PRELUDE = """
import sys, time
import torch
import tardigrade as tg
from tardigrade.storage.local import LocalWriter

MiB = 1024 * 1024
DELAY = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0
_write = LocalWriter.write

def slow_write(self, data):
    # Every data-file write announces itself, then takes DELAY seconds.
    if "/data-" in self.path:
        print("WRITING", flush=True)
        time.sleep(DELAY)
    _write(self, data)

LocalWriter.write = slow_write

def make_state(seed, mib):
    g = torch.Generator().manual_seed(seed)
    n = mib * MiB // 4
    return {"a": torch.randn(n // 2, generator=g), "b": torch.randn(n - n // 2, generator=g),
            "step": seed}
"""


def child_argv(body: str, delay: float = 0.0) -> list[str]:
    source = CHILD_PRELUDE + textwrap.dedent(body)
    return [sys.executable, "-c", source, str(delay)]


def run_child(body: str, *, delay: float = 0.0, timeout: float = 60) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            child_argv(body, delay), capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"child did not finish within {timeout} s (hung); stdout: {e.stdout!r}")


def read_until(proc: subprocess.Popen, marker: str, timeout: float) -> str:
    """The child's output up to ``marker``, read straight from the pipe.

    Raw ``os.read`` rather than ``readline`` on the buffered file: select() watches the pipe,
    and lines the file object has already buffered (two lines arriving in one chunk) would
    never wake it up again.
    """
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    seen = ""
    deadline = time.monotonic() + timeout
    while marker not in seen:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            pytest.fail(f"child never printed {marker!r}; output so far: {seen!r}")
        chunk = os.read(fd, 65536)
        if not chunk:
            pytest.fail(f"child exited before printing {marker!r}; output: {seen!r}")
        seen += chunk.decode(errors="replace")
    return seen


def kill_after(proc: subprocess.Popen, *markers: str) -> str:
    """SIGKILL the child once it printed every one of ``markers``; reap it; its output."""
    output = ""
    try:
        for marker in markers:
            if marker not in output:
                output += read_until(proc, marker, timeout=60)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
    return output


# ----------------------------------------------------------------------------------------------
# 5. background errors surface, once, and leave nothing behind


@pytest.mark.parametrize("where", list(FAULTS))
def test_failed_background_save_raises_on_result_and_leaves_nothing(
    tmp_path: Path,
    where: str,
    monkeypatch: pytest.MonkeyPatch,
    faulty: FaultyStorage,
    committed: tuple[Path, dict[str, Any]],
    checkpointers: Callable[..., tg.AsyncCheckpointer],
) -> None:
    ckpt = checkpointers()
    state = make_state(seed=1, mib=80)  # two data files
    path = faulty.url("next")
    inject(faulty, monkeypatch, where)
    fut = ckpt.save(path, state)
    assert fut is not None
    with pytest.raises(SaveError) as info:
        fut.result(timeout=60)
    code, words = FAULTS[where]
    assert_save_error(info.value, path, code, words)
    only_entries(tmp_path, "prev")
    with pytest.raises(CheckpointNotFoundError):
        tg.load(path)
    assert_intact(committed)

    # Observed through result(): not raised a second time, and the checkpointer still works.
    assert ckpt.wait() is None
    heal(faulty, monkeypatch)
    fut = ckpt.save(path, state)
    assert fut is not None
    fut.result(timeout=60)
    ckpt.close()
    assert_same(tg.load(path), state)


def test_unobserved_error_surfaces_on_the_next_save(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    faulty: FaultyStorage,
    committed: tuple[Path, dict[str, Any]],
    checkpointers: Callable[..., tg.AsyncCheckpointer],
) -> None:
    ckpt = checkpointers()
    state = make_state(seed=2, mib=4)
    failed = faulty.url("failed")
    inject(faulty, monkeypatch, "data-write")
    fut = ckpt.save(failed, state)
    assert fut is not None
    wait_done(fut)
    heal(faulty, monkeypatch)

    other = tmp_path / "other"
    with pytest.raises(SaveError) as info:
        ckpt.save(other, state)
    assert_save_error(info.value, failed, errno.ENOSPC, "injected ENOSPC")
    only_entries(tmp_path, "prev")
    assert_intact(committed)

    # Raised once: the retried save, wait() and close() all go through.
    fut = ckpt.save(other, state)
    assert fut is not None
    fut.result(timeout=60)
    assert ckpt.wait() is not None
    ckpt.close()
    assert_same(tg.load(other), state)
    only_entries(tmp_path, "other", "prev")


def test_unobserved_error_surfaces_on_wait(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    faulty: FaultyStorage,
    committed: tuple[Path, dict[str, Any]],
    checkpointers: Callable[..., tg.AsyncCheckpointer],
) -> None:
    ckpt = checkpointers()
    state = make_state(seed=3, mib=4)
    failed = faulty.url("failed")
    inject(faulty, monkeypatch, "data-write")
    fut = ckpt.save(failed, state)
    assert fut is not None
    with pytest.raises(SaveError) as info:
        ckpt.wait()
    assert_save_error(info.value, failed, errno.ENOSPC, "injected ENOSPC")
    only_entries(tmp_path, "prev")
    assert_intact(committed)

    assert ckpt.wait() is None  # raised once
    heal(faulty, monkeypatch)
    fut = ckpt.save(tmp_path / "next", state)
    assert fut is not None
    fut.result(timeout=60)
    ckpt.close()
    assert_same(tg.load(tmp_path / "next"), state)


def test_unobserved_error_surfaces_on_close(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    faulty: FaultyStorage,
    committed: tuple[Path, dict[str, Any]],
) -> None:
    ckpt = tg.AsyncCheckpointer()
    state = make_state(seed=4, mib=4)
    failed = faulty.url("failed")
    inject(faulty, monkeypatch, "data-write")
    fut = ckpt.save(failed, state)
    assert fut is not None
    with pytest.raises(SaveError) as info:
        ckpt.close()
    assert_save_error(info.value, failed, errno.ENOSPC, "injected ENOSPC")
    only_entries(tmp_path, "prev")
    assert_intact(committed)
    ckpt.close()  # raised once; idempotent


def test_failed_save_under_a_budget_does_not_deadlock(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    faulty: FaultyStorage,
    committed: tuple[Path, dict[str, Any]],
    checkpointers: Callable[..., tg.AsyncCheckpointer],
) -> None:
    """Failed writers still release their slabs, or staging would wait forever on the budget."""
    ckpt = checkpointers(max_staging_bytes=4 * MiB)
    path = faulty.url("next")
    inject(faulty, monkeypatch, "data-write")
    fut = ckpt.save(path, make_state(seed=5, mib=80))
    assert fut is not None
    with pytest.raises(SaveError) as info:
        fut.result(timeout=60)
    assert_save_error(info.value, path, errno.ENOSPC, "injected ENOSPC")
    assert ckpt.staging.allocated_bytes <= 4 * MiB
    only_entries(tmp_path, "prev")
    assert_intact(committed)


def parent_is_a_file(tmp_path: Path) -> Path:
    """A checkpoint path whose parent is a regular file: the staging dir cannot be created."""
    (tmp_path / "a-file").write_bytes(b"x")
    return tmp_path / "a-file" / "ckpt"


def test_failed_writes_return_staging_buffers_to_the_pool(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    faulty: FaultyStorage,
    checkpointers: Callable[..., tg.AsyncCheckpointer],
) -> None:
    ckpt = checkpointers()
    state = make_state(seed=6, mib=16)
    for name in ("warm-1", "warm-2"):
        fut = ckpt.save(tmp_path / name, state)
        assert fut is not None
        fut.result(timeout=60)
    steady = ckpt.staging
    inject(faulty, monkeypatch, "data-write")
    fut = ckpt.save(faulty.url("failed"), state)
    assert fut is not None
    with pytest.raises(SaveError):
        fut.result(timeout=60)
    heal(faulty, monkeypatch)
    fut = ckpt.save(tmp_path / "after", state)
    assert fut is not None
    fut.result(timeout=60)
    assert ckpt.staging == steady, "a failed save leaked its staging buffers"


def test_failure_to_create_the_staging_dir_returns_staging_buffers(
    tmp_path: Path, checkpointers: Callable[..., tg.AsyncCheckpointer]
) -> None:
    ckpt = checkpointers()
    state = make_state(seed=7, mib=16)
    for name in ("warm-1", "warm-2"):
        fut = ckpt.save(tmp_path / name, state)
        assert fut is not None
        fut.result(timeout=60)
    steady = ckpt.staging
    bad = parent_is_a_file(tmp_path)
    fut = ckpt.save(bad, state)
    assert fut is not None
    with pytest.raises(SaveError) as info:
        fut.result(timeout=60)
    assert str(bad) in str(info.value)
    fut = ckpt.save(tmp_path / "after", state)
    assert fut is not None
    fut.result(timeout=60)
    assert ckpt.staging == steady, "a failed save leaked its staging buffers"


@pytest.mark.slow
def test_failure_to_create_the_staging_dir_under_a_budget_raises_instead_of_hanging(
    tmp_path: Path,
) -> None:
    # In a child process: a save() that hangs holds the checkpointer's lock, which would also
    # hang this interpreter's exit.
    bad = parent_is_a_file(tmp_path)
    proc = subprocess.Popen(
        child_argv(
            f"""
            ckpt = tg.AsyncCheckpointer(max_staging_bytes=4 * MiB)
            state = make_state(1, 16)
            print("READY", flush=True)
            try:
                ckpt.save({str(bad)!r}, state).result(timeout=30)
            except tg.SaveError as e:
                print("SaveError:", e, flush=True)
            """
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        read_until(proc, "READY", timeout=60)
        try:
            out, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail("save() hung when the staging directory could not be created")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert f"SaveError: {bad}" in out, out


# ----------------------------------------------------------------------------------------------
# 7. leaving the interpreter waits for the save in flight


@pytest.mark.slow
@pytest.mark.parametrize(
    "how, mib",
    [("tg.save", 50), ("checkpointer", 50), ("dropped-checkpointer", 50), ("tg.save", 130)],
    ids=["default", "checkpointer", "dropped-checkpointer", "default-several-files"],
)
def test_interpreter_exit_waits_for_the_save_in_flight(tmp_path: Path, how: str, mib: int) -> None:
    path = tmp_path / "ckpt"
    start = {
        "tg.save": f"fut = tg.save({str(path)!r}, state, async_=True)",
        # Kept referenced until exit, never closed:
        "checkpointer": f"ckpt = tg.AsyncCheckpointer(); fut = ckpt.save({str(path)!r}, state)",
        # Unreferenced (garbage) as soon as save() returns:
        "dropped-checkpointer": f"fut = tg.AsyncCheckpointer().save({str(path)!r}, state)",
    }[how]
    outcome = run_child(
        f"""
        state = make_state(3, {mib})
        {start}
        print("EXITING done=" + str(fut.done()), flush=True)
        """,
        delay=0.3,
        timeout=90,
    )
    assert outcome.returncode == 0, outcome.stderr
    assert "EXITING done=False" in outcome.stdout, "the save was not in flight at exit"
    assert "Traceback" not in outcome.stderr, outcome.stderr
    tg.verify(path)
    assert_same(tg.load(path), make_state(3, mib))
    only_entries(tmp_path, "ckpt")


# ----------------------------------------------------------------------------------------------
# 8. SIGKILL in the middle of a background write


@pytest.mark.crash
@pytest.mark.parametrize("target", ["new", "overwrite"])
def test_sigkill_during_background_write_commits_nothing(
    tmp_path: Path, target: str, committed: tuple[Path, dict[str, Any]]
) -> None:
    path = tmp_path / ("next" if target == "new" else "prev")
    proc = subprocess.Popen(
        child_argv(
            f"""
            fut = tg.save({str(path)!r}, make_state(5, 50), async_=True, overwrite=True)
            print("SAVE RETURNED", flush=True)
            fut.result()
            print("COMMITTED", flush=True)
            """,
            # The data write is held until the kill: an async save hands a whole staging slab
            # to one write call, so a short delay could let the save commit before the kill.
            delay=3600.0,
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    # Once the background write is in flight (and held for DELAY seconds): kill it.
    output = kill_after(proc, "WRITING")
    assert proc.returncode == -signal.SIGKILL
    assert "COMMITTED" not in output

    # At most the killed save's staging directory is left; the earlier checkpoint is untouched
    # (for "overwrite", it is the very checkpoint the killed save was replacing).
    leftovers = [n for n in os.listdir(tmp_path) if n != "prev"]
    assert all(n.startswith(".tmp-") for n in leftovers), leftovers
    if target == "new":
        with pytest.raises(CheckpointNotFoundError):
            tg.load(path)
    assert_intact(committed)


# ----------------------------------------------------------------------------------------------
# 9. a real full disk


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A freshly mounted 16 MiB tmpfs (root needed; skipped only where mounting is forbidden)."""
    target = tmp_path / "tiny"
    target.mkdir()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    where = os.fsencode(target)
    if libc.mount(b"tmpfs", where, b"tmpfs", 0, b"size=16m") != 0:
        code = ctypes.get_errno()
        if code == errno.EPERM:
            pytest.skip("mounting a tmpfs is not permitted here (EPERM)")
        raise OSError(code, f"mount -t tmpfs {target}: {os.strerror(code)}")
    try:
        yield target
    finally:
        if libc.umount2(where, 2) != 0:  # MNT_DETACH
            code = ctypes.get_errno()
            raise OSError(code, f"umount {target}: {os.strerror(code)}")


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_disk_full_fails_the_save_cleanly(tiny_fs: Path, mode: str) -> None:
    small = make_state(seed=8, mib=1)
    tg.save(tiny_fs / "small", small)
    vfs = os.statvfs(tiny_fs)
    free_before = vfs.f_bavail * vfs.f_frsize

    big = make_state(seed=9, mib=32)
    path = tiny_fs / "big"
    with pytest.raises(SaveError) as info:
        if mode == "async":
            tg.save(path, big, async_=True).result(timeout=60)
        else:
            tg.save(path, big)
    assert_save_error(info.value, path, errno.ENOSPC, "No space left on device")
    only_entries(tiny_fs, "small")
    vfs = os.statvfs(tiny_fs)
    assert vfs.f_bavail * vfs.f_frsize == free_before, "the failed save's bytes were not freed"
    tg.verify(tiny_fs / "small")
    assert_same(tg.load(tiny_fs / "small"), small)

    # Training goes on: the next save that fits succeeds.
    fits = make_state(seed=10, mib=4)
    if mode == "async":
        tg.save(tiny_fs / "fits", fits, async_=True).result(timeout=60)
    else:
        tg.save(tiny_fs / "fits", fits)
    assert_same(tg.load(tiny_fs / "fits"), fits)
    only_entries(tiny_fs, "fits", "small")


@pytest.mark.parametrize("budget", [None, 4 * MiB], ids=["unbounded", "budget"])
def test_failure_while_staging_returns_staging_buffers(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    checkpointers: Callable[..., tg.AsyncCheckpointer],
    budget: int | None,
) -> None:
    """An error in the middle of the host copy (after slabs were taken) leaks no slab, raises
    from save() itself, commits nothing, and the next save works."""
    ckpt = checkpointers(max_staging_bytes=budget)
    state = {f"t{i}": torch.randn(MiB // 4) for i in range(8)}  # 8 MiB in 1 MiB tensors
    fut = ckpt.save(tmp_path / "warm", state)
    assert fut is not None
    fut.result(timeout=60)
    real = _async.item_source
    calls = {"n": 0}

    def failing(entries: Any, item: Any) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 6:  # several slabs are in use by now
            raise RuntimeError("device lost while copying")
        return real(entries, item)

    monkeypatch.setattr(_async, "item_source", failing)
    with pytest.raises(RuntimeError, match="device lost"):
        ckpt.save(tmp_path / "failed", state)
    assert ckpt.pool.in_use_bytes == 0, "a failed staging kept slabs out of the pool"
    assert not (tmp_path / "failed").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    monkeypatch.undo()
    fut = ckpt.save(tmp_path / "after", state)
    assert fut is not None
    fut.result(timeout=60)
    assert ckpt.pool.in_use_bytes == 0
    assert_same(tg.load(tmp_path / "after"), state)


# ----------------------------------------------------------------------------------------------
# staged bytes that disagree with the file's header fail the save; nothing is committed


def _staged_header(how: str) -> Callable[[Any], bytes]:
    """A stand-in for the stager's ``file_header``: the image it stages then no longer matches
    the header the writer records (longer, or the same length with other bytes)."""
    real = _async.file_header

    def fake(fp: Any) -> bytes:
        head = real(fp)
        if how == "longer":
            return head + b"        "
        assert b'"pt"' in head
        return head.replace(b'"pt"', b'"PT"')

    return fake


def assert_layout_error(exc: BaseException, path: Path) -> None:
    msg = str(exc)
    assert isinstance(exc, SaveError), repr(exc)
    assert str(path / "data-00000-of-00001.safetensors") in msg, msg
    assert "would not match its own header" in msg and "nothing was committed" in msg, msg
    assert "bug in Tardigrade" in msg, msg


@pytest.mark.parametrize("how", ["longer", "altered"])
@pytest.mark.parametrize("budget", [None, 4 * MiB], ids=["unbounded", "budget"])
def test_async_image_that_disagrees_with_its_header_fails_the_save(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    committed: tuple[Path, dict[str, Any]],
    checkpointers: Callable[..., tg.AsyncCheckpointer],
    how: str,
    budget: int | None,
) -> None:
    """Whatever goes wrong in staging, a file whose bytes contradict its own header (which no
    reader could load) is never committed: the writer checks every staged run against the
    header's layout and fails the save instead."""
    ckpt = checkpointers(max_staging_bytes=budget)
    state = make_state(seed=11, mib=6)
    monkeypatch.setattr(_async, "file_header", _staged_header(how))
    fut = ckpt.save(tmp_path / "bad", state)
    assert fut is not None
    with pytest.raises(SaveError) as info:
        fut.result(timeout=60)
    assert_layout_error(info.value, tmp_path / "bad")
    only_entries(tmp_path, "prev")
    assert ckpt.pool.in_use_bytes == 0, "the failed save kept slabs out of the pool"
    assert_intact(committed)
    monkeypatch.undo()
    fut = ckpt.save(tmp_path / "after", state)
    assert fut is not None
    fut.result(timeout=60)
    assert_same(tg.load(tmp_path / "after"), state)


def test_sync_stream_with_extra_bytes_fails_the_save(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    committed: tuple[Path, dict[str, Any]],
) -> None:
    """The synchronous path gets the same check: an item handed more bytes than the header
    gives it (here a stray segment at the end of the stream) fails the save."""
    real = _write.stream_borrowed

    def with_stray_segment(job: Any) -> list[list[Any]]:
        streams = [list(s) for s in real(job)]
        end = streams[0].pop()
        streams[0] += [_write.Segment(0, memoryview(b"stray bytes")), end]
        return streams

    monkeypatch.setattr(_save, "stream_borrowed", with_stray_segment)
    with pytest.raises(SaveError) as info:
        tg.save(tmp_path / "bad", make_state(seed=12, mib=2))
    assert_layout_error(info.value, tmp_path / "bad")
    assert "item 0" in str(info.value)
    only_entries(tmp_path, "prev")
    assert_intact(committed)


def test_sync_stream_failing_midway_fails_the_save_cleanly(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    committed: tuple[Path, dict[str, Any]],
) -> None:
    """A synchronous save copies accelerator tensors to host lazily, while each file is
    written: a copy that fails midway (a device error) fails the save, commits nothing and
    leaves no staging behind."""
    real = _write.item_source
    calls = {"n": 0}

    def failing(entries: Any, item: Any) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 2:  # the first tensor is written by now
            raise RuntimeError("CUDA error: device-side assert triggered")
        return real(entries, item)

    monkeypatch.setattr(_write, "item_source", failing)
    with pytest.raises(SaveError, match="device-side assert"):
        tg.save(tmp_path / "bad", make_state(seed=13, mib=2))
    only_entries(tmp_path, "prev")
    assert_intact(committed)


@pytest.mark.crash
@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize("where", ["same-directory", "faster-directory"])
def test_sigkill_with_two_saves_in_flight_loses_nothing_committed(
    tmp_path: Path, overlap: bool, where: str, committed: tuple[Path, dict[str, Any]]
) -> None:
    """Two saves in flight (``max_in_flight=2``), the first held in its data write, and the
    process killed: the first commits nothing; the second, into the same directory, waited
    its turn and commits nothing either, while into another directory it committed whole
    before the kill and stays so. ``overlap``: both copy an optimizer's state beside
    training (the model and its SGD moments)."""
    first = tmp_path / "a"
    (tmp_path / "fast").mkdir()
    second = tmp_path / ("b" if where == "same-directory" else "fast/b")
    proc = subprocess.Popen(
        child_argv(
            f"""
            held = LocalWriter.write

            def hold_a(self, data):
                if "/.tmp-a-" in self.path:
                    print("WRITING A", flush=True)
                    time.sleep(3600)
                held(self, data)

            LocalWriter.write = hold_a
            torch.manual_seed(0)
            model = torch.nn.Linear(1024, 2048)
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            model(torch.randn(4, 1024)).sum().backward()
            opt.step()
            state = {{"model": model, "opt": opt, "extra": make_state(5, 4)}}
            ckpt = tg.AsyncCheckpointer(max_in_flight=2)
            a = ckpt.save({str(first)!r}, state, overlap={overlap})
            b = ckpt.save({str(second)!r}, state, overlap={overlap})
            print("BOTH MADE", flush=True)
            b.wait_staged()
            opt.step()  # the fence: waits for both copies
            if {where == "faster-directory"}:
                b.result()
                print("B COMMITTED", flush=True)
            time.sleep(3600)
            """
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output = kill_after(
        proc, "B COMMITTED" if where == "faster-directory" else "BOTH MADE", "WRITING A"
    )
    assert proc.returncode == -signal.SIGKILL, output

    with pytest.raises(CheckpointNotFoundError):
        tg.load(first)
    if where == "same-directory":
        with pytest.raises(CheckpointNotFoundError):
            tg.load(second)
    else:
        tg.verify(second)
        torch.manual_seed(0)  # the child's first step, replayed
        model = torch.nn.Linear(1024, 2048)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.randn(4, 1024)).sum().backward()
        opt.step()
        loaded = tg.load(second)
        # Its values after one step: the second step waited for the copy (the fence).
        assert torch.equal(loaded["model"]["weight"], model.weight.detach())
        assert torch.equal(
            loaded["opt"]["state"][0]["momentum_buffer"], opt.state[model.weight]["momentum_buffer"]
        )
    leftovers = [n for n in os.listdir(tmp_path) if n not in ("prev", "fast")]
    assert all(n.startswith(".tmp-") for n in leftovers), leftovers
    assert_intact(committed)
