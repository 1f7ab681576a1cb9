"""Fuzz the loader with mutations of real checkpoints: every outcome is a correct load or a
TardigradeError.

    python tests/fuzz/fuzz.py --n 20000 --seed 1          # what `make fuzz` runs
    python tests/fuzz/fuzz.py --replay 1:4711 -v          # one case again, in this process
    python tests/fuzz/fuzz.py --replay 1:4711 --fixture NAME   # keep it as a regression fixture

Each case (seed, index) copies a pristine checkpoint, applies one mutation drawn from
``random.Random(f"{seed}:{index}")`` (bit flips, byte edits, truncation, extension, JSON-aware
edits of the manifest and of safetensors headers, header lengths, hostile file names, symlinks,
FIFOs, directories) and runs ``read_manifest``, ``verify``, ``load(verify=True)``,
``load(verify=False)`` and ``CheckpointManager.restore()`` on it.

The oracle, per target:
- an exception that is not a TardigradeError is a finding ("exception");
- a module imported while reading a checkpoint is a finding ("import": the file chose it);
- a call over ``SLOW_S`` seconds is a finding ("slow"), a worker that does not answer within
  ``HANG_S`` is killed and respawned ("hang"), one that dies is respawned ("crash");
- an InsufficientMemoryError, or a MemoryError, under the worker's address-space limit is a
  finding ("memory"): the caps must stop a few-KB checkpoint long before that;
- ``load(verify=True)`` and ``restore()`` must give values bitwise equal to the pristine
  checkpoint's (restore: the newest checkpoint's, or the older pristine one's after skipping the
  damaged one), or raise. A different value is "silent": a finding, except for a format-v1
  manifest, which carries no checksum of its own (counted apart as "silent-unchecksummed-manifest").

Corpora: "fresh" is saved by the Tardigrade under test (so it has the newest format), "v1" is
the golden format-1 checkpoint in tests/compat/v1/ckpt, "v5" the golden distributed one (two
ranks: chunks as columns, a row-sharded tensor, per-rank parts; tests/compat/v5/ckpt), "v6" the
golden two-rank save with packed lists (tests/compat/v6/ckpt-2ranks), "v7" the golden save
that shares data (tests/compat/v7/root/step-2, its base a shared object beside it: the manifest
edits reach its references). The distributed ones are
read in one process, as rank 0, as a job restarted on one rank reads them.

Cases run in a few long-lived worker processes (spawning python+torch per case would cost a
second each), fed over a pipe; each worker limits its own address space after importing torch.
"""

from __future__ import annotations

import argparse
import base64
import functools
import importlib.util
import json
import os
import random
import re
import selectors
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
V1_CKPT = REPO / "tests" / "compat" / "v1" / "ckpt"
# Golden checkpoints of a distributed save, fuzzed like the others (read by one process).
GOLDEN = {
    "v5": REPO / "tests" / "compat" / "v5" / "ckpt",
    "v6": REPO / "tests" / "compat" / "v6" / "ckpt-2ranks",
    "v7": REPO / "tests" / "compat" / "v7" / "root" / "step-2",  # its data: a shared object
}
CORPORA = ("fresh", "v1", *GOLDEN)
FIXTURES = REPO / "tests" / "faults" / "fuzz_fixtures"
MANIFEST = "manifest.json"
STEP_DIR = "step-000000007"  # the mutated checkpoint in a worker's manager directory
OLDER_DIR = "step-000000005"  # an older pristine one restore() may fall back to
TARGETS = ("read_manifest", "verify", "load_verified", "load_unverified", "restore")
SLOW_S = 5.0
HANG_S = 30.0  # a whole case (all targets) in the parent's eyes
MEM_BUDGET = 1 << 30  # address space a worker may add on top of what torch's import took
# Cases write and delete files all the time: on tmpfs where there is one.
_SCRATCH = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
BAD = ("exception", "slow", "hang", "crash", "memory", "silent", "import", "harness")

HOSTILE_STRINGS = [
    "../manifest.json",
    "..",
    "/etc/passwd",
    "a/b",
    "a\\b",
    "x\x00y",
    "",
    "_inductor",
    "has_cuda",
    "float32",
    "F64",
    "I64",
    "__metadata__",
    "𝄞" * 3,
    "x" * 300,
]
EDGE_NUMBERS = [
    0,
    1,
    -1,
    2,
    7,
    255,
    2**31,
    2**32,
    2**53 + 1,
    2**62,
    2**63 - 1,
    2**63,
    2**64,
    2**64 + 7,
    10**30,
    -(2**63),
    1.5,
    -0.0,
    1e308,
]


# ----------------------------------------------------------------------------------------------
# corpora


@functools.cache
def _fixture_module() -> Any:
    spec = importlib.util.spec_from_file_location(
        "tg_v1_make_fixture", REPO / "tests" / "compat" / "v1" / "make_fixture.py"
    )
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def live_state(step: int) -> dict[str, Any]:
    """The state every corpus checkpoint holds (the golden v1 one's, so both restore into it)."""
    state = _fixture_module().build_state()
    state["step"] = step
    return state


def v5_state(step: int) -> dict[str, Any]:
    """A live state the golden v5 checkpoint restores into (one process: rank 0)."""
    import torch

    import tardigrade as tg

    return {
        "emb": tg.Sharded(torch.zeros(5, 3), (0, 0), (5, 3)),
        "bias": torch.zeros(3),
        "step": step,
        "mine": tg.PerRank({"rank": -1, "seen": torch.zeros(2, dtype=torch.int64)}),
    }


