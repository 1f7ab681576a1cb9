"""Every leaf real training states hold comes back exactly, type included, without pickle.

torch.Size, torch.device, Counter, set/frozenset, complex, complex tensors, numpy scalars and
sparse tensors; and views of one buffer write only the bytes they cover.
"""

from __future__ import annotations

import math
import struct
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open

import tardigrade as tg
from tardigrade.errors import CorruptCheckpointError, StateMismatchError, UnsupportedTypeError


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


# ----------------------------------------------------------------------------------------------
# torch.Size, torch.device, sets, complex


def test_torch_size_and_device_come_back_with_their_types(tmp_path: Path) -> None:
    state = {
        "shape": torch.Size([3, 0, 7]),
        "scalar_shape": torch.Size([]),
        "shapes": [torch.Size([2]), (torch.Size([1, 1]),)],
        "cuda1": torch.device("cuda:1"),  # no CUDA needed to save or load it
        "cuda": torch.device("cuda"),
        "cpu": torch.device("cpu"),
        "meta": torch.device("meta"),
        "mps0": torch.device("mps", 0),
    }
    out = roundtrip(tmp_path, state)
    for k in ("shape", "scalar_shape"):
        assert type(out[k]) is torch.Size and out[k] == state[k]
    assert type(out["shapes"][0]) is torch.Size and type(out["shapes"][1][0]) is torch.Size
    assert out["shapes"] == state["shapes"]
    for k in ("cuda1", "cuda", "cpu", "meta", "mps0"):
        assert type(out[k]) is torch.device and out[k] == state[k], k
    assert out["cuda1"].index == 1 and out["cuda"].index is None


def test_sets_and_frozensets_come_back_with_their_types(tmp_path: Path) -> None:
    state = {
        "set": {3, "a", None, (1, b"x"), 2.5, frozenset({1})},
        "frozen": frozenset({("w", 1), 7, True}),
        "empty": set(),
        "empty_frozen": frozenset(),
        "mixed_numbers": {1, 2.5, 1 + 1j, np.int64(9)},
    }
    out = roundtrip(tmp_path, state)
    for k, v in state.items():
        assert type(out[k]) is type(v), k
        assert out[k] == v, k
    inner = next(x for x in out["set"] if isinstance(x, frozenset))
    assert type(inner) is frozenset
    assert {type(x) for x in out["mixed_numbers"]} == {int, float, complex, np.int64}


def test_sets_are_stored_in_a_deterministic_order(tmp_path: Path) -> None:
    """The same set built in another order writes the same manifest tree."""
    items = ["b", "a", 3, 1.5, (2, "x"), None, b"y", -1, frozenset({"q", "p"})]
    tg.save(tmp_path / "one", {"s": set(items), "f": frozenset(items)})
    tg.save(tmp_path / "two", {"s": set(reversed(items)), "f": frozenset(reversed(items))})
    one, two = tg.read_manifest(tmp_path / "one"), tg.read_manifest(tmp_path / "two")
    assert one["tree"] == two["tree"]
    assert tg.load(tmp_path / "one") == {"s": set(items), "f": frozenset(items)}


def test_complex_scalars_are_bit_exact(tmp_path: Path) -> None:
    values = [
        1 + 2j,
        complex(-0.0, -0.0),
        complex(0.0, -0.0),
        complex(math.inf, -math.inf),
        complex(NAN_PAYLOAD, 1.0),
        complex(2.0, NAN_PAYLOAD),
        complex(5e-324, -1e308),
    ]
    out = roundtrip(tmp_path, {"z": values, "t": (3j,)})
    assert all(type(z) is complex for z in out["z"])
    assert [complex_bits(z) for z in out["z"]] == [complex_bits(z) for z in values]
    assert out["t"] == (3j,) and type(out["t"]) is tuple


# ----------------------------------------------------------------------------------------------
# numpy scalars


