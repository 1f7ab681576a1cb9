"""The golden checkpoints of every format version keep loading (``v1/ckpt`` ... ``v7/root``).

Each was made once by its ``vN/make_fixture.py`` from the same state and seeds, so every value
is checked against the same literals or deterministic re-creation written out here (not
imported from the scripts, so editing a script cannot silently change the expectations).
v3 adds a ``"leaves"`` subtree with every leaf kind v3 introduced (checked by
``test_v3_leaves``). v4 is a different, tiny state saved by two ranks (a sharded tensor, a
replicated one, per-rank values; ``test_distributed_*``); v5 is that state saved again, its
chunks stored as columns. The fixtures are only read; their bytes are pinned by hash.
"""

from __future__ import annotations

import hashlib
import math
import random
import struct
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open

import tardigrade as tg
from tardigrade._tree import decode
from tardigrade.format.manifest import parse

HERE = Path(__file__).resolve().parent

# What the make_fixture.py scripts printed (the draws are the same for every version).
NEXT_RANDOM = 0.4407325991753527
NEXT_NP_RAND = 0.5188654396289326
NEXT_TORCH_RAND3 = [0.7301741242408752, 0.859134316444397, 0.2593020796775818]
TORCH_RNG_SHA256 = "a67b8cc9ea0ec3c78fda15a772ada60599ee90df980648a9e901e8dcf87084b1"
DATA_SHA256 = "b97059a68e3c2c095079b2caa094b6ea004f67ec48ec104e043cb7b95aefe343"  # v1, v2
DATA_BYTES = 9711


@dataclass(frozen=True)
class Golden:
    version: int
    save_id: str
    manifest_sha256: str
    files: list[dict[str, Any]]  # the manifest's "files" list
    data_sha256: str = DATA_SHA256
    # file name -> sha256, for fixtures with more than the one data file ``data_sha256`` pins
    data_files: tuple[tuple[str, str], ...] = ()

    @property
    def data_bytes(self) -> int:
        return sum(f["size"] for f in self.files)

    @property
    def ckpt(self) -> Path:
        return HERE / f"v{self.version}" / "ckpt"


GOLDEN = [
    Golden(
        1,
        "01f318a082864caabbfacd306ff8d73e",
        "2d6ea9af4094a2eb5ebd18375185b0cd024af86a940e79cf10c87b8e19ef5646",
        [{"name": "data-00000-of-00001.safetensors", "size": 9711}],
    ),
    Golden(
        2,
        "01b09f6f658d4de79a8ee46b0434806b",
        "f0319a41238e50589a416d81156ecee2b75068efc927478a533c329bdb3048bd",
        [
            {
                "name": "data-00000-of-00001.safetensors",
                "size": 9711,
                "header_checksum": "e8f83aebee0ca6bd",
            }
        ],
    ),
    Golden(
        3,
        "4e8cd149744845e1b4725bb280df3172",
        "f067e3266477d60f2d7c7dfabcdd7a8d14e306ba8e1c1758a0839fa3d55ca635",
        [
            {
                "name": "data-00000-of-00001.safetensors",
                "size": 11679,
                "header_checksum": "a54934a775344ad8",
            }
        ],
        data_sha256="9a16ac9fa10bf8e57ce27a10f0996ac628b6c7424098d96bba4f36fc8c31d284",
    ),
]
GOLDEN_V3 = GOLDEN[2]
GOLDEN_V4 = Golden(
    4,
    "ef8093cc9ab0449fb83ae7c21cd5fc10",
    "484585ab127bd99c98828e061077847d0f72f5bbc8f206473a04f175e9552a1c",
    [
        {
            "name": "data-r00000-00000-of-00001.safetensors",
            "size": 220,
            "header_checksum": "8f544d4e7f89954e",
        },
        {
            "name": "data-r00001-00000-of-00001.safetensors",
            "size": 284,
            "header_checksum": "345fd3e7ac46712e",
        },
    ],
    data_files=(
        (
            "data-r00000-00000-of-00001.safetensors",
            "8d16f267322475fee0273c00ee0a8dbf52cd79086b1c84a78bbc93aa01c4d3b8",
        ),
        (
            "data-r00001-00000-of-00001.safetensors",
            "8a984c0773d51cc80829195c7ecc1fc8bcec77bf2f42b015ef84ec1e6b578d4b",
        ),
    ),
)


