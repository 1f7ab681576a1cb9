"""CheckpointManager under faults: damaged checkpoints, unusable directories, a really full
disk, and preemption of a real training process by SIGTERM.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import shutil
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tardigrade as tg
from tardigrade._catalog import Catalog
from tardigrade.errors import CorruptCheckpointError, SaveError, StorageError
from tardigrade.storage import local
from tardigrade.testing import FaultyStorage

pytestmark = pytest.mark.timeout(90)

ASYNC = pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
CHILD_TIMEOUT = 60


def make_state(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    return {"model": nn.Linear(4, 3), "step": 0, "extra": {"hist": torch.zeros(5)}}


def mark(state: dict[str, Any], value: float) -> None:
    with torch.no_grad():
        state["model"].weight.fill_(value)
    state["extra"]["hist"].fill_(value)
    state["step"] = int(value)


def save_steps(mgr: tg.CheckpointManager, steps: list[int]) -> None:
    for s in steps:
        mark(mgr.state, s)
        assert mgr.save(s) is True
    mgr.wait()


def tmp_entries(d: Path) -> list[str]:
    return [n for n in os.listdir(d) if n.startswith(".tmp-")]


def flip_a_data_byte(ckpt: Path) -> None:
    data = sorted(ckpt.glob("data-*.safetensors"))
    assert data, f"no data file in {ckpt}"
    raw = bytearray(data[0].read_bytes())
    raw[-1] ^= 0xFF  # the last byte is tensor payload, never the safetensors header
    data[0].write_bytes(bytes(raw))


def warnings_about(caplog: pytest.LogCaptureFixture, needle: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "tardigrade" and r.levelno == logging.WARNING and needle in r.getMessage()
    ]


# -- 3. auto-resume past damaged checkpoints ---------------------------------------------------


@pytest.fixture
def three_checkpoints(tmp_path: Path) -> Path:
    with tg.CheckpointManager(tmp_path, make_state()) as mgr:
        save_steps(mgr, [10, 20, 30])
    return tmp_path


def test_restore_skips_a_corrupt_newer_checkpoint(
    three_checkpoints: Path, caplog: pytest.LogCaptureFixture
):
    d = three_checkpoints
    flip_a_data_byte(d / "step-000000030")
    caplog.set_level(logging.INFO, logger="tardigrade")
    state = make_state(seed=5)
    with tg.CheckpointManager(d, state, every_steps=1) as mgr:
        assert mgr.restore() == 20
        # The state holds step 20 entirely: nothing of the damaged checkpoint leaked in.
        assert torch.equal(state["model"].weight.detach(), torch.full((3, 4), 20.0))
        assert torch.equal(state["extra"]["hist"], torch.full((5,), 20.0))
        assert state["step"] == 20
        (msg,) = warnings_about(caplog, "step-000000030")
        assert "skipping" in msg and "checksum" in msg
        # Kept as evidence, and an explicit request for it fails loudly.
        assert (d / "step-000000030").is_dir()
        assert mgr.steps() == [10, 20, 30]
        with pytest.raises(CorruptCheckpointError, match="checksum"):
            mgr.restore(step=30)
        # Training goes on from 21; reaching 30 again replaces the damaged one.
        for s in range(21, 31):
            mark(state, s)
            mgr.step(s)
        mgr.wait()
        assert mgr.stats.failed == 0
        tg.verify(mgr.path(30))
        assert float(mgr.load(30)["model"]["weight"][0, 0]) == 30.0


def test_restore_skips_a_checkpoint_with_a_broken_manifest(
    three_checkpoints: Path, caplog: pytest.LogCaptureFixture
):
    d = three_checkpoints
    (d / "step-000000030" / "manifest.json").write_text('{"format": "tardigrade", "tens')
    caplog.set_level(logging.WARNING, logger="tardigrade")
    with tg.CheckpointManager(d, make_state()) as mgr:
        assert mgr.restore() == 20
    assert warnings_about(caplog, "step-000000030")
    assert (d / "step-000000030" / "manifest.json").exists()


def test_restore_skips_a_checkpoint_with_a_missing_data_file(
    three_checkpoints: Path, caplog: pytest.LogCaptureFixture
):
    d = three_checkpoints
    for f in (d / "step-000000030").glob("data-*"):
        f.unlink()
    caplog.set_level(logging.WARNING, logger="tardigrade")
    with tg.CheckpointManager(d, make_state()) as mgr:
        assert mgr.restore() == 20
    (msg,) = warnings_about(caplog, "step-000000030")
    assert "missing" in msg


def test_restore_skips_an_incomplete_checkpoint_without_deleting_it(three_checkpoints: Path):
    d = three_checkpoints
    incomplete = d / "step-000000040"
    incomplete.mkdir()
    (incomplete / "data-00000-of-00001.safetensors").write_bytes(b"\x00" * 64)
    with tg.CheckpointManager(d, make_state()) as mgr:
        assert mgr.restore() == 30
        assert incomplete.is_dir() and len(list(incomplete.iterdir())) == 1
        assert mgr.latest() == 30


def test_restore_warns_about_an_incomplete_checkpoint(
    three_checkpoints: Path, caplog: pytest.LogCaptureFixture
):
    d = three_checkpoints
    (d / "step-000000040").mkdir()
    caplog.set_level(logging.WARNING, logger="tardigrade")
    with tg.CheckpointManager(d, make_state()) as mgr:
        assert mgr.restore() == 30
    (msg,) = warnings_about(caplog, "step-000000040")
    assert "manifest" in msg


def test_restore_removes_leftover_staging_dirs(three_checkpoints: Path):
    d = three_checkpoints
    leftovers = [
        d / f".tmp-step-000000040-{uuid.uuid4().hex}",
        d / ".tmp-deleting-step-000000005",
        d / f".tmp-step-000000030-replaced-{uuid.uuid4().hex}",
    ]
    for p in leftovers:
        p.mkdir()
        (p / "data-00000-of-00001.safetensors").write_bytes(b"x" * 100)
    with tg.CheckpointManager(d, make_state()) as mgr:
        assert (d / ".lock").exists()
        assert mgr.restore() == 30
        assert tmp_entries(d) == []
        assert mgr.steps() == [10, 20, 30]
        assert (d / ".lock").exists()  # not a leftover
        save_steps(mgr, [31])


def test_restore_falls_back_past_several_bad_checkpoints(
    three_checkpoints: Path, caplog: pytest.LogCaptureFixture
):
    d = three_checkpoints
    flip_a_data_byte(d / "step-000000030")
    flip_a_data_byte(d / "step-000000020")
    caplog.set_level(logging.WARNING, logger="tardigrade")
    with tg.CheckpointManager(d, make_state()) as mgr:
        assert mgr.restore() == 10
    assert len(warnings_about(caplog, "skipping")) == 2
    flip_a_data_byte(d / "step-000000010")
    # restore() reads each candidate once, into the live state: damaged bytes found on the
    # way have landed, and with no older checkpoint to rewrite them, it says so instead of
    # returning None (which would train on from a mix).
    with (
        tg.CheckpointManager(d, make_state()) as mgr,
        pytest.raises(CorruptCheckpointError, match="no older checkpoint"),
    ):
        mgr.restore()
    assert sorted(p.name for p in d.iterdir() if p.name.startswith("step-")) == [
        "step-000000010",
        "step-000000020",
        "step-000000030",
    ]


# -- restore() falls back past a checkpoint it cannot read (issue 8, item 17) -------------------


def only_data_file(ckpt: Path) -> Path:
    (data,) = sorted(ckpt.glob("data-*.safetensors"))
    return data


def test_restore_falls_back_past_a_socket_in_place_of_a_data_file(
    three_checkpoints: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
):
    d = three_checkpoints
    data = only_data_file(d / "step-000000030")
    data.unlink()
    # A real UNIX socket bound at the data file's path: open() on it fails with ENXIO. Bound by
    # relative name from inside the checkpoint, since socket paths are limited to 108 bytes.
    monkeypatch.chdir(data.parent)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(data.name)
        monkeypatch.undo()
        assert stat.S_ISSOCK(os.lstat(data).st_mode)
        caplog.set_level(logging.WARNING, logger="tardigrade")
        state = make_state(seed=5)
        with tg.CheckpointManager(d, state) as mgr:
            assert mgr.restore() == 20
            assert torch.equal(state["model"].weight.detach(), torch.full((3, 4), 20.0))
            (msg,) = warnings_about(caplog, "step-000000030")
            assert "skipping" in msg and data.name in msg
            assert os.strerror(errno.ENXIO) in msg, msg
            with pytest.raises(StorageError, match=data.name):
                mgr.restore(step=30)  # asked for exactly this one: no fallback
        assert stat.S_ISSOCK(os.lstat(data).st_mode)  # left as evidence
    finally:
        sock.close()


def test_restore_falls_back_past_a_data_file_it_may_not_read(
    three_checkpoints: Path, caplog: pytest.LogCaptureFixture
):
    d = three_checkpoints
    data = only_data_file(d / "step-000000030")
    # The tests run as root, for whom chmod 000 changes nothing: storage gives what the
    # kernel gives an unprivileged reader (EACCES from open) for exactly this one file.
    faulty = FaultyStorage(str(d))
    faulty.fail("open_reader", where=f"step-000000030/{data.name}", error="EACCES", times=99)
    caplog.set_level(logging.WARNING, logger="tardigrade")
    state = make_state(seed=5)
    with tg.CheckpointManager(faulty.root, state) as mgr:
        assert mgr.restore() == 20
        assert torch.equal(state["extra"]["hist"], torch.full((5,), 20.0))
        (msg,) = warnings_about(caplog, "step-000000030")
        assert "injected EACCES" in msg and data.name in msg
    assert data.is_file()


def test_restore_still_raises_when_the_state_does_not_fit(three_checkpoints: Path):
    # A StateMismatchError is about the live state, not the checkpoint: an older checkpoint
    # would not fit either, so it is raised, never skipped.
    state = make_state()
    state["model"] = nn.Linear(5, 3)
    with (
        tg.CheckpointManager(three_checkpoints, state) as mgr,
        pytest.raises(tg.StateMismatchError),
    ):
        mgr.restore()


# -- restore() never cleans up under our own save in flight (issue 8, item 4) -------------------


def test_restore_waits_for_our_own_async_save_before_cleaning_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    writing = threading.Event()
    release = threading.Event()
    real_write = local.LocalWriter.write

    def held_write(self: local.LocalWriter, data: Any) -> None:
        if "step-000000002" in self.path:
            writing.set()
            release.wait(CHILD_TIMEOUT)  # held until the save is waited for (or cleaned up)
        real_write(self, data)

    def releasing(real: Any) -> Any:
        def wait(self: tg.SaveFuture, timeout: float | None = None) -> Any:
            if self.path.endswith("step-000000002"):
                release.set()  # someone waits for the held save: let it finish
            return real(self, timeout)

        return wait

    monkeypatch.setattr(local.LocalWriter, "write", held_write)
    monkeypatch.setattr(tg.SaveFuture, "exception", releasing(tg.SaveFuture.exception))
    monkeypatch.setattr(tg.SaveFuture, "result", releasing(tg.SaveFuture.result))
    staging_at_cleanup: list[list[str]] = []
    real_tidy = Catalog.tidy

    def watched_tidy(self: Catalog, **kw: Any) -> Any:
        staging_at_cleanup.append([n for n in self.names() if "step-000000002" in n])
        release.set()
        return real_tidy(self, **kw)

    monkeypatch.setattr(Catalog, "tidy", watched_tidy)
    state = make_state()
    with tg.CheckpointManager(tmp_path, state, async_save=True) as mgr:
        save_steps(mgr, [1])
        mark(state, 2)
        assert mgr.save(2) is True
        assert writing.wait(CHILD_TIMEOUT)
        assert mgr.restore() == 2
        # The cleanup ran only after our save of step 2 had committed: what it saw of step 2
        # was the committed checkpoint, not a staging directory it would take for a leftover.
        assert staging_at_cleanup == [["step-000000002"]]
        assert [(s.step, s.ok) for s in mgr.stats] == [(1, True), (2, True)]
        tg.verify(mgr.path(2))
        assert float(mgr.load(2)["model"]["weight"][0, 0]) == 2.0


# -- 5. a directory that can never work fails at construction (issue 8, item 14) ---------------


def error_records(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "tardigrade" and r.levelno == logging.ERROR
    ]


def assert_refused(
    info: pytest.ExceptionInfo[StorageError], directory: Path, code: int, *needles: str
) -> None:
    e = info.value
    assert isinstance(e, tg.TardigradeError) and isinstance(e, OSError)
    assert e.errno == code, e
    msg = str(e)
    assert str(directory) in msg and "no save could ever succeed" in msg, msg
    for needle in needles:
        assert needle in msg, msg


@pytest.mark.parametrize("on_save_error", ["warn", "raise"])
@pytest.mark.parametrize("where", ["under-the-file", "the-file-itself"])
def test_a_file_in_the_way_fails_at_construction(tmp_path: Path, on_save_error: str, where: str):
    blocker = tmp_path / "afile"
    blocker.write_text("not a directory")
    d = blocker / "ckpt" if where == "under-the-file" else blocker
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(StorageError) as info:
        tg.CheckpointManager(d, make_state(), on_save_error=on_save_error)
    code = errno.ENOTDIR if where == "under-the-file" else errno.EEXIST
    assert_refused(info, d, code, f"{blocker} is a regular file", "move it away")
    assert blocker.read_text() == "not a directory"
    assert os.listdir(tmp_path) == ["afile"]
    assert signal.getsignal(signal.SIGTERM) is before  # nothing left installed


@pytest.mark.parametrize("on_save_error", ["warn", "raise"])
@pytest.mark.parametrize("sub", ["", "ckpt"], ids=["mount-point", "missing-subdir"])
def test_a_read_only_filesystem_fails_at_construction(
    read_only_fs: Path, on_save_error: str, sub: str
):
    d = read_only_fs / sub if sub else read_only_fs
    with pytest.raises(StorageError) as info:
        tg.CheckpointManager(d, make_state(), on_save_error=on_save_error)
    assert_refused(info, d, errno.EROFS, "read-only filesystem", "writable filesystem")


def test_permission_denied_fails_at_construction(tmp_path: Path):
    # Root ignores permission bits, so the child drops the capabilities that let it
    # (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH): a real EACCES from the kernel.
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to drop CAP_DAC_OVERRIDE")
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 65534, 65534)  # someone else's directory, not writable by us
    caps = "-dac_override,-dac_read_search"
    child = textwrap.dedent(
        """
        import sys
        import tardigrade as tg
        try:
            tg.CheckpointManager(sys.argv[1], {})
        except tg.StorageError as e:
            print("REFUSED", e.errno, e)
        else:
            print("CONSTRUCTED")
        """
    )
    for d in (theirs, theirs / "ckpt"):
        setpriv = ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}", "--"]
        r = subprocess.run(
            [*setpriv, sys.executable, "-c", child, str(d)],
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT,
        )
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith(f"REFUSED {errno.EACCES} "), r.stdout + r.stderr
        assert str(d) in r.stdout and "permission denied" in r.stdout
        assert "uid 0" in r.stdout  # says who could not write
    assert os.listdir(theirs) == []


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT], ids=["ENOSPC", "EDQUOT"])
def test_a_full_disk_at_construction_is_not_fatal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, code: int
):
    # Space can be freed while training runs: only the saves are refused (and reported).
    real_mkdir = os.mkdir

    def mkdir(path: Any, *a: Any, **kw: Any) -> None:
        if ".probe-" in os.fspath(path):  # the preflight's probe directory
            raise OSError(code, os.strerror(code), os.fspath(path))
        real_mkdir(path, *a, **kw)

    monkeypatch.setattr(os, "mkdir", mkdir)
    caplog.set_level(logging.WARNING, logger="tardigrade")
    with tg.CheckpointManager(tmp_path, make_state()) as mgr:
        (warning,) = [r.getMessage() for r in caplog.records if os.strerror(code) in r.getMessage()]
        assert str(tmp_path) in warning and "saves will fail" in warning
        monkeypatch.undo()  # space freed
        assert mgr.save(1) is True
        mgr.wait()
        assert mgr.steps() == [1]


def test_a_really_full_disk_at_construction_constructs_and_warns(
    small_tmpfs: Path, caplog: pytest.LogCaptureFixture
):
    d = small_tmpfs / "ckpt"
    d.mkdir()
    with open(small_tmpfs / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC
    caplog.set_level(logging.WARNING, logger="tardigrade")
    mgr = tg.CheckpointManager(d, make_state())  # does not raise
    try:
        logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        (full,) = [m for m in logged if "is full" in m]
        assert str(d) in full and "saves will fail until space is freed" in full
    finally:
        mgr.close()


@ASYNC
def test_a_directory_turning_read_only_mid_run_does_not_stop_training(
    small_tmpfs: Path, caplog: pytest.LogCaptureFixture, async_save: bool, remount: Any
):
    # What still fails in the background after construction (an ext4 error remounting the
    # disk read-only) is reported and training goes on; the saves succeed again once fixed.
    d = small_tmpfs / "ckpt"
    caplog.set_level(logging.INFO, logger="tardigrade")
    mgr = tg.CheckpointManager(d, make_state(), every_steps=2, async_save=async_save)
    try:
        assert mgr.save(1) is True
        mgr.wait()
        remount(small_tmpfs, "ro")
        try:
            caplog.clear()
            assert mgr.save(3) is async_save  # async: the failure surfaces later
            for s in range(4, 7):
                mgr.step(s)
            mgr.wait()
        finally:
            remount(small_tmpfs, "rw")
        mgr.step(8)
        mgr.wait()
        assert [(s.step, s.ok) for s in mgr.stats] == [
            (1, True),
            (3, False),
            (4, False),
            (6, False),
            (8, True),
        ]
        errors = error_records(caplog)
        for step in (3, 4, 6):
            (msg,) = [m for m in errors if f"SAVE FAILED for step {step} " in m]
            assert "Read-only file system" in msg
        assert mgr.steps() == [1, 8]
        assert tmp_entries(d) == []
    finally:
        mgr.close()
    assert not (d / ".lock").exists()


# -- 5. a really full disk --------------------------------------------------------------------


@ASYNC
def test_full_disk(small_tmpfs: Path, caplog: pytest.LogCaptureFixture, async_save: bool):
    d = small_tmpfs / "ckpt"
    # 6 MiB of state: two checkpoints fit into 16 MiB, a third does not.
    state = {"model": {"w": torch.zeros(6 * 1024 * 1024 // 4)}, "step": 0}
    caplog.set_level(logging.INFO, logger="tardigrade")

    def mark_big(s: int) -> None:
        state["model"]["w"].fill_(float(s))
        state["step"] = s

    mgr = tg.CheckpointManager(d, state, every_steps=1, keep_last=2, async_save=async_save)
    for s in range(1, 5):  # the training loop goes on through the failures
        mark_big(s)
        mgr.step(s)
    mgr.wait()
    assert [(s.step, s.ok) for s in mgr.stats] == [(1, True), (2, True), (3, False), (4, False)]
    assert mgr.stats.failed == 2
    errors = error_records(caplog)
    for step in (3, 4):
        (msg,) = [m for m in errors if f"SAVE FAILED for step {step} " in m]
        assert "No space left" in msg
    assert "No space left" in (mgr.stats[2].error or "")
    # Nothing half-written stays behind, and the earlier checkpoints are intact.
    assert tmp_entries(d) == []
    assert mgr.steps() == [1, 2]
    for s in (1, 2):
        tg.verify(mgr.path(s))
        tree = mgr.load(s)
        assert tree["step"] == s
        assert torch.equal(tree["model"]["w"], torch.full_like(state["model"]["w"], float(s)))

    # An operator frees space: the next save succeeds and retention works again.
    shutil.rmtree(mgr.path(1))
    mark_big(5)
    mgr.step(5)
    mgr.wait()
    assert mgr.stats[-1].ok
    assert mgr.steps() == [2, 5]
    mgr.close()
    with tg.CheckpointManager(d, {"model": {"w": torch.ones(1)}, "step": -1}) as again:
        assert again.load()["step"] == 5


def test_full_disk_raise_mode(small_tmpfs: Path):
    d = small_tmpfs / "ckpt"
    state = {"w": torch.zeros(10 * 1024 * 1024 // 4)}  # 10 MiB: fits once only
    with tg.CheckpointManager(d, state, on_save_error="raise", async_save=False) as mgr:
        assert mgr.save(1) is True
        state["w"].add_(1)  # new bytes (the same ones would be shared, taking no room)
        with pytest.raises(SaveError, match="No space left"):
            mgr.save(2)
        assert mgr.steps() == [1]
        assert tmp_entries(d) == []
        tg.verify(mgr.path(1))


# -- 6. preemption of a real training process ---------------------------------------------------


TRAIN = textwrap.dedent(
    r"""
    import sys
    import time

    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import tardigrade as tg

    ckpt_dir, final_path, total = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    ds = TensorDataset(torch.randn(48, 8), torch.randn(48, 1))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 1))
    # A hand-written momentum SGD: its buffers are user state in the checkpoint (torch.optim
    # would import torch._dynamo on the first step, seconds of start-up on a slow machine).
    momentum = [torch.zeros_like(p) for p in model.parameters()]
    sampler = tg.ResumableSampler(len(ds), shuffle=True, seed=3)
    # The loader gets its own generator: otherwise every new DataLoader iterator draws a seed
    # from the global torch RNG, and a run resumed mid-epoch would draw once more than the
    # uninterrupted run.
    loader = DataLoader(ds, batch_size=8, sampler=sampler, generator=torch.Generator())
    state = {"model": model, "momentum": momentum, "rng": tg.RNGState(), "data": sampler}

    mgr = tg.CheckpointManager(ckpt_dir, state, every_steps=10**6, async_save=True)
    start = mgr.restore()
    print(f"START {start}", flush=True)
    step = 1 if start is None else start + 1
    while step <= total and not mgr.should_stop:
        for x, y in loader:
            model.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            with torch.no_grad():
                for p, buf in zip(model.parameters(), momentum):
                    buf.mul_(0.9).add_(p.grad)
                    p.sub_(0.05 * buf)
            mgr.step(step, metrics={"loss": loss.item()})
            print(f"STEP {step}", flush=True)
            if mgr.should_stop:
                print(f"STOPPED {step}", flush=True)
                break
            step += 1
            if step > total:
                break
            time.sleep(0.02)
    mgr.close()
    if not mgr.should_stop:
        tg.save(final_path, {"model": model, "momentum": momentum})
        print("DONE", flush=True)
    """
)
TOTAL = 60


class Child:
    """A subprocess whose stdout lines are read by a thread, so waits can time out."""

    def __init__(self, args: list[str]) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_for(self, prefix: str, timeout: float = CHILD_TIMEOUT) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.kill()
                pytest.fail(f"child printed no {prefix!r} in {timeout} s:\n" + "\n".join(self.seen))
            if line is None:
                pytest.fail(f"child ended before {prefix!r}:\n" + "\n".join(self.seen))
            self.seen.append(line)
            if line.startswith(prefix):
                return line

    def finish(self, timeout: float = CHILD_TIMEOUT) -> int:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail("child did not exit:\n" + "\n".join(self.seen))
        while (line := self.lines.get(timeout=10)) is not None:
            self.seen.append(line)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.mark.slow
def test_sigterm_saves_stops_and_resumes_bit_exactly(tmp_path: Path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)

    def run(ckpt: Path, final: Path) -> Child:
        return Child([sys.executable, str(script), str(ckpt), str(final), str(TOTAL)])

    # The uninterrupted reference run, started first so it overlaps with the others.
    ref = run(tmp_path / "ref", tmp_path / "ref-final")
    try:
        preempted = run(tmp_path / "ckpt", tmp_path / "final")
        try:
            preempted.wait_for("STEP 10")
            preempted.proc.send_signal(signal.SIGTERM)
            stopped = int(preempted.wait_for("STOPPED").split()[1])
            assert preempted.finish() == 0, "\n".join(preempted.seen)
        finally:
            preempted.kill()
        assert 10 <= stopped < TOTAL
        assert "DONE" not in preempted.seen
        assert not (tmp_path / "final").exists()
        # Exactly one checkpoint, at the step where it stopped; no policy save happened.
        assert sorted(os.listdir(tmp_path / "ckpt")) == [f"step-{stopped:09d}"]
        tg.verify(tmp_path / "ckpt" / f"step-{stopped:09d}")

        resumed = run(tmp_path / "ckpt", tmp_path / "final")
        try:
            assert resumed.wait_for("START") == f"START {stopped}"
            assert resumed.wait_for("STEP") == f"STEP {stopped + 1}"
            assert resumed.finish() == 0, "\n".join(resumed.seen)
        finally:
            resumed.kill()
        assert "DONE" in resumed.seen
        assert ref.finish() == 0, "\n".join(ref.seen)
    finally:
        ref.kill()

    assert ref.seen[0] == "START None"
    got = tg.load(tmp_path / "final")
    want = tg.load(tmp_path / "ref-final")
    for key, value in want["model"].items():
        assert torch.equal(got["model"][key], value), key
    assert len(got["momentum"]) == len(want["momentum"]) == 4
    for a, b in zip(got["momentum"], want["momentum"], strict=True):
        assert torch.equal(a, b)


def test_a_manager_that_lost_its_lock_deletes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Fencing: retention and leftover cleanup check the lock is still ours before deleting.
    state = {"w": torch.zeros(2)}
    mgr = tg.CheckpointManager(tmp_path, state, async_save=False, keep_last=None)
    try:
        for s in (1, 2, 3):
            mgr.save(s)
        (tmp_path / ".tmp-step-000000009-dead").mkdir()

        def lost() -> None:
            raise tg.CheckpointLockedError(f"{tmp_path}: taken over (injected)")

        monkeypatch.setattr(mgr._lock, "check", lost)
        mgr.keep_last = 1
        caplog.set_level(logging.ERROR, logger="tardigrade")
        mgr._retainer.retain()
        mgr._restorer.tidy()
        assert mgr.steps() == [1, 2, 3]
        assert (tmp_path / ".tmp-step-000000009-dead").is_dir()
        assert any("not removing old checkpoints" in r.getMessage() for r in caplog.records)
        assert any("not cleaning up leftovers" in r.getMessage() for r in caplog.records)
    finally:
        monkeypatch.undo()
        mgr.close()
