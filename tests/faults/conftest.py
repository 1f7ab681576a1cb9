"""Shared fixtures of the fault tests: real filesystems mounted for the test (root needed)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


def mount(args: list[str]) -> None:
    """``mount ARGS``; skips the test where this machine cannot mount (not root, no mount)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a filesystem needs root")
    r = subprocess.run(["mount", *args], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        pytest.skip(f"cannot mount here: {r.stderr.strip()}")


def umount(mnt: Path) -> None:
    r = subprocess.run(["umount", str(mnt)], capture_output=True, timeout=30)
    if r.returncode != 0:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A fresh 16 MiB tmpfs (a disk that fills up quickly), unmounted at teardown."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mount(["-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)])
    try:
        yield mnt
    finally:
        umount(mnt)


@pytest.fixture
def read_only_fs(tmp_path: Path) -> Iterator[Path]:
    """A real read-only filesystem: an empty tmpfs mounted with -o ro."""
    mnt = tmp_path / "ro"
    mnt.mkdir()
    mount(["-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mnt)])
    try:
        yield mnt
    finally:
        umount(mnt)


@pytest.fixture
def remount() -> Callable[[Path, str], None]:
    """``remount(mnt, "ro")`` / ``remount(mnt, "rw")``: switch a mounted test filesystem."""
    return lambda mnt, mode: mount(["-o", f"remount,{mode}", str(mnt)])