NUMPY_SCALARS = [
    np.bool_(True),
    np.bool_(False),
    np.uint8(255),
    np.int8(-128),
    np.int16(-2),
    np.uint16(65535),
    np.int32(-(2**31)),
    np.uint32(2**32 - 1),
    np.int64(5),
    np.uint64(2**64 - 1),
    np.float16(-0.0),
    np.float32(1.5),
    np.frombuffer(bytes.fromhex("2301c0ff"), dtype=np.float32)[0],  # NaN with a payload
    np.float64(-0.0),
    np.float64(NAN_PAYLOAD),
    np.complex64(complex(1.5, -0.0)),
    np.complex128(complex(NAN_PAYLOAD, -2.0)),
]


@pytest.mark.parametrize("value", NUMPY_SCALARS, ids=lambda v: f"{type(v).__name__}({v!r})")
def test_numpy_scalars_keep_their_type_and_bits(tmp_path: Path, value: np.generic) -> None:
    out = roundtrip(tmp_path, {"v": value, "in_list": [value], "key": {value: 1}})
    for got in (out["v"], out["in_list"][0], next(iter(out["key"]))):
        assert type(got) is type(value)
        assert got.tobytes() == value.tobytes()


def test_metrics_computed_with_numpy_round_trip(tmp_path: Path) -> None:
    preds = np.array([0.1, 0.9, 0.4], dtype=np.float32)
    state = {"best": {"acc": np.mean(preds > 0.5), "loss": preds.sum(), "n": np.int64(3)}}
    out = roundtrip(tmp_path, state)
    assert type(out["best"]["acc"]) is np.float64 and out["best"]["acc"] == state["best"]["acc"]
    assert type(out["best"]["loss"]) is np.float32 and out["best"]["loss"] == preds.sum()
    assert type(out["best"]["n"]) is np.int64


# ----------------------------------------------------------------------------------------------
# dict keys


def test_hashable_leaves_are_dict_keys(tmp_path: Path) -> None:
    d = {
        frozenset({1, 2}): "frozenset",
        1 + 2j: "complex",
        np.int64(7): "np.int64",
        np.float32(0.5): "np.float32",
        torch.device("cuda", 3): "device",
        torch.Size([2, 3]): "size",
        torch.float16: "dtype",
        (frozenset({"a"}), torch.device("cpu"), np.bool_(True)): "tuple of them",
    }
    out = roundtrip(tmp_path, {"d": d})["d"]
    assert list(out.values()) == list(d.values())
    for got, want in zip(out, d, strict=True):
        assert type(got) is type(want) and got == want and hash(got) == hash(want)
    assert out[torch.device("cuda:3")] == "device"


@pytest.mark.parametrize(
    ("key", "named"),
    [
        (torch.zeros(1), "Tensor"),
        ((1, torch.zeros(1)), "Tensor"),
        ((torch.zeros(1).to_sparse(),), "Tensor"),
    ],
    ids=["tensor", "tensor-in-tuple", "sparse-in-tuple"],
)
def test_unhashable_by_value_keys_are_refused(tmp_path: Path, key: Any, named: str) -> None:
    with pytest.raises(UnsupportedTypeError, match=rf"state\['d'\].*dict key .*{named}"):
        tg.save(tmp_path / "ckpt", {"d": {key: 1}})
    assert not (tmp_path / "ckpt").exists()


# ----------------------------------------------------------------------------------------------
# complex tensors


def _complex_values(dtype: torch.dtype) -> torch.Tensor:
    real = torch.finfo(dtype.to_real()).tiny
    parts = torch.tensor(
        [[1.5, -0.0], [-0.0, 2.0], [math.inf, -math.inf], [real, 3.0], [0.0, 0.0], [7.0, 8.0]],
        dtype=dtype.to_real(),
    )
    nan = {
        torch.float16: "7e01",
        torch.float32: "7fc00123",
        torch.float64: "fff8000000000123",
    }[dtype.to_real()]
    raw = torch.frombuffer(bytearray(bytes.fromhex(nan)[::-1]), dtype=dtype.to_real())
    parts[4, 0], parts[5, 1] = raw[0], raw[0]  # NaN payloads in each part
    return torch.view_as_complex(parts)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128, torch.complex32])