def v6_state(step: int) -> dict[str, Any]:
    """A live state the golden two-rank v6 checkpoint restores into."""
    import torch

    import tardigrade as tg

    return {"perm": [], "floats": (), "short": [], "w": torch.zeros(6), "mine": tg.PerRank([])}


def v7_state(step: int) -> dict[str, Any]:
    """A live state the golden v7 checkpoint (shared data) restores into."""
    import torch

    return {"base": torch.zeros(256, 1024), "adapter": torch.zeros(4, 8), "step": step}


STATES = {"fresh": live_state, "v1": live_state, "v5": v5_state, "v6": v6_state, "v7": v7_state}


def build_corpora(root: Path) -> dict[str, Path]:
    """Manager directories holding an older pristine checkpoint and the one to mutate."""
    import tardigrade as tg

    out = {}
    fresh = root / "fresh"
    for step, name in ((5, OLDER_DIR), (7, STEP_DIR)):
        tg.save(fresh / name, live_state(step), step=step, metrics={"loss": 0.25})
    out["fresh"] = fresh
    v1 = root / "v1"
    # Both v1 checkpoints are the golden one (so a v1 fixture replays on a v1-only reader).
    shutil.copytree(V1_CKPT, v1 / OLDER_DIR)
    shutil.copytree(V1_CKPT, v1 / STEP_DIR)
    out["v1"] = v1
    for name, golden in GOLDEN.items():
        shutil.copytree(golden, root / name / OLDER_DIR)
        shutil.copytree(golden, root / name / STEP_DIR)
        if (golden.parent / ".shared").is_dir():  # the shared data both reference
            shutil.copytree(golden.parent / ".shared", root / name / ".shared")
        out[name] = root / name
    return out


# ----------------------------------------------------------------------------------------------
# mutations: each is a list of explicit ops, so a finding can be stored and replayed as is


def _files(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.iterdir() if p.is_file())


def _data_files(ckpt: Path) -> list[str]:
    return [n for n in _files(ckpt) if n != MANIFEST]


