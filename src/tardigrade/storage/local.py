"""Local filesystem backend: fsync'd files, atomic directory rename."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import stat

from ..errors import CorruptCheckpointError, StorageError
from .base import Reader, Storage, Writer

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False if unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), b)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalWriter(Writer):
    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise StorageError(e.errno, f"cannot create {path}: {e.strerror}") from e

    def write(self, data: memoryview | bytes) -> None:
        view = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
        while view.nbytes:
            try:
                n = os.write(self._fd, view)
            except OSError as e:
                raise StorageError(e.errno, f"writing {self.path}: {e.strerror}") from e
            view = view[n:]

    def close(self) -> None:
        try:
            os.fsync(self._fd)
        except OSError as e:
            raise StorageError(e.errno, f"fsync of {self.path}: {e.strerror}") from e
        finally:
            os.close(self._fd)

    def abort(self) -> None:
        try:
            os.close(self._fd)
        except OSError:
            pass


class LocalReader(Reader):
    def __init__(self, path: str) -> None:
        self.name = path
        # O_NONBLOCK so a FIFO planted in place of a data file cannot hang the open;
        # O_NOFOLLOW so a symlink cannot redirect the read outside the checkpoint.
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            self._fd = os.open(path, flags)
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"{path}: file listed in the manifest is missing; the checkpoint is incomplete. "
                "Delete it or restore it from a backup."
            ) from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise CorruptCheckpointError(
                    f"{path}: is a symbolic link; checkpoint files must be regular files. "
                    "Refusing to follow it."
                ) from None
            raise StorageError(e.errno, f"cannot open {path}: {e.strerror}") from e
        st = os.fstat(self._fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(self._fd)
            raise CorruptCheckpointError(
                f"{path}: is not a regular file (mode {stat.filemode(st.st_mode)}); checkpoint "
                "files must be regular files. Refusing to read it."
            )
        self.size = st.st_size

    def readinto(self, offset: int, buf: memoryview) -> None:
        view = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
        while view.nbytes:
            n = os.preadv(self._fd, [view], offset)
            if n == 0:
                raise CorruptCheckpointError(
                    f"{self.name}: file ended early at byte {offset} (truncated); delete this "
                    "checkpoint or restore it from a backup."
                )
            view = view[n:]
            offset += n

    def close(self) -> None:
        os.close(self._fd)


class LocalStorage(Storage):
    """Checkpoints as directories under ``root`` on a POSIX filesystem."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)

    def _path(self, name: str) -> str:
        return os.path.join(self.root, name) if name else self.root

    def open_writer(self, name: str) -> Writer:
        return LocalWriter(self._path(name))

    def open_reader(self, name: str) -> Reader:
        return LocalReader(self._path(name))

    def list(self, name: str = "") -> list[str]:
        try:
            return sorted(os.listdir(self._path(name)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def exists(self, name: str) -> bool:
        return os.path.lexists(self._path(name))

    def is_dir(self, name: str) -> bool:
        return os.path.isdir(self._path(name))

    def delete(self, name: str) -> None:
        path = self._path(name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def begin(self, name: str, save_id: str) -> str:
        staging = f".tmp-{name}-{save_id}"
        try:
            os.makedirs(self.root, exist_ok=True)
            os.mkdir(self._path(staging))
        except OSError as e:
            raise StorageError(e.errno, f"cannot create {self._path(staging)}: {e.strerror}") from e
        return staging

    def commit(self, staging: str, name: str, *, replace: bool) -> None:
        src, dst = self._path(staging), self._path(name)
        try:
            fsync_dir(src)
            if replace and os.path.lexists(dst):
                # rename() cannot replace a non-empty directory. Swap the two atomically, so at
                # every instant the name holds a complete checkpoint (old, then new).
                if _exchange(src, dst):
                    fsync_dir(self.root)
                    shutil.rmtree(src, ignore_errors=True)
                else:
                    # No atomic swap here: move the old one aside first. A crash in between
                    # leaves it as ".tmp-NAME-replaced-ID", which recover() puts back.
                    old = self._path(f".tmp-{name}-replaced-{staging.rsplit('-', 1)[-1]}")
                    os.rename(dst, old)
                    os.rename(src, dst)
                    fsync_dir(self.root)
                    shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(src, dst)
            fsync_dir(self.root)
        except OSError as e:
            raise StorageError(e.errno, f"cannot commit {dst}: {e.strerror}") from e
