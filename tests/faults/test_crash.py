"""Crash safety with real processes killed by SIGKILL in the middle of a save.

A child process saves checkpoint A (complete), then starts saving checkpoint B next to it and is
SIGKILLed at a chosen point of the commit protocol (by a hook it installs in the local storage
backend), or at a random moment chosen by the parent. Afterwards A must load bit-exactly and
verify, and B must either be invisible or - only when the kill came after the rename - complete.
"""

from __future__ import annotations

import os
import random
import runpy
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import tardigrade as tg
from tardigrade.errors import CheckpointNotFoundError

pytestmark = [pytest.mark.crash, pytest.mark.timeout(180)]

CHILD_TIMEOUT = 90
SEED_A, SEED_B = 1, 2

# The child's code. The parent runs the same file (without __main__) to re-create the expected
# state from its seed, so both sides agree on every byte.
CHILD = textwrap.dedent(
    r'''
    import os
    import signal
    import sys

    import torch

    BIG_MIB = 8


    def make_state(seed):
        g = torch.Generator().manual_seed(seed)
        return {
            "model": {
                "big": torch.randn(BIG_MIB * 1024 * 1024 // 4, generator=g).reshape(-1, 256),
                "w": torch.randn(64, 32, generator=g).to(torch.bfloat16),
                "ids": torch.randint(-1000, 1000, (999,), generator=g),
                "mask": torch.rand(33, generator=g) > 0.5,
            },
            "step": seed,
            "meta": {"name": f"ckpt-{seed}", "t": (1, 2.5, None, b"\x00\xff")},
        }


    def die(where):
        sys.stderr.write(f"KILLPOINT {where}\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)


    def arm(point, parent):
        """Install a hook that SIGKILLs this process at ``point`` of the next save."""
        from tardigrade._commit import RenameCommit
        from tardigrade.storage import local

        final_b = os.path.join(parent, "B")
        if point == "begin":
            orig_begin = RenameCommit.begin

            def begin(self, name, save_id):
                staging = orig_begin(self, name, save_id)
                die(f"begin {staging}")

            RenameCommit.begin = begin
        elif point == "mid_data":
            orig_write = local.LocalWriter.write

            def write(self, data, **kw):
                # Once a data file holds 1 MiB (the big tensor is being streamed), write half
                # of the next piece and die: the file ends in the middle of a tensor.
                view = memoryview(data).cast("B")
                done = getattr(self, "_crash_written", 0)
                if self.path.endswith(".safetensors") and done + view.nbytes >= 1024 * 1024:
                    half = max(1, view.nbytes // 2)
                    orig_write(self, view[:half], **kw)
                    die(f"mid_data {self.path} after {done + half} bytes")
                self._crash_written = done + view.nbytes
                orig_write(self, data, **kw)

            local.LocalWriter.write = write
        elif point == "manifest_open":
            orig_init = local.LocalWriter.__init__

            def init(self, path, **kw):
                orig_init(self, path, **kw)
                if os.path.basename(path) == "manifest.json":
                    die(f"manifest_open {path}")

            local.LocalWriter.__init__ = init
        elif point == "before_rename":
            # The manifest is written and fsynced in staging; the rename has not happened.

            def rename_new(src, dst):
                die(f"before_rename {src}")

            local._rename_new = rename_new
        elif point == "after_rename_before_fsync":
            orig_fsync_dir = local.fsync_dir

            def fsync_dir(path):
                if os.path.abspath(path) == os.path.abspath(parent) and os.path.isdir(final_b):
                    die(f"after_rename_before_fsync {path}")
                orig_fsync_dir(path)

            local.fsync_dir = fsync_dir
        elif point == "after_commit":
            orig_commit = RenameCommit.commit

            def commit(self, staging, name, manifest, **kw):
                orig_commit(self, staging, name, manifest, **kw)
                die(f"after_commit {name}")

            RenameCommit.commit = commit
        elif point == "after_replace_exchange":
            # The replace swaps old and new atomically (renameat2 RENAME_EXCHANGE); die right
            # after the swap, before the old copy is removed or the parent is fsynced.
            orig_exchange = local._exchange

            def exchange(a, b):
                if not orig_exchange(a, b):
                    die("after_replace_exchange unsupported")
                die(f"after_replace_exchange swapped {a} and {b}")

            local._exchange = exchange
        else:
            raise SystemExit(f"unknown kill point {point}")


    def main():
        import tardigrade as tg

        mode, parent = sys.argv[1], sys.argv[2]
        seed_a, seed_b = int(sys.argv[3]), int(sys.argv[4])
        tg.save(os.path.join(parent, "A"), make_state(seed_a))
        open(os.path.join(parent, "..", "A-committed"), "w").close()
        if mode == "loop":
            # save until killed: B-0001, B-0002, ... each a new checkpoint
            i = 0
            while True:
                i += 1
                tg.save(os.path.join(parent, f"B-{i:04d}"), make_state(seed_b + i))
                print(f"COMMITTED {i}", flush=True)
        if mode == "overwrite":
            tg.save(os.path.join(parent, "B"), make_state(seed_a))
            arm("after_replace_exchange", parent)
            tg.save(os.path.join(parent, "B"), make_state(seed_b), overwrite=True)
        else:
            arm(mode, parent)
            tg.save(os.path.join(parent, "B"), make_state(seed_b))
        print("SAVE RETURNED", flush=True)


    if __name__ == "__main__":
        main()
    '''
)