# Format v5: the v4 state saved by the same two ranks, its chunks stored as columns.
GOLDEN_V5 = Golden(
    5,
    "be8fe1c4820d4377a18da68f1f124005",
    "20988126ce35f6accb6a169789eb2219e430749f942d82bef7ba5fe316a76ae7",
    [
        {
            "name": "data-r00000-00000-of-00001.safetensors",
            "size": 228,
            "header_checksum": "e0c43aae826d30a9",
        },
        {
            "name": "data-r00001-00000-of-00001.safetensors",
            "size": 284,
            "header_checksum": "7c973b4aadaa0684",
        },
    ],
    data_files=(
        (
            "data-r00000-00000-of-00001.safetensors",
            "6270246ed7ff06b3e2e28d7ce0bfe37e65be9350abd7a62096dfb9b22c07984d",
        ),
        (
            "data-r00001-00000-of-00001.safetensors",
            "c841a11435c1fa87119671deacfa87be659cb66fad51760aa98750fff2974558",
        ),
    ),
)
DISTRIBUTED = [GOLDEN_V4, GOLDEN_V5]


@pytest.fixture(params=GOLDEN, ids=[f"v{g.version}" for g in GOLDEN])
def golden(request: pytest.FixtureRequest) -> Golden:
    return request.param


@pytest.fixture(autouse=True)
def _fixture_is_never_rewritten(golden: Golden):
    """The fixture's bytes are pinned, before and after every test here."""
    pinned = dict(golden.data_files) or {"data-00000-of-00001.safetensors": golden.data_sha256}
    pinned["manifest.json"] = golden.manifest_sha256

    def digests() -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in golden.ckpt.iterdir()}

    assert digests() == pinned
    yield
    assert digests() == pinned


@pytest.fixture(autouse=True)
def _keep_global_rng():
    state = tg.RNGState().state_dict()
    yield
    tg.RNGState().load_state_dict(state)


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_tensor(got: Any, want: torch.Tensor) -> None:
    assert isinstance(got, torch.Tensor)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert bits(got) == bits(want)


def assert_float(got: Any, want: float) -> None:
    assert type(got) is float
    assert struct.pack("<d", got) == struct.pack("<d", want), (got, want)


def expected_tensors() -> dict[str, torch.Tensor]:
    inf, nan = math.inf, math.nan
    return {
        "f32": (torch.arange(24, dtype=torch.float32).reshape(4, 6) - 11.5) / 3,
        "bf16": torch.tensor(
            [
                [-2.0, -1.6328125, -1.2578125, -0.890625],
                [-0.51953125, -0.150390625, 0.2197265625, 0.58984375],
                [0.9609375, 1.328125, 1.703125, 2.0625],
                [2.4375, 2.8125, 3.1875, 3.546875],
            ],
            dtype=torch.bfloat16,
        ).reshape(2, 8),
        "f16": torch.tensor(
            [0.0, -0.0, 1.0, -2.5, 65504.0, 5.960464477539063e-08, inf, -inf, nan],
            dtype=torch.float16,
        ),
        "f64": torch.tensor(
            [3.141592653589793, -2.718281828459045, 1e300, -1e-300, 0.0, -0.0],
            dtype=torch.float64,
        ),
        "f8": torch.tensor([0x30, 0xB8, 0x7E, 0x00], dtype=torch.uint8).view(torch.float8_e4m3fn),
        "i8": torch.tensor(list(range(-128, 128, 16)), dtype=torch.int8),
        "u8": torch.tensor(list(range(0, 256, 17)), dtype=torch.uint8),
        "bool": torch.tensor([True, False, True, True, False]),
        "i32": torch.tensor([[-(2**31), 2**31 - 1], [0, -1]], dtype=torch.int32),
        "i64": torch.tensor([2**62, -(2**63), 0, 7], dtype=torch.int64),
        "scalar": torch.tensor(3.25, dtype=torch.float32),
        "empty": torch.empty(0, 4, dtype=torch.float32),
        "strided": torch.tensor(
            [[0, 2, 4], [5, 7, 9], [10, 12, 14], [15, 17, 19]], dtype=torch.int64
        ),
    }


