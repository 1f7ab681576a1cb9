"""A share sent to a peer (``_peers.pack``): read piece by piece as it is sent, never whole in
the sender's memory; the files opened when packed, so a file retired meanwhile still reads as
it was; a file that fails mid-send goes as zeros the receiver's checks reject, and says why."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import tardigrade as tg
from tardigrade._peers import keep_share, pack, unpack
from tardigrade._ramtier import RamTier
from tardigrade._staging import populate
from tardigrade.errors import CorruptCheckpointError
from tardigrade.format.manifest import is_shared
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
    with pack([(3, share, None)], NAME) as payload:
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
    with pack([(0, share, None)], NAME) as payload:
        for f in files:
            os.unlink(tmp_path / NAME / f)  # a newer save retired the step meanwhile
        (got,) = unpack(memoryview(read_all(payload, 5000)), 0)
    assert {f: bytes(v) for f, v in got.files.items()} == files


def test_a_file_failing_mid_send_goes_as_zeros_and_says_why(share: LocalStorage) -> None:
    with pack([(0, share, None)], NAME) as payload:
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


SHARED = "step-000000002"


@pytest.fixture
def shared_share(tmp_path: Path) -> LocalStorage:
    """A checkpoint whose two large tensors are shared objects (format 7) and one small one a
    plain file of its own."""
    state = {
        "a": torch.arange(300_000, dtype=torch.float32),
        "b": torch.ones(300_000, dtype=torch.float32),
        "c": torch.ones(37, dtype=torch.int8),
    }
    tg.save(tmp_path / "src" / NAME, state)
    tg.save(tmp_path / "src" / SHARED, state, base=tmp_path / "src" / NAME)
    return LocalStorage(str(tmp_path / "src"))


def _objects(tmp_path: Path) -> list[str]:
    files = tg.Checkpoint.open(str(tmp_path / "src" / SHARED)).manifest.files
    return sorted(f for f in files if is_shared(f))


def _replica(tmp_path: Path) -> RamTier:
    (tmp_path / "shm").mkdir(exist_ok=True)
    return RamTier(str(tmp_path / "src"), tmp_path / "shm", replica_of=1)


def test_a_replica_receives_the_objects_it_lacks_and_keeps_those_it_holds(
    shared_share: LocalStorage, tmp_path: Path
) -> None:
    objects = _objects(tmp_path)
    assert len(objects) == 2
    tier = _replica(tmp_path)
    with pack([(1, shared_share, None)], SHARED) as payload:
        (first,) = unpack(memoryview(read_all(payload, payload.nbytes)), 1)
    assert sorted(f for f in first.files if is_shared(f)) == objects and first.kept == []
    keep_share(tier, first)
    assert sorted(tier.catalog.shared_objects()) == objects
    # The peer says it holds the first object: the payload carries the other alone, and
    # names the first as the share's (``kept``).
    with pack([(1, shared_share, None)], SHARED, skip={objects[0]}) as payload:
        data = read_all(payload, payload.nbytes)
    (again,) = unpack(memoryview(data), 1)
    assert again.kept == [objects[0]] and objects[0] not in again.files
    assert objects[1] in again.files
    keep_share(tier, again)
    tg.verify(tier.storage.url(SHARED))  # whole: its objects verified where they are


def test_a_replica_refuses_a_kept_object_it_lacks_or_a_damaged_one_writing_nothing(
    shared_share: LocalStorage, tmp_path: Path
) -> None:
    objects = _objects(tmp_path)
    tier = _replica(tmp_path)
    with pack([(1, shared_share, None)], SHARED, skip={objects[0]}) as payload:
        data = bytearray(read_all(payload, payload.nbytes))
    (share,) = unpack(memoryview(bytes(data)), 1)
    with pytest.raises(CorruptCheckpointError, match=objects[0].replace(".", r"\.")):
        keep_share(tier, share)  # said to be held here, and it is not
    # One byte of the object sent is flipped in transit: refused before anything is written.
    with pack([(1, shared_share, None)], SHARED) as payload:
        data = bytearray(read_all(payload, payload.nbytes))
    (share,) = unpack(memoryview(bytes(data)), 1)
    at = bytes(data).index(bytes(share.files[objects[1]]))
    data[at + share.files[objects[1]].nbytes - 1] ^= 0xFF
    (share,) = unpack(memoryview(bytes(data)), 1)
    with pytest.raises(CorruptCheckpointError, match="failed verification"):
        keep_share(tier, share)
    assert tier.catalog.shared_objects() == []
    assert not tier.catalog.committed(SHARED)
