"""Every leaf real training states hold comes back exactly, type included, without pickle.

torch.Size, torch.device, Counter, set/frozenset, complex, complex tensors, numpy scalars and
sparse tensors; and views of one buffer write only the bytes they cover.
"""

from __future__ import annotations

import struct
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

import tardigrade as tg


def roundtrip(tmp_path: Path, state: Any, name: str = "ckpt") -> Any:
    tg.save(tmp_path / name, state)
    return tg.load(tmp_path / name)


def data_files_readable(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every data file opens with safetensors itself; returns all stored tensors by key."""
    out = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():  # noqa: SIM118 (safe_open has no __iter__)
                out[k] = st.get_tensor(k)
    return out


def f64_bits(x: float) -> bytes:
    return struct.pack("<d", x)


def complex_bits(z: complex) -> bytes:
    return f64_bits(z.real) + f64_bits(z.imag)


def tensor_bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


NAN_PAYLOAD = struct.unpack("<d", bytes.fromhex("2301000000f8ffff"))[0]  # negative, payload 0x123


# ----------------------------------------------------------------------------------------------
# Counter


def test_counter_comes_back_a_counter(tmp_path: Path) -> None:
    c = Counter({"b": 2, 3: 1, (1, 2): -4, "zero": 0})
    out = roundtrip(tmp_path, {"c": c, "nested": [Counter(), {"k": Counter("hello")}]})
    assert type(out["c"]) is Counter
    assert list(out["c"].items()) == list(c.items())  # insertion order kept, zero counts too
    assert out["c"]["missing"] == 0  # a Counter, not a dict: missing keys count zero
    assert type(out["nested"][0]) is Counter and out["nested"][0] == Counter()
    assert out["nested"][1]["k"] == Counter("hello")


def _multistep(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.MultiStepLR(optim, milestones=[2, 4, 4, 7], gamma=0.5)
    return {"model": model, "optim": optim, "sched": sched}


def _step(s: dict[str, Any]) -> float:
    loss = s["model"](torch.ones(1, 3)).square().sum()
    s["optim"].zero_grad()
    loss.backward()
    s["optim"].step()
    s["sched"].step()
    return loss.item()


def test_multistep_lr_milestones_restore_as_a_counter(tmp_path: Path) -> None:
    ref = _multistep(0)
    for _ in range(3):
        _step(ref)
    tg.save(tmp_path / "ckpt", ref)
    live = _multistep(1)
    _step(live)
    tg.load(tmp_path / "ckpt", into=live)
    assert type(live["sched"].milestones) is Counter
    assert live["sched"].milestones == Counter({2: 1, 4: 2, 7: 1})
    for _ in range(6):  # past the doubled milestone 4 and past 7: a dict would raise KeyError
        assert _step(live) == _step(ref)
        assert live["sched"].get_last_lr() == ref["sched"].get_last_lr()


class _Tally:
    """A user object whose state holds a Counter and a set."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.seen: set[int] = set()

    def state_dict(self) -> dict[str, Any]:
        return {"counts": self.counts, "seen": self.seen}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.counts, self.seen = sd["counts"], sd["seen"]


def test_counter_and_set_inside_a_user_object_restore_into_it(tmp_path: Path) -> None:
    t = _Tally()
    t.counts.update("abracadabra")
    t.seen.update({3, 1, 2})
    tg.save(tmp_path / "ckpt", {"tally": t, "plain": {"c": Counter([1, 1])}})
    live = {"tally": _Tally(), "plain": {"c": Counter()}}
    tg.load(tmp_path / "ckpt", into=live)
    assert type(live["tally"].counts) is Counter and live["tally"].counts == t.counts
    assert type(live["tally"].seen) is set and live["tally"].seen == {1, 2, 3}
    assert type(live["plain"]["c"]) is Counter and live["plain"]["c"] == Counter({1: 2})