def test_complex_tensors_are_bit_exact(tmp_path: Path, dtype: torch.dtype) -> None:
    t = _complex_values(dtype)
    state = {"t": t, "grid": t.reshape(2, 3), "scalar": t[0], "empty": t[:0]}
    out = roundtrip(tmp_path, state)
    for k, want in state.items():
        assert out[k].dtype == dtype and out[k].shape == want.shape, k
        assert tensor_bits(out[k]) == tensor_bits(want), k
    # stored as the real view, under a dtype the safetensors file holds
    stored = data_files_readable(tmp_path / "ckpt")
    assert {v.dtype for v in stored.values()} == {dtype.to_real()}
    real = tensor_bits(torch.view_as_real(t))
    assert any(tensor_bits(v) == real for v in stored.values())


def test_complex_views_conjugates_and_real_views_share_as_saved(tmp_path: Path) -> None:
    base = torch.randn(4, 5, dtype=torch.complex64)
    state = {
        "base": base,
        "rows": base[1:3],
        "cols": base[:, ::2],
        "real": torch.view_as_real(base),  # the same memory read as float32
        "imag": base.imag,  # a float32 view at an odd offset
        "conj": base.conj(),  # lazy conjugate: stored resolved
    }
    out = roundtrip(tmp_path, state)
    for k, want in state.items():
        assert out[k].dtype == want.dtype and out[k].shape == want.shape, k
        assert tensor_bits(out[k].resolve_conj()) == tensor_bits(want.resolve_conj()), k
    storages = {k: out[k].untyped_storage().data_ptr() for k in ("base", "rows", "cols", "real")}
    assert len(set(storages.values())) == 1, storages
    assert out["imag"].untyped_storage().data_ptr() == storages["base"]
    out["base"][1, 0] = 5 - 6j
    assert out["rows"][0, 0] == 5 - 6j and out["real"][1, 0, 1] == -6.0 and out["imag"][1, 0] == -6
    assert not out["conj"].is_conj()


