"""Local filesystem backend: fsync'd files, atomic directory rename."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import shutil
import stat
import threading
import uuid
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
# numpy is imported by the writers that use it: `tardigrade ls` and `gc` start without it.


from ..errors import CorruptCheckpointError, StorageError
from .base import (
    PROBE_PREFIX,
    Directories,
    Hashes,
    PreconditionFailed,
    PutMode,
    Reader,
    Stat,
    Writer,
)
from .local_lease import DirectoryLock

__all__ = [
    "BOUNCE_BYTES",
    "DIRECT_BLOCK",
    "DIRECT_MIN_BYTES",
    "LocalReader",
    "LocalStorage",
    "LocalWriter",
    "free_bytes",
    "private_directory",
]

log = logging.getLogger("tardigrade")
# A small object being written by put(): a dot file of its own, which cleanup never takes for
# a save's staging.
TMP_PUT = ".put-"
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _renameat2(a: str, b: str, flags: int) -> bool:
    """Linux renameat2(a, b, flags); False where the kernel or filesystem lacks it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), b)


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (RENAME_EXCHANGE); False if unsupported."""
    return _renameat2(a, b, _RENAME_EXCHANGE)


def _rename_new(a: str, b: str) -> None:
    """Rename ``a`` to ``b`` only if nothing is at ``b`` (RENAME_NOREPLACE where there is one:
    a plain rename silently replaces an empty directory)."""
    try:
        if _renameat2(a, b, _RENAME_NOREPLACE):
            return
    except FileExistsError:
        raise
    except OSError as e:
        if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
            raise
        raise FileExistsError(e.errno, e.strerror, b) from None
    if os.path.lexists(b):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), b)
    os.rename(a, b)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Large data files bypass the page cache (O_DIRECT) through an aligned bounce buffer. On this
# kind of VM a buffered write must first fault in fresh page-cache memory, which after an idle
# period runs at a fraction of the disk's speed; direct writes go at disk speed and leave the
# training process's memory alone.
DIRECT_MIN_BYTES = 4 * 1024 * 1024
# TARDIGRADE_DIRECT_IO=0 turns direct writes off (every file buffered), e.g. for a network or
# FUSE filesystem where O_DIRECT is accepted but slow.
DIRECT_IO_ENV = "TARDIGRADE_DIRECT_IO"
DIRECT_BLOCK = 4096  # offsets, lengths and buffer addresses of direct I/O are multiples of this
BOUNCE_BYTES = 8 * 1024 * 1024
SCRATCH_BYTES = 1024 * 1024
# Full-size bounce buffers of closed writers, kept for the next ones: a save sharing data
# writes a file per large chunk, and faulting a fresh buffer in for each cost it ~1 ms per
# 8 MiB. At most this many are kept (one per writer thread).
SPARE_BOUNCES = 8
_spares: list[np.ndarray[Any, Any]] = []
_spares_lock = threading.Lock()


class LocalWriter(Writer):
    """A new file, written sequentially and fsynced on ``close``.

    With a ``size_hint`` of at least ``DIRECT_MIN_BYTES`` the file is written with O_DIRECT
    where the filesystem supports it. Data that starts at a block-aligned address while the
    file is at a block boundary goes to disk straight from the caller's memory (an async save's
    staging slabs are laid out so); anything else passes through a page-aligned bounce buffer.
    The last block is zero-padded and the file truncated back to its true size before the fsync.
    """

    def __init__(self, path: str, *, size_hint: int | None = None) -> None:

        self.path = path
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise StorageError(e.errno, f"cannot create {path}: {e.strerror}") from e
        self._size = 0  # bytes accepted so far (the file's final size)
        self._bounce: np.ndarray[Any, Any] | None = None  # allocated on first use
        self._bounce_cap = 0
        self._fill = 0
        self._scratch: bytearray | None = None  # private copies for hashed buffered writes
        self.direct = False  # whether the bytes go to disk with O_DIRECT
        if (
            size_hint is not None
            and size_hint >= DIRECT_MIN_BYTES
            and os.environ.get(DIRECT_IO_ENV, "1").strip().lower()
            not in ("0", "false", "no", "off")
            and _set_direct(self._fd, True)
        ):
            self._bounce_cap = min(BOUNCE_BYTES, -(-size_hint // DIRECT_BLOCK) * DIRECT_BLOCK)
            self.direct = True

    def write(self, data: memoryview | bytes, *, hasher: Hashes | None = None) -> None:
        import numpy as np

        view = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
        self._size += view.nbytes
        if not self._bounce_cap:
            if hasher is None:
                self._write_all(view)
            else:
                self._write_private(view, hasher)
            return
        if hasher is None and self.direct and self._fill == 0 and view.nbytes >= DIRECT_BLOCK:
            # Block-aligned memory at a block boundary of the file: no copy needed.
            whole = view.nbytes - view.nbytes % DIRECT_BLOCK
            if np.frombuffer(view, dtype=np.uint8).ctypes.data % DIRECT_BLOCK == 0:
                self._write_all(view[:whole])
                view = view[whole:]
        while view.nbytes:
            bounce = self._bounce_for(view.nbytes)
            n = min(view.nbytes, len(bounce) - self._fill)
            # numpy copies without holding the GIL, so parallel writers overlap their copies.
            bounce[self._fill : self._fill + n] = np.frombuffer(view[:n], dtype=np.uint8)
            if hasher is not None:
                hasher.update(memoryview(bounce[self._fill : self._fill + n]))  # type: ignore[arg-type]  # numpy arrays are buffers; its stubs say so from Python 3.12
            self._fill += n
            view = view[n:]
            if self._fill == len(bounce):
                self._flush_bounce(self._fill)

    def _write_private(self, view: memoryview, hasher: Hashes) -> None:
        """Copy, hash the copy, write the copy: the source may change under a buffered write."""
        while view.nbytes:
            n = min(view.nbytes, SCRATCH_BYTES)
            if self._scratch is None:
                self._scratch = bytearray(SCRATCH_BYTES)
            piece = memoryview(self._scratch)[:n]
            piece[:] = view[:n]
            hasher.update(piece)
            self._write_all(piece)
            view = view[n:]

    def _bounce_for(self, nbytes: int) -> np.ndarray[Any, Any]:
        """The bounce buffer, sized to take ``nbytes`` more: one block while everything fits
        in one (a file whose bulk goes direct from the caller's memory only bounces its small
        tail), else the full cap at once (growing step by step would fault in fresh memory
        and copy the fill again at every step)."""
        one_block = self._fill + nbytes <= DIRECT_BLOCK
        need = DIRECT_BLOCK if one_block else self._bounce_cap
        if self._bounce is None or len(self._bounce) < need:
            grown = _spare(need)
            if grown is None:
                grown = _aligned(need)
            if self._fill:
                assert self._bounce is not None
                grown[: self._fill] = self._bounce[: self._fill]
            self._bounce = grown
        return self._bounce

    def _flush_bounce(self, nbytes: int) -> None:
        assert self._bounce is not None
        self._write_all(memoryview(self._bounce[:nbytes]))  # type: ignore[arg-type]  # numpy arrays are buffers; its stubs say so from Python 3.12
        self._fill = 0

    def _write_all(self, view: memoryview) -> None:
        while view.nbytes:
            try:
                n = os.write(self._fd, view)
            except OSError as e:
                if e.errno == errno.EINVAL and self.direct:
                    # The filesystem accepted O_DIRECT at open but not for this write: go on
                    # buffered (the bounce buffer still batches the copies).
                    _set_direct(self._fd, False)
                    self.direct = False
                    continue
                raise StorageError(e.errno, f"writing {self.path}: {e.strerror}") from e
            view = view[n:]

    def close(self) -> None:
        try:
            if self._bounce is not None and self._fill:
                padded = -(-self._fill // DIRECT_BLOCK) * DIRECT_BLOCK
                self._bounce[self._fill : padded] = 0
                self._flush_bounce(padded)
                os.ftruncate(self._fd, self._size)
            os.fsync(self._fd)
            # Direct writes pad the last block and truncate it off again: one fstat proves the
            # file holds exactly the bytes accepted, no padding left and none lost.
            actual = os.fstat(self._fd).st_size
            if actual != self._size:
                raise StorageError(
                    errno.EIO,
                    f"{self.path}: the file holds {actual} bytes after writing, but {self._size} "
                    "were written to it; the file is not what was written. This is a bug in "
                    "Tardigrade or a filesystem fault; please report it.",
                )
        except StorageError:
            raise
        except OSError as e:
            raise StorageError(e.errno, f"finishing {self.path}: {e.strerror}") from e
        finally:
            self._release()

    def abort(self) -> None:
        """Close and remove the file (created by this writer): nothing is left visible."""
        try:
            self._release()
        except OSError:
            pass
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def _release(self) -> None:
        fd, self._fd = self._fd, -1
        bounce, self._bounce = self._bounce, None
        if bounce is not None and len(bounce) == BOUNCE_BYTES:
            with _spares_lock:
                if len(_spares) < SPARE_BOUNCES:
                    _spares.append(bounce)
        self._scratch = None
        if fd >= 0:
            os.close(fd)


def _spare(nbytes: int) -> np.ndarray[Any, Any] | None:
    """A kept bounce buffer for a writer that needs ``nbytes`` (its contents are stale: a
    writer fills what it writes and pads its last block itself), or None."""
    if nbytes != BOUNCE_BYTES:
        return None
    with _spares_lock:
        return _spares.pop() if _spares else None


def _aligned(nbytes: int) -> np.ndarray[Any, Any]:
    """A zeroed uint8 buffer whose address is a multiple of ``DIRECT_BLOCK``."""
    import numpy as np

    raw = np.zeros(nbytes + DIRECT_BLOCK, dtype=np.uint8)
    start = -raw.ctypes.data % DIRECT_BLOCK
    return raw[start : start + nbytes]


def _set_direct(fd: int, on: bool) -> bool:
    """Switch O_DIRECT on or off for an open file; False where the filesystem refuses it."""
    direct = getattr(os, "O_DIRECT", 0)
    if not direct:
        return False
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | direct if on else flags & ~direct)
    except OSError:
        return False
    return True


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
            try:
                n = os.preadv(self._fd, [view], offset)
            except OSError as e:  # EIO from a failing disk, ESTALE from NFS, ...
                raise StorageError(
                    e.errno,
                    f"reading {self.name} at byte {offset}: {e.strerror}; the disk or "
                    "filesystem failed. Check it; CheckpointManager.restore() falls back to an "
                    "older checkpoint",
                ) from e
            if n == 0:
                raise CorruptCheckpointError(
                    f"{self.name}: file ended early at byte {offset} (truncated); delete this "
                    "checkpoint or restore it from a backup."
                )
            view = view[n:]
            offset += n

    def close(self) -> None:
        os.close(self._fd)


class LocalStorage(Directories):
    """Checkpoints as directories under ``root`` on a POSIX filesystem: fsynced files, and
    directories made, locked (``flock``), renamed and swapped (``renameat2``) durably."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self._held: dict[str, int] = {}  # name -> fd holding its flock (``hold``)

    def _path(self, name: str) -> str:
        return os.path.join(self.root, name) if name else self.root

    def open_writer(self, name: str, *, size_hint: int | None = None) -> Writer:
        self._parent(name)
        return LocalWriter(self._path(name), size_hint=size_hint)

    def _parent(self, name: str) -> None:
        """Create the directories above ``name``, as a store's prefixes exist implicitly."""
        parent = os.path.dirname(self._path(name))
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as e:
            raise StorageError(e.errno, f"cannot create {parent}: {e.strerror}") from e

    def open_reader(self, name: str) -> Reader:
        return LocalReader(self._path(name))

    def list(self, name: str = "") -> list[str]:
        try:
            return sorted(os.listdir(self._path(name)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def exists(self, name: str) -> bool:
        return os.path.lexists(self._path(name))

    def lease(self, name: str, *, lease_seconds: float = 30.0) -> DirectoryLock:
        return DirectoryLock(self._path(name), lease_seconds=lease_seconds)

    def preflight(self) -> None:
        preflight_directory(self.root)

    def move(self, src: str, dst: str) -> None:
        a, b = self._path(src), self._path(dst)
        try:
            _rename_new(a, b)
            fsync_dir(os.path.dirname(b))
        except OSError as e:
            raise StorageError(e.errno, f"cannot rename {a} to {b}: {e.strerror}") from e

    def exchange(self, a: str, b: str) -> bool:
        try:
            return _exchange(self._path(a), self._path(b))
        except OSError as e:
            raise StorageError(
                e.errno, f"cannot swap {self._path(a)} and {self._path(b)}: {e.strerror}"
            ) from e

    def sync(self, name: str = "") -> None:
        try:
            fsync_dir(self._path(name))
        except OSError as e:
            raise StorageError(e.errno, f"cannot fsync {self._path(name)}: {e.strerror}") from e

    def make_dir(self, name: str) -> bool:
        try:
            os.makedirs(os.path.dirname(self._path(name)) or self.root, exist_ok=True)
            os.mkdir(self._path(name))
        except FileExistsError:
            return False
        except OSError as e:
            raise StorageError(e.errno, f"cannot create {self._path(name)}: {e.strerror}") from e
        return True

    def hold(self, name: str, *, wait: bool) -> bool:
        if name in self._held:
            return False
        fd = lock_dir(self._path(name), wait=wait)
        if fd is None:
            return False
        self._held[name] = fd
        return True

    def release(self, name: str) -> None:
        fd = self._held.pop(name, None)
        if fd is not None:
            os.close(fd)

    def stat(self, name: str) -> Stat | None:
        try:
            st = os.lstat(self._path(name))
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            raise StorageError(e.errno, f"cannot stat {self._path(name)}: {e.strerror}") from e
        version = f"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}"
        return Stat(
            st.st_size,
            version,
            stat.S_ISDIR(st.st_mode),
            stat.S_ISLNK(st.st_mode),
            modified=st.st_mtime,
        )

    def put(
        self, name: str, data: bytes, *, mode: PutMode = "create", expect: str | None = None
    ) -> str:
        """Write ``name`` whole: a fsynced temporary file, then link (create) or rename.

        ``"create"`` links the file into place, which fails if anything is there, atomically.
        ``"if_match"`` compares and renames: atomic against a crash, not against a concurrent
        writer (on a local directory the lease keeps writers out; stores do it in one call).
        """
        path = self._path(name)
        if mode == "if_match":
            now = self.stat(name)
            if now is None or now.version != expect:
                raise PreconditionFailed(
                    errno.ESTALE, f"{path}: changed since it was read; nothing was written"
                )
        self._parent(name)
        tmp = os.path.join(os.path.dirname(path), f"{TMP_PUT}{uuid.uuid4().hex}")
        try:
            w = LocalWriter(tmp)
            try:
                w.write(data)
            except BaseException:
                w.abort()
                raise
            w.close()
            if mode == "create":
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    raise PreconditionFailed(
                        errno.EEXIST, f"{path}: exists already; nothing was written"
                    ) from None
            else:
                os.replace(tmp, path)
            fsync_dir(os.path.dirname(path))
        except OSError as e:
            if isinstance(e, StorageError):
                raise
            raise StorageError(e.errno, f"cannot write {path}: {e.strerror}") from e
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        got = self.stat(name)
        assert got is not None
        return got.version

    def is_dir(self, name: str) -> bool:
        path = self._path(name)
        return os.path.isdir(path) and not os.path.islink(path)

    def delete(self, name: str) -> None:
        path = self._path(name)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
        finally:
            self.release(name)


def lock_dir(path: str, *, wait: bool) -> int | None:
    """An fd of directory ``path`` holding an exclusive flock on it, or None.

    None when ``path`` is gone or is no longer the directory that was locked (someone removed
    or replaced it meanwhile), or, with ``wait=False``, when another process holds the lock.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        now, held = os.stat(path, follow_symlinks=False), os.fstat(fd)
        if (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


# -- checking the directory ------------------------------------------------------------------
# Errors that no amount of waiting fixes: a manager on such a directory would run for days with
# every save failing (and only logged, under on_save_error="warn"), so it refuses to start.
# A full disk or quota (ENOSPC, EDQUOT) is not among them: space can be freed while training.
_PERMANENT = {
    errno.EROFS: "it is on a read-only filesystem; pass a directory on a writable filesystem "
    "(or remount this one read-write)",
    errno.EACCES: "permission denied; fix its permissions or pass a directory this process "
    "(uid {uid}) can write to",
    errno.EPERM: "operation not permitted; fix its permissions or pass a directory this "
    "process (uid {uid}) can write to",
    errno.ENOTDIR: "{blocker} is a regular file, not a directory; move it away or pass "
    "another directory",
    errno.EEXIST: "{blocker} is a regular file, not a directory; move it away or pass "
    "another directory",
    errno.ELOOP: "too many symbolic links in the path; pass a plain directory",
    errno.ENAMETOOLONG: "the path is too long; pass a shorter one",
}


# Below this much free space a save of any real model fails: say so when the manager starts.
_FULL_BYTES = 1 << 20


def _first_non_directory(path: str) -> str:
    """The first component of ``path`` that exists but is not a directory (or ``path``)."""
    probe = path
    chain = []
    while probe and probe != os.path.dirname(probe):
        chain.append(probe)
        probe = os.path.dirname(probe)
    for p in reversed(chain):
        if os.path.lexists(p) and not os.path.isdir(p):
            return p
    return path


def preflight_directory(directory: str) -> None:
    """Raise StorageError if ``directory`` can never hold checkpoints; create it if missing.

    The test is what a save does: create the directory, list it, make a subdirectory in it
    (the staging of a save) and a file in that. A transient failure (a full disk) passes here
    and is reported by the saves, which may succeed once space is freed.
    """
    storage = LocalStorage(directory)
    try:
        os.makedirs(directory, exist_ok=True)
        os.listdir(directory)
        # A directory like a save's staging (locked, so a concurrent cleanup leaves it alone).
        probe = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
        storage.make_dir(probe)
        try:
            storage.hold(probe, wait=True)
            storage.open_writer(f"{probe}/probe").close()
        finally:
            storage.delete(probe)
    except OSError as e:
        why = _PERMANENT.get(e.errno or 0)
        if why is None:
            log.warning(
                "tardigrade: checkpoint directory %s: %s; saves will fail until this is fixed "
                "(training is not stopped for it)",
                directory,
                e,
            )
            return
        why = why.format(uid=os.geteuid(), blocker=_first_non_directory(directory))
        raise StorageError(
            e.errno,
            f"{directory}: cannot be used as a checkpoint directory, no save could ever succeed "
            f"there ({e.strerror}): {why}.",
        ) from e
    try:
        fs = os.statvfs(directory)
    except OSError:
        return
    if fs.f_bavail * fs.f_frsize < _FULL_BYTES:
        log.warning(
            "tardigrade: the filesystem of checkpoint directory %s is full (%d bytes free); "
            "saves will fail until space is freed (training is not stopped for it)",
            directory,
            fs.f_bavail * fs.f_frsize,
        )


def private_directory(path: str) -> None:
    """Create directory ``path`` (mode 0700) in an existing parent unless it is there; raise
    StorageError unless it then is a directory of this user that nobody else can write.

    For a directory in a place every user of the machine shares (``/dev/shm``): one made by
    someone else, or a link planted in its place, is not ours to write into or read from.
    """
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise StorageError(e.errno, f"cannot create {path}: {e.strerror}") from e
    try:
        st = os.lstat(path)
    except OSError as e:
        raise StorageError(e.errno, f"cannot stat {path}: {e.strerror}") from e
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise StorageError(
            errno.EPERM,
            f"{path} is not a private directory of this user (a link, another user's, or "
            "writable by others)",
        )


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer can still store on the filesystem holding ``path``."""
    try:
        st = os.statvfs(path)
    except OSError as e:
        raise StorageError(e.errno, f"cannot stat the filesystem of {path}: {e.strerror}") from e
    return st.f_bavail * st.f_frsize
