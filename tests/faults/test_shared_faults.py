"""Shared data (format 7) under damage and forgery: a reference to an object that is missing,
truncated, of other bytes (a forged collision: the right name, other content), a link, or
named outside ``.shared/``; a v7 manifest relabelled as v6. Each is a TardigradeError naming
the checkpoint and the object; ``verify`` reports every broken reference; ``restore()`` falls
back to the newest checkpoint that is whole."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import tardigrade as tg
from tardigrade.errors import ChecksumMismatchError, CorruptCheckpointError, TardigradeError

from .test_malformed import edit_manifest

OBJECT_BYTES = 1 << 20


def shared_pair(tmp_path: Path) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """Checkpoints ``a`` and ``b`` of one root: ``b`` references ``a``'s two shared objects."""
    state = {"x": torch.arange(262144.0).reshape(256, 1024), "y": -torch.ones(512, 512)}
    tg.save(tmp_path / "plain", state)
    tg.save(tmp_path / "a", state, base=tmp_path / "plain")
    tg.save(tmp_path / "b", state, base=tmp_path / "a")
    return tmp_path / "a", tmp_path / "b", state


def objects(ckpt: Path) -> list[Path]:
    doc = tg.read_manifest(ckpt)
    return [ckpt.parent / f["name"] for f in doc["files"] if f["name"].startswith(".shared/")]


@pytest.mark.parametrize("damage", ["missing", "truncated", "other bytes", "a link", "a dir"])
def test_a_damaged_shared_object_is_named_by_load_and_verify(tmp_path: Path, damage: str) -> None:
    _, b, state = shared_pair(tmp_path)
    x, y = objects(b)
    if damage == "missing":
        os.unlink(x)
    elif damage == "truncated":
        os.truncate(x, x.stat().st_size - 1)
    elif damage == "other bytes":
        # A forged collision: a valid object of the same dtype and shape under x's name.
        raw = bytearray(x.read_bytes())
        raw[-4:] = b"\x00\x00\x80\x3f"
        x.write_bytes(bytes(raw))
    elif damage == "a link":
        os.unlink(x)
        os.symlink(y, x)
    else:
        os.unlink(x)
        x.mkdir()
    error = ChecksumMismatchError if damage == "other bytes" else CorruptCheckpointError
    with pytest.raises(error, match=x.name):
        tg.verify(b)
    with pytest.raises(TardigradeError, match=x.name):
        tg.load(b)
    # What does not read the damaged object still loads.
    assert torch.equal(tg.load(b, keys=["y"])["y"], state["y"])


def test_verify_reports_every_broken_reference(tmp_path: Path) -> None:
    _, b, _ = shared_pair(tmp_path)
    x, y = objects(b)
    os.unlink(x)
    os.truncate(y, 10)
    with pytest.raises(CorruptCheckpointError) as caught:
        tg.verify(b)
    assert "2 of 2 data file(s)" in str(caught.value)
    assert x.name in str(caught.value) and y.name in str(caught.value)


@pytest.mark.parametrize(
    "name",
    [
        ".shared/bf/../../../escape.safetensors",
        "../.shared/bf/bf833c5e65412dc18c9c22256741d800.safetensors",
        ".shared/zz/zz833c5e65412dc18c9c22256741d800.safetensors",
        ".shared/ab/bf833c5e65412dc18c9c22256741d800.safetensors",
        ".shared/bf/bf833c5e65412dc18c9c22256741d800.safetensors/x",
        "/etc/.shared/bf/bf833c5e65412dc18c9c22256741d800.safetensors",
        ".shared/bf/BF833C5E65412DC18C9C22256741D800.safetensors",
    ],
)
def test_a_reference_outside_the_shared_directory_is_refused(tmp_path: Path, name: str) -> None:
    _, b, _ = shared_pair(tmp_path)
    real = objects(b)[0].relative_to(tmp_path).as_posix()

    def edit(doc: dict[str, Any]) -> None:
        for f in doc["files"]:
            if f["name"] == real:
                f["name"] = name
        for t in doc["tensors"]:
            for c in t["chunks"]:
                if c["file"] == real:
                    c["file"] = name

    edit_manifest(b, edit)
    with pytest.raises(CorruptCheckpointError, match="not a plain file name"):
        tg.load(b)