class _Spectral(torch.nn.Module):
    """A state-space-like model with a complex parameter and a complex buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.lam = torch.nn.Parameter(torch.randn(8, dtype=torch.complex64))
        self.register_buffer("kernel", torch.fft.rfft(torch.randn(16)))


def test_complex_parameters_restore_in_place(tmp_path: Path) -> None:
    torch.manual_seed(0)
    src = _Spectral()
    opt = torch.optim.Adam(src.parameters(), lr=0.1)
    src.lam.grad = torch.randn(8, dtype=torch.complex64)
    opt.step()
    tg.save(tmp_path / "ckpt", {"model": src, "optim": opt})
    torch.manual_seed(1)
    live = _Spectral()
    live_opt = torch.optim.Adam(live.parameters(), lr=0.1)
    ptrs = (live.lam.data_ptr(), live.kernel.data_ptr())
    tg.load(tmp_path / "ckpt", into={"model": live, "optim": live_opt})
    assert (live.lam.data_ptr(), live.kernel.data_ptr()) == ptrs  # read straight into them
    assert tensor_bits(live.lam.detach()) == tensor_bits(src.lam.detach())
    assert tensor_bits(live.kernel) == tensor_bits(src.kernel)
    exp_avg = live_opt.state[live.lam]["exp_avg"]
    assert exp_avg.dtype == torch.complex64
    assert tensor_bits(exp_avg) == tensor_bits(opt.state[src.lam]["exp_avg"])


def test_complex_tensor_mismatch_is_reported_in_complex_terms(tmp_path: Path) -> None:
    tg.save(tmp_path / "ckpt", {"z": torch.zeros(3, dtype=torch.complex64)})
    with pytest.raises(StateMismatchError, match=r"state\['z'\].*\[3\] torch.complex64.*\[4\]"):
        tg.load(tmp_path / "ckpt", into={"z": torch.zeros(4, dtype=torch.complex64)})


# ----------------------------------------------------------------------------------------------
# sparse tensors


def _sparse_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    dense = torch.randn(6, 8).relu()
    uncoalesced = torch.sparse_coo_tensor(
        torch.tensor([[2, 0, 2, 1], [1, 3, 1, 0]]), torch.tensor([1.0, 2.0, 3.0, -0.0]), (3, 4)
    )
    return {
        "coo": dense.to_sparse(),
        "coo_uncoalesced": uncoalesced,
        "coo_hybrid": torch.randn(5, 3).to_sparse(1),  # one sparse dim, one dense dim
        "coo_complex": torch.randn(4, 4, dtype=torch.complex64).to_sparse(),
        "coo_empty": torch.sparse_coo_tensor(torch.zeros(2, 0, dtype=torch.int64), [], (2, 2)),
        "csr": dense.to_sparse_csr(),
        "csr_int32": torch.sparse_csr_tensor(
            torch.tensor([0, 1, 3], dtype=torch.int32),
            torch.tensor([2, 0, 1], dtype=torch.int32),
            torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64),
            (2, 3),
        ),
        "csc": dense.to_sparse_csc(),
        "bsr": dense.to_sparse_bsr((2, 2)),
        "bsc": dense.to_sparse_bsc((3, 4)),
    }


def assert_sparse_equal(got: Any, want: torch.Tensor) -> None:
    assert isinstance(got, torch.Tensor)
    assert got.layout == want.layout and got.dtype == want.dtype and got.shape == want.shape
    if want.layout == torch.sparse_coo:
        assert got.is_coalesced() == want.is_coalesced()
        parts = [(got._indices(), want._indices()), (got._values(), want._values())]
    elif want.layout in (torch.sparse_csr, torch.sparse_bsr):
        parts = [
            (got.crow_indices(), want.crow_indices()),
            (got.col_indices(), want.col_indices()),
            (got.values(), want.values()),
        ]
    else:
        parts = [
            (got.ccol_indices(), want.ccol_indices()),
            (got.row_indices(), want.row_indices()),
            (got.values(), want.values()),
        ]
    for g, w in parts:
        assert g.dtype == w.dtype and g.shape == w.shape
        assert tensor_bits(g) == tensor_bits(w)


def test_sparse_tensors_come_back_sparse_with_the_same_parts(tmp_path: Path) -> None:
    state = _sparse_state()
    out = roundtrip(tmp_path, state)
    for k, want in state.items():
        assert_sparse_equal(out[k], want)
    assert not out["coo_uncoalesced"].is_coalesced()  # duplicates kept, not summed
    assert out["coo_uncoalesced"]._values().tolist() == [1.0, 2.0, 3.0, -0.0]
    assert out["bsr"].values().shape[1:] == (2, 2) and out["bsc"].values().shape[1:] == (3, 4)
    # stored as dense component tensors in plain safetensors files
    stored = data_files_readable(tmp_path / "ckpt")
    assert tensor_bits(stored["csr/crow_indices"]) == tensor_bits(state["csr"].crow_indices())
    assert tensor_bits(stored["coo/values"]) == tensor_bits(state["coo"]._values())
    assert stored["csr_int32/col_indices"].dtype == torch.int32


def test_sparse_tensor_restores_into_live_state(tmp_path: Path) -> None:
    state = _sparse_state()
    tg.save(tmp_path / "ckpt", {"coo": state["coo"], "csr": state["csr"]})
    live = {"coo": torch.zeros(6, 8).to_sparse(), "csr": torch.zeros(6, 8).to_sparse_csr()}
    tg.load(tmp_path / "ckpt", into=live)
    assert_sparse_equal(live["coo"], state["coo"])
    assert_sparse_equal(live["csr"], state["csr"])
    other = {"coo": torch.zeros(6, 8).to_sparse_csr(), "csr": torch.zeros(6, 8).to_sparse_csr()}
    with pytest.raises(StateMismatchError, match=r"state\['coo'\]: .*sparse coo.*sparse_csr"):
        tg.load(tmp_path / "ckpt", into=other)


def test_sparse_embedding_gradient_state(tmp_path: Path) -> None:
    """SparseAdam's state and a sparse gradient kept by the user round trip."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = torch.optim.SparseAdam(emb.parameters(), lr=0.1)
    emb(torch.tensor([1, 4, 4])).sum().backward()
    grad = emb.weight.grad
    assert grad is not None and grad.layout == torch.sparse_coo
    opt.step()
    out = roundtrip(tmp_path, {"grad": grad, "optim": opt.state_dict()})
    assert_sparse_equal(out["grad"], grad)


