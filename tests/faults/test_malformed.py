"""Safe loading: every malformed checkpoint is rejected with the right error, naming the culprit.

Each test saves a small valid checkpoint with ``tg.save``, damages exactly one thing (bytes of
a data file's safetensors header, the manifest JSON, or the filesystem entry of a file), then
asserts both the exact error class and that the message names the offending file or key.

The reader checks its rules in order (size recorded in the manifest, header length, JSON,
entry count, each entry, then the layout of the data region), so each damage below is crafted
so that the rule under test is the one that fires: when a header changes length, the manifest's
recorded file size is updated too.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

import tardigrade as tg
from tardigrade.errors import (
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    TardigradeError,
    UnsupportedFormatError,
)
from tardigrade.format import limits
from tardigrade.format.checksum import checksum
from tardigrade.format.jsonio import dumps
from tardigrade.format.manifest import FORMAT_VERSION, READABLE_VERSIONS, seal

MANIFEST = "manifest.json"


# ----------------------------------------------------------------------------------------------
# helpers


def make_state() -> dict[str, Any]:
    """Three tensors of different item sizes (so the file holds them in a known order)."""
    return {
        "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": torch.arange(4, dtype=torch.int64),
        "c": torch.ones(3, dtype=torch.int16),
        "n": 5,
    }


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    tg.save(path, make_state())
    return path


@contextmanager
def raises_exactly(cls: type[BaseException], pattern: str) -> Iterator[pytest.ExceptionInfo]:
    """Like ``pytest.raises`` but the class must be exactly ``cls`` (not a subclass).

    ``pattern`` is searched with DOTALL, since verify() reports one line per failed file.
    """
    with pytest.raises(cls, match=f"(?s){pattern}") as info:
        yield info
    assert type(info.value) is cls, f"expected exactly {cls.__name__}, got {info.value!r}"
    assert isinstance(info.value, TardigradeError)


def assert_rejected(ckpt: Path, cls: type[BaseException], pattern: str) -> None:
    """Both ``load`` and ``verify`` must refuse the checkpoint the same way."""
    with raises_exactly(cls, pattern):
        tg.load(ckpt)
    with raises_exactly(cls, pattern):
        tg.verify(ckpt)


def data_file(ckpt: Path) -> Path:
    files = read_manifest_doc(ckpt)["files"]
    assert len(files) == 1, "the test state is meant to fit one data file"
    return ckpt / files[0]["name"]


def split_data_file(path: Path) -> tuple[bytes, bytes]:
    """(raw JSON header bytes, data region bytes) of a safetensors file."""
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    return blob[8 : 8 + n], blob[8 + n :]


def header_of(path: Path) -> dict[str, Any]:
    return json.loads(split_data_file(path)[0])


def write_data_file(
    ckpt: Path, raw_header: bytes, data: bytes, *, length: int | None = None
) -> None:
    """Re-emit the data file with ``raw_header`` (and a forged length field if given).

    The manifest's recorded size is updated so that the header rule under test is what fires.
    """
    path = data_file(ckpt)
    n = len(raw_header) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + raw_header + data)
    sync_sizes(ckpt)


def rewrite_header(ckpt: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    raw, data = split_data_file(data_file(ckpt))
    header = json.loads(raw)
    edit(header)
    write_data_file(ckpt, json.dumps(header, separators=(",", ":")).encode(), data)


def replace_in_header(ckpt: Path, old: bytes, new: bytes) -> None:
    """Swap bytes inside the header, keeping its length (so the file size is unchanged)."""
    raw, data = split_data_file(data_file(ckpt))
    assert len(old) == len(new) and raw.count(old) >= 1, (old, raw)
    write_data_file(ckpt, raw.replace(old, new, 1), data)


def read_manifest_doc(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / MANIFEST).read_bytes())


def write_manifest_doc(ckpt: Path, doc: Any) -> None:
    """Write ``doc`` as the manifest, re-sealed with a fresh checksum.

    These tests forge checkpoints the way an attacker would (consistent checksums), so that
    the rule under test fires, not the checksum that catches accidental damage.
    """
    if isinstance(doc, dict):
        doc = {k: v for k, v in doc.items() if k != "manifest_checksum"}
        (ckpt / MANIFEST).write_bytes(seal(dumps(doc)))
    else:
        (ckpt / MANIFEST).write_text(json.dumps(doc))


def edit_manifest(ckpt: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    doc = read_manifest_doc(ckpt)
    edit(doc)
    write_manifest_doc(ckpt, doc)


def sync_sizes(ckpt: Path) -> None:
    """Record the current size and header checksum of every (regular) data file."""

    def edit(doc: dict[str, Any]) -> None:
        for f in doc["files"]:
            p = ckpt / f["name"]
            if p.is_file() and not p.is_symlink():
                f["size"] = p.stat().st_size
                blob = p.read_bytes()
                n = struct.unpack("<Q", blob[:8])[0] if len(blob) >= 8 else 0
                f["header_checksum"] = checksum(blob[: 8 + n])

    edit_manifest(ckpt, edit)


def span(ckpt: Path, key: str) -> tuple[int, int]:
    begin, end = header_of(data_file(ckpt))[key]["data_offsets"]
    return begin, end


def rename_data_file(ckpt: Path, new_name: str) -> None:
    """Point the manifest's file list and every chunk at ``new_name``."""

    def edit(doc: dict[str, Any]) -> None:
        for f in doc["files"]:
            f["name"] = new_name
        for t in doc["tensors"]:
            for c in t["chunks"]:
                c["file"] = new_name

    edit_manifest(ckpt, edit)


