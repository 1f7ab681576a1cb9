"""The physical references every tool is compared with, on the same byte count.

All work on one pre-faulted scratch buffer the size of the state, so they measure the disk and
memory, not page faults: a raw sequential write + fsync of it (buffered, and with O_DIRECT), a
hot-cache read into it, and a memcpy of the live tensors into it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

import torch

from .state import TrainState

CHUNK = 64 * 1024 * 1024  # bytes per write/read call


BLOCK = 4096  # direct I/O wants block-aligned addresses, offsets and lengths


class Scratch:
    """A buffer of the state's size, touched once so later copies into it never fault.

    It starts at a block-aligned address, so ``raw_write_direct`` can hand it to O_DIRECT.
    """

    def __init__(self, nbytes: int) -> None:
        raw = torch.empty(nbytes + BLOCK, dtype=torch.uint8)
        start = -raw.data_ptr() % BLOCK
        self.buf = raw[start : start + nbytes]
        self.view = memoryview(self.buf.numpy())

    def fill_from(self, state: TrainState) -> int:
        """memcpy every live tensor into the buffer, back to back; return the bytes copied."""
        pos = 0
        for t in state.tensors().values():
            n = t.numel() * t.element_size()
            self.buf[pos : pos + n].copy_(t.detach().reshape(-1).view(torch.uint8))
            pos += n
        return pos


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_write(scratch: Scratch, path: Path) -> None:
    """Sequential write of the whole buffer to a new file, then fsync the file and directory."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = scratch.view
        while view.nbytes:
            n = os.write(fd, view[:CHUNK])
            view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(path.parent)


def raw_write_direct(scratch: Scratch, path: Path) -> None:
    """The same write with O_DIRECT (no page cache), then fsync: the disk's own speed.

    The block-aligned bulk goes direct; a ragged tail (under 4 KiB) is written buffered.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
    try:
        view = scratch.view
        bulk = view.nbytes - view.nbytes % BLOCK
        pos = 0
        while pos < bulk:
            pos += os.write(fd, view[pos : min(bulk, pos + CHUNK)])
        if pos < view.nbytes:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            while pos < view.nbytes:
                pos += os.write(fd, view[pos:])
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(path.parent)


def hot_read(scratch: Scratch, path: Path) -> None:
    """Read the file written by ``raw_write`` back into the buffer (call ``warm`` first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        view, pos = scratch.view, 0
        while pos < view.nbytes:
            n = os.preadv(fd, [view[pos : pos + CHUNK]], pos)
            if n == 0:
                raise RuntimeError(f"{path}: ended at byte {pos}, expected {view.nbytes}")
            pos += n
    finally:
        os.close(fd)


def memcpy(scratch: Scratch, state: TrainState) -> None:
    scratch.fill_from(state)


_WARM_BUF = bytearray(CHUNK)


def warm(path: Path) -> int:
    """Read every file under ``path`` once, so its pages are in the page cache; return bytes."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    buf, total = memoryview(_WARM_BUF), 0
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            while n := os.readv(fd, [buf]):
                total += n
        finally:
            os.close(fd)
    return total


def remove(path: Path) -> None:
    """Delete a tool's previous output (a file or a directory) before it is rewritten."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