def _edit_tree(ckpt: Path, edit: Any) -> None:
    from tardigrade.format.jsonio import dumps
    from tardigrade.format.manifest import seal

    doc = tg.read_manifest(ckpt)
    doc.pop("manifest_checksum", None)
    edit(doc["tree"])
    (ckpt / "manifest.json").write_bytes(seal(dumps(doc)))


def _item(tree: dict[str, Any], key: str) -> dict[str, Any]:
    return next(v for k, v in tree["v"] if k["v"] == key)


@pytest.mark.parametrize(
    ("edit", "pattern"),
    [
        (lambda t: _item(t, "s").update(size=[2, 2]), "size is inconsistent with indices"),
        (lambda t: _item(t, "s").update(coalesced=True), "uncoalesced"),
        (lambda t: _item(t, "s").update(layout="zzz"), "unknown sparse layout 'zzz'"),
        (lambda t: _item(t, "s").update(layout="csr"), "only a sparse COO tensor records"),
        (lambda t: _item(t, "s").update(layout="csr", coalesced=None), "sparse csr tensor has"),
        (lambda t: _item(t, "z").update(complex="C7"), "unknown complex dtype 'C7'"),
        (lambda t: _item(t, "z").update(complex="C128"), "stored as torch.float32"),
        (lambda t: _item(t, "d").update(type="evil"), "malformed node of type 'device'"),
        (lambda t: _item(t, "d").update(index=-1), "malformed node of type 'device'"),
        (lambda t: _item(t, "n").update(v="00"), "numpy float32 scalar of 1 bytes"),
        (lambda t: _item(t, "n").update(dtype="object"), "malformed node of type 'npscalar'"),
        (lambda t: _item(t, "c").update(v=[{"t": "int", "v": "1"}] * 2), "complex parts"),
        (lambda t: _item(t, "f").update(v=[{"t": "list", "v": []}]), "unhashable type list"),
    ],
    ids=[
        "index-out-of-bounds",
        "false-coalesced",
        "layout",
        "coalesced-on-csr",
        "parts",
        "complex-name",
        "complex-dtype",
        "device-type",
        "device-index",
        "npscalar-size",
        "npscalar-dtype",
        "complex-parts",
        "set-element",
    ],
)
def test_forged_leaves_are_refused(tmp_path: Path, edit: Any, pattern: str) -> None:
    uncoalesced = torch.sparse_coo_tensor(torch.tensor([[2, 0, 2], [3, 0, 3]]), [1.0, 2, 3], (3, 4))
    state = {
        "s": uncoalesced,
        "z": torch.zeros(2, dtype=torch.complex64),
        "d": torch.device("cuda:0"),
        "n": np.float32(1.0),
        "c": 1j,
        "f": frozenset({1}),
    }
    tg.save(tmp_path / "ckpt", state)
    _edit_tree(tmp_path / "ckpt", edit)
    with pytest.raises(CorruptCheckpointError, match=pattern):
        tg.load(tmp_path / "ckpt")


# ----------------------------------------------------------------------------------------------
# views of one buffer