def test_a_v7_manifest_relabelled_as_v6_is_refused(tmp_path: Path) -> None:
    _, b, _ = shared_pair(tmp_path)
    edit_manifest(b, lambda d: d.update(format_version=6))
    with pytest.raises(CorruptCheckpointError, match="not a plain file name"):
        tg.read_manifest(b)


def test_restore_falls_back_to_the_newest_checkpoint_whose_shared_data_is_whole(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    state = {"w": torch.zeros(512, 512)}
    with tg.CheckpointManager(root, state, every_steps=1) as mgr:
        for step in (1, 2):
            state["w"].fill_(float(step))  # each step its own object
            mgr.step(step)
            mgr.wait()
    newest = objects(root / "step-000000002")
    assert len(newest) == 1 and newest != objects(root / "step-000000001")
    os.truncate(newest[0], 100)
    state["w"].zero_()
    with tg.CheckpointManager(root, state) as mgr:
        assert mgr.restore() == 1
    assert torch.equal(state["w"], torch.ones(512, 512))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["staging", "deciding"])
@pytest.mark.parametrize("ram", [False, True], ids=["directory", "ram-tier"])
def test_a_sharing_save_failing_mid_way_hangs_nothing_and_leaks_no_slab(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ram: bool, where: str
) -> None:
    """A failure while staging, or while a writer decides on an object it has taken whole
    (its stream ended: waiting for more would hang the save), fails that save only."""
    from tardigrade import _async, _write

    state = {f"t{i}": torch.randn(512, 1024) for i in range(4)}  # 2 MiB each: shared objects
    shm = tmp_path / "shm"
    shm.mkdir()
    with tg.CheckpointManager(
        tmp_path / "run",
        state,
        every_steps=1,
        on_save_error="raise",
        ram_tier=shm if ram else False,
    ) as mgr:
        mgr.step(1)
        mgr.wait()
        calls = {"n": 0}
        if where == "staging":
            real = _async.item_source

            def failing(entries: Any, item: Any) -> torch.Tensor:
                calls["n"] += 1
                if calls["n"] == 3:  # two objects staged
                    raise RuntimeError("device lost while copying")
                return real(entries, item)

            monkeypatch.setattr(_async, "item_source", failing)
        else:
            named = _write.shared_name

            def naming(digest: str) -> str:
                calls["n"] += 1
                if calls["n"] >= 2:  # the disk's writers and the RAM tier's alike
                    raise RuntimeError("device lost while deciding")
                return named(digest)

            monkeypatch.setattr(_write, "shared_name", naming)
        with pytest.raises((RuntimeError, TardigradeError), match="device lost"):
            mgr.step(2)
            mgr.wait()
        monkeypatch.undo()
        assert mgr._async is not None and mgr._async.pool.in_use_bytes == 0
        for t in state.values():
            t.add_(1)
        mgr.step(3)
        mgr.wait()
        assert mgr.steps() == [1, 3]
    got = tg.load(tmp_path / "run" / "step-000000003")
    assert all(torch.equal(got[k], state[k]) for k in state)


@pytest.mark.parametrize("where", [".shared", ".shared/ab"])
def test_the_sweep_follows_no_link_out_of_the_root(tmp_path: Path, where: str) -> None:
    root = tmp_path / "run"
    tg.save(root / "a", {"w": torch.ones(3)})
    outside = tmp_path / "outside" / "ab"
    outside.mkdir(parents=True)
    victim = outside / ("ab" + "0" * 30 + ".safetensors")  # named as an unreferenced object
    victim.write_bytes(b"not the root's")
    old = victim.stat().st_mtime - 7200
    os.utime(victim, (old, old))
    if where == ".shared":
        os.symlink(outside.parent, root / ".shared")
    else:
        (root / ".shared").mkdir()
        os.symlink(outside, root / ".shared" / "ab")
    assert tg.Catalog(root).sweep_shared(grace=False) == []
    assert victim.read_bytes() == b"not the root's"