@pytest.fixture
def child(tmp_path: Path) -> dict[str, Any]:
    script = tmp_path / "crash_child.py"
    script.write_text(CHILD)
    ns = runpy.run_path(str(script), run_name="crash_child")
    parent = tmp_path / "ckpts"
    parent.mkdir()
    return {"script": script, "make_state": ns["make_state"], "parent": parent}


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_child(c: dict[str, Any], mode: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, str(c["script"]), mode, str(c["parent"]), str(SEED_A), str(SEED_B)],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT,
        env=child_env(),
    )
    assert proc.returncode == -signal.SIGKILL, (
        f"child was not killed (rc={proc.returncode}); the kill point was never reached\n"
        f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )
    assert f"KILLPOINT {mode}" in proc.stderr, proc.stderr
    assert "SAVE RETURNED" not in proc.stdout
    return proc


def assert_tensors_bit_equal(got: Any, want: Any, path: str = "state") -> None:
    assert type(got) is type(want), path
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, path
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), path
    elif isinstance(want, dict):
        assert list(got) == list(want), path
        for k in want:
            assert_tensors_bit_equal(got[k], want[k], f"{path}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_tensors_bit_equal(g, w, f"{path}[{i}]")
    else:
        assert got == want, path


def assert_intact(path: Path, want: Any) -> None:
    """A complete checkpoint: verifies and loads bit-exactly."""
    report = tg.verify(path)
    assert report.tensors > 0
    assert_tensors_bit_equal(tg.load(path), want)


def assert_invisible(path: Path) -> None:
    """No checkpoint at ``path``: not loadable, not verifiable, not readable."""
    with pytest.raises(CheckpointNotFoundError):
        tg.load(path)
    with pytest.raises(CheckpointNotFoundError):
        tg.verify(path)
    with pytest.raises(CheckpointNotFoundError):
        tg.read_manifest(path)


def staging_dirs(parent: Path) -> list[Path]:
    return sorted(p for p in parent.iterdir() if p.name.startswith(".tmp-"))


def data_file_sizes(ckpt: Path) -> dict[str, int]:
    return {f["name"]: f["size"] for f in tg.read_manifest(ckpt)["files"]}


@pytest.mark.parametrize(
    "point", ["begin", "mid_data", "manifest_open", "before_rename"], ids=lambda p: p
)
def test_kill_before_commit_leaves_previous_checkpoint_and_no_new_one(
    child: dict[str, Any], point: str
) -> None:
    run_child(child, point)
    parent: Path = child["parent"]
    make_state = child["make_state"]

    assert_intact(parent / "A", make_state(SEED_A))
    assert_invisible(parent / "B")
    names = sorted(p.name for p in parent.iterdir())
    assert names[-1] == "A" and all(n.startswith(".tmp-B-") for n in names[:-1]), names

    # the kill really happened where intended: inspect what the save left in staging
    (staging,) = staging_dirs(parent)
    files = {p.name: p.stat().st_size for p in staging.iterdir()}
    if point == "begin":
        assert files == {}
    elif point == "mid_data":
        assert "manifest.json" not in files
        # the same save, completed by the parent, gives the full sizes to compare against
        tg.save(parent / "ref", make_state(SEED_B))
        full = data_file_sizes(parent / "ref")
        assert set(files) <= set(full)
        assert any(files[n] < full[n] for n in files), (files, full)
    elif point == "manifest_open":
        assert files.get("manifest.json") == 0
        assert any(n.endswith(".safetensors") for n in files)
    elif point == "before_rename":
        assert files.get("manifest.json", 0) > 0

    # the leftovers do not block the next save of B, which is then complete
    tg.save(parent / "B", make_state(SEED_B))
    assert_intact(parent / "B", make_state(SEED_B))
    assert_intact(parent / "A", make_state(SEED_A))


@pytest.mark.parametrize("point", ["after_rename_before_fsync", "after_commit"], ids=lambda p: p)
def test_kill_after_rename_leaves_both_checkpoints_complete(
    child: dict[str, Any], point: str
) -> None:
    run_child(child, point)
    parent: Path = child["parent"]
    make_state = child["make_state"]

    assert_intact(parent / "A", make_state(SEED_A))
    assert_intact(parent / "B", make_state(SEED_B))
    assert staging_dirs(parent) == []
    assert sorted(p.name for p in parent.iterdir()) == ["A", "B"]


def test_kill_during_overwrite_keeps_old_or_new_checkpoint(child: dict[str, Any]) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(child["script"]),
            "overwrite",
            str(child["parent"]),
            str(SEED_A),
            str(SEED_B),
        ],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT,
        env=child_env(),
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert "KILLPOINT after_replace_exchange swapped" in proc.stderr, proc.stderr
    parent: Path = child["parent"]
    make_state = child["make_state"]
    assert_intact(parent / "A", make_state(SEED_A))
    loaded = tg.load(parent / "B")  # the old B (seed A) or the new one (seed B), never nothing
    want = make_state(SEED_A if loaded["step"] == SEED_A else SEED_B)
    assert_intact(parent / "B", want)