def guard_allocations(monkeypatch: pytest.MonkeyPatch, limit: int = 1 << 20) -> None:
    """Fail the test if anything asks torch.empty for more than ``limit`` bytes."""
    real_empty = torch.empty

    def empty(*size: Any, **kw: Any) -> torch.Tensor:
        dims = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list)) else size
        itemsize = (kw.get("dtype") or torch.get_default_dtype()).itemsize
        nbytes = math.prod(int(d) for d in dims) * itemsize
        if nbytes > limit:
            pytest.fail(f"torch.empty asked for {nbytes} bytes for shape {list(dims)}")
        return real_empty(*size, **kw)

    monkeypatch.setattr(torch, "empty", empty)


def test_fixture_checkpoint_is_valid(ckpt: Path) -> None:
    """The starting point of every test below loads and verifies cleanly."""
    out = tg.load(ckpt)
    for k, v in make_state().items():
        assert torch.equal(out[k], v) if isinstance(v, torch.Tensor) else out[k] == v
    assert tg.verify(ckpt).tensors == 3
    # The layout the tests rely on: widest dtype first, so 'c' is the last tensor in the file.
    assert [k for k in header_of(data_file(ckpt)) if k != "__metadata__"] == ["b", "a", "c"]


# ----------------------------------------------------------------------------------------------
# the safetensors header of a data file


def test_header_length_larger_than_file(ckpt: Path) -> None:
    path = data_file(ckpt)
    raw, data = split_data_file(path)
    size = path.stat().st_size
    write_data_file(ckpt, raw, data, length=size)
    assert path.stat().st_size == size
    assert_rejected(
        ckpt,
        CorruptCheckpointError,
        rf"{re.escape(path.name)}: header length {size} runs past the end of the {size}-byte file",
    )


@pytest.mark.parametrize(
    "length", [limits.MAX_HEADER_BYTES + 1, 2**64 - 1], ids=["cap+1", "u64max"]
)
def test_header_length_over_cap(ckpt: Path, length: int) -> None:
    path = data_file(ckpt)
    raw, data = split_data_file(path)
    write_data_file(ckpt, raw, data, length=length)
    assert_rejected(
        ckpt,
        CorruptCheckpointError,
        rf"{re.escape(path.name)}: header length {length} exceeds the cap of "
        rf"{limits.MAX_HEADER_BYTES} bytes",
    )


def test_header_invalid_utf8(ckpt: Path) -> None:
    replace_in_header(ckpt, b'"b"', b'"\xff"')
    assert_rejected(
        ckpt,
        CorruptCheckpointError,
        rf"{re.escape(data_file(ckpt).name)}: header is not valid UTF-8",
    )


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (b'"dtype"', b"'dtype'"),  # single quotes
        (b'"shape":[2,3]', b'"shape":[N,3]'),  # bare word
        (b'"shape":[4]', b'"shape":[NaN]'),  # non-standard constant Python would accept
    ],
    ids=["quotes", "bareword", "nan"],
)
def test_header_invalid_json(ckpt: Path, old: bytes, new: bytes) -> None:
    if len(old) != len(new):
        raw, data = split_data_file(data_file(ckpt))
        write_data_file(ckpt, raw.replace(old, new, 1), data)
    else:
        replace_in_header(ckpt, old, new)
    assert_rejected(
        ckpt,
        CorruptCheckpointError,
        rf"{re.escape(data_file(ckpt).name)}: header is not valid JSON",
    )