def test_manifest_fields(golden: Golden) -> None:
    m = tg.read_manifest(golden.ckpt)
    assert m["format"] == "tardigrade"
    assert m["format_version"] == golden.version
    assert m["save_id"] == golden.save_id
    assert m["step"] == 7 and m["epoch"] == 2
    assert m["world_size"] == 1
    assert m["metadata"] == {"purpose": f"golden v{golden.version}"}
    assert m["metrics"] == {"loss": 0.125}
    assert m["versions"]["tardigrade"] == "0.1.0"
    assert m["checksum_algorithm"] == "xxh3-64"
    assert m["files"] == golden.files


def test_verify(golden: Golden) -> None:
    report = tg.verify(golden.ckpt)
    assert report.step == 7
    assert report.files == 1
    assert report.nbytes == golden.data_bytes
    assert golden.version >= 3 or report.nbytes == DATA_BYTES


def test_every_value(golden: Golden) -> None:
    state = tg.load(golden.ckpt)
    assert list(state) == [
        "tensors",
        "shared",
        "numpy",
        "tree",
        "model",
        "user",
        "rng",
        "step",
        "views",
        *(["leaves"] if golden.version >= 3 else []),
    ]

    # tensors, bit for bit
    tensors = state["tensors"]
    want = expected_tensors()
    assert list(tensors) == list(want)
    for k, w in want.items():
        assert_tensor(tensors[k], w)
    # the literal bf16 values are what the fixture formula gives
    formula = (torch.arange(16, dtype=torch.float32) * 0.37 - 2.0).to(torch.bfloat16).reshape(2, 8)
    assert bits(formula) == bits(want["bf16"])
    assert math.copysign(1.0, tensors["f16"][1].item()) == -1.0
    assert math.isnan(tensors["f16"][8].item())
    assert tensors["f8"].float().tolist() == [0.5, -1.0, 448.0, 0.0]

    # one tensor under two keys comes back as one tensor
    shared = state["shared"]
    assert list(shared) == ["a", "b"]
    assert_tensor(shared["a"], torch.tensor([-7, -4, -1, 2, 5, 8, 11, 14], dtype=torch.int16))
    assert shared["a"].data_ptr() == shared["b"].data_ptr()

    # numpy arrays keep their dtypes
    arrays = state["numpy"]
    assert list(arrays) == ["i32", "f16", "u64", "bool"]
    for a in arrays.values():
        assert type(a) is np.ndarray
    np.testing.assert_array_equal(arrays["i32"], np.array([[0, 1, 2], [3, 4, 5]], dtype=np.int32))
    assert arrays["i32"].dtype == np.int32
    assert arrays["f16"].dtype == np.float16
    assert arrays["f16"].tobytes() == np.array([1.5, -0.0, 65504.0], dtype=np.float16).tobytes()
    assert arrays["u64"].dtype == np.uint64
    assert arrays["u64"].tolist() == [0, 2**64 - 1, 12345]
    assert arrays["bool"].dtype == np.bool_ and arrays["bool"].tolist() == [[True], [False]]

    # plain Python values with their exact types
    tree = state["tree"]
    assert list(tree) == [
        "tuple",
        "list",
        "dict",
        "odict",
        "huge",
        "neg_huge",
        "negzero",
        "nan",
        "inf",
        "ninf",
        "pi",
        "true",
        "false",
        "str",
        "empty_str",
        "none",
        "bytes",
        "dtype",
    ]
    assert type(tree["tuple"]) is tuple and tree["tuple"][:2] == (1, "two")
    assert_float(tree["tuple"][2], 3.0)
    assert tree["tuple"][3] is None
    assert type(tree["list"]) is list
    assert tree["list"][0] == b"\x00\x01\xfe\xff" and type(tree["list"][0]) is bytes
    assert tree["list"][1] == [] and type(tree["list"][1]) is list
    assert tree["list"][2] == () and type(tree["list"][2]) is tuple
    assert tree["list"][3] == {} and type(tree["list"][3]) is dict
    assert tree["dict"] == {1: "int key", (2, "b"): "tuple key", "s": {"deep": [None, (True,)]}}
    assert [type(k) for k in tree["dict"]] == [int, tuple, str]
    assert type(tree["dict"]["s"]["deep"][1]) is tuple
    assert type(tree["odict"]) is OrderedDict and list(tree["odict"].items()) == [
        ("z", 1),
        ("a", 2),
    ]
    assert tree["huge"] == 2**300 + 12345 and type(tree["huge"]) is int
    assert tree["neg_huge"] == -(3**200)
    assert_float(tree["negzero"], -0.0)
    assert_float(tree["nan"], float("nan"))
    assert_float(tree["inf"], math.inf)
    assert_float(tree["ninf"], -math.inf)
    assert_float(tree["pi"], 3.141592653589793)
    assert tree["true"] is True and tree["false"] is False
    assert tree["str"] == "gr\u00fc\u00dfe \u2713 \U0001d11e"
    assert tree["empty_str"] == ""
    assert tree["none"] is None
    assert tree["bytes"] == bytes(range(16))
    assert tree["dtype"] is torch.bfloat16

    # an nn.Module's state_dict, with the module version metadata load_state_dict relies on
    model = state["model"]
    assert type(model) is OrderedDict and list(model) == ["weight", "bias"]
    assert_tensor(model["weight"], torch.tensor([[-0.25, -0.125, 0.0], [0.125, 0.25, 0.375]]))
    assert_tensor(model["bias"], torch.tensor([0.5, -1.5]))
    assert model._metadata == {"": {"version": 1}}

    # a user object's state
    assert state["user"] == {"calls": 41, "history": [0.5, -0.25]}
    assert state["step"] == 7 and type(state["step"]) is int

    # overlapping views come back as views of one storage
    views = state["views"]
    base = torch.arange(12, dtype=torch.float32) * 0.5
    assert_tensor(views["base"], base)
    assert_tensor(views["head"], base[:8])
    assert_tensor(views["tail"], base[4:])
    assert_tensor(views["every3"], base[::3])
    assert views["every3"].stride() == (3,)
    ptrs = {v.untyped_storage().data_ptr() for v in views.values()}
    assert len(ptrs) == 1