def _json_paths(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _json_paths(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _json_paths(v, (*path, i))
    return out


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        doc = doc[p]
    return doc


INTERESTING_KEYS = {
    "shape", "offsets", "data_offsets", "dtype", "e", "view", "stride", "offset", "size",
    "name", "file", "key", "format_version", "format", "t", "files", "tensors", "chunks",
    "checksum", "numpy", "step", "manifest_checksum", "header_checksum",
}  # fmt: skip


def _interesting(doc: Any, path: tuple[Any, ...]) -> bool:
    """Paths into shapes, offsets, names, tags, dtype leaves and tensor references."""
    if any(k in INTERESTING_KEYS for k in path[-3:] if isinstance(k, str)):
        return True
    if path and path[-1] == "v":
        parent = _get(doc, path[:-1])
        return isinstance(parent, dict) and parent.get("t") in ("dtype", "int", "bytes")
    return False


def _edit_json(rng: random.Random, doc: Any) -> tuple[Any, str]:
    """One structural edit of a JSON document; returns (new doc, description)."""
    paths = _json_paths(doc)
    # Most leaves are RNG state; aim most edits at what the reader must validate.
    pick = rng.random()
    if pick < 0.6:
        pool = [p for p in paths if _interesting(doc, p)]
    elif pick < 0.85:
        pool = [p for p in paths if p and isinstance(_get(doc, p), (int, float, str, bool))]
    else:
        pool = paths
    path = rng.choice(pool or paths)
    if not path:
        return rng.choice([[], None, 1, "x", {"format": "tardigrade"}]), "replace root"
    parent, key = _get(doc, path[:-1]), path[-1]
    old = parent[key]
    kind = rng.choice(["number", "number", "type", "string", "delete", "add", "nest", "dup"])
    if kind == "number":
        if type(old) is int and rng.random() < 0.5:
            new: Any = old + rng.choice([-1, 1, -8, 8, 2**32, -(2**63)])
        else:
            new = rng.choice(EDGE_NUMBERS)
    elif kind == "type":
        new = rng.choice([None, True, "1", [old], {"v": old}, [], {}, 0.0])
    elif kind == "string":
        new = rng.choice(HOSTILE_STRINGS) if rng.random() < 0.7 else str(old)[:-1]
    elif kind == "delete":
        if isinstance(parent, dict):
            del parent[key]
        else:
            parent.pop(key)
        return doc, f"delete {list(path)}"
    elif kind == "add":
        if isinstance(parent, dict):
            parent[rng.choice(["extra", "t", "v", "e", "view", "meta", "pruned"])] = old
        else:
            parent.insert(rng.randrange(len(parent) + 1), old)
        return doc, f"add sibling of {list(path)}"
    elif kind == "nest":
        new = old
        for _ in range(rng.choice([1, 2, 50, 300])):
            new = [new] if rng.random() < 0.5 else {"t": "list", "v": [new]}
    else:  # dup: copy another node of the same document here
        new = json.loads(json.dumps(_get(doc, rng.choice(paths))))
    parent[key] = new
    return doc, f"{kind} {list(path)}: {_short(old)} -> {_short(new)}"


def _short(v: Any) -> str:
    s = json.dumps(v, ensure_ascii=True)
    return s if len(s) <= 60 else s[:57] + "..."


def _split_st(blob: bytes) -> tuple[int, bytes, bytes] | None:
    if len(blob) < 8:
        return None
    (n,) = struct.unpack("<Q", blob[:8])
    if 8 + n > len(blob):
        return None
    return n, blob[8 : 8 + n], blob[8 + n :]


def make_mutation(rng: random.Random, ckpt: Path) -> dict[str, Any]:
    """Draw one mutation of the pristine checkpoint directory ``ckpt`` as explicit ops."""
    files = _files(ckpt)
    kind = rng.choice(
        ["bitflip"] * 3
        + ["byte"] * 2
        + ["truncate", "extend", "manifest_json", "manifest_json", "manifest_json"]
        + ["header_json", "header_json", "header_len", "fs", "splice"]
        + ["semantic"] * 4
    )
    ops: list[dict[str, Any]] = []
    name = rng.choice(files)
    blob = (ckpt / name).read_bytes()
    desc = kind
    if kind == "bitflip":
        new = bytearray(blob)
        flips = [rng.randrange(len(blob) * 8) for _ in range(rng.choice([1, 1, 1, 2, 8]))]
        for bit in flips:
            new[bit // 8] ^= 1 << (bit % 8)
        desc = f"bitflip {name} bits {flips}"
        ops.append({"op": "write", "file": name, "data": bytes(new)})
    elif kind == "byte":
        new = bytearray(blob)
        pos = rng.randrange(len(blob))
        val = rng.choice([0, 0xFF, 0x7F, 0x80, ord("9"), ord("-"), ord('"'), ord("{"), ord("[")])
        new[pos] = val
        desc = f"byte {name}[{pos}] = {val:#x}"
        ops.append({"op": "write", "file": name, "data": bytes(new)})
    elif kind == "truncate":
        keep = rng.randrange(len(blob))
        desc = f"truncate {name} to {keep}"
        ops.append({"op": "write", "file": name, "data": blob[:keep]})
    elif kind == "extend":
        extra = rng.choice([b"\0", b" ", b"}", b"\0" * 4096, rng.randbytes(rng.randrange(1, 64))])
        desc = f"extend {name} by {len(extra)} bytes"
        ops.append({"op": "write", "file": name, "data": blob + extra})
    elif kind == "splice":  # a slice of the file copied over another place
        a, b = sorted(rng.randrange(len(blob)) for _ in range(2))
        at = rng.randrange(len(blob))
        new = bytearray(blob)
        new[at : at + (b - a)] = blob[a:b]
        desc = f"splice {name}[{a}:{b}] at {at}"
        ops.append({"op": "write", "file": name, "data": bytes(new[: len(blob)])})
    elif kind == "manifest_json":
        doc = json.loads((ckpt / MANIFEST).read_bytes())
        doc, what = _edit_json(rng, doc)
        desc = f"manifest_json {what}"
        ops.append({"op": "write", "file": MANIFEST, "data": _dumps(doc)})
    elif kind == "semantic":
        doc = json.loads((ckpt / MANIFEST).read_bytes())
        target = rng.choice([MANIFEST, MANIFEST, MANIFEST, "header"])
        if target == "header":
            name = rng.choice(_data_files(ckpt))
            parts = _split_st((ckpt / name).read_bytes())
            assert parts is not None
            _, raw, data = parts
            header = json.loads(raw)
            what = _semantic_header(rng, header)
            raw = _dumps(header)
            ops.append(
                {"op": "write", "file": name, "data": struct.pack("<Q", len(raw)) + raw + data}
            )
            ops.append({"op": "sync_size", "file": name})
        else:
            what = _semantic_manifest(rng, doc)
            ops.append({"op": "write", "file": MANIFEST, "data": _dumps(doc)})
        desc = f"semantic {what}"
    elif kind in ("header_json", "header_len"):
        name = rng.choice(_data_files(ckpt))
        blob = (ckpt / name).read_bytes()
        parts = _split_st(blob)
        assert parts is not None
        n, raw, data = parts
        if kind == "header_json":
            doc, what = _edit_json(rng, json.loads(raw))
            raw = _dumps(doc)
            desc = f"header_json {name} {what}"
            length = len(raw)
        else:
            length = rng.choice([0, 1, n - 1, n + 1, len(blob) - 8, len(blob), 2**63, 2**64 - 1])
            desc = f"header_len {name} = {length}"
        ops.append({"op": "write", "file": name, "data": struct.pack("<Q", length) + raw + data})
        if rng.random() < 0.5:  # keep the manifest's recorded size in step
            ops.append({"op": "sync_size", "file": name})
            desc += " (size synced)"
    else:  # fs
        name = rng.choice(files)
        how = rng.choice(["symlink_out", "symlink_in", "fifo", "dir", "delete", "hardlink_out"])
        desc = f"fs {how} {name}"
        ops.append({"op": how, "file": name, "other": rng.choice(files)})
    if kind in ("manifest_json", "semantic", "header_json", "header_len") and rng.random() < 0.5:
        # Re-seal what the edit broke (header checksums, the manifest's own): the case then
        # tests the validation behind the checksums. Values may then legitimately differ.
        ops.append({"op": "reseal", "file": MANIFEST})
        desc += " (resealed)"
    return {"kind": kind, "desc": desc, "ops": ops}


def _edge_dim(rng: random.Random, old: int) -> int:
    return rng.choice([0, 1, old + 1, old * 2, 2**31, 2**32, 2**62, 2**63 - 1, 2**63, 2**64])


def _semantic_manifest(rng: random.Random, doc: dict[str, Any]) -> str:
    """An edit a validator must understand: shapes, dtypes, views, references, names."""
    tensors = doc.get("tensors") or []
    nodes = [n for p in _json_paths(doc["tree"]) if isinstance(n := _get(doc["tree"], p), dict)]
    how = rng.choice(["shape", "shape", "dtype", "dtype_leaf", "view", "ref", "name", "offsets"])
    if isinstance(doc.get("per_rank"), list) and rng.random() < 0.3:
        return _semantic_per_rank(rng, doc)
    columns = [(i, t) for i, t in enumerate(tensors) if isinstance(t.get("chunks"), dict)]
    if columns and how in ("shape", "offsets", "name"):
        return _semantic_columns(rng, *rng.choice(columns), n_files=len(doc.get("files") or []))
    if how in ("shape", "offsets", "dtype") and tensors:
        i = rng.randrange(len(tensors))
        t = tensors[i]
        if how == "dtype":
            t["dtype"] = rng.choice(["F32", "F64", "U8", "BOOL", "BF16", "I64", "F8_E5M2", "x"])
            return f"tensor #{i} dtype -> {t['dtype']}"
        field = "shape" if how == "shape" else "offsets"
        dims = t["shape"] if how == "shape" else t["chunks"][0]["offsets"]
        if not dims:
            t["shape"] = [rng.choice([0, 2**63, 1])]
            return f"tensor #{i} 0-d shape -> {t['shape']}"
        d = rng.randrange(len(dims))
        new = _edge_dim(rng, dims[d])
        dims[d] = new
        if how == "shape" and len(t["chunks"]) == 1 and rng.random() < 0.7:
            t["chunks"][0]["shape"][d] = new  # keep the tiling consistent
        return f"tensor #{i} {field}[{d}] -> {new}"
    if how == "dtype_leaf":
        leaves = [n for n in nodes if n.get("t") == "dtype"] or nodes
        n = rng.choice(leaves)
        n["t"], n["v"] = "dtype", rng.choice(["_inductor", "has_cuda", "nn", "float", "Tensor"])
        return f"dtype leaf -> {n['v']}"
    refs = [n for n in nodes if n.get("t") in ("tensor", "ndarray")]
    if how in ("view", "ref") and refs:
        n = rng.choice(refs)
        if how == "ref":
            n["e"] = rng.choice([0, len(tensors) - 1, len(tensors), -1, 2**63])
            return f"tensor ref -> {n['e']}"
        view = n.setdefault("view", {"offset": 0, "shape": [1], "stride": [1]})
        field = rng.choice(["offset", "shape", "stride"])
        if field == "offset":
            view["offset"] = _edge_dim(rng, view["offset"])
        else:
            view[field] = [_edge_dim(rng, x) for x in view[field]] or [2**63]
            if rng.random() < 0.5:
                view["shape"] = [0, *view["shape"]]
                view["stride"] = [1, *view["stride"]]
        return f"view {field} -> {view}"
    files = doc.get("files") or [{}]
    new = rng.choice(HOSTILE_STRINGS)
    for f in files:
        f["name"] = new
    for t in tensors:
        for c in t.get("chunks", []):
            c["file"] = new
    return f"file name -> {new!r}"


def _semantic_columns(rng: random.Random, i: int, t: dict[str, Any], n_files: int) -> str:
    """An edit of a format-5 tensor's chunk columns: a column one element longer or shorter, a
    number at an edge, a file index out of range, a checksum of another length, a name."""
    cols = t["chunks"]
    what = rng.choice(["offsets", "shape", "offsets", "shape", "file", "checksum", "name"])
    if what == "name":
        t["name"] = rng.choice([*HOSTILE_STRINGS, "emb@0.0", t.get("name", "") + "@1"])
        return f"tensor #{i} name -> {t['name']!r}"
    if what == "checksum":
        cols["checksum"] = rng.choice([cols["checksum"][:-1], cols["checksum"] + "0", "", "zz"])
        return f"tensor #{i} checksum column -> {len(cols['checksum'])} characters"
    if what == "file":
        cols["file"] = rng.choice([n_files, -1, 2**63, [0, n_files], [0], []])
        return f"tensor #{i} file column -> {cols['file']}"
    dims = cols[what]
    if not dims:
        cols[what] = [rng.choice([0, [0, 0], 2**63])]
        return f"tensor #{i} {what} columns of a 0-d tensor -> {cols[what]}"
    d = rng.randrange(len(dims))
    col = dims[d]
    how = rng.choice(["longer", "shorter", "edge", "to_list", "extra_dim"])
    if how == "longer":  # one element more than there are chunks
        dims[d] = [*col, rng.choice([0, 1, 2**62])] if isinstance(col, list) else [col, col]
    elif how == "shorter" and isinstance(col, list):
        dims[d] = col[:-1]
    elif how == "to_list":
        dims[d] = [col] if not isinstance(col, list) else col[0]
    elif how == "extra_dim":
        dims.append(rng.choice([0, 1, [0, 1]]))
    else:
        dims[d] = [_edge_dim(rng, x) for x in col] if isinstance(col, list) else _edge_dim(rng, col)
    return f"tensor #{i} {what}[{d}] ({how}) -> {_short(dims[d] if d < len(dims) else dims)}"


def _semantic_per_rank(rng: random.Random, doc: dict[str, Any]) -> str:
    """An edit of the per-rank parts: a rank's part dropped, swapped, nested, or retagged."""
    parts = doc["per_rank"]
    how = rng.choice(["drop", "swap", "nest", "retag", "extra"])
    if how == "drop" and parts:
        parts.pop(rng.randrange(len(parts)))
    elif how == "swap" and len(parts) > 1:
        parts[0], parts[-1] = parts[-1], parts[0]
    elif how == "nest" and parts and parts[0]:
        node = parts[0][0]
        for _ in range(rng.choice([1, 150, 199, 250])):
            node = {"t": "list", "v": [node]}
        parts[0][0] = node
    elif how == "retag" and parts and parts[-1]:
        parts[-1][0] = rng.choice(
            [{"t": "per_rank", "i": 0}, {"t": "tensor", "e": 0}, {"t": "packed", "v": "AA"}, {}]
        )
    else:
        parts.append(parts[0] if parts else [])
    return f"per_rank {how}"


def _semantic_header(rng: random.Random, header: dict[str, Any]) -> str:
    keys = [k for k in header if k != "__metadata__"]
    if not keys:  # a rank's file that holds no tensor: give it one the manifest does not list
        header["x"] = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
        return "header of an empty file gains a tensor"
    k = rng.choice(keys)
    e = header[k]
    how = rng.choice(["shape", "shape", "dtype", "offsets", "metadata"])
    if how == "shape":
        if not e["shape"]:
            e["shape"] = [0, 2**63]
        else:
            d = rng.randrange(len(e["shape"]))
            e["shape"][d] = _edge_dim(rng, e["shape"][d])
        return f"header {k!r} shape -> {e['shape']}"
    if how == "dtype":
        e["dtype"] = rng.choice(["F32", "F64", "U8", "BOOL", "BF16", "I64", "C64", "_inductor"])
        return f"header {k!r} dtype -> {e['dtype']}"
    if how == "offsets":
        e["data_offsets"] = [_edge_dim(rng, x) for x in e["data_offsets"]]
        return f"header {k!r} data_offsets -> {e['data_offsets']}"
    header["__metadata__"] = rng.choice([[], {"a": 1}, {"a": [[]] * 100}, "x"])
    return "header __metadata__ replaced"


def _dumps(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()


def apply_ops(ckpt: Path, ops: list[dict[str, Any]], outside: Path) -> None:
    """Apply a mutation's ops to a copy of a checkpoint; ``outside`` is a file beside it."""
    for op in ops:
        path = ckpt / op["file"]
        kind = op["op"]
        if kind == "write":
            path.write_bytes(op["data"])
        elif kind == "reseal":
            _reseal(ckpt)
        elif kind == "sync_size":
            doc = json.loads((ckpt / MANIFEST).read_bytes())
            for f in _doc_files(doc):
                if isinstance(f, dict) and f.get("name") == op["file"]:
                    f["size"] = path.stat().st_size
            (ckpt / MANIFEST).write_bytes(_dumps(doc))
        else:
            keep = path.read_bytes() if path.is_file() else b""
            os.unlink(path)
            if kind == "symlink_out":  # the same bytes, but through a link out of the checkpoint
                outside.write_bytes(keep)
                os.symlink(outside, path)
            elif kind == "symlink_in":
                os.symlink(op["other"], path)
            elif kind == "hardlink_out":
                outside.write_bytes(keep)
                os.link(outside, path)
            elif kind == "fifo":
                os.mkfifo(path)
            elif kind == "dir":
                os.mkdir(path)
            elif kind != "delete":
                raise ValueError(f"unknown op {kind}")


def _doc_files(doc: Any) -> list[Any]:
    """A manifest's file list, or none when a mutation made it something else."""
    files = doc.get("files") if isinstance(doc, dict) else None
    return files if isinstance(files, list) else []


def _reseal(ckpt: Path) -> None:
    """Recompute every checksum that covers metadata: data files' headers, then the manifest."""
    try:
        doc = json.loads((ckpt / MANIFEST).read_bytes())
    except ValueError:
        return
    if not isinstance(doc, dict) or "manifest_checksum" not in doc:
        return  # an unsealed (v1) manifest: nothing to reseal
    from tardigrade.format.checksum import checksum
    from tardigrade.format.manifest import seal

    for f in _doc_files(doc):
        name = f.get("name") if isinstance(f, dict) else None
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\0" in name:
            continue
        p = ckpt / name
        try:
            if p.is_symlink() or not p.is_file():
                continue
            blob = p.read_bytes()
        except OSError:  # a hostile name the file system refuses
            continue
        parts = _split_st(blob)
        if parts is not None:
            f["header_checksum"] = checksum(blob[: 8 + parts[0]])
        f["size"] = len(blob)
    del doc["manifest_checksum"]
    body = _dumps(doc)
    if body.endswith(b"}") and body != b"{}":
        (ckpt / MANIFEST).write_bytes(seal(body))


def ops_to_json(ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {**op, "data": base64.b64encode(op["data"]).decode()} if "data" in op else op for op in ops
    ]


def ops_from_json(ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**op, "data": base64.b64decode(op["data"])} if "data" in op else op for op in ops]


# ----------------------------------------------------------------------------------------------
# the oracle


def snapshot(obj: Any, depth: int = 0) -> Any:
    """A comparable, bitwise picture of a value (tensors by dtype/shape/bytes, floats by bits)."""
    import numpy as np
    import torch

    import tardigrade as tg
    from tardigrade._tree import is_stateful

    if depth > 300:
        return ("deep",)
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().clone(memory_format=torch.contiguous_format)
        return ("tensor", str(t.dtype), tuple(t.shape), t.reshape(-1).view(torch.uint8).tolist())
    if isinstance(obj, np.ndarray):
        return ("ndarray", obj.dtype.str, obj.shape, np.ascontiguousarray(obj).tobytes())
    if type(obj) is float:
        return ("float", struct.pack(">d", obj))
    if isinstance(obj, dict):
        items = [(snapshot(k, depth + 1), snapshot(v, depth + 1)) for k, v in obj.items()]
        meta = getattr(obj, "_metadata", None)
        return (type(obj).__name__, items, snapshot(meta, depth + 1) if meta else None)
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, [snapshot(v, depth + 1) for v in obj])
    if isinstance(obj, tg.Sharded):
        return ("sharded", obj.offsets, obj.global_shape, snapshot(obj.local, depth + 1))
    if isinstance(obj, tg.PerRank):
        return ("per_rank", snapshot(obj.value, depth + 1))
    if is_stateful(obj) and not isinstance(obj, (int, str, bytes)):
        return ("stateful", type(obj).__name__, snapshot(obj.state_dict(), depth + 1))
    return (type(obj).__name__, repr(obj))


def _classify(exc: BaseException) -> tuple[str, str]:
    import tardigrade as tg

    name = type(exc).__name__
    if isinstance(exc, MemoryError):
        return "memory", f"{name}: {exc}"
    if isinstance(exc, tg.TardigradeError):
        return "rejected", name
    return "exception", f"{name}: {str(exc)[:300]}"


class Worker:
    """Runs cases against one corpus inside this process (the worker loop and --replay)."""

    def __init__(self, corpus: Path, scratch: Path, kind: str | None = None) -> None:
        import tardigrade as tg

        self.tg = tg
        self.corpus = corpus
        self.kind = kind or corpus.name  # which live state restores it (a key of STATES)
        self.run = scratch / "run"
        self.outside = scratch / "outside.bin"
        shutil.rmtree(self.run, ignore_errors=True)
        shutil.copytree(corpus, self.run, symlinks=True)
        self.expect_load = snapshot(tg.load(corpus / STEP_DIR))
        # 7 first: restore(5) sets the newer 7 aside as an abandoned timeline (reset() puts
        # the run directory back before each case).
        self.expect_restore = {s: self._restored(self.run, s) for s in (7, 5)}
        self.pristine = {p.name: p.read_bytes() for p in (corpus / STEP_DIR).iterdir()}
        # The shared objects beside the checkpoints (v7), which both reference: kept as is.
        self.shared = {
            p.relative_to(corpus).as_posix(): p.read_bytes()
            for p in (corpus / ".shared").glob("*/*")
        }
        self.dirty: set[str] = set()
        raw = self.pristine[MANIFEST]
        self.checksummed_manifest = b'"manifest_checksum"' in raw
        assert self.expect_restore[7] is not None, "the pristine corpus must restore"

    def _restored(self, directory: Path, step: int | None = None) -> Any:
        live = STATES[self.kind](-1)
        mgr = self.tg.CheckpointManager(directory, live, async_save=False, save_on_signals=())
        try:
            got = mgr.restore(step)
        finally:
            mgr.close()
        return None if got is None else (got, snapshot(live))

    def reset(self) -> Path:
        """Put the checkpoint back as it was: only what differs is rewritten (deleting and
        copying a directory per case costs more than the case itself on some filesystems)."""
        ckpt = self.run / STEP_DIR
        if ckpt.is_symlink() or not ckpt.is_dir():
            ckpt.unlink(missing_ok=True)
            ckpt.mkdir()
        for name in os.listdir(ckpt):
            p = ckpt / name
            if name not in self.pristine or p.is_symlink() or not p.is_file():
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        for name, data in self.pristine.items():
            p = ckpt / name
            if name in self.dirty or not p.exists():
                p.write_bytes(data)
        self.dirty = set()
        for p in self.run.iterdir():  # whatever a manager left beside the checkpoints
            if p.name not in (STEP_DIR, OLDER_DIR, ".shared"):
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else os.unlink(p)
        for name, data in self.shared.items():
            p = self.run / name
            if not p.is_file() or p.is_symlink() or p.stat().st_size != len(data):
                p.parent.mkdir(parents=True, exist_ok=True)
                p.unlink(missing_ok=True)
                p.write_bytes(data)
        self.outside.unlink(missing_ok=True)
        return ckpt

    def run_case(self, mutation: dict[str, Any], always_restore: bool = True) -> dict[str, Any]:
        """Run every target; ``restore`` is skipped (to save time) when ``verify`` rejected the
        checkpoint, unless ``always_restore`` (restore runs that same verify first)."""
        ckpt = self.reset()
        self.dirty = {op["file"] for op in mutation["ops"]} | {MANIFEST}
        apply_ops(ckpt, mutation["ops"], self.outside)
        # A v1 manifest has no checksum of its own: an edit to it may load another value.
        manifest_edit = any(
            op["file"] == MANIFEST or op["op"] == "sync_size" for op in mutation["ops"]
        )
        unguarded = manifest_edit and not self.checksummed_manifest
        resealed = any(op["op"] == "reseal" for op in mutation["ops"])
        tg = self.tg
        results: dict[str, Any] = {}
        for target in TARGETS:
            if (
                target == "restore"
                and not always_restore
                and results["verify"]["outcome"] == "rejected"
            ):
                continue
            start = time.perf_counter()
            modules = len(sys.modules)
            outcome, detail = "ok", ""
            try:
                if target == "read_manifest":
                    tg.read_manifest(ckpt)
                elif target == "verify":
                    tg.verify(ckpt)
                elif target == "load_verified":
                    if snapshot(tg.load(ckpt)) != self.expect_load:
                        outcome = "silent"
                elif target == "load_unverified":
                    tg.load(ckpt, verify=False)
                else:
                    got = self._restored(self.run)
                    if got not in (self.expect_restore[7], self.expect_restore[5]):
                        outcome, detail = "silent", f"restored step {got and got[0]}"
            except BaseException as e:  # the oracle itself: anything else is a finding
                if isinstance(e, KeyboardInterrupt):
                    raise
                outcome, detail = _classify(e)
                if outcome == "exception":
                    detail += "\n" + "".join(traceback.format_tb(e.__traceback__)[-3:])
                elif outcome == "memory" and type(e).__name__ != "MemoryError":
                    detail = f"{detail} (a tiny checkpoint made the loader ask for that much)"
            elapsed = time.perf_counter() - start
            if len(sys.modules) > modules and outcome not in BAD:
                # The checkpoint made the loader import something (a name looked up on torch).
                new = len(sys.modules) - modules
                outcome, detail = "import", f"{new} modules imported while reading it"
            if outcome == "silent" and resealed and self.checksummed_manifest:
                outcome = "different-resealed"  # an edit with valid checksums is the file
            elif outcome == "silent" and unguarded:
                outcome = "silent-unchecksummed-manifest"
            if elapsed > SLOW_S and outcome not in BAD:
                outcome, detail = "slow", f"{elapsed:.1f} s"
            results[target] = {"outcome": outcome, "detail": detail, "s": round(elapsed, 4)}
        return results


def case_mutation(corpus: Path, seed: int, index: int) -> dict[str, Any]:
    rng = random.Random(f"{seed}:{index}")
    return make_mutation(rng, corpus / STEP_DIR)


def _limit_memory(budget: int) -> None:
    import resource

    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + budget, vm + budget))