def test_distant_views_of_one_buffer_write_only_their_own_bytes(tmp_path: Path) -> None:
    buf = torch.arange(1_000_000, dtype=torch.float32)
    state = {"a": buf[:10], "b": buf[-10:]}
    out = roundtrip(tmp_path, state)
    assert torch.equal(out["a"], buf[:10]) and torch.equal(out["b"], buf[-10:])
    m = tg.read_manifest(tmp_path / "ckpt")
    assert sorted(t["shape"] for t in m["tensors"]) == [[10], [10]]
    assert sum(f["size"] for f in m["files"]) < 1024  # 80 bytes of data plus the header
    assert out["a"].untyped_storage().data_ptr() != out["b"].untyped_storage().data_ptr()


def test_flat_parameter_buffer_writes_only_the_views_and_keeps_overlaps_shared(
    tmp_path: Path,
) -> None:
    """A fused buffer: parameter views far apart, two of them overlapping a shared window."""
    flat = torch.arange(4_000_000, dtype=torch.float32)
    state = {
        "w1": flat[0:100].view(10, 10),
        "w1_head": flat[50:150],  # overlaps w1 and w2: one group
        "w2": flat[120:200],
        "w3": flat[2_000_000:2_000_064].view(8, 8),
        "w4": flat[-32:],
        "w4_alias": flat[-32:],  # the same view twice: one tensor
    }
    out = roundtrip(tmp_path, state)
    for k, want in state.items():
        assert torch.equal(out[k], want), k
    m = tg.read_manifest(tmp_path / "ckpt")
    # three groups: flat[0:200] (w1, w1_head, w2 overlap), w3, w4; nothing in between
    assert sorted(math.prod(t["shape"]) for t in m["tensors"]) == [32, 64, 200]
    assert sum(f["size"] for f in m["files"]) < 4096
    ptr = {k: v.untyped_storage().data_ptr() for k, v in out.items()}
    assert ptr["w1"] == ptr["w1_head"] == ptr["w2"]  # overlapping: still one buffer
    assert out["w4"].data_ptr() == out["w4_alias"].data_ptr()
    assert len({ptr["w1"], ptr["w3"], ptr["w4"]}) == 3  # apart: separate tensors
    out["w1_head"][75] = -2.0  # flat[125], which is w2[5]
    assert out["w2"][5] == -2.0
    out["w1"][7, 5] = -3.0  # flat[75], which is w1_head[25]
    assert out["w1_head"][25] == -3.0


def test_views_next_to_each_other_load_in_place_into_live_tensors(tmp_path: Path) -> None:
    """Views that do not overlap are plain tensors again, read straight into live ones."""
    flat = torch.randn(1000)
    tg.save(tmp_path / "ckpt", {"a": flat[:10], "b": flat[10:20], "c": flat[-5:]})
    live = {"a": torch.zeros(10), "b": torch.zeros(10), "c": torch.zeros(5)}
    ptrs = {k: v.data_ptr() for k, v in live.items()}
    m = tg.read_manifest(tmp_path / "ckpt")
    assert sorted(t["shape"] for t in m["tensors"]) == [[5], [10], [10]]
    assert all("view" not in node for node in _leaves(m["tree"]))
    tg.load(tmp_path / "ckpt", into=live)
    assert {k: v.data_ptr() for k, v in live.items()} == ptrs
    assert torch.equal(live["b"], flat[10:20]) and torch.equal(live["c"], flat[-5:])


def _leaves(tree: dict[str, Any]) -> list[dict[str, Any]]:
    return [v for _, v in tree["v"]]