def test_rng_state_values(golden: Golden) -> None:
    rng = tg.load(golden.ckpt, keys=["rng"])["rng"]
    assert list(rng) == ["python", "numpy", "torch", "cuda"]
    assert rng["cuda"] == []

    random.seed(1234)
    random.random()
    assert rng["python"] == random.getstate()
    assert type(rng["python"]) is tuple and type(rng["python"][1]) is tuple

    np.random.seed(5678)
    np.random.rand(3)
    want_np = np.random.get_state(legacy=True)
    assert type(rng["numpy"]) is tuple and len(rng["numpy"]) == 5
    assert rng["numpy"][0] == want_np[0] == "MT19937"
    assert rng["numpy"][1].dtype == np.uint32
    np.testing.assert_array_equal(rng["numpy"][1], want_np[1])
    assert rng["numpy"][2:] == tuple(want_np[2:])

    # torch's stream was also advanced by nn.Linear's init in the script: pin the bytes instead
    assert rng["torch"].dtype == torch.uint8 and rng["torch"].shape == (5056,)
    assert hashlib.sha256(bits(rng["torch"])).hexdigest() == TORCH_RNG_SHA256


def test_rng_restore_continues_the_recorded_streams(golden: Golden) -> None:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    live = {"rng": tg.RNGState()}
    tg.load(golden.ckpt, keys=["rng"], into=live)
    assert random.random() == NEXT_RANDOM
    assert float(np.random.rand()) == NEXT_NP_RAND
    assert torch.equal(torch.rand(3), torch.tensor(NEXT_TORCH_RAND3, dtype=torch.float32))


