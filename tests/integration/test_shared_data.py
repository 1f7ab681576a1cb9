"""Write only what changed (format 7): a manager writes each unchanged chunk of 1 MiB or more
once, as a shared object beside the checkpoints, and references it from every later one;
retention deletes an object once no checkpoint references it; a tensor changed in place, by
any route, is written again; every kept checkpoint loads bit-exactly and verifies."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import tardigrade as tg
from tardigrade.errors import CorruptCheckpointError, InvalidArgumentError, TardigradeError

MiB = 1 << 20


def disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and p.name != ".lock")


def shared_objects(root: Path) -> list[Path]:
    return sorted((root / ".shared").rglob("*.safetensors"))


class Lora(nn.Module):
    """A frozen base (two 4 MiB weights, biases) and a trainable low-rank adapter."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))
        self.base.requires_grad_(False)
        self.down = nn.Linear(1024, 8, bias=False)
        self.up = nn.Linear(8, 1024, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


def lora_state(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = Lora()
    optim = torch.optim.AdamW([*model.down.parameters(), *model.up.parameters()], lr=1e-2)
    return {"model": model, "optim": optim, "step": 0}


def train(state: dict[str, Any], steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        state["step"] += 1
        g = torch.Generator().manual_seed(state["step"])
        x = torch.randn(4, 1024, generator=g)
        loss = state["model"](x).square().mean()
        loss.backward()
        state["optim"].step()
        state["optim"].zero_grad()
        losses.append(loss.item())
    return losses


def snapshot(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.clone() for k, v in state["model"].state_dict().items()}
    for i, s in state["optim"].state_dict()["state"].items():
        out.update({f"optim/{i}/{k}": v.clone() for k, v in s.items()})
    return out


def test_lora_saves_write_the_base_once_and_every_kept_checkpoint_resumes_exactly(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    state = lora_state()
    base_bytes = sum(p.numel() * 4 for p in state["model"].base.parameters())
    taken: dict[int, dict[str, torch.Tensor]] = {}
    with tg.CheckpointManager(root, state, every_steps=1, keep_last=3) as mgr:
        for step in range(1, 11):
            train(state, 1)
            taken[step] = snapshot(state)
            mgr.step(step)
            mgr.wait()
            kept = mgr.steps()
            assert kept == list(range(max(1, step - 2), step + 1))
            # One base (its two large weights as shared objects, its biases in each
            # checkpoint), plus each kept checkpoint's adapter and optimizer state.
            own = sum(disk_bytes(root / f"step-{s:09d}") for s in kept)
            shared = sum(p.stat().st_size for p in shared_objects(root))
            assert len(shared_objects(root)) == 2
            assert shared < 1.05 * base_bytes
            assert disk_bytes(root) == own + shared
            assert own < 0.05 * base_bytes * len(kept)
            if step > 1:
                # The save after the first wrote only the adapter, optimizer and small tensors.
                assert mgr.stats[-1].nbytes < 0.05 * base_bytes
    assert tg.read_manifest(root / "step-000000010")["format_version"] == 7
    for step in (8, 9, 10):
        ckpt = root / f"step-{step:09d}"
        assert tg.verify(ckpt).nbytes >= base_bytes
        fresh = lora_state(seed=1)
        tg.load(ckpt, into=fresh)
        assert fresh["step"] == step
        got = snapshot(fresh)
        assert got.keys() == taken[step].keys()
        assert all(torch.equal(got[k], taken[step][k]) for k in got)
        # Resuming from the checkpoint trains as the uninterrupted run did.
        reference = lora_state()
        train(reference, 12)
        train(fresh, 12 - step)
        assert all(torch.equal(a, b) for a, b in zip(snapshot(fresh).values(), snapshot(reference).values(), strict=True))  # fmt: skip


@pytest.mark.parametrize("how", ["in place", ".data", "numpy view", "a new tensor"])
def test_a_frozen_tensor_changed_between_saves_is_written_again(tmp_path: Path, how: str) -> None:
    weight = torch.randn(1024, 512)  # 2 MiB: a shared object
    state = {"w": weight}
    with tg.CheckpointManager(tmp_path / "run", state, every_steps=1) as mgr:
        mgr.step(1)
        mgr.wait()
        if how == "in place":
            weight.mul_(2)
        elif how == ".data":
            weight.data[7, 3] += 1
        elif how == "numpy view":
            weight.numpy()[1023, 511] = -5.0
        else:
            state["w"] = weight.clone()
            state["w"][0, 0] = 42.0
        expected = state["w"].clone()
        mgr.step(2)
        mgr.wait()
    assert len(shared_objects(tmp_path / "run")) == 2
    assert torch.equal(tg.load(tmp_path / "run" / "step-000000002")["w"], expected)
    assert not torch.equal(tg.load(tmp_path / "run" / "step-000000001")["w"], expected)


def test_sync_and_async_saves_name_equal_bytes_alike(tmp_path: Path) -> None:
    state = {"a": torch.randn(512, 1024), "b": torch.arange(300_000, dtype=torch.int64)}
    tg.save(tmp_path / "plain", state)
    tg.save(tmp_path / "sync", state, base=tmp_path / "plain")
    fut = tg.save(tmp_path / "async", state, base=tmp_path / "plain", async_=True)
    assert fut is not None
    result = fut.result(timeout=60)  # type: ignore[union-attr]
    # The async save found no object to reference (its base shares none), wrote the same
    # objects under the same names (replacing nothing), and holds the same manifest data.
    assert len(shared_objects(tmp_path)) == 2
    assert result.files == 2
    synced = tg.read_manifest(tmp_path / "sync")
    assert synced["files"] == tg.read_manifest(tmp_path / "async")["files"]
    later = tg.save(tmp_path / "later", state, base=tmp_path / "async")
    assert later.files == 0  # everything referenced: only the manifest written
    for name in ("sync", "async", "later"):
        got = tg.load(tmp_path / name)
        assert all(torch.equal(got[k], state[k]) for k in state)


def test_dedup_false_writes_everything_into_each_checkpoint(tmp_path: Path) -> None:
    state = {"w": torch.randn(1024, 1024)}
    with tg.CheckpointManager(tmp_path / "run", state, every_steps=1, dedup=False) as mgr:
        for step in (1, 2):
            mgr.step(step)
            mgr.wait()
    assert not (tmp_path / "run" / ".shared").exists()
    assert tg.read_manifest(tmp_path / "run" / "step-000000002")["format_version"] == 4
    with pytest.raises(InvalidArgumentError, match="dedup must be a bool"):
        tg.CheckpointManager(tmp_path / "other", state, dedup="yes")  # type: ignore[arg-type]


def test_a_base_elsewhere_is_refused(tmp_path: Path) -> None:
    state = {"w": torch.randn(1024, 1024)}
    tg.save(tmp_path / "a" / "ckpt", state)
    with pytest.raises(InvalidArgumentError, match="not in the same directory"):
        tg.save(tmp_path / "b" / "ckpt", state, base=tmp_path / "a" / "ckpt")
    with pytest.raises(tg.CheckpointNotFoundError):
        tg.save(tmp_path / "a" / "next", state, base=tmp_path / "a" / "missing")
    assert not (tmp_path / "a" / "next").exists()


def test_a_shared_object_deleted_by_hand_is_named_and_the_next_save_writes_it_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "run"
    state = {"w": torch.randn(1024, 1024), "small": torch.ones(3)}
    with tg.CheckpointManager(root, state, every_steps=1) as mgr:
        mgr.step(1)
        mgr.wait()
        (obj,) = shared_objects(root)
        os.unlink(obj)
        with pytest.raises(CorruptCheckpointError, match=obj.name):
            tg.verify(root / "step-000000001")
        with pytest.raises(TardigradeError, match=obj.name):
            tg.load(root / "step-000000001")
        with caplog.at_level(logging.WARNING, logger="tardigrade"):
            mgr.step(2)
            mgr.wait()
        assert "writing it again" in caplog.text
    assert shared_objects(root) == [obj]
    assert torch.equal(tg.load(root / "step-000000002")["w"], state["w"])


def test_gc_removes_unreferenced_shared_objects_past_the_grace_period_only(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    state = {"w": torch.randn(1024, 1024)}
    with tg.CheckpointManager(root, state, every_steps=1) as mgr:
        mgr.step(1)
        mgr.wait()
    (kept,) = shared_objects(root)
    # An object no checkpoint references: what a save killed before its commit leaves.
    orphan = root / ".shared" / "ab" / ("ab" + "0" * 30 + ".safetensors")
    orphan.parent.mkdir()
    orphan.write_bytes(b"x" * 100)
    catalog = tg.Catalog(root)
    assert catalog.tidy() == []  # young: another process's save may be about to commit it
    old = kept.stat().st_mtime - 7200
    os.utime(orphan, (old, old))
    os.utime(kept, (old, old))
    done = catalog.tidy()
    assert [(t.action, t.nbytes) for t in done] == [("removed", 100)]
    assert shared_objects(root) == [kept]
    assert torch.equal(tg.load(root / "step-000000001")["w"], state["w"])


def test_an_unreadable_manifest_stops_the_sweep(tmp_path: Path) -> None:
    root = tmp_path / "run"
    state = {"w": torch.randn(1024, 1024)}
    with tg.CheckpointManager(root, state, every_steps=1) as mgr:
        mgr.step(1)
        mgr.wait()
    (obj,) = shared_objects(root)
    manifest = root / "step-000000001" / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:-5])  # damaged: what it references is unknown
    old = obj.stat().st_mtime - 7200
    os.utime(obj, (old, old))
    assert tg.Catalog(root).sweep_shared() == []
    assert shared_objects(root) == [obj]


def test_numpy_arrays_and_views_share_as_tensors_do(tmp_path: Path) -> None:
    table = np.random.default_rng(0).standard_normal((2048, 256)).astype(np.float32)  # 2 MiB
    tg.save(tmp_path / "a", {"t": table})
    tg.save(tmp_path / "b", {"t": table}, base=tmp_path / "a")
    third = tg.save(tmp_path / "c", {"t": table}, base=tmp_path / "b")
    assert third.files == 0
    assert np.array_equal(tg.load(tmp_path / "c")["t"], table)


def test_a_chunk_held_twice_in_one_save_is_one_object_and_a_plain_copy(tmp_path: Path) -> None:
    w = torch.randn(512, 1024)
    state = {"a": w, "b": w.clone(), "c": torch.zeros(3)}
    with tg.CheckpointManager(tmp_path / "run", state, every_steps=1) as mgr:
        for step in (1, 2):
            mgr.step(step)
            mgr.wait()
    for step in (1, 2):
        ckpt = tmp_path / "run" / f"step-{step:09d}"
        files = [f["name"] for f in tg.read_manifest(ckpt)["files"]]
        assert sum(f.startswith(".shared/") for f in files) == 1, files
        tg.verify(ckpt)
        got = tg.load(ckpt)
        assert torch.equal(got["a"], w) and torch.equal(got["b"], w)
    assert len(shared_objects(tmp_path / "run")) == 1


def store_bytes(url: str) -> dict[str, int]:
    """Every object under ``url`` (a store prefix) with its size, from the store's listing."""
    from tardigrade.storage import open_root

    storage = open_root(url)
    walked = storage.walk()
    assert walked is not None
    return {name: st.size for name, st in walked}


def uploader_of(mgr: tg.CheckpointManager) -> Any:
    from tardigrade.manager._tiers import RemoteTier

    tier = mgr._tiers.first(RemoteTier)
    assert tier is not None
    return tier.uploader


@pytest.mark.s3
def test_a_lora_run_on_the_store_and_its_uploads_send_the_base_once(
    tmp_path: Path, s3_env: Any
) -> None:
    from tardigrade.storage import open_root

    state = lora_state()
    base_bytes = sum(p.numel() * 4 for p in state["model"].base.parameters())
    root = f"s3://{s3_env.bucket}/lora-{os.getpid()}-{id(state)}"
    remote = f"{root}-remote"
    try:
        # The store as the manager's root, and a local root uploading to the store.
        with tg.CheckpointManager(root, state, every_steps=1, keep_last=2) as mgr:
            for step in (1, 2, 3):
                train(state, 1)
                mgr.step(step)
                mgr.wait()
            assert mgr.stats[-1].nbytes < 0.05 * base_bytes
        held = store_bytes(root)
        shared = sum(n for k, n in held.items() if k.startswith(".shared/"))
        assert 0.99 * base_bytes <= shared < 1.05 * base_bytes  # its weights (biases: small)
        assert sum(held.values()) - shared < 0.1 * base_bytes  # two kept: adapters, optimizer
        with tg.CheckpointManager(
            tmp_path / "local", state, every_steps=1, upload_to=remote, keep_last_remote=2
        ) as mgr:
            train(state, 1)
            mgr.step(4)
            mgr.wait()
            assert uploader_of(mgr).wait(120)
            first = sum(store_bytes(remote).values())
            train(state, 1)
            taken = snapshot(state)
            mgr.step(5)
            mgr.wait()
            assert uploader_of(mgr).wait(120)
        second = sum(store_bytes(remote).values()) - first
        assert first > base_bytes and second < 0.05 * base_bytes  # the adapter and optimizer
        fresh = lora_state(seed=1)
        tg.load(f"{remote}/step-000000005", into=fresh)
        got = snapshot(fresh)
        assert all(torch.equal(got[k], taken[k]) for k in taken)
        tg.verify(f"{root}/step-000000003")
    finally:
        for url in (root, remote):
            open_root(url).delete("")


@pytest.mark.parametrize("async_save", [False, True])
def test_chunks_that_changed_last_save_are_hashed_as_they_are_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool
) -> None:
    """A manager's save writes a chunk that held new bytes at its last save straight away,
    naming it from the bytes it wrote (one pass); the others are hashed first. A guess that
    proves wrong (the chunk did not change this time) references the object and leaves no
    file behind; every checkpoint loads exactly."""
    from tardigrade import _write

    calls: list[str] = []
    for fn in ("_hash_then_write", "_write_unnamed"):
        real = getattr(_write, fn)
        monkeypatch.setattr(
            _write, fn, lambda *a, _f=fn, _r=real, **k: calls.append(_f) or _r(*a, **k)
        )
    root = tmp_path / "run"
    state = {"a": torch.randn(512, 1024), "b": torch.randn(512, 1024)}  # 2 MiB each
    kept = {}
    with tg.CheckpointManager(root, state, async_save=async_save) as mgr:
        for step in (1, 2, 3):
            calls.clear()
            state["a"].add_(1.0)
            if step < 3:
                state["b"].add_(1.0)  # b stops changing at step 3: the guess is wrong
            mgr.save(step)
            mgr.wait()
            kept[step] = {k: v.clone() for k, v in state.items()}
            if step == 1:
                assert sorted(calls) == ["_hash_then_write"] * 2
            else:
                assert sorted(calls) == ["_write_unnamed"] * 2
        assert mgr.stats[-1].nbytes < 3 * MiB  # b was referenced: only a's 2 MiB written
    assert len(shared_objects(root)) == 5  # a: 3 versions, b: 2
    for step, want in kept.items():
        ckpt = root / f"step-{step:09d}"
        assert sorted(p.name for p in ckpt.iterdir()) == ["manifest.json"]  # nothing left over
        tg.verify(ckpt)
        got = tg.load(ckpt)
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_bytes_changed_during_a_synchronous_save_are_never_published_under_a_wrong_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tensor modified by another thread between the hash that names its object and the
    write: the save fails and nothing is committed or published (a later save referencing
    that name would load other bytes)."""
    from tardigrade._save_job import SaveJob

    state = {"w": torch.zeros(512, 1024)}
    tg.save(tmp_path / "base", state)
    real = SaveJob.claim

    def claim_then_mutate(self: SaveJob, name: str, file: str) -> bool:
        state["w"].add_(1.0)  # after the hash, before the write
        return real(self, name, file)

    monkeypatch.setattr(SaveJob, "claim", claim_then_mutate)
    with pytest.raises(tg.SaveError, match="changed while the save wrote them"):
        tg.save(tmp_path / "next", state, base=tmp_path / "base")
    assert not (tmp_path / "next").exists()
    assert shared_objects(tmp_path) == []