def worker_main(corpora_root: Path, scratch: Path, budget: int) -> None:
    """Read ``corpus seed index`` lines from stdin, answer one JSON line each on stdout."""
    import logging

    logging.disable(logging.WARNING)  # restore() logs every checkpoint it skips
    workers = {
        name: Worker(corpora_root / name, scratch / name)
        for name in sorted(os.listdir(corpora_root))
    }
    _limit_memory(budget)
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        corpus, seed, index = line.split()
        w = workers[corpus]
        try:
            mutation = case_mutation(w.corpus, int(seed), int(index))
            results = w.run_case(mutation, always_restore=int(index) % 4 == 0)
            reply = {"desc": mutation["desc"], "kind": mutation["kind"], "r": results}
        except Exception:  # the harness itself failed (the targets' errors are caught inside)
            detail = traceback.format_exc()
            reply = {
                "desc": "",
                "kind": "",
                "r": {"harness": {"outcome": "harness", "detail": detail}},
            }
        out.write(json.dumps(reply))
        out.write("\n")
        out.flush()


# ----------------------------------------------------------------------------------------------
# the parent


class _Proc:
    def __init__(self, corpora: Path, scratch: Path, budget: int) -> None:
        env = dict(os.environ, MALLOC_ARENA_MAX="2", PYTHONHASHSEED="0")
        src = str(REPO / "src")
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
        scratch.mkdir(parents=True, exist_ok=True)
        self.p = subprocess.Popen(
            [sys.executable, __file__, "--worker", str(corpora), str(scratch), str(budget)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(scratch / "stderr.log", "w"),  # noqa: SIM115
            text=True,
            bufsize=1,
        )
        self.job: tuple[str, int, int] | None = None
        self.started = 0.0
        self.ready = False

    def send(self, job: tuple[str, int, int]) -> None:
        assert self.p.stdin
        self.job = job
        self.started = time.monotonic()
        self.p.stdin.write(f"{job[0]} {job[1]} {job[2]}\n")
        self.p.stdin.flush()

    def kill(self) -> None:
        self.p.kill()
        self.p.wait()


def run_fuzz(
    n: int,
    seed: int,
    workers: int,
    corpora: list[str],
    budget: int = MEM_BUDGET,
    log: Any = sys.stderr,
) -> dict[str, Any]:
    """Run ``n`` cases (spread over ``corpora``) and return the tally and the findings."""
    tmp = Path(tempfile.mkdtemp(prefix="tg-fuzz-", dir=_SCRATCH))
    start = time.monotonic()
    try:
        roots = build_corpora(tmp / "corpora")
        for name in list(roots):
            if name not in corpora:
                shutil.rmtree(roots.pop(name))
        jobs = [(corpora[i % len(corpora)], seed, i) for i in range(n)]
        jobs.reverse()
        tally: dict[str, Counter[str]] = {c: Counter() for c in corpora}
        findings: list[dict[str, Any]] = []
        procs = [_Proc(tmp / "corpora", tmp / f"w{i}", budget) for i in range(workers)]
        sel = selectors.DefaultSelector()
        for p in procs:
            sel.register(p.p.stdout, selectors.EVENT_READ, p)  # type: ignore[arg-type]
        done = 0

        def finding(job: tuple[str, int, int], what: str, detail: str, desc: str = "") -> None:
            findings.append(
                {
                    "corpus": job[0],
                    "seed": job[1],
                    "index": job[2],
                    "what": what,
                    "detail": detail,
                    "desc": desc,
                }
            )
            print(
                f"FINDING {what}: corpus={job[0]} replay with --replay {job[1]}:{job[2]} "
                f"--corpus {job[0]}  [{desc}] {detail.splitlines()[0] if detail else ''}",
                file=log,
            )

        def respawn(p: _Proc) -> _Proc:
            sel.unregister(p.p.stdout)  # type: ignore[arg-type]
            p.kill()
            q = _Proc(tmp / "corpora", tmp / f"w{procs.index(p)}", budget)
            procs[procs.index(p)] = q
            sel.register(q.p.stdout, selectors.EVENT_READ, q)  # type: ignore[arg-type]
            return q

        while done < n:
            for p in procs:
                if p.ready and p.job is None and jobs:
                    p.send(jobs.pop())
            events = sel.select(timeout=1.0)
            for key, _ in events:
                p = key.data
                line = p.p.stdout.readline()
                if not line:  # the worker died
                    if p.job is not None:
                        code = p.p.poll()
                        finding(p.job, "crash", f"worker exited with {code}")
                        tally[p.job[0]]["crash"] += 1
                        done += 1
                    elif not p.ready:
                        log_text = (tmp / f"w{procs.index(p)}" / "stderr.log").read_text()
                        raise RuntimeError(f"a fuzz worker failed to start:\n{log_text}")
                    respawn(p)
                    continue
                if line.strip() == "ready":
                    p.ready = True
                    continue
                res = json.loads(line)
                job, p.job = p.job, None
                done += 1
                for target, r in res["r"].items():
                    tally[job[0]][r["outcome"]] += 1
                    if r["outcome"] in BAD:
                        finding(job, f"{r['outcome']} in {target}", r["detail"], res["desc"])
            now = time.monotonic()
            for p in list(procs):
                if p.job is not None and now - p.started > HANG_S:
                    finding(p.job, "hang", f"no answer in {HANG_S} s")
                    tally[p.job[0]]["hang"] += 1
                    done += 1
                    respawn(p)
        for p in procs:
            p.kill()
        return {
            "cases": n,
            "seconds": round(time.monotonic() - start, 1),
            "tally": {c: dict(t) for c, t in tally.items()},
            "findings": findings,
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------------------------
# replay and fixtures


def replay(corpus_name: str, seed: int, index: int, fixture: str | None) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="tg-fuzz-replay-", dir=_SCRATCH))
    try:
        roots = build_corpora(tmp / "corpora")
        w = Worker(roots[corpus_name], tmp / "w")
        mutation = case_mutation(w.corpus, seed, index)
        results = w.run_case(mutation)
        if fixture:
            save_fixture(fixture, w.corpus, mutation, results, f"{corpus_name} {seed}:{index}")
        return {"desc": mutation["desc"], "results": results}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save_fixture(
    name: str, corpus: Path, mutation: dict[str, Any], results: dict[str, Any], origin: str
) -> Path:
    """Store the pristine manager directory and the mutation, so the case replays exactly."""
    if not re.fullmatch(r"[a-z0-9][a-z0-9_-]*", name):
        raise SystemExit(f"fixture name {name!r}: use lower-case letters, digits, - and _")
    out = FIXTURES / name
    if out.exists():
        raise SystemExit(f"{out} exists")
    shutil.copytree(corpus, out / "pristine")
    case = {
        "origin": origin,
        "desc": mutation["desc"],
        "ops": ops_to_json(mutation["ops"]),
        "found": {t: r["outcome"] for t, r in results.items()},
    }
    (out / "case.json").write_text(json.dumps(case, indent=1) + "\n")
    return out