def test_header_duplicate_keys(ckpt: Path) -> None:
    """A second entry for 'b' would silently win in a lax parser: a different tensor for 'b'."""
    raw, data = split_data_file(data_file(ckpt))
    body = raw.rstrip(b" ")
    assert body.endswith(b"}")
    forged = json.dumps({"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}).encode()
    write_data_file(ckpt, body[:-1] + b',"b":' + forged + b"}", data)
    assert_rejected(
        ckpt,
        CorruptCheckpointError,
        rf"{re.escape(data_file(ckpt).name)}: duplicate JSON key 'b'",
    )


def test_header_duplicate_keys_nested(ckpt: Path) -> None:
    raw, data = split_data_file(data_file(ckpt))
    write_data_file(ckpt, raw.replace(b'"dtype":"F32"', b'"dtype":"F32","dtype":"I32"', 1), data)
    assert_rejected(
        ckpt,
        CorruptCheckpointError,
        rf"{re.escape(data_file(ckpt).name)}: duplicate JSON key 'dtype'",
    )


@pytest.mark.parametrize("opener", [b"[", b'{"a":'], ids=["arrays", "objects"])
def test_header_deeply_nested(ckpt: Path, opener: bytes) -> None:
    _, data = split_data_file(data_file(ckpt))
    write_data_file(ckpt, opener * 100_000, data)
    assert_rejected(
        ckpt,
        CorruptCheckpointError,
        rf"{re.escape(data_file(ckpt).name)}: JSON is nested too deeply",
    )


def test_header_not_an_object(ckpt: Path) -> None:
    _, data = split_data_file(data_file(ckpt))
    write_data_file(ckpt, b'["b","a","c"]', data)
    assert_rejected(
        ckpt,
        CorruptCheckpointError,
        rf"{re.escape(data_file(ckpt).name)}: header is not a JSON object",
    )


def test_header_unknown_dtype(ckpt: Path) -> None:
    replace_in_header(ckpt, b'"dtype":"F32"', b'"dtype":"Q32"')
    assert_rejected(
        ckpt,
        UnsupportedFormatError,
        rf"{re.escape(data_file(ckpt).name)}: tensor 'a' has unknown dtype 'Q32'",
    )


def test_header_shape_disagrees_with_byte_range(ckpt: Path) -> None:
    """[3, 3] float32 needs 36 bytes; the entry's data_offsets span 24."""
    replace_in_header(ckpt, b'"shape":[2,3]', b'"shape":[3,3]')
    assert_rejected(
        ckpt,
        CorruptCheckpointError,
        rf"{re.escape(data_file(ckpt).name)}: tensor 'a': shape \[3, 3\] of F32 needs 36 bytes "
        r"but data_offsets \[\d+, \d+\] span 24",
    )


def test_header_huge_shape_rejected_without_allocating(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2**80 elements: the arithmetic alone must reject it; nothing may be allocated for it."""
    guard_allocations(monkeypatch)
    rewrite_header(ckpt, lambda h: h["a"].update(shape=[2**40, 2**40]))
    assert_rejected(
        ckpt,
        CorruptCheckpointError,
        rf"{re.escape(data_file(ckpt).name)}: tensor 'a': shape \[{2**40}, {2**40}\] of F32 "
        r"needs \d+ bytes",
    )


def test_header_entry_count_bomb(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cap is checked before any entry is looked at (the extra entries are not even valid)."""
    monkeypatch.setattr(limits, "MAX_TENSORS_PER_FILE", 100)

    def edit(h: dict[str, Any]) -> None:
        h.update({f"x{i}": 0 for i in range(100)})

    rewrite_header(ckpt, edit)
    assert_rejected(
        ckpt,
        CorruptCheckpointError,
        rf"{re.escape(data_file(ckpt).name)}: header lists 103 tensors, over the cap of 100",
    )


# ----------------------------------------------------------------------------------------------
# the layout of the data region


def test_offsets_overlap(ckpt: Path) -> None:
    """'a' moved 8 bytes back onto 'b' (its length still matches its shape)."""
    begin, end = span(ckpt, "a")
    old = f'"data_offsets":[{begin},{end}]'.encode()
    new = f'"data_offsets":[{begin - 8},{end - 8}]'.encode()
    replace_in_header(ckpt, old, new)
    assert_rejected(
        ckpt,
        CorruptCheckpointError,
        rf"{re.escape(data_file(ckpt).name)}: tensor 'a' overlaps the tensor before it",
    )


def test_offsets_leave_gap(ckpt: Path) -> None:
    """'c' moved 2 bytes later, the file grown by 2 bytes: two unaccounted bytes before 'c'."""
    begin, end = span(ckpt, "c")
    raw, data = split_data_file(data_file(ckpt))
    old = f'"data_offsets":[{begin},{end}]'.encode()
    new = f'"data_offsets":[{begin + 2},{end + 2}]'.encode()
    write_data_file(ckpt, raw.replace(old, new, 1), data + b"\0\0")
    assert_rejected(
        ckpt,
        CorruptCheckpointError,
        rf"{re.escape(data_file(ckpt).name)}: there is a gap of 2 bytes before tensor 'c'",
    )


def test_offsets_past_end_of_file(ckpt: Path) -> None:
    begin, end = span(ckpt, "c")
    old = f'"data_offsets":[{begin},{end}]'.encode()
    new = f'"data_offsets":[{begin + 4},{end + 4}]'.encode()
    replace_in_header(ckpt, old, new)
    assert_rejected(
        ckpt,
        CorruptCheckpointError,
        rf"{re.escape(data_file(ckpt).name)}: tensor 'c': data_offsets \[{begin + 4}, "
        rf"{end + 4}\] run past the end of the file",
    )


def test_trailing_bytes_after_last_tensor(ckpt: Path) -> None:
    raw, data = split_data_file(data_file(ckpt))
    write_data_file(ckpt, raw, data + b"evil")
    assert_rejected(
        ckpt,
        CorruptCheckpointError,
        rf"{re.escape(data_file(ckpt).name)}: 4 trailing bytes after the last tensor",
    )


@pytest.mark.parametrize("keep", [0, 4, 100, -2], ids=["empty", "4B", "mid-header", "last-2B"])
def test_truncated_data_file(ckpt: Path, keep: int) -> None:
    """Truncated, with the manifest's size updated too, so the reader's own rules fire."""
    path = data_file(ckpt)
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    cut = blob[:keep]
    path.write_bytes(cut)
    sync_sizes(ckpt)
    name = re.escape(path.name)
    if len(cut) < 8:
        # The manifest now records a size too small for its own tensors, which is caught
        # before the data file is even opened.
        pattern = rf"claims more bytes than data file '{name}' holds \({len(cut)}\)"
    elif 8 + n > len(cut):
        pattern = rf"{name}: header length {n} runs past the end of the {len(cut)}-byte file"
    else:
        pattern = rf"{name}: tensor 'c': data_offsets \[\d+, \d+\] run past the end of the file"
    assert_rejected(ckpt, CorruptCheckpointError, pattern)


def test_data_file_size_differs_from_manifest(ckpt: Path) -> None:
    """Truncated after commit: the size recorded in the manifest catches it before the header."""
    path = data_file(ckpt)
    size = path.stat().st_size
    os.truncate(path, size - 2)
    assert_rejected(
        ckpt,
        CorruptCheckpointError,
        rf"{re.escape(path.name)}: file is {size - 2} bytes but the manifest recorded {size}",
    )


# ----------------------------------------------------------------------------------------------
# tensor bytes


def test_flipped_byte_fails_checksum(ckpt: Path) -> None:
    path = data_file(ckpt)
    raw, data = split_data_file(path)
    begin, _ = span(ckpt, "a")
    damaged = bytearray(data)
    damaged[begin + 5] ^= 0x01  # inside a[1]
    write_data_file(ckpt, raw, bytes(damaged))
    pattern = rf"{re.escape(path.name)}: tensor 'a' .*fails its checksum"
    with raises_exactly(ChecksumMismatchError, pattern):
        tg.load(ckpt)
    with raises_exactly(ChecksumMismatchError, pattern):
        tg.verify(ckpt)
    # Opting out of verification reads the damaged bytes as they are.
    out = tg.load(ckpt, verify=False)
    want = make_state()
    assert not torch.equal(out["a"], want["a"])
    assert torch.equal(out["a"].flatten()[2:], want["a"].flatten()[2:])
    assert torch.equal(out["b"], want["b"]) and torch.equal(out["c"], want["c"])


# ----------------------------------------------------------------------------------------------
# filesystem entries


def test_missing_data_file(ckpt: Path) -> None:
    path = data_file(ckpt)
    path.unlink()
    assert_rejected(
        ckpt,
        CorruptCheckpointError,
        rf"{re.escape(path.name)}: file listed in the manifest is missing",
    )


@pytest.mark.parametrize("which", ["data", "manifest"])
def test_symlink_is_refused(ckpt: Path, tmp_path: Path, which: str) -> None:
    """Even a link to a perfectly valid copy: reads must never leave the checkpoint directory."""
    path = data_file(ckpt) if which == "data" else ckpt / MANIFEST
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    target = elsewhere / path.name
    shutil.copyfile(path, target)
    path.unlink()
    path.symlink_to(target)
    assert path.is_file()  # following the link would find a valid file
    assert_rejected(ckpt, CorruptCheckpointError, rf"{re.escape(path.name)}: is a symbolic link")


@pytest.mark.timeout(10)
@pytest.mark.parametrize("which", ["data", "manifest"])
@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_special_file_is_refused(ckpt: Path, which: str, kind: str) -> None:
    """A FIFO must not hang the reader (nobody ever writes to it); a directory is no file."""
    path = data_file(ckpt) if which == "data" else ckpt / MANIFEST
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
    assert_rejected(ckpt, CorruptCheckpointError, rf"{re.escape(path.name)}: is not a regular file")


@pytest.mark.parametrize(
    "bad_name",
    [
        "sub/data.safetensors",
        "../outside.safetensors",
        "sub\\data.safetensors",
        "..",
        ".",
        "",
        "data\x00.safetensors",
        "ABSOLUTE",
    ],
    ids=["slash", "dotdot-slash", "backslash", "dotdot", "dot", "empty", "nul", "absolute"],
)
def test_manifest_file_name_escapes_checkpoint(ckpt: Path, tmp_path: Path, bad_name: str) -> None:
    """Where possible a valid copy is planted at the target, so only the name check can stop it."""
    src = data_file(ckpt)
    if bad_name == "ABSOLUTE":
        bad_name = str(tmp_path / "absolute.safetensors")
    target = (ckpt / bad_name) if bad_name not in ("", ".", "..") and "\0" not in bad_name else None
    if target is not None:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, target)
    rename_data_file(ckpt, bad_name)
    pattern = rf"{MANIFEST}: data file name {re.escape(repr(bad_name))} is not a plain file name"
    with raises_exactly(CorruptCheckpointError, pattern):
        tg.load(ckpt)
    with raises_exactly(CorruptCheckpointError, pattern):
        tg.verify(ckpt)
    with raises_exactly(CorruptCheckpointError, pattern):
        tg.read_manifest(ckpt)


@pytest.mark.parametrize("what", ["manifest", "directory", "nothing"])
def test_no_manifest_is_not_found(tmp_path: Path, ckpt: Path, what: str) -> None:
    if what == "manifest":
        target, pattern = ckpt, "it has no manifest.json"
        (ckpt / MANIFEST).unlink()
    elif what == "directory":
        target, pattern = tmp_path / "empty", "it has no manifest.json"
        target.mkdir()
    else:
        target, pattern = tmp_path / "absent", "nothing exists at this path"
    pattern = rf"{re.escape(str(target))}: no committed checkpoint here \({pattern}"
    for fn in (tg.load, tg.verify, tg.read_manifest):
        with raises_exactly(CheckpointNotFoundError, pattern) as info:
            fn(target)
        assert isinstance(info.value, FileNotFoundError)


# ----------------------------------------------------------------------------------------------
# the manifest


def assert_manifest_rejected(ckpt: Path, cls: type[BaseException], pattern: str) -> None:
    """read_manifest, load and verify all refuse it; the message names manifest.json."""
    pattern = rf"{re.escape(str(ckpt / MANIFEST))}: {pattern}"
    for fn in (tg.read_manifest, tg.load, tg.verify):
        with raises_exactly(cls, pattern):
            fn(ckpt)


@pytest.mark.parametrize("version", [max(READABLE_VERSIONS) + 1, 999], ids=["next", "far-future"])
def test_manifest_future_format_version(ckpt: Path, version: int) -> None:
    edit_manifest(ckpt, lambda d: d.update(format_version=version))
    assert_manifest_rejected(
        ckpt, UnsupportedFormatError, f"format_version {version} is not supported"
    )


@pytest.mark.parametrize("version", ["1", 1.0, None, True], ids=["str", "float", "null", "bool"])
def test_manifest_format_version_not_an_int(ckpt: Path, version: Any) -> None:
    edit_manifest(ckpt, lambda d: d.update(format_version=version))
    assert_manifest_rejected(
        ckpt, CorruptCheckpointError, re.escape(f"'format_version' is {version!r}")
    )


def test_manifest_unknown_dtype(ckpt: Path) -> None:
    edit_manifest(ckpt, lambda d: d["tensors"][0].update(dtype="F128"))
    assert_manifest_rejected(ckpt, UnsupportedFormatError, "tensor #0 has unknown dtype 'F128'")


@pytest.mark.parametrize(
    "raw",
    [b"[]", b"null", b"42", b'"tardigrade"'],
    ids=["list", "null", "number", "string"],
)
def test_manifest_not_an_object(ckpt: Path, raw: bytes) -> None:
    (ckpt / MANIFEST).write_bytes(raw)
    assert_manifest_rejected(ckpt, CorruptCheckpointError, "manifest is not a JSON object")


@pytest.mark.parametrize("tree", ["missing", [], None, "x"])
def test_manifest_tree_missing(ckpt: Path, tree: Any) -> None:
    def edit(d: dict[str, Any]) -> None:
        if tree == "missing":
            del d["tree"]
        else:
            d["tree"] = tree

    edit_manifest(ckpt, edit)
    assert_manifest_rejected(ckpt, CorruptCheckpointError, "'tree' is missing")


def write_manifest_raw(ckpt: Path, raw: bytes) -> None:
    """Write manifest bytes, re-sealed (see write_manifest_doc)."""
    body = raw[: raw.rindex(b',"manifest_checksum"')] + b"}"
    (ckpt / MANIFEST).write_bytes(seal(body))


def test_manifest_invalid_utf8(ckpt: Path) -> None:
    raw = (ckpt / MANIFEST).read_bytes()
    write_manifest_raw(ckpt, raw.replace(b'"tardigrade"', b'"tardigr\xe9de"', 1))
    assert_manifest_rejected(ckpt, CorruptCheckpointError, "header is not valid UTF-8")


@pytest.mark.parametrize("cut", [0, 0.5], ids=["empty", "half"])
def test_manifest_invalid_json(ckpt: Path, cut: float) -> None:
    raw = (ckpt / MANIFEST).read_bytes()
    (ckpt / MANIFEST).write_bytes(raw[: int(len(raw) * cut)])
    assert_manifest_rejected(ckpt, CorruptCheckpointError, "header is not valid JSON")


@pytest.mark.parametrize(
    ("old", "new", "key"),
    [
        (
            f'"format_version":{FORMAT_VERSION},',
            f'"format_version":{FORMAT_VERSION},"format_version":{FORMAT_VERSION + 1},',
            "format_version",
        ),
        ('"dtype":"F32",', '"dtype":"F32","dtype":"I64",', "dtype"),
    ],
    ids=["top-level", "nested"],
)
def test_manifest_duplicate_keys(ckpt: Path, old: str, new: str, key: str) -> None:
    raw = (ckpt / MANIFEST).read_bytes()
    assert old.encode() in raw
    write_manifest_raw(ckpt, raw.replace(old.encode(), new.encode(), 1))
    assert_manifest_rejected(ckpt, CorruptCheckpointError, f"duplicate JSON key '{key}'")


def test_manifest_deeply_nested(ckpt: Path) -> None:
    (ckpt / MANIFEST).write_bytes(b"[" * 100_000)
    assert_manifest_rejected(ckpt, CorruptCheckpointError, "JSON is nested too deeply")


@pytest.mark.parametrize(
    ("cap", "pattern"),
    [
        ("MAX_TENSORS", "'tensors' must be a list of at most 2 entries"),
        ("MAX_FILES", "'files' must be a list of at most 0 entries"),
    ],
    ids=["tensors", "files"],
)
def test_manifest_count_caps(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, cap: str, pattern: str
) -> None:
    """The fixture lists 3 tensors and 1 file; each cap is lowered just below that."""
    monkeypatch.setattr(limits, cap, 2 if cap == "MAX_TENSORS" else 0)
    assert_manifest_rejected(ckpt, CorruptCheckpointError, pattern)


def test_manifest_byte_cap(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    size = (ckpt / MANIFEST).stat().st_size
    monkeypatch.setattr(limits, "MAX_MANIFEST_BYTES", size - 1)
    assert_manifest_rejected(
        ckpt, CorruptCheckpointError, f"{size} bytes exceeds the cap of {size - 1} bytes"
    )


@pytest.mark.parametrize("e", [3, 10**30, -1, "0", True, None, 1.0])
def test_tree_refers_to_missing_tensor(ckpt: Path, e: Any) -> None:
    def edit(d: dict[str, Any]) -> None:
        d["tree"]["v"][0][1]["e"] = e  # state['a']

    edit_manifest(ckpt, edit)
    pattern = rf"{re.escape(str(ckpt))}: tree refers to tensor #{re.escape(repr(e))}, which"
    with raises_exactly(CorruptCheckpointError, pattern):
        tg.load(ckpt)
    with raises_exactly(CorruptCheckpointError, pattern):
        tg.load(ckpt, keys=["a"])
    with raises_exactly(CorruptCheckpointError, pattern):
        tg.verify(ckpt)


def test_manifest_shape_disagrees_with_header(ckpt: Path) -> None:
    """The manifest says [3, 2] where the data file holds [2, 3]: same bytes, other tensor."""

    def edit(d: dict[str, Any]) -> None:
        d["tensors"][0]["shape"] = [3, 2]
        d["tensors"][0]["chunks"][0]["shape"] = [3, 2]

    edit_manifest(ckpt, edit)
    name = re.escape(data_file(ckpt).name)
    with raises_exactly(CorruptCheckpointError, rf"{name}: tensor 'a' \(for state\['a'\]\)"):
        tg.load(ckpt)
    with raises_exactly(CorruptCheckpointError, rf"{name}: tensor 'a' has dtype/shape F32\[2, 3\]"):
        tg.verify(ckpt)


@pytest.mark.parametrize(
    ("chunks", "pattern"),
    [
        ([([0], [2]), ([1], [2])], "tensor #1: two of its chunks overlap"),
        ([([0], [2]), ([3], [1])], r"tensor #1: its chunks do not cover its shape \[4\] exactly"),
        ([([0], [2]), ([3], [2])], r"tensor #1 has a chunk at \[3\] of shape \[2\] outside \[4\]"),
    ],
    ids=["overlap", "gap", "outside"],
)
def test_manifest_chunks_do_not_tile(
    ckpt: Path, chunks: list[tuple[list[int], list[int]]], pattern: str
) -> None:
    """Chunk offsets in the manifest must cover each tensor exactly once."""

    def edit(d: dict[str, Any]) -> None:
        proto = d["tensors"][1]["chunks"][0]  # 'b', shape [4]
        d["tensors"][1]["chunks"] = [dict(proto, offsets=o, shape=s) for o, s in chunks]

    edit_manifest(ckpt, edit)
    assert_manifest_rejected(ckpt, CorruptCheckpointError, pattern)


def test_manifest_chunk_key_missing_from_file(ckpt: Path) -> None:
    edit_manifest(ckpt, lambda d: d["tensors"][0]["chunks"][0].update(key="nope"))
    name = re.escape(data_file(ckpt).name)
    with raises_exactly(CorruptCheckpointError, rf"{name}: tensor 'nope' \(for state\['a'\]\)"):
        tg.load(ckpt)
    with raises_exactly(
        CorruptCheckpointError, rf"{name}: holds tensors \['a'\].*lacks \['nope'\]"
    ):
        tg.verify(ckpt)


def test_tree_nested_too_deeply(ckpt: Path) -> None:
    """Deep, but not so deep that the JSON parser's own guard fires first."""
    depth = limits.MAX_TREE_DEPTH + 50
    node: dict[str, Any] = {"t": "none"}
    for _ in range(depth):
        node = {"t": "list", "v": [node]}
    edit_manifest(ckpt, lambda d: d["tree"]["v"].append([{"t": "str", "v": "deep"}, node]))
    pattern = (
        rf"{re.escape(str(ckpt))}/manifest.json: state tree at state\['deep'\](\[0\])+: nested "
        rf"more than {limits.MAX_TREE_DEPTH} levels deep"
    )
    # Refused while validating the manifest, so verify() refuses it too.
    assert_rejected(ckpt, CorruptCheckpointError, pattern)


# (case, how the tree is damaged, the path the message must name)
TREE_DAMAGE: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "stateful-without-cls": (lambda t: t["v"][0][1].pop("cls"), "state['m']"),
    "stateful-v-not-object": (lambda t: t["v"][0][1].update(v=[]), "state['m']"),
    "dict-v-not-list": (lambda t: t["v"][1][1].update(v=5), "state['x']"),
    "dict-item-not-pair": (lambda t: t["v"][1][1].update(v=[5]), "state['x']"),
    "dict-key-not-node": (lambda t: t["v"][1][1].update(v=[[5, {"t": "none"}]]), "state['x']"),
    "list-v-not-list": (lambda t: t["v"][2][1].update(v=5), "state['l']"),
    "root-without-tag": (lambda t: t.pop("t"), "state"),
    "root-v-not-list": (lambda t: t.update(v={"m": 1}), "state"),
}


@pytest.mark.parametrize(
    ("case", "mode"),
    [
        pytest.param(
            case,
            mode,
            marks=[],
            id=f"{case}-{mode}",
        )
        for case in TREE_DAMAGE
        for mode in ("plain", "keys", "into")
    ],
)
def test_tree_malformed_node(tmp_path: Path, case: str, mode: str) -> None:
    ckpt = tmp_path / "ckpt"
    tg.save(ckpt, {"m": torch.nn.Linear(2, 2), "x": {"y": torch.ones(2)}, "l": [1, 2]})
    damage, where = TREE_DAMAGE[case]
    edit_manifest(ckpt, lambda d: damage(d["tree"]))
    pattern = rf"{re.escape(str(ckpt))}: .*state tree at {re.escape(where)}:"
    with raises_exactly(CorruptCheckpointError, pattern):
        if mode == "plain":
            tg.load(ckpt)
        elif mode == "keys":
            tg.load(ckpt, keys=[("m", "weight"), ("x", "y"), "l"])
        else:
            live = {"m": torch.nn.Linear(2, 2), "x": {"y": torch.zeros(2)}, "l": [0, 0]}
            tg.load(ckpt, into=live)


# ----------------------------------------------------------------------------------------------
# regressions of bugs found and fixed while this suite was written


@pytest.mark.parametrize("shape", [[2**40, 2**40], [2**15, 2**15]], ids=["2^80", "4GiB"])
def test_manifest_huge_shape_rejected_without_allocating(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, shape: list[int]
) -> None:
    """A tensor can never need more bytes than its data file holds; check that before allocating."""

    def edit(d: dict[str, Any]) -> None:
        d["tensors"][0]["shape"] = shape
        d["tensors"][0]["chunks"][0]["shape"] = shape

    edit_manifest(ckpt, edit)
    guard_allocations(monkeypatch)
    with raises_exactly(CorruptCheckpointError, r"tensor (#0|'a')"):
        tg.load(ckpt)


def test_manifest_many_overlapping_chunks(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    tg.save(ckpt, {"x": torch.tensor([1.0])})
    n = 2049

    def edit(d: dict[str, Any]) -> None:
        d["tensors"][0]["shape"] = [n]
        d["tensors"][0]["chunks"] = d["tensors"][0]["chunks"] * n  # all at offset 0

    edit_manifest(ckpt, edit)
    # Either rule may fire first; both refuse the manifest before any byte is read.
    with raises_exactly(
        CorruptCheckpointError,
        "tensor #0: two of its chunks overlap|tensor #0 .* claims more bytes",
    ):
        tg.load(ckpt)


def test_verify_error_class_does_not_depend_on_path(tmp_path: Path) -> None:
    ckpt = tmp_path / "checksum-demo"
    tg.save(ckpt, make_state())
    path = data_file(ckpt)
    os.truncate(path, path.stat().st_size - 2)
    with raises_exactly(CorruptCheckpointError, re.escape(path.name)):
        tg.verify(ckpt)


def test_tree_error_message_is_not_nested(ckpt: Path) -> None:
    edit_manifest(ckpt, lambda d: d["tree"]["v"][3][1].update(v="five"))  # state['n']
    with raises_exactly(CorruptCheckpointError, r"state tree at state\['n'\]") as info:
        tg.load(ckpt)
    assert str(info.value).count("state tree at") == 1, str(info.value)


# ----------------------------------------------------------------------------------------------
# shapes torch cannot describe (a zero dim hides any other dim from the byte count)


@pytest.fixture
def empty_ckpt(tmp_path: Path) -> Path:
    """One empty tensor (shape [0, 4]) and a normal one, for shapes that hold no bytes."""
    path = tmp_path / "empty"
    tg.save(path, {"e": torch.empty(0, 4), "x": torch.arange(3.0)})
    return path


@pytest.mark.parametrize(
    ("shape", "pattern"),
    [
        ([0, 2**63], r"tensor #0 has an invalid shape \[0, 9223372036854775808\]"),
        ([0, 2**62, 4], r"tensor #0 has a shape \[0, 4611686018427387904, 4\] too large"),
        ([2**61, 0, 2**2], r"tensor #0 has a shape \[2305843009213693952, 0, 4\] too large"),
    ],
    ids=["dim-2^63", "strides-overflow", "bytes-overflow"],
)
def test_manifest_empty_tensor_with_huge_dims(
    empty_ckpt: Path, shape: list[int], pattern: str
) -> None:
    """Zero elements, so no byte count catches it; torch.empty raised TypeError/RuntimeError."""

    def edit(d: dict[str, Any]) -> None:
        t = d["tensors"][0]
        assert t["shape"] == [0, 4]
        t["shape"] = shape
        t["chunks"][0]["shape"] = shape
        t["chunks"][0]["offsets"] = [0] * len(shape)

    edit_manifest(empty_ckpt, edit)
    assert_manifest_rejected(empty_ckpt, CorruptCheckpointError, pattern)
    with raises_exactly(CorruptCheckpointError, pattern):
        tg.load(empty_ckpt, verify=False)


def test_header_empty_tensor_with_huge_dims(empty_ckpt: Path) -> None:
    """The data file's own header is held to the same rule (tools read it without a manifest)."""
    from tardigrade.format import safetensors as st
    from tardigrade.storage.local import LocalReader

    rewrite_header(empty_ckpt, lambda h: h["e"].update(shape=[0, 2**62, 4]))
    with (
        LocalReader(str(data_file(empty_ckpt))) as src,
        raises_exactly(
            CorruptCheckpointError, r"tensor 'e': shape \[0, 4611686018427387904, 4\] is too large"
        ),
    ):
        st.read_header(src)
    rewrite_header(empty_ckpt, lambda h: h["e"].update(shape=[0, 2**63]))
    with (
        LocalReader(str(data_file(empty_ckpt))) as src,
        raises_exactly(
            CorruptCheckpointError, r"tensor 'e' has an invalid shape \[0, 9223372036854775808\]"
        ),
    ):
        st.read_header(src)


@pytest.mark.parametrize(
    "view",
    [
        {"offset": 0, "shape": [0, 2**63], "stride": [1, 1]},
        {"offset": 0, "shape": [0, 2**62, 4], "stride": [1, 1, 1]},
        {"offset": 0, "shape": [0], "stride": [2**63]},
        {"offset": 2**63, "shape": [0], "stride": [1]},
    ],
    ids=["dim-2^63", "strides-overflow", "stride-2^63", "offset-2^63"],
)
def test_tree_view_with_huge_dims(empty_ckpt: Path, view: dict[str, Any]) -> None:
    def edit(d: dict[str, Any]) -> None:
        d["tree"]["v"][1][1]["view"] = view  # state['x'], a 3-element tensor

    edit_manifest(empty_ckpt, edit)
    pattern = r"a tensor view .* does not fit its storage"
    for verify in (True, False):
        with raises_exactly(CorruptCheckpointError, pattern):
            tg.load(empty_ckpt, verify=verify)


# ----------------------------------------------------------------------------------------------
# dtype leaves: names come from a fixed table, never looked up on the torch module

_IMPORT_PROBE = r"""
import json, sys
import tardigrade as tg
from tardigrade.errors import CorruptCheckpointError
before = set(sys.modules)
outcomes = []
for ckpt in sys.argv[1:]:
    try:
        tg.load(ckpt)
        outcomes.append("loaded")
    except CorruptCheckpointError as e:
        outcomes.append(str(e))
print(json.dumps({"new": sorted(set(sys.modules) - before), "outcomes": outcomes}))
"""


@pytest.mark.timeout(60)
def test_dtype_leaf_imports_and_calls_nothing(tmp_path: Path) -> None:
    """'_inductor' made the loader import ~800 torch modules; 'has_cuda' handed back a bool."""
    names = ["_inductor", "has_cuda", "nn", "Tensor", "float", "_dynamo", "load"]
    paths = []
    for name in names:
        ckpt = tmp_path / name
        tg.save(ckpt, {"d": torch.bfloat16, "x": torch.ones(2)})
        edit_manifest(ckpt, lambda d, n=name: d["tree"]["v"][0][1].update(v=n))
        paths.append(str(ckpt))
    env = dict(os.environ, PYTHONPATH=str(Path(tg.__file__).parent.parent))
    out = subprocess.run(
        [sys.executable, "-c", _IMPORT_PROBE, *paths],
        capture_output=True,
        text=True,
        timeout=50,
        env=env,
        check=True,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["new"] == [], f"loading imported {len(got['new'])} modules: {got['new'][:10]}"
    for name, outcome in zip(names, got["outcomes"], strict=True):
        assert re.search(
            r"state tree at state\['d'\]: unknown or malformed node of type 'dtype'", outcome
        ), (name, outcome)


def test_dtype_leaf_table_decodes_every_dtype() -> None:
    """Every torch.dtype a state can hold round-trips through the fixed table."""
    from tardigrade._tree import decode, flatten

    dtypes = {n: d for n, d in vars(torch).items() if isinstance(d, torch.dtype)}
    flat = flatten({"all": list(dtypes.values())})
    out = decode(flat.tree, lambda n, p: None, "here")
    assert out["all"] == list(dtypes.values())
