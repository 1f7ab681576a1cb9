"""Set-ups that resume inexactly warn at save time; sampler.loader() avoids all of them."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import tardigrade as tg
from tardigrade import _loader_audit

N, BS = 40, 4


@pytest.fixture(autouse=True)
def _fresh_audit(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # The audit scans a few times per process; each test is a process of its own here.
    monkeypatch.setattr(_loader_audit, "_scans_left", 5)
    monkeypatch.setattr(_loader_audit, "_last_scan", -1e9)
    monkeypatch.setattr(_loader_audit, "_warned", set())
    yield


def _ds() -> TensorDataset:
    return TensorDataset(torch.arange(N))


def _save_during(loader: Any, state: dict[str, Any], path: Path) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, _ in enumerate(loader):
            if i == 2:
                tg.save(path, state)
                break
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def test_a_shuffling_loader_warns_when_the_state_holds_rng_state(tmp_path: Path) -> None:
    loader = DataLoader(_ds(), batch_size=BS, shuffle=True)
    got = _save_during(loader, {"rng": tg.RNGState()}, tmp_path / "a")
    assert any("shuffle=True" in m and "tg.ResumableSampler" in m for m in got), got
    # Saving only weights (no RNGState, no sampler) is no resume: no warning.
    assert not _save_during(loader, {"w": torch.ones(1)}, tmp_path / "b")


def test_workers_reading_a_sampler_without_track_warn(tmp_path: Path) -> None:
    s = tg.ResumableSampler(N, seed=1)
    loader = DataLoader(_ds(), batch_size=BS, sampler=s, num_workers=2, generator=s.generator)
    got = _save_during(loader, {"data": s}, tmp_path / "a")
    assert any("num_workers=2" in m and "sampler.track(loader)" in m for m in got), got
    assert not any("generator" in m for m in got), got


def test_workers_read_through_track_do_not_warn(tmp_path: Path) -> None:
    s = tg.ResumableSampler(N, seed=1)
    ds = tg.SeededDataset(_ds())
    loader = DataLoader(ds, batch_size=BS, sampler=s, num_workers=2, generator=s.generator)
    assert not _save_during(s.track(loader), {"data": s, "rng": tg.RNGState()}, tmp_path / "a")


def test_workers_over_a_dataset_that_is_not_seeded_warn_about_augmentation(
    tmp_path: Path,
) -> None:
    s = tg.ResumableSampler(N, seed=1)
    loader = s.loader(_ds(), batch_size=BS, num_workers=2)
    got = _save_during(loader, {"data": s, "rng": tg.RNGState()}, tmp_path / "a")
    assert any("draws random numbers (augmentation)" in m and "tg.SeededDataset(" in m
               for m in got), got  # fmt: skip
    assert len(got) == 1, got  # nothing else is wrong with this loader


def test_a_loader_without_the_sampler_generator_warns(tmp_path: Path) -> None:
    s = tg.ResumableSampler(N, seed=1)
    loader = DataLoader(_ds(), batch_size=BS, sampler=s)
    got = _save_during(loader, {"data": s}, tmp_path / "a")
    assert any("generator=sampler.generator" in m for m in got), got
    s2 = tg.ResumableSampler(N, seed=1)
    loader2 = DataLoader(_ds(), batch_size=BS, sampler=s2, generator=s2.generator)
    assert not _save_during(loader2, {"data": s2}, tmp_path / "b")


@pytest.mark.parametrize("workers", [0, 2])
def test_sampler_loader_resumes_exactly_and_quietly(tmp_path: Path, workers: int) -> None:
    def batches(sampler: tg.ResumableSampler, stop: int | None) -> list[list[int]]:
        out = []
        loader = sampler.loader(_ds(), batch_size=BS, num_workers=workers)
        for epoch in range(2):
            for batch in loader:
                out.append(batch[0].tolist())
                if stop is not None and len(out) == stop:
                    tg.save(tmp_path / "ck", {"data": sampler, "rng": tg.RNGState()})
                    return out
            assert sampler.epoch == epoch + 1
        return out

    want = batches(tg.ResumableSampler(N, seed=2), None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first = batches(tg.ResumableSampler(N, seed=2), 13)
    resumed = tg.ResumableSampler(N, seed=2)
    tg.load(tmp_path / "ck", into={"data": resumed, "rng": tg.RNGState()})
    rest = []
    loader = resumed.loader(_ds(), batch_size=BS, num_workers=workers)
    while len(first) + len(rest) < len(want):
        rest += [b[0].tolist() for b in loader]
    assert first + rest == want


def test_sampler_loader_sets_what_is_its_own() -> None:
    s = tg.ResumableSampler(N)
    with pytest.raises(tg.InvalidArgumentError, match="generator= is set by the sampler"):
        s.loader(_ds(), batch_size=BS, generator=torch.Generator())


def test_a_sampler_left_out_of_the_state_warns(tmp_path: Path) -> None:
    s = tg.ResumableSampler(N, seed=1)
    loader = s.loader(_ds(), batch_size=BS)
    got = _save_during(loader, {"rng": tg.RNGState()}, tmp_path / "a")
    assert any("does not hold it" in m and "state['data'] = sampler" in m for m in got), got
    # In the state, also as a rank's own value: no warning.
    s2 = tg.ResumableSampler(N, seed=1)
    got = _save_during(s2.loader(_ds(), batch_size=BS), {"rng": tg.RNGState(), "d": s2},
                       tmp_path / "b")  # fmt: skip
    assert not got, got
    s3 = tg.ResumableSampler(N, seed=1)
    state = {"rng": tg.RNGState(), "d": tg.PerRank(s3)}
    assert not _save_during(s3.loader(_ds(), batch_size=BS), state, tmp_path / "c")


def test_warnings_point_at_the_users_line(tmp_path: Path) -> None:
    """Not at tardigrade/_rng.py or _loader_audit.py: at the line that saved, here."""
    loader = DataLoader(_ds(), batch_size=BS, shuffle=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in loader:
            with tg.CheckpointManager(tmp_path, {"rng": tg.RNGState()}, async_save=False) as mgr:
                mgr.save(1)
            break
    (w,) = [w for w in caught if "shuffle=True" in str(w.message)]
    assert w.filename == __file__, w.filename