def replay_fixture(path: Path, scratch: Path) -> dict[str, Any]:
    """Run a stored case with the current code; returns the results by target."""
    case = json.loads((path / "case.json").read_text())
    kind = case["origin"].split()[0]  # the corpus it was found in: "v5 1:2054"
    w = Worker(path / "pristine", scratch, kind)
    return w.run_case({"ops": ops_from_json(case["ops"]), "desc": case["desc"]})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=2000, help="number of cases")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workers", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    ap.add_argument("--corpus", action="append", choices=list(CORPORA))
    ap.add_argument("--replay", metavar="SEED:INDEX")
    ap.add_argument("--fixture", metavar="NAME", help="with --replay: store the case")
    ap.add_argument("--json", metavar="FILE", help="write the summary as JSON")
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker_main(Path(args.worker[0]), Path(args.worker[1]), int(args.worker[2]))
        return 0
    corpora = args.corpus or list(CORPORA)
    if args.replay:
        seed, index = (int(x) for x in args.replay.split(":"))
        out = replay(corpora[0], seed, index, args.fixture)
        print(json.dumps(out, indent=1))
        return 0
    summary = run_fuzz(args.n, args.seed, args.workers, corpora)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    print(f"fuzz: {summary['cases']} mutations x {len(TARGETS)} targets in {summary['seconds']} s")
    for c, t in summary["tally"].items():
        print(f"  {c}: " + ", ".join(f"{k}={v}" for k, v in sorted(t.items())))
    bad = [f for f in summary["findings"]]
    print(f"  findings: {len(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
