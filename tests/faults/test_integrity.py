"""Every byte of a checkpoint is covered, keys never collide, and a racing sync save verifies.

Single-byte damage anywhere (manifest, safetensors header, tensor bytes) must be caught by
``load``, ``verify`` and ``restore()``; saves must never commit something their own reader
rejects.
"""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tardigrade as tg
from tardigrade import _plan
from tardigrade.errors import CorruptCheckpointError, SaveError, TardigradeError
from tardigrade.format.jsonio import dumps
from tardigrade.format.manifest import seal

MANIFEST = "manifest.json"


def small_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(4, 3, generator=g),
        "b": torch.arange(5, dtype=torch.int64),
        "rng": {"python": random.Random(7).getstate()[1][:20], "seed": 1234567},
        "lr": 0.001,
        "step": 42,
        "name": "run-a",
        "arr": np.arange(3, dtype=np.float32),
    }


def same(a: Any, b: Any) -> bool:
    """Bitwise equality of loaded trees (type included)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and a.view(-1).view(torch.uint8).equal(b.view(-1).view(torch.uint8))
        )
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        return a.hex() == b.hex()
    return a == b


def checkpoint_files(ckpt: Path) -> list[Path]:
    return sorted(p for p in ckpt.iterdir() if p.is_file())


@pytest.mark.parametrize("target", ["manifest", "data"])
def test_every_single_byte_change_is_detected_by_load_and_verify(
    tmp_path: Path, target: str
) -> None:
    ckpt = tmp_path / "ckpt"
    tg.save(ckpt, small_state(), step=42)
    original = tg.load(ckpt)
    files = [p for p in checkpoint_files(ckpt) if (p.name == MANIFEST) == (target == "manifest")]
    rnd = random.Random(0)
    changed = 0
    for path in files:
        blob = path.read_bytes()
        for pos in range(len(blob)):
            damaged = bytearray(blob)
            damaged[pos] ^= rnd.randrange(1, 256)
            path.write_bytes(bytes(damaged))
            with pytest.raises(TardigradeError):
                tg.verify(ckpt)
            try:
                value = tg.load(ckpt)
            except TardigradeError:
                pass
            else:  # pragma: no cover - the assertion message is the point
                assert same(value, original), f"{path.name} byte {pos}: loaded a different value"
                pytest.fail(f"{path.name} byte {pos} changed and load() did not notice")
            changed += 1
        path.write_bytes(blob)
    assert changed > 200
    assert same(tg.load(ckpt), original)


def digit_edits(raw: bytes, count: int, seed: int) -> list[tuple[int, bytes]]:
    """``count`` single-digit edits inside the manifest (what a bad disk sector or a stray
    editor keystroke does to numbers: RNG state, sizes, offsets, counters)."""
    rnd = random.Random(seed)
    digits = [i for i, c in enumerate(raw) if 0x30 <= c <= 0x39]
    out = []
    for pos in rnd.sample(digits, min(count, len(digits))):
        new = 0x30 + (raw[pos] - 0x30 + rnd.randrange(1, 10)) % 10
        out.append((pos, raw[:pos] + bytes([new]) + raw[pos + 1 :]))
    return out


def test_restore_falls_back_past_a_manifest_with_an_edited_digit(tmp_path: Path) -> None:
    state = {"w": torch.zeros(3), "step": 0, "rng": tg.RNGState()}
    with tg.CheckpointManager(tmp_path, state, async_save=False) as mgr:
        state["w"] += 1
        state["step"] = 1
        mgr.save(1)
        state["w"] += 1
        state["step"] = 2
        mgr.save(2)
    newest = tmp_path / "step-000000002" / MANIFEST
    raw = newest.read_bytes()
    for pos, damaged in digit_edits(raw, 25, seed=1):
        newest.write_bytes(damaged)
        live = {"w": torch.full((3,), 9.0), "step": -1, "rng": tg.RNGState()}
        with tg.CheckpointManager(tmp_path, live, async_save=False) as mgr:
            assert mgr.restore() == 1, f"digit at byte {pos}: restore did not fall back"
        assert live["step"] == 1 and live["w"].tolist() == [1.0, 1.0, 1.0]
    newest.write_bytes(raw)


def test_an_unsealed_v2_manifest_is_rejected(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    tg.save(ckpt, small_state())
    doc = json.loads((ckpt / MANIFEST).read_bytes())
    del doc["manifest_checksum"]
    (ckpt / MANIFEST).write_bytes(dumps(doc))
    with pytest.raises(CorruptCheckpointError, match="manifests end with their checksum"):
        tg.load(ckpt)
    # Re-sealed (what a tool that edits manifests on purpose must do), it loads again.
    (ckpt / MANIFEST).write_bytes(seal(dumps(doc)))
    assert same(tg.load(ckpt), tg.load(ckpt))


# ----------------------------------------------------------------------------------------------
# keys


def test_split_chunk_keys_do_not_collide_with_user_keys(tmp_path: Path) -> None:
    # 136 MB is split over two files, so "w" becomes chunks "w@0", "w@..."; the user's own
    # "w@0" must not be mistaken for one of them.
    big = torch.arange(34_000_000, dtype=torch.float32)
    state = {"w": big, "w@0": torch.tensor([1.0, 2.0, 3.0])}
    tg.save(tmp_path / "a", state)
    back = tg.load(tmp_path / "a")
    assert torch.equal(back["w"], big)
    assert back["w@0"].tolist() == [1.0, 2.0, 3.0]
    tg.verify(tmp_path / "a")
    doc = tg.read_manifest(tmp_path / "a")
    keys = [(c["file"], c["key"]) for t in doc["tensors"] for c in t["chunks"]]
    assert len(keys) == len(set(keys)) and len(keys) >= 3


def test_keys_that_print_alike_do_not_collide(tmp_path: Path) -> None:
    state = {"5": torch.tensor([1.0]), "5#2": torch.tensor([2.0]), 5: torch.tensor([3.0])}
    tg.save(tmp_path / "a", state)
    back = tg.load(tmp_path / "a")
    assert back["5"].item() == 1.0 and back["5#2"].item() == 2.0 and back[5].item() == 3.0


def test_the_writer_refuses_a_manifest_whose_keys_collide(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Simulate a planner bug: every item gets the same key. Nothing may be committed.
    monkeypatch.setattr(_plan.KeyMaker, "__call__", lambda self, wanted: "same")
    with pytest.raises(SaveError):
        tg.save(tmp_path / "a", {"x": torch.ones(2), "y": torch.zeros(2)})
    assert not (tmp_path / "a").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_the_reader_refuses_two_chunks_with_one_key(tmp_path: Path) -> None:
    ckpt = tmp_path / "a"
    tg.save(ckpt, {"x": torch.ones(2), "y": torch.ones(2)})
    doc = json.loads((ckpt / MANIFEST).read_bytes())
    del doc["manifest_checksum"]
    doc["tensors"][1]["chunks"][0]["key"] = doc["tensors"][0]["chunks"][0]["key"]
    (ckpt / MANIFEST).write_bytes(seal(dumps(doc)))
    with pytest.raises(CorruptCheckpointError, match="is used twice"):
        tg.load(ckpt)


# ----------------------------------------------------------------------------------------------
# a synchronous save racing an in-place mutation


@pytest.mark.parametrize(
    ("numel", "direct"),
    [(16_000_000, "1"), (16_000_000, "0"), (500_000, "1")],
    ids=["direct", "buffered", "small-file"],
)
def test_a_sync_save_racing_a_mutation_commits_a_checkpoint_that_verifies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, numel: int, direct: str
) -> None:
    monkeypatch.setenv("TARDIGRADE_DIRECT_IO", direct)
    t = torch.zeros(numel)
    stop = threading.Event()

    def mutate() -> None:
        while not stop.is_set():
            t.add_(1.0)

    thread = threading.Thread(target=mutate, daemon=True)
    thread.start()
    try:
        for i in range(6):
            tg.save(tmp_path / f"c{i}", {"t": t})
    finally:
        stop.set()
        thread.join()
    for i in range(6):
        tg.verify(tmp_path / f"c{i}")  # raised ChecksumMismatchError before the fix


def test_a_read_error_names_the_file_as_a_storage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EIO from a failing disk while reading a data file: a StorageError (also an OSError with
    that errno) naming the file and the byte, not a bare OSError."""
    import errno

    from tardigrade.errors import StorageError
    from tardigrade.storage import local

    tg.save(tmp_path / "ckpt", {"w": torch.arange(10.0)})

    real, calls = local.os.preadv, []

    def failing(*args: Any) -> int:
        calls.append(args)
        if len(calls) == 1:  # the manifest reads; then the data file fails
            return real(*args)
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(local.os, "preadv", failing)
    with pytest.raises(
        StorageError, match=r"reading .*data-00000-of-00001\.safetensors at byte"
    ) as e:
        tg.load(tmp_path / "ckpt")
    assert e.value.errno == errno.EIO and isinstance(e.value, OSError)
