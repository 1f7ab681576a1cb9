"""Hostile manifests within the caps: bounded work to validate, bounded memory to parse.

Each manifest here is built adversarially (many tiny boxes, layouts no plane cuts, dense JSON)
and must be read in work linear in its chunks, whatever the verdict (``python -m bench.hostile``
times them: about a second per 10 MB).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import tardigrade as tg
from tardigrade.errors import CorruptCheckpointError
from tardigrade.format import limits, manifest, tiling

TARGET_BYTES = 10_000_000


def doc(tensors: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "format": "tardigrade",
        "format_version": 1,
        "checksum_algorithm": "xxh3-64",
        "tree": {"t": "dict", "v": []},
        "files": [{"name": "d", "size": 2**62}],
        "tensors": tensors,
    }


_KEYS = itertools.count()


def chunk(offsets: tuple[int, ...], shape: tuple[int, ...]) -> dict[str, Any]:
    """A chunk entry as short as the format allows (keys must be unique per data file)."""
    return {
        "file": "d",
        "key": f"{next(_KEYS):x}",
        "offsets": list(offsets),
        "shape": list(shape),
        "checksum": "0",
    }


def grid(shape: tuple[int, ...]) -> dict[str, Any]:
    """``shape`` cut into 1x1x... boxes: the most chunks per byte a valid tensor can have."""
    cells = itertools.product(*(range(s) for s in shape))
    return {
        "dtype": "U8",
        "shape": list(shape),
        "chunks": [chunk(c, (1,) * len(shape)) for c in cells],
    }


def bricks(rows: int, cols: int) -> dict[str, Any]:
    """A brick wall: every other row shifted by one, so no plane cuts it (not a guillotine)."""
    out = []
    for r in range(rows):
        if r % 2:
            out.append(chunk((r, 0), (1, 1)))
            out += [chunk((r, c), (1, 2)) for c in range(1, cols - 1, 2)]
            out.append(chunk((r, cols - 1), (1, 1)))
        else:
            out += [chunk((r, c), (1, 2)) for c in range(0, cols, 2)]
    return {"dtype": "U8", "shape": [rows, cols], "chunks": out}


PINWHEEL = [
    ((0, 0), (2, 1)),
    ((2, 0), (3, 2)),
    ((1, 2), (3, 3)),
    ((0, 1), (1, 3)),
    ((1, 1), (2, 2)),
]


def pinwheel_3d() -> dict[str, Any]:
    """A 3x3x3 tensor: three pinwheel layers, each rotated, with unequal z extents, so that no
    plane in x, y or z separates its boxes and they are compared pairwise."""
    out = []
    for z, (a, b) in enumerate(PINWHEEL):
        out.append(chunk((a[0], a[1], 0), (b[0] - a[0], b[1] - a[1], 1 + z % 2)))
        if z % 2 == 0:
            out.append(chunk((a[0], a[1], 1), (b[0] - a[0], b[1] - a[1], 2)))
        else:
            out.append(chunk((a[0], a[1], 2), (b[0] - a[0], b[1] - a[1], 1)))
    return {"dtype": "U8", "shape": [3, 3, 3], "chunks": out}


def repeat(make: Any, approx_bytes_each: int) -> list[dict[str, Any]]:
    return [make() for _ in range(TARGET_BYTES // approx_bytes_each)]


def overlapping_last(t: dict[str, Any]) -> dict[str, Any]:
    """Move the last box onto the first: same volume, one overlap, one hole."""
    t["chunks"][-1] = dict(t["chunks"][0])
    return t


CASES: dict[str, Any] = {
    # 64x64 grids: 4096 boxes each, which the pairwise check took minutes over
    "grids-64x64": lambda: doc([grid((64, 64)) for _ in range(TARGET_BYTES // 300_000)]),
    "one-400x400-grid": lambda: doc([grid((400, 400))]),
    "one-46^3-grid": lambda: doc([grid((46, 46, 46))]),
    "one-18^4-grid": lambda: doc([grid((18, 18, 18, 18))]),
    "bricks": lambda: doc([bricks(300, 1000)]),
    "many-2x2x2-grids": lambda: doc(repeat(lambda: grid((2, 2, 2)), 560)),
    "many-3x3-grids": lambda: doc(repeat(lambda: grid((3, 3)), 600)),
    "many-pinwheels-3d": lambda: doc(repeat(pinwheel_3d, 720)),
    "grid-overlap-at-the-end": lambda: doc([overlapping_last(grid((400, 400)))]),
}


# Box visits the tiling check may make per chunk: a few per split dimension, or up to
# MAX_BOX_CHUNKS for the boxes of a stuck part compared pairwise. The quadratic check this
# guards against made ~4,000 per chunk on a 64x64 grid.
VISITS_PER_CHUNK = 2 * limits.MAX_BOX_CHUNKS


def count_tiling_work(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the boxes each step of the tiling check handles (a pairwise check: pairs)."""
    visits = [0]

    def counted(fn: Any, cost: Any) -> Any:
        def wrapper(part: list[Any], *args: Any) -> Any:
            visits[0] += cost(part, *args)
            return fn(part, *args)

        return wrapper

    for name in ("_check_1d", "_check_2d"):
        monkeypatch.setattr(tiling, name, counted(getattr(tiling, name), lambda p, *a: len(p)))
    monkeypatch.setattr(
        tiling, "_cut", counted(tiling._cut, lambda p, split, *a: len(p) * len(split))
    )
    monkeypatch.setattr(
        tiling, "_check_pairwise", counted(tiling._check_pairwise, lambda p: len(p) ** 2)
    )
    return visits


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", list(CASES))
def test_worst_case_manifest_validates_in_bounded_work(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Work, not seconds: ``python -m bench.hostile`` times the same documents."""
    document = CASES[case]()
    chunks = sum(len(t["chunks"]) for t in document["tensors"])
    raw = json.dumps(document, separators=(",", ":")).encode()
    assert len(raw) > 0.7 * TARGET_BYTES, len(raw)
    visits = count_tiling_work(monkeypatch)
    try:
        manifest.parse(raw, "hostile.json")
        verdict = "valid"
    except CorruptCheckpointError as e:
        verdict = str(e)
    assert 0 < visits[0] <= VISITS_PER_CHUNK * chunks, (case, visits[0], chunks)
    if case == "grid-overlap-at-the-end":
        assert "hostile.json: tensor #0: two of its chunks overlap" in verdict
    else:
        assert verdict == "valid", verdict


def test_pinwheel_3d_is_not_separable_but_valid() -> None:
    """The stuck case really is stuck (so the pairwise fallback is what the timing covers)."""
    from tardigrade.format.tiling import _cut, check_exact_tiling

    t = pinwheel_3d()
    boxes = [
        (tuple(c["offsets"]), tuple(o + n for o, n in zip(c["offsets"], c["shape"], strict=True)))
        for c in t["chunks"]
    ]
    assert _cut(boxes, [0, 1, 2], (0, 0, 0), (3, 3, 3)) is None
    check_exact_tiling(boxes, (3, 3, 3), 64)


@pytest.mark.parametrize(
    ("boxes", "shape", "valid"),
    [
        (PINWHEEL, (3, 3), True),
        (
            [
                ((0, 0), (2, 1)),
                ((2, 0), (3, 2)),
                ((1, 2), (3, 3)),
                ((0, 1), (1, 3)),
                ((0, 0), (1, 1)),
            ],
            (3, 3),
            False,
        ),
        ([((0,), (2,)), ((2,), (4,))], (4,), True),
        ([((0, 0), (1, 2)), ((0, 1), (2, 2)), ((1, 0), (2, 1))], (2, 2), False),  # overlap + hole
        ([((0, 0, 0), (1, 1, 1)), ((0, 0, 0), (1, 1, 1))], (1, 1, 2), False),
    ],
    ids=["pinwheel", "pinwheel-overlap", "1d", "l-shapes", "duplicates"],
)
def test_exact_tiling_verdicts(
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], shape: tuple[int, ...], valid: bool
) -> None:
    from tardigrade.format.tiling import TilingError, check_exact_tiling

    if valid:
        check_exact_tiling(boxes, shape, 64)
    else:
        with pytest.raises(TilingError):
            check_exact_tiling(boxes, shape, 64)


def test_exact_tiling_agrees_with_counting_cells() -> None:
    """Random layouts in 1-4 dims, valid and damaged, against a cell-by-cell count."""
    import math
    import random

    import numpy as np

    from tardigrade.format.tiling import TilingError, check_exact_tiling

    rng = random.Random(20)
    checked = refused = 0
    for _ in range(3000):
        shape = tuple(rng.randrange(1, 6) for _ in range(rng.choice([1, 2, 2, 3, 3, 4])))
        boxes = _random_layout(rng, shape)
        if sum(
            math.prod(b - a for a, b in zip(lo, hi, strict=True)) for lo, hi in boxes
        ) != math.prod(shape):
            continue
        cells = np.zeros(shape, dtype=np.int32)
        for lo, hi in boxes:
            cells[tuple(slice(a, b) for a, b in zip(lo, hi, strict=True))] += 1
        exact = bool((cells == 1).all())
        try:
            check_exact_tiling(boxes, shape, 64)
            verdict = True
        except TilingError as e:
            verdict = False
            if exact and "too complex" in str(e):  # a valid layout no writer makes: refused
                refused += 1
                continue
        assert verdict == exact, (shape, boxes)
        checked += 1
    assert checked > 1000
    assert refused < checked / 50, refused


def _random_layout(
    rng: Any, shape: tuple[int, ...]
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Greedy random boxes filling the grid (often not a guillotine), sometimes one moved."""
    import numpy as np

    taken = np.zeros(shape, dtype=bool)
    boxes = []
    for cell in itertools.product(*(range(s) for s in shape)):
        if taken[cell]:
            continue
        hi = [c + 1 for c in cell]
        for _ in range(5):
            k = rng.randrange(len(shape))
            if hi[k] < shape[k]:
                grown = [*hi[:k], hi[k] + 1, *hi[k + 1 :]]
                if not taken[tuple(slice(a, b) for a, b in zip(cell, grown, strict=True))].any():
                    hi = grown
        taken[tuple(slice(a, b) for a, b in zip(cell, hi, strict=True))] = True
        boxes.append((tuple(cell), tuple(hi)))
    if rng.random() < 0.5:
        i, k = rng.randrange(len(boxes)), rng.randrange(len(shape))
        lo, hi = boxes[i]
        if hi[k] < shape[k]:
            boxes[i] = ((*lo[:k], lo[k] + 1, *lo[k + 1 :]), (*hi[:k], hi[k] + 1, *hi[k + 1 :]))
    rng.shuffle(boxes)
    return boxes


# ----------------------------------------------------------------------------------------------
# memory: parsing a hostile manifest or header costs a bounded multiple of its size

_MEASURE = r"""
import json, resource, sys
from tardigrade.errors import TardigradeError
kind, path = sys.argv[1], sys.argv[2]
raw = open(path, "rb").read()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    if kind == "manifest":
        from tardigrade.format.manifest import parse
        parse(raw, path)
    else:
        from tardigrade.format.safetensors import read_header
        class Src:
            name, size = path, len(raw)
            def readinto(self, offset, buf):
                buf[:] = raw[offset : offset + len(buf)]
        read_header(Src())
    verdict = "ok"
except TardigradeError as e:
    verdict = type(e).__name__ + ": " + str(e)[:200]
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"grew": (peak - base) * 1024, "verdict": verdict}))
"""

_MANIFEST_HEAD = (
    b'{"format":"tardigrade","format_version":1,"checksum_algorithm":"xxh3-64",'
    b'"tree":{"t":"dict","v":[]},"files":[],"tensors":[],"extra":['
)
SIZE = 40_000_000


def _dense(unit: bytes, head: bytes = _MANIFEST_HEAD, tail: bytes = b"]}") -> bytes:
    body = unit * (SIZE // len(unit))
    return head + body[:-1] + tail


def _header(body: bytes) -> bytes:
    return len(body).to_bytes(8, "little") + body


def _tiny_entries() -> bytes:
    entries = b",".join(
        b'"%d":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}' % i for i in range(1_000_000)
    )
    return b"{" + entries + b"}"


def _realistic_manifest() -> bytes:
    entry = (
        b'{"dtype":"F32","shape":[4096,4096],"numpy":false,"chunks":[{"file":"d",'
        b'"key":"model/model.layers.%d.mlp.up_proj.weight","offsets":[0,0],"shape":[4096,4096],'
        b'"checksum":"c77b3abb6f87acd9"}]}'
    )
    n = SIZE // len(entry)
    tensors = b",".join(entry % i for i in range(n))
    return (
        b'{"format":"tardigrade","format_version":1,"checksum_algorithm":"xxh3-64",'
        b'"tree":{"t":"dict","v":[]},"files":[{"name":"d","size":%d}],"tensors":[%s]}'
        % (n * 4096 * 4096 * 4, tensors)
    )


# (what is parsed, how it is built, accepted?, bound on growth as a multiple of the input)
MEMORY_CASES: dict[str, tuple[str, Any, bool, float]] = {
    # the densest content the estimate lets through (floats: ~12x)
    "manifest-floats": ("manifest", lambda: _dense(b"1.5,"), True, 16),
    "manifest-realistic-tensors": ("manifest", _realistic_manifest, True, 16),
    # 25-40x when parsed: refused before parsing, over 1 GiB estimated
    "manifest-empty-lists": ("manifest", lambda: _dense(b"[],"), False, 2),
    "manifest-nested-lists": ("manifest", lambda: _dense(b"[[]],"), False, 2),
    # state-tree nodes of plain ints (~14x): what a big Python list in a state becomes
    "manifest-tree-nodes": ("manifest", lambda: _dense(b'{"t":"int","v":"5"},'), True, 16),
    "header-metadata-dicts": (
        "header",
        lambda: _header(_dense(b"{},", b'{"__metadata__":[', b"]}")),
        False,
        2,
    ),
    # a million empty tensors with short names: the most entries a header may list
    "header-tiny-entries": ("header", lambda: _header(_tiny_entries()), True, 16),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", list(MEMORY_CASES))
def test_parse_memory_is_bounded(case: str, tmp_path: Any) -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    import tardigrade as tg

    kind, build, accepted, multiple = MEMORY_CASES[case]
    raw = build()
    path = tmp_path / "input"
    path.write_bytes(raw)
    del raw
    env = dict(os.environ, PYTHONPATH=str(Path(tg.__file__).parent.parent))
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, kind, str(path)],
        capture_output=True,
        text=True,
        timeout=200,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    size = path.stat().st_size
    bound = multiple * size + (64 << 20)
    assert got["grew"] <= bound, (
        f"{case}: parsing {size >> 20} MiB grew the process by {got['grew'] >> 20} MiB "
        f"(> {bound >> 20} MiB); {got['verdict']}"
    )
    if accepted:
        assert got["verdict"] == "ok", got["verdict"]
    else:
        assert "so dense in objects and lists" in got["verdict"], got["verdict"]


def test_a_save_whose_manifest_no_reader_accepts_commits_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reader caps a manifest's size; a save must not commit one above that cap (a job
    of many ranks and tensors can reach it), since no load could ever read it back."""
    from tardigrade.format import limits

    state = {f"t{i}": torch.zeros(2) for i in range(200)}
    monkeypatch.setattr(limits, "MAX_MANIFEST_BYTES", 4096)
    with pytest.raises(tg.SaveError, match=r"manifest would be .* any reader accepts"):
        tg.save(tmp_path / "ckpt", state)
    assert not (tmp_path / "ckpt").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