def wait_for(path: Path, proc: subprocess.Popen[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"child exited early (rc={proc.returncode}):\n{out}\n{err}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"child did not create {path} within {timeout}s")
        time.sleep(0.005)


@pytest.mark.parametrize("seed", range(8))
def test_kill_at_a_random_moment_of_repeated_saves(child: dict[str, Any], seed: int) -> None:
    parent: Path = child["parent"]
    make_state = child["make_state"]
    marker = parent.parent / "A-committed"
    proc = subprocess.Popen(
        [sys.executable, str(child["script"]), "loop", str(parent), str(SEED_A), str(SEED_B)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        wait_for(marker, proc, CHILD_TIMEOUT)
        delay = random.Random(seed).uniform(0.05, 0.8)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=CHILD_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == -signal.SIGKILL, err
    committed = {int(line.split()[1]) for line in out.splitlines() if line.startswith("COMMITTED")}

    assert_intact(parent / "A", make_state(SEED_A))
    complete = set()
    for d in sorted(parent.iterdir()):
        if d.name.startswith(".tmp-") or d.name == "A":
            continue
        assert d.name.startswith("B-"), d.name
        i = int(d.name.removeprefix("B-"))
        # a visible checkpoint is always complete and holds exactly what was saved
        assert_intact(d, make_state(SEED_B + i))
        complete.add(i)
    # every save the child saw return is there; at most one more finished its rename
    assert committed <= complete
    assert len(complete - committed) <= 1
    assert complete == set(range(1, len(complete) + 1))
    assert len(staging_dirs(parent)) <= 1
    for i in range(1, 100):
        if i not in complete:
            assert_invisible(parent / f"B-{i:04d}")
            break