def test_restore_into_live_objects(golden: Golden) -> None:
    class Counter:
        def __init__(self) -> None:
            self.calls, self.history = 0, [0.0, 0.0]

        def state_dict(self) -> dict[str, Any]:
            return {"calls": self.calls, "history": self.history}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            self.calls, self.history = sd["calls"], sd["history"]

    model = torch.nn.Linear(3, 2)
    user = Counter()
    live = {"model": model, "user": user, "rng": tg.RNGState(), "step": 0}
    ptr = model.weight.data_ptr()
    tg.load(golden.ckpt, keys=["model", "user", "rng", "step"], into=live)
    assert model.weight.data_ptr() == ptr
    assert_tensor(model.weight.detach(), torch.tensor([[-0.25, -0.125, 0.0], [0.125, 0.25, 0.375]]))
    assert_tensor(model.bias.detach(), torch.tensor([0.5, -1.5]))
    assert user.calls == 41 and user.history == [0.5, -0.25]
    assert live["step"] == 7
    assert random.random() == NEXT_RANDOM


def test_partial_load_of_nested_key(golden: Golden) -> None:
    out = tg.load(golden.ckpt, keys=[("tensors", "bf16"), ("tree", "huge")])
    assert list(out) == ["tensors", "tree"]
    assert list(out["tensors"]) == ["bf16"] and list(out["tree"]) == ["huge"]
    assert_tensor(out["tensors"]["bf16"], expected_tensors()["bf16"])
    assert out["tree"]["huge"] == 2**300 + 12345


# ----------------------------------------------------------------------------------------------
# format v3: the leaf kinds it added

NAN64_BITS = bytes.fromhex("2301000000f8ffff")  # little-endian: negative quiet NaN, payload 0x123
NAN32_BITS = bytes.fromhex("2301c0ff")


def _sparse_parts(t: torch.Tensor) -> list[torch.Tensor]:
    if t.layout == torch.sparse_coo:
        return [t._indices(), t._values()]
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [t.crow_indices(), t.col_indices(), t.values()]
    return [t.ccol_indices(), t.row_indices(), t.values()]


