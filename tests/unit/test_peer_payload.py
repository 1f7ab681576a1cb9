"""A share sent to a peer (``_peers.pack``): read piece by piece as it is sent, never whole in
the sender's memory; the files opened when packed, so a file retired meanwhile still reads as
it was; a file that fails mid-send goes as zeros the receiver's checks reject, and says why."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import tardigrade as tg
from tardigrade._peers import pack, unpack
from tardigrade._staging import populate
from tardigrade.storage import LocalStorage

NAME = "step-000000001"


def read_all(payload: object, piece: int) -> bytes:
    out = bytearray(payload.nbytes)  # type: ignore[attr-defined]
    view = memoryview(out)
    for start in range(0, len(out), piece):
        payload.read_into(start, view[start : start + piece])  # type: ignore[attr-defined]
    return bytes(out)


@pytest.fixture
def share(tmp_path: Path) -> LocalStorage:
    state = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(37, dtype=torch.int8)}
    tg.save(tmp_path / NAME, state)
    return LocalStorage(str(tmp_path))


def files_of(tmp_path: Path) -> dict[str, bytes]:
    return {
        p.name: p.read_bytes() for p in (tmp_path / NAME).iterdir() if p.name != "manifest.json"
    }


def test_pieces_of_any_size_add_up_to_the_share(share: LocalStorage, tmp_path: Path) -> None:
    with pack([(3, share)], NAME) as payload:
        whole = read_all(payload, payload.nbytes)
        for piece in (1, 7, 4096, payload.nbytes - 1):
            assert read_all(payload, piece) == whole
    (got,) = unpack(memoryview(whole), 0)
    assert got.share == 3 and got.name == NAME
    assert got.manifest == (tmp_path / NAME / "manifest.json").read_bytes()
    assert {f: bytes(v) for f, v in got.files.items()} == files_of(tmp_path)
    assert payload.error is None


def test_a_file_retired_after_packing_still_reads_as_it_was(
    share: LocalStorage, tmp_path: Path
) -> None:
    files = files_of(tmp_path)
    with pack([(0, share)], NAME) as payload:
        for f in files:
            os.unlink(tmp_path / NAME / f)  # a newer save retired the step meanwhile
        (got,) = unpack(memoryview(read_all(payload, 5000)), 0)
    assert {f: bytes(v) for f, v in got.files.items()} == files


def test_a_file_failing_mid_send_goes_as_zeros_and_says_why(share: LocalStorage) -> None:
    with pack([(0, share)], NAME) as payload:
        whole = read_all(payload, payload.nbytes)
        reader = payload._parts[-1][1]

        def failing(offset: int, buf: memoryview) -> None:
            raise OSError(5, "Input/output error")

        reader.readinto = failing  # type: ignore[method-assign,union-attr]
        sent = read_all(payload, 4096)
    assert isinstance(payload.error, OSError)
    assert sent != whole and len(sent) == len(whole)
    # The bytes of the failing piece are zeros, the rest as they were.
    assert sent.rstrip(b"\0") == whole[: len(sent.rstrip(b"\0"))]


def test_populating_a_buffer_keeps_its_bytes() -> None:
    buf = torch.arange(3 * 4096 + 17, dtype=torch.uint8)
    before = buf.clone()
    populate(buf, 5, buf.numel() - 3)  # False on a kernel without MADV_POPULATE_WRITE
    assert torch.equal(buf, before)
    assert populate(buf, 10, 20)  # less than a page: nothing to do
