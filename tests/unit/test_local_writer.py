"""The local file writer: direct (O_DIRECT) writes through a bounce buffer, and their fallbacks.

Large data files bypass the page cache; these tests pin that the bytes on disk are exactly the
bytes written whatever the size (block-aligned or not, one bounce buffer or many), and that a
filesystem refusing direct I/O at open or at write time still gets a correct file.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import tardigrade as tg
from tardigrade.errors import StorageError
from tardigrade.storage import local
from tardigrade.storage.local import BOUNCE_BYTES, DIRECT_BLOCK, DIRECT_MIN_BYTES, LocalWriter


def _payload(nbytes: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def _write(path: Path, data: bytes, piece: int, size_hint: int | None) -> LocalWriter:
    w = LocalWriter(str(path), size_hint=size_hint)
    view = memoryview(data)
    for start in range(0, len(data), piece):
        w.write(view[start : start + piece])
    w.close()
    return w


@pytest.mark.parametrize(
    "nbytes",
    [
        DIRECT_MIN_BYTES,  # exactly block-aligned
        DIRECT_MIN_BYTES + 1,  # one byte into the last block
        BOUNCE_BYTES * 2 + DIRECT_BLOCK - 7,  # several bounce buffers and a ragged tail
    ],
)
@pytest.mark.parametrize("piece", [1 << 20, 12_345])
def test_direct_write_stores_exactly_the_bytes_given(
    tmp_path: Path, nbytes: int, piece: int
) -> None:
    data = _payload(nbytes)
    path = tmp_path / "f"
    w = _write(path, data, piece, size_hint=nbytes)
    assert w.direct, "a large file on a local filesystem should be written with O_DIRECT"
    assert path.stat().st_size == nbytes
    assert path.read_bytes() == data


def test_small_or_unsized_files_are_buffered(tmp_path: Path) -> None:
    small = LocalWriter(str(tmp_path / "small"), size_hint=DIRECT_MIN_BYTES - 1)
    unsized = LocalWriter(str(tmp_path / "unsized"))
    assert not small.direct and not unsized.direct
    small.write(b"abc")
    unsized.write(b"xyz")
    small.close()
    unsized.close()
    assert (tmp_path / "small").read_bytes() == b"abc"
    assert (tmp_path / "unsized").read_bytes() == b"xyz"


def test_filesystem_refusing_direct_io_at_open_gets_a_buffered_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local, "_set_direct", lambda fd, on: False)
    data = _payload(DIRECT_MIN_BYTES + 999)
    w = _write(tmp_path / "f", data, 1 << 20, size_hint=len(data))
    assert not w.direct
    assert (tmp_path / "f").read_bytes() == data


@pytest.mark.parametrize("value", ["0", "false", "OFF"])
def test_direct_io_can_be_turned_off_by_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("TARDIGRADE_DIRECT_IO", value)
    data = _payload(DIRECT_MIN_BYTES + 3)
    w = _write(tmp_path / "f", data, 1 << 20, size_hint=len(data))
    assert not w.direct
    assert (tmp_path / "f").read_bytes() == data


def test_filesystem_refusing_a_direct_write_falls_back_to_buffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_write = os.write
    refused = []

    def write(fd: int, data: memoryview) -> int:
        import fcntl

        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(local.os, "write", write)
    data = _payload(BOUNCE_BYTES + 4321)
    _write(tmp_path / "f", data, 1 << 20, size_hint=len(data))
    assert refused, "the direct write was never attempted"
    assert (tmp_path / "f").read_bytes() == data


def test_a_failing_direct_write_raises_storage_error_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def write(fd: int, data: memoryview) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    w = LocalWriter(str(tmp_path / "f"), size_hint=BOUNCE_BYTES * 2)
    monkeypatch.setattr(local.os, "write", write)
    with pytest.raises(StorageError, match="No space left on device") as info:
        w.write(_payload(BOUNCE_BYTES + 1))
    assert str(tmp_path / "f") in str(info.value)
    w.abort()


def test_checkpoint_written_directly_round_trips_and_opens_as_safetensors(tmp_path: Path) -> None:
    from safetensors import safe_open

    state = {"w": torch.randn(3_000_017), "i": torch.arange(1001, dtype=torch.int16)}
    tg.save(tmp_path / "c", state)
    out = tg.load(tmp_path / "c")
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["i"], state["i"])
    data = next((tmp_path / "c").glob("data-*.safetensors"))
    assert data.stat().st_size % DIRECT_BLOCK != 0  # the padding was truncated away
    with safe_open(str(data), framework="pt") as f:
        assert torch.equal(f.get_tensor("w"), state["w"])


def test_aligned_data_goes_direct_without_a_bounce_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block-aligned buffer written at a block boundary reaches the disk straight from the
    caller's memory; only an unaligned tail passes through a (small) bounce buffer."""
    bounced: list[int] = []
    real = local._aligned
    monkeypatch.setattr(local, "_aligned", lambda n: (bounced.append(n), real(n))[1])
    raw = np.zeros(3 * BOUNCE_BYTES + 2 * DIRECT_BLOCK, dtype=np.uint8)
    start = -raw.ctypes.data % DIRECT_BLOCK
    block = raw[start : start + 3 * BOUNCE_BYTES]
    block[:] = np.frombuffer(_payload(block.nbytes, seed=1), dtype=np.uint8)
    tail = _payload(1000, seed=2)
    path = tmp_path / "f"
    w = LocalWriter(str(path), size_hint=block.nbytes + len(tail))
    w.write(memoryview(block))
    assert bounced == [], "aligned data was copied through the bounce buffer"
    w.write(tail)
    w.close()
    assert bounced and max(bounced) == DIRECT_BLOCK  # the tail alone, one block
    assert path.read_bytes() == block.tobytes() + tail


def test_a_file_whose_size_is_not_what_was_written_fails_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A direct write pads the last block and truncates the padding off again. If the file
    does not end up exactly as long as what was written (here the truncate is lost), close()
    must fail rather than let a save commit a file with stray bytes at its end."""
    monkeypatch.setattr(local.os, "ftruncate", lambda fd, length: None)
    data = _payload(DIRECT_MIN_BYTES + 1)
    w = LocalWriter(str(tmp_path / "f"), size_hint=len(data))
    assert w.direct
    w.write(data)
    with pytest.raises(StorageError) as info:
        w.close()
    msg = str(info.value)
    assert str(tmp_path / "f") in msg, msg
    assert f"holds {DIRECT_MIN_BYTES + DIRECT_BLOCK} bytes" in msg, msg
    assert f"but {len(data)} were written" in msg, msg
    assert info.value.errno == errno.EIO