def test_async_save_holds_new_leaves_as_they_were_at_save_time(tmp_path: Path) -> None:
    """Complex, sparse and far-apart views are staged like any tensor: mutating after save()
    returns does not change what is written."""
    torch.manual_seed(0)
    c = torch.randn(64, 3, dtype=torch.complex64)
    coo = torch.randn(20, 10).relu().to_sparse()
    csr = torch.randn(20, 10).relu().to_sparse_csr()
    buf = torch.randn(1_000_000)
    state = {"c": c, "c_rows": c[5:9], "coo": coo, "csr": csr, "a": buf[:10], "b": buf[-10:]}
    want = {
        "c": c.clone(),
        "coo": coo.clone(),
        "csr": csr.clone(),
        "a": buf[:10].clone(),
        "b": buf[-10:].clone(),
    }
    fut = tg.save(tmp_path / "ckpt", state, async_=True)
    assert fut.staged()
    c.mul_(0)
    buf.zero_()
    coo._values().zero_()
    csr.values().zero_()
    fut.result(timeout=60)
    out = tg.load(tmp_path / "ckpt")
    assert tensor_bits(out["c"]) == tensor_bits(want["c"])
    assert tensor_bits(out["c_rows"]) == tensor_bits(want["c"][5:9])
    assert_sparse_equal(out["coo"], want["coo"])
    assert_sparse_equal(out["csr"], want["csr"])
    assert torch.equal(out["a"], want["a"]) and torch.equal(out["b"], want["b"])
    assert sum(f["size"] for f in tg.read_manifest(tmp_path / "ckpt")["files"]) < 64 * 1024


def test_interleaved_strided_views_that_share_nothing_write_only_their_elements(
    tmp_path: Path,
) -> None:
    """Columns of a 4 MB matrix: their ranges overlap, but only views sharing an element are
    stored together (as the span they cover); the others only their own elements."""
    m = torch.arange(1_000_000, dtype=torch.float32).reshape(1000, 1000)
    state = {
        "col0": m[:, 0],
        "col1": m[:, 1],
        "diag": m[:2, :2].diagonal(),  # shares m[0, 0] with col0 and m[1, 1] with col1
        "col5": m[:, 5],
        "col9": m[::2, 9],
    }
    out = roundtrip(tmp_path, state)
    for k, want in state.items():
        assert torch.equal(out[k], want), k
    ptr = {k: v.untyped_storage().data_ptr() for k, v in out.items()}
    assert ptr["col0"] == ptr["col1"] == ptr["diag"]  # sharing kept where elements are shared
    for k in ("col0", "col1", "diag"):
        assert out[k].stride() == state[k].stride(), k
    assert len({ptr["col0"], ptr["col5"], ptr["col9"]}) == 3
    out["diag"][1] = -1.0
    assert out["col1"][1] == -1.0
    # col0/col1/diag: the span they share (col0's first to col1's last element); col5 and col9
    # share nothing: their own elements, not a span over the matrix
    stored = sorted(math.prod(t["shape"]) for t in tg.read_manifest(tmp_path / "ckpt")["tensors"])
    assert stored == [500, 1000, 999 * 1000 + 2]


def test_far_apart_strided_views_without_a_shared_element_are_stored_by_value(
    tmp_path: Path,
) -> None:
    m = torch.arange(1_000_000, dtype=torch.float32).reshape(1000, 1000)
    state = {"col0": m[:, 0], "col1": m[:, 1]}
    out = roundtrip(tmp_path, state)
    assert torch.equal(out["col0"], m[:, 0]) and torch.equal(out["col1"], m[:, 1])
    shapes = sorted(t["shape"] for t in tg.read_manifest(tmp_path / "ckpt")["tensors"])
    assert shapes == [[1000], [1000]]  # 8 KB written, not the 4 MB between them


def test_numpy_metrics_are_recorded(tmp_path: Path) -> None:
    preds = np.array([0.25, 0.75], dtype=np.float32)
    tg.save(tmp_path / "ckpt", {"x": 1}, metrics={"loss": preds.mean(), "n": np.int64(2)})
    assert tg.read_manifest(tmp_path / "ckpt")["metrics"] == {"loss": 0.5, "n": 2.0}
    with pytest.raises(tg.InvalidArgumentError, match="metric 'ok'"):
        tg.save(tmp_path / "other", {"x": 1}, metrics={"ok": np.bool_(True)})