@pytest.mark.parametrize("golden", [GOLDEN_V3], ids=["v3"])
def test_v3_leaves(golden: Golden) -> None:
    leaves = tg.load(golden.ckpt, keys=["leaves"])["leaves"]
    assert list(leaves) == [
        "size",
        "device",
        "cpu",
        "counter",
        "set",
        "frozenset",
        "complex",
        "np",
        "keys",
        "c64",
        "c64_rows",
        "c128",
        "coo",
        "coo_uncoalesced",
        "csr",
        "csc",
        "bsr",
        "apart",
    ]
    assert type(leaves["size"]) is torch.Size and leaves["size"] == (3, 0, 7)
    assert type(leaves["device"]) is torch.device and leaves["device"] == torch.device("cuda:1")
    assert leaves["device"].index == 1
    assert type(leaves["cpu"]) is torch.device and leaves["cpu"] == torch.device("cpu")
    assert type(leaves["counter"]) is Counter
    assert list(leaves["counter"].items()) == [("b", 2), (3, 1), ((1, 2), -4)]
    assert type(leaves["set"]) is set
    assert leaves["set"] == {3, "a", None, (1, b"x"), 2.5, frozenset({1})}
    assert type(leaves["frozenset"]) is frozenset and leaves["frozenset"] == {("w", 1), 7}
    z = leaves["complex"]
    assert type(z) is complex
    assert struct.pack("<d", z.real) == struct.pack("<d", -0.0)
    assert struct.pack("<d", z.imag) == NAN64_BITS

    want_np = [
        (np.int64, b"\x05" + b"\x00" * 7),
        (np.float32, struct.pack("<f", 1.5)),
        (np.bool_, b"\x01"),
        (np.float64, struct.pack("<d", -0.0)),
        (np.uint8, b"\xff"),
        (np.float16, struct.pack("<e", -2.5)),
        (np.complex64, struct.pack("<ff", 1.0, -2.0)),
        (np.float32, NAN32_BITS),
    ]
    assert [(type(v), v.tobytes()) for v in leaves["np"]] == want_np

    keys = leaves["keys"]
    assert list(keys.values()) == ["frozenset", "complex", "np.int64", "device", "size"]
    assert [type(k) for k in keys] == [frozenset, complex, np.int64, torch.device, torch.Size]
    assert list(keys) == [frozenset({1, 2}), 1 + 2j, 7, torch.device("cuda:0"), (2,)]

    parts = (torch.arange(12, dtype=torch.float32).reshape(6, 2) - 5.5) / 4
    parts[2, 0] = -0.0
    parts[3, 1] = torch.frombuffer(bytearray(NAN32_BITS), dtype=torch.float32)[0]
    c64 = torch.view_as_complex(parts)
    assert_tensor(leaves["c64"], c64)
    assert_tensor(leaves["c64_rows"], c64[1:4])
    assert leaves["c64_rows"].untyped_storage().data_ptr() == (
        leaves["c64"].untyped_storage().data_ptr()
    )
    c128 = torch.view_as_complex(
        torch.tensor([[1.0, -0.0], [0.0, 2.5], [1e300, -1e-300]], dtype=torch.float64)
    )
    c128_bits = bytearray(bits(c128))
    c128_bits[16:24] = NAN64_BITS
    assert leaves["c128"].dtype == torch.complex128 and leaves["c128"].shape == (3,)
    assert bits(leaves["c128"]) == bytes(c128_bits)

    dense = torch.tensor(
        [[0.0, 1.5, 0.0, 0.0], [2.0, 0.0, 0.0, -3.0], [0.0, 0.0, 0.0, 0.0], [0.0, 4.0, 0.5, 0.0]]
    )
    layouts = {
        "coo": torch.sparse_coo,
        "csr": torch.sparse_csr,
        "csc": torch.sparse_csc,
        "bsr": torch.sparse_bsr,
    }
    for k, layout in layouts.items():
        got = leaves[k]
        assert got.layout == layout, k
        assert torch.equal(got.to_dense(), dense), k
    assert leaves["coo"].is_coalesced()
    assert_tensor(leaves["coo"]._indices(), torch.tensor([[0, 1, 1, 3, 3], [1, 0, 3, 1, 2]]))
    assert_tensor(leaves["csr"].crow_indices(), torch.tensor([0, 1, 3, 3, 5]))
    assert_tensor(leaves["csr"].col_indices(), torch.tensor([1, 0, 3, 1, 2]))
    assert_tensor(leaves["csr"].values(), torch.tensor([1.5, 2.0, -3.0, 4.0, 0.5]))
    assert_tensor(leaves["csc"].ccol_indices(), torch.tensor([0, 1, 3, 4, 5]))
    assert leaves["bsr"].values().shape == (4, 2, 2)
    unc = leaves["coo_uncoalesced"]
    assert unc.layout == torch.sparse_coo and not unc.is_coalesced() and unc.shape == (3, 4)
    assert_tensor(unc._indices(), torch.tensor([[2, 0, 2], [1, 3, 1]]))
    assert_tensor(unc._values(), torch.tensor([1.0, 2.0, 3.0]))

    buf = torch.arange(1000, dtype=torch.float32) * 0.25
    assert_tensor(leaves["apart"]["head"], buf[:10])
    assert_tensor(leaves["apart"]["tail"], buf[-10:])
    # views far apart were written as two small tensors, not the span between them
    m = tg.read_manifest(golden.ckpt)
    shapes = [t["shape"] for t in m["tensors"]]
    assert [1000] not in shapes and shapes.count([10]) == 2
    # complex and sparse tensors are stored as real, dense parts: a plain safetensors file
    with safe_open(str(golden.ckpt / "data-00000-of-00001.safetensors"), "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118
    assert not {d for d in dtypes if d.startswith("C")}, dtypes  # no complex dtype
    assert {"F32", "F64", "I64"} <= dtypes


@pytest.mark.parametrize("golden", [GOLDEN_V3], ids=["v3"])
def test_v3_leaves_restore_into_live_objects(golden: Golden) -> None:
    live = {
        "c64": torch.zeros(6, dtype=torch.complex64),
        "csr": torch.zeros(4, 4).to_sparse_csr(),
        "counter": Counter(),
    }
    ptr = live["c64"].data_ptr()
    tg.load(golden.ckpt, keys=[("leaves", k) for k in live], into={"leaves": live})
    assert live["c64"].data_ptr() == ptr
    assert bits(live["c64"][1:4]) == bits(
        tg.load(golden.ckpt, keys=["leaves"])["leaves"]["c64_rows"]
    )
    assert live["csr"].layout == torch.sparse_csr and live["csr"].values().tolist()[0] == 1.5
    assert type(live["counter"]) is Counter and live["counter"]["b"] == 2


# ----------------------------------------------------------------------------------------------
# format v4: a checkpoint saved by two ranks, read back in one process

V4_EMB = torch.tensor(
    [
        [-3.0, -2.5, -2.0],
        [-1.5, -1.0, -0.5],
        [0.0, 0.5, 1.0],
        [1.5, 2.0, 2.5],
        [3.0, 3.5, 4.0],
    ]
)


@pytest.mark.parametrize("golden", DISTRIBUTED, ids=["v4", "v5"])
def test_distributed_manifest(golden: Golden) -> None:
    m = tg.read_manifest(golden.ckpt)
    assert m["format_version"] == golden.version
    assert m["save_id"] == golden.save_id
    assert m["world_size"] == 2
    assert m["step"] == 7
    assert m["metadata"] == {"purpose": f"golden v{golden.version}"}
    assert m["files"] == golden.files
    layouts = [(t.get("layout", "replicated"), t.get("rank")) for t in m["tensors"]]
    assert layouts == [("sharded", None), ("replicated", None), ("per_rank", 0), ("per_rank", 1)]
    # the uneven row split: rank 0 wrote rows 0-2, rank 1 rows 3-4
    path = golden.ckpt / "manifest.json"
    emb = parse(path.read_bytes(), str(path)).tensors[0]
    assert [(c.file[:11], c.offsets, c.shape) for c in emb.chunks] == [
        ("data-r00000", (0, 0), (3, 3)),
        ("data-r00001", (3, 0), (2, 3)),
    ]
    if golden.version == 5:  # columns; trailing offsets and widths once for all chunks
        assert m["tensors"][0]["chunks"]["offsets"] == [[0, 3], 0]
        assert m["tensors"][0]["chunks"]["shape"] == [[3, 2], 3]
        with safe_open(str(golden.ckpt / golden.files[0]["name"]), "pt") as f:
            assert sorted(f.keys()) == ["emb@0.0", "mine/seen@2.0"]  # name@tensor.chunk
    report = tg.verify(golden.ckpt)
    assert report.files == 2 and report.nbytes == golden.data_bytes


@pytest.mark.parametrize("golden", DISTRIBUTED, ids=["v4", "v5"])
def test_distributed_loads_in_one_process(golden: Golden) -> None:
    state = tg.load(golden.ckpt)
    assert list(state) == ["emb", "bias", "step", "mine"]
    assert_tensor(state["emb"], V4_EMB)  # whole, gathered from both ranks' files
    assert_tensor(state["bias"], torch.tensor([0.25, -1.0, 3.5]))
    assert state["step"] == 7
    # one process is rank 0: it gets rank 0's per-rank values
    assert state["mine"]["rank"] == 0
    assert_tensor(state["mine"]["seen"], torch.tensor([0, 1], dtype=torch.int64))


@pytest.mark.parametrize("golden", DISTRIBUTED, ids=["v4", "v5"])
def test_distributed_restores_a_piece_into_live_state(golden: Golden) -> None:
    live = {
        "emb": tg.Sharded(torch.zeros(2, 3), (3, 0), (5, 3)),
        "bias": torch.zeros(3),
        "step": 0,
        "mine": tg.PerRank({"rank": -1, "seen": torch.zeros(2, dtype=torch.int64)}),
    }
    tg.load(golden.ckpt, into=live)
    assert_tensor(live["emb"].local, V4_EMB[3:])
    assert_tensor(live["bias"], torch.tensor([0.25, -1.0, 3.5]))
    assert live["step"] == 7
    assert live["mine"].value["rank"] == 0
    assert_tensor(live["mine"].value["seen"], torch.tensor([0, 1], dtype=torch.int64))


# Format v6: packed lists, from one process (chunks as in v4) and from two (columns, as in v5).
V6_MANIFESTS = {
    "ckpt": "5de66aae7a8a6c19987ab372f986e7eebe6b9e2e556b82927322a1b73eb0e12a",
    "ckpt-2ranks": "f6e184e00bcb1685fba1af517795572db597defa1a0a06b981a79c2f0e432f9f",
}
V6_NAN_BITS = 0x7FF8_0000_0000_DEAD


@pytest.mark.parametrize("name", list(V6_MANIFESTS))
def test_v6_packed_lists_load_exactly(name: str) -> None:
    ckpt = HERE / "v6" / name
    raw = (ckpt / "manifest.json").read_bytes()
    assert hashlib.sha256(raw).hexdigest() == V6_MANIFESTS[name]
    m = tg.read_manifest(ckpt)
    assert m["format_version"] == 6 and m["step"] == 6
    assert ("columns" if m["world_size"] == 2 else "list") == (
        "columns" if isinstance(m["tensors"][0]["chunks"], dict) else "list"
    )
    tg.verify(ckpt)
    state = tg.load(ckpt)
    assert state["perm"] == [(37 * i) % 101 for i in range(101)]
    floats = state["floats"]
    assert type(floats) is tuple
    expected = [struct.pack("<d", x) for x in (0.5, -0.0)]
    expected += [struct.pack("<Q", V6_NAN_BITS), struct.pack("<d", math.inf)]
    assert [struct.pack("<d", x) for x in floats] == expected * 16
    assert state["short"] == [1, 2, 3]
    assert_tensor(state["w"], torch.arange(6, dtype=torch.float32) / 4)
    if name == "ckpt-2ranks":
        assert state["mine"] == list(range(70))  # one process is rank 0
        rank1 = decode(m["per_rank"][1][0], lambda n, p: None, "golden")
        assert rank1 == [1000 + i for i in range(70)]


# Format v7: shared data. Two checkpoints of one root reference one shared object.
V7_MANIFESTS = {
    "step-1": "d2c4579331b01ca2927cf6fac7d7ac8228bc32db14dcd3646f59fde00301b4ab",
    "step-2": "e07a53c961d72f37075b0af01654043ac10a96c1ad662f2fbcacd6c6de57ce63",
}
V7_OBJECT = ".shared/bf/bf833c5e65412dc18c9c22256741d800.safetensors"
V7_OBJECT_SHA256 = "d532b4fa304e16a25d59b40d5d5896d21d67a9d76641fbd4b3cb2d7707860a94"


@pytest.mark.parametrize("name", list(V7_MANIFESTS))
def test_v7_checkpoints_sharing_an_object_load_exactly(name: str) -> None:
    root = HERE / "v7" / "root"
    ckpt = root / name
    raw = (ckpt / "manifest.json").read_bytes()
    assert hashlib.sha256(raw).hexdigest() == V7_MANIFESTS[name]
    assert hashlib.sha256((root / V7_OBJECT).read_bytes()).hexdigest() == V7_OBJECT_SHA256
    m = tg.read_manifest(ckpt)
    assert m["format_version"] == 7
    assert V7_OBJECT in [f["name"] for f in m["files"]]
    assert tg.verify(ckpt).nbytes > 1 << 20
    step = int(name.removeprefix("step-"))
    state = tg.load(ckpt)
    assert state["step"] == step
    assert_tensor(state["base"], torch.arange(262144, dtype=torch.float32).reshape(256, 1024) / 7)
    assert_tensor(state["adapter"], torch.full((4, 8), float(step)))
    # The shared object is a plain safetensors file of its one chunk.
    with safe_open(str(root / V7_OBJECT), framework="pt") as f:
        assert list(f.keys()) == ["t"]
        assert torch.equal(f.get_tensor("t"), state["base"])
