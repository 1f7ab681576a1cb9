"""Long lists and tuples of ints or floats are stored packed (format 6) and come back exactly.

A permutation of a few million sample ids is a common piece of training state; one JSON node
per item made its manifest so dense that every reader refused it (after the save committed).
"""

from __future__ import annotations

import math
import struct
from pathlib import Path

import pytest

import tardigrade as tg
from tardigrade._tree import PACK_MIN_ITEMS
from tardigrade.errors import CorruptCheckpointError
from tardigrade.format.jsonio import dumps, loads_strict
from tardigrade.format.manifest import FORMAT_VERSION, PACKED_VERSION, seal


def test_a_permutation_of_millions_saves_loads_and_verifies(tmp_path: Path) -> None:
    perm = list(range(2_500_000))
    perm[0], perm[-1] = perm[-1], perm[0]
    tg.save(tmp_path / "c", {"perm": perm, "epoch": 3})
    m = tg.read_manifest(tmp_path / "c")
    assert m["format_version"] == PACKED_VERSION
    # 8 bytes per id in base64: well under the 61 MiB one node per item took.
    assert (tmp_path / "c" / "manifest.json").stat().st_size < 12 * len(perm)
    tg.verify(tmp_path / "c")
    out = tg.load(tmp_path / "c")
    assert out == {"perm": perm, "epoch": 3}
    live = {"perm": [], "epoch": 0}
    tg.load(tmp_path / "c", into=live)
    assert live["perm"] == perm and live["epoch"] == 3


def f64_bits(x: float) -> bytes:
    return struct.pack("<d", x)


def test_packed_items_keep_their_exact_type_and_bits(tmp_path: Path) -> None:
    nan = struct.unpack("<d", struct.pack("<Q", 0x7FF8_0000_DEAD_BEEF))[0]
    floats = [0.1, -0.0, nan, math.inf, -math.inf, 5e-324] * 20
    state = {
        "ints": [*range(-(2**63), -(2**63) + 100), 2**63 - 1],
        "floats": floats,
        "tuple": tuple(range(PACK_MIN_ITEMS)),
        "nested": [list(range(PACK_MIN_ITEMS))] * 3,
    }
    tg.save(tmp_path / "c", state)
    tree = tg.read_manifest(tmp_path / "c")["tree"]
    kinds = {item[0]["v"]: item[1]["t"] for item in tree["v"]}
    assert kinds == {"ints": "packed", "floats": "packed", "tuple": "packed", "nested": "list"}
    out = tg.load(tmp_path / "c")
    assert out["ints"] == state["ints"] and all(type(x) is int for x in out["ints"])
    assert [f64_bits(x) for x in out["floats"]] == [f64_bits(x) for x in floats]
    assert all(type(x) is float for x in out["floats"])
    assert type(out["tuple"]) is tuple and out["tuple"] == state["tuple"]
    assert out["nested"] == state["nested"]


@pytest.mark.parametrize(
    "items",
    [
        [True] * PACK_MIN_ITEMS,  # bool is not int
        [1, 2.0] * PACK_MIN_ITEMS,  # mixed
        [2**63] * PACK_MIN_ITEMS,  # beyond int64
        list(range(PACK_MIN_ITEMS - 1)),  # short: stays readable, and format 4
    ],
    ids=["bools", "mixed", "bigints", "short"],
)
def test_other_lists_stay_one_node_per_item(tmp_path: Path, items: list[object]) -> None:
    tg.save(tmp_path / "c", {"x": items})
    m = tg.read_manifest(tmp_path / "c")
    assert m["format_version"] == FORMAT_VERSION
    assert m["tree"]["v"][0][1]["t"] == "list"
    out = tg.load(tmp_path / "c")["x"]
    assert out == items and [type(x) for x in out] == [type(x) for x in items]


def test_a_forged_packed_node_is_a_corrupt_checkpoint(tmp_path: Path) -> None:
    tg.save(tmp_path / "c", {"x": list(range(PACK_MIN_ITEMS))})
    path = tmp_path / "c" / "manifest.json"
    raw = path.read_bytes()
    body = raw[: raw.rindex(b',"manifest_checksum"')] + b"}"
    doc = loads_strict(body, "test")
    for bad in ("AAAA", "not base64!", 5):  # 3 bytes: not a whole int64; not base64; no str
        doc["tree"]["v"][0][1]["v"] = bad
        path.write_bytes(seal(dumps(doc)))
        with pytest.raises(CorruptCheckpointError, match=r"state\['x'\]"):
            tg.load(tmp_path / "c")
