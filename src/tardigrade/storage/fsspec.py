"""Any other URL an installed fsspec filesystem serves: ``gs://``, ``az://``, ``abfs://``, ...

Schemes this package has no backend of its own for go through fsspec (imported on first use,
from the ``fsspec`` extra; the filesystem itself comes from its own package: ``gcsfs`` for
``gs://``, ``adlfs`` for ``az://``). ``storage_options`` are the filesystem's arguments, as
everywhere in the fsspec world. It cannot rename, so checkpoints commit as on every store
(``tardigrade._commit.ManifestLastCommit``): data objects under names unique to the save, the
manifest last with a create-only put; nothing is ever renamed or copied.

What fsspec gives and what it does not, and how the contract is kept:

- a writer is a file opened with ``autocommit=False`` (fsspec's transaction hook: local files
  go to a temporary file, object stores hold the upload open) whose ``commit()`` makes it
  visible only in ``close()``; ``abort()`` discards it. A file object's exit or garbage
  collection never completes an upload (the s3fs #154 trap): an aborted file is marked closed
  before it is dropped. Whether the filesystem honours ``autocommit=False`` is probed (fsspec's
  own memory filesystem ignores it); one that does not gets plain files, removed on abort.
  Either way no manifest names a data object before the commit, so a partly written one is
  never part of a checkpoint;
- create-only is fsspec's ``pipe_file(mode="create")``. Whether the filesystem enforces it is
  probed once per filesystem (a second create of one name must be refused, and fsspec's
  generic fallback, which checks and then writes, does not count). Where it does not, the
  store runs in single-writer mode, said once in a log line: checkpoints stay atomic, but
  two jobs writing under one root at once are not detected;
- fsspec has no portable if-match at all: a replace (``overwrite=True``) and the lease's
  renewal check the version and then write. Within this process a lock makes every
  conditional put atomic; across processes the lease keeps one writer per root, fenced as
  well as check-then-write allows;
- an object's version is the filesystem's own token where it reports one (ETag, generation,
  version id), else a digest of its bytes for small objects (lease records, manifests) and
  its size and modification time for large ones.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import threading
import uuid
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from ..errors import CorruptCheckpointError, InvalidArgumentError, StorageError, TardigradeError
from ._options import grace_seconds
from .base import (
    GRACE_SECONDS,
    PROBE_PREFIX,
    Hashes,
    PreconditionFailed,
    PutMode,
    Reader,
    Stat,
    Storage,
    Writer,
)
from .lease import ObjectLease

__all__ = [
    "FsspecStorage",
]

log = logging.getLogger("tardigrade")

EXTRA = "pip install 'tardigrade-ckpt[fsspec]'"
# A large read is fetched in ranges of this size: the bytes fsspec returns are copied into
# the caller's buffer, so this bounds the extra memory a read holds.
RANGE_BYTES = 16 * 1024 * 1024
# Objects up to this size without a version token of the filesystem's own are versioned by a
# digest of their bytes (conditional puts only ever target small objects).
HASHED_BYTES = 1024 * 1024
# Version tokens filesystems report in ``info()``, best first.
_TOKENS = ("generation", "version_id", "VersionId", "ETag", "etag", "md5Hash", "content_md5")
# Times filesystems report in ``info()``: of the last write, best first, then of creation (an
# object store's objects are written once).
_TIMES = ("mtime", "LastModified", "last_modified", "updated", "modified", "created")

# Per filesystem: whether it enforces create-only, and whether it honours autocommit=False
# (each probed once).
_creates: dict[Any, bool] = {}
_transactions: dict[Any, bool] = {}
# The locks that make a check-then-write conditional put atomic in-process, striped by URL.
_locks = [threading.Lock() for _ in range(64)]
_shared_lock = threading.Lock()


def _fsspec(url: str) -> Any:
    try:
        import fsspec
    except ImportError:
        raise TardigradeError(
            f"{url}: {url.partition('://')[0]}:// is not a scheme Tardigrade stores to itself, "
            f"and fsspec, which serves the others, is not installed; install it with: {EXTRA} "
            "(and the filesystem for this scheme, e.g. gcsfs for gs://, adlfs for az://)"
        ) from None
    return fsspec


def serves(scheme: str, url: str) -> bool:
    """Whether an fsspec filesystem serves ``scheme``. Raises a TardigradeError naming ``url``
    and what to install when fsspec, or the package of a filesystem it knows, is missing."""
    fsspec = _fsspec(url)
    from fsspec.registry import known_implementations, registry

    if scheme not in known_implementations and scheme not in registry:
        return False
    try:
        fsspec.get_filesystem_class(scheme)
    except ImportError as e:
        known = known_implementations.get(scheme, {})
        package = str(known.get("class", "")).partition(".")[0] or "the package that serves it"
        raise TardigradeError(
            f"{url}: fsspec serves {scheme}:// with {package}, which is not installed "
            f"({e}); install it with: pip install {package}"
        ) from None
    return True


def _filesystem(root: str, options: Mapping[str, Any]) -> tuple[Any, str]:
    """The fsspec filesystem of ``root`` and the path of ``root`` on it."""
    fsspec = _fsspec(root)
    scheme = root.partition("://")[0]
    if not serves(scheme, root):
        raise InvalidArgumentError(f"{root}: fsspec knows no filesystem for {scheme}://")
    try:
        fs, path = fsspec.core.url_to_fs(root, **dict(options))
    except TypeError as e:  # an argument the filesystem does not take
        raise InvalidArgumentError(
            f"{root}: storage options {sorted(options)} do not fit the {scheme}:// filesystem: {e}"
        ) from None
    except Exception as e:
        raise StorageError(errno.EIO, f"{root}: cannot open the {scheme}:// filesystem: {e}") from e
    return fs, str(path).rstrip("/")


def _errno(e: BaseException) -> int:
    if isinstance(e, OSError) and e.errno:
        return e.errno
    if isinstance(e, PermissionError):
        return errno.EACCES
    if isinstance(e, FileNotFoundError):
        return errno.ENOENT
    return errno.EIO


class FsspecWriter(Writer):
    def __init__(self, storage: FsspecStorage, name: str) -> None:
        self._storage = storage
        self._name = name
        self._path = storage.path(name)
        self._transaction = storage.has_transactions()
        try:
            if self._transaction:
                self._file = storage.fs.open(self._path, "wb", autocommit=False)
            else:  # a plain file, removed on abort
                self._file = storage.fs.open(self._path, "wb")
        except Exception as e:
            raise storage.fail(name, "open for writing", e) from e
        self._open = True

    def write(self, data: memoryview | bytes, *, hasher: Hashes | None = None) -> None:
        # A private copy: the caller's memory may change during the call (live tensors), and
        # the checksum must describe the bytes written.
        part = bytes(memoryview(data).cast("B"))
        if hasher is not None:
            hasher.update(memoryview(part))
        try:
            self._file.write(part)
        except Exception as e:
            raise self._storage.fail(self._name, "write", e) from e

    def close(self) -> None:
        if not self._open:
            return
        try:
            self._file.close()
            if self._transaction:
                self._file.commit()
        except Exception as e:
            self.abort()
            raise self._storage.fail(self._name, "complete the object", e) from e
        self._open = False

    def abort(self) -> None:
        if not self._open:
            return
        self._open = False
        try:
            self._file.discard()  # an upload held open is aborted; a temporary file removed
        except Exception as e:
            log.debug("tardigrade: discarding %s: %s", self._path, e)
        _mark_closed(self._file)
        if not self._transaction:
            try:
                self._storage.fs.rm(self._path)
            except Exception:  # never written, or gone: nothing visible either way
                pass


class FsspecReader(Reader):
    def __init__(self, storage: FsspecStorage, name: str, size: int) -> None:
        self._storage = storage
        self._local = name
        self._path = storage.path(name)
        self.name = storage.url(name)
        self.size = size

    def readinto(self, offset: int, buf: memoryview) -> None:
        view, end = self.byte_span(offset, buf)
        at = offset
        while at < end:
            stop = min(end, at + RANGE_BYTES)
            try:
                data = self._storage.fs.cat_file(self._path, start=at, end=stop)
            except Exception as e:
                raise self._storage.fail(self._local, "read", e) from e
            if len(data) != stop - at:
                raise CorruptCheckpointError(
                    f"{self.name}: object ended early at byte {at + len(data)} (wanted bytes "
                    f"{at} to {stop}); delete this checkpoint or restore it from a backup."
                )
            view[at - offset : stop - offset] = data
            at = stop

    def close(self) -> None:
        pass


class FsspecStorage(Storage):
    implicit_directories = True  # a name is a directory exactly when objects lie under it

    """Checkpoints under any URL an fsspec filesystem serves; see the module docstring.

    ``storage_options`` go to the filesystem (``fsspec.core.url_to_fs(root, **options)``),
    e.g. ``{"token": "anon"}`` for gcsfs or ``{"account_name": ...}`` for adlfs; all but
    ``gc_grace_seconds``, Tardigrade's own: the age below which ``tidy`` (``tardigrade gc``,
    a manager's cleanup) leaves a save's data objects alone, 1 hour by default as on S3,
    because another process's save may still be running (a zombie's could still commit).

    Example::

        storage = FsspecStorage("gs://bucket/ckpts", {"token": "google_default"})
    """

    def __init__(self, root: str, options: Mapping[str, Any] | None = None) -> None:
        self.root = root.rstrip("/")
        options = dict(options or {})
        self.gc_grace_seconds = grace_seconds(root, options.pop("gc_grace_seconds", GRACE_SECONDS))
        self.fs, self._base = _filesystem(self.root, options)

    def path(self, name: str) -> str:
        """``name``'s path on the filesystem."""
        name = name.strip("/")
        return f"{self._base}/{name}" if name else self._base

    def fail(self, name: str, op: str, e: BaseException) -> TardigradeError:
        """The error to raise for filesystem error ``e`` during ``op`` on ``name``."""
        if isinstance(e, TardigradeError):
            return e
        return StorageError(
            _errno(e), f"{self.url(name)}: {op} failed: {type(e).__name__}: {e}".rstrip(": ")
        )

    # -- the byte primitives -------------------------------------------------------------

    def open_writer(self, name: str, *, size_hint: int | None = None) -> Writer:
        return FsspecWriter(self, name)

    def _info(self, name: str, op: str) -> dict[str, Any] | None:
        try:
            return dict(self.fs.info(self.path(name)))
        except FileNotFoundError:
            return None
        except Exception as e:
            raise self.fail(name, op, e) from e

    def open_reader(self, name: str) -> Reader:
        info = self._info(name, "open for reading")
        if info is None or info.get("type") == "directory":
            raise CorruptCheckpointError(
                f"{self.url(name)}: object listed in the manifest is missing; the checkpoint is "
                "incomplete. Delete it or restore it from a backup."
            )
        return FsspecReader(self, name, int(info["size"]))

    def _version(self, name: str, info: Mapping[str, Any]) -> str:
        for key in _TOKENS:
            token = info.get(key)
            if token not in (None, ""):
                return f"{key}:{token}"
        size = int(info.get("size") or 0)
        if size <= HASHED_BYTES:
            try:
                data = self.fs.cat_file(self.path(name))
            except FileNotFoundError:
                return ""
            except Exception as e:
                raise self.fail(name, "read the version", e) from e
            return "b2:" + hashlib.blake2b(data, digest_size=16).hexdigest()
        when = next(
            (info[k] for k in ("mtime", "LastModified", "last_modified", "created") if info.get(k)),
            "",
        )
        return f"{size}@{when}"

    def stat(self, name: str) -> Stat | None:
        info = self._info(name, "stat")
        if info is None:
            return None
        if info.get("type") == "directory":
            # Some stores keep listing a prefix as a folder after its last object is gone.
            return Stat(0, "", is_dir=True) if self.list(name) else None
        return Stat(int(info.get("size") or 0), self._version(name, info), modified=_modified(info))

    def list(self, name: str = "") -> list[str]:
        where = self.path(name)
        try:
            entries = self.fs.ls(where, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except Exception as e:
            raise self.fail(name, "list", e) from e
        under = self.fs._strip_protocol(where).rstrip("/") + "/"
        found = set()
        for entry in entries:
            entry = self.fs._strip_protocol(str(entry)).rstrip("/")
            if entry.startswith(under) and entry != under.rstrip("/"):
                found.add(entry[len(under) :].split("/", 1)[0])
        return sorted(n for n in found if n)

    def delete(self, name: str) -> None:
        try:
            self.fs.rm(self.path(name), recursive=True)
        except FileNotFoundError:
            pass
        except Exception as e:
            raise self.fail(name, "delete", e) from e

    def put(
        self, name: str, data: bytes, *, mode: PutMode = "create", expect: str | None = None
    ) -> str:
        path = self.path(name)
        with _lock(self.url(name)):  # check-then-write is atomic among this process's threads
            if mode == "create" and self._enforces_create():
                try:
                    self.fs.pipe_file(path, bytes(data), mode="create")
                except FileExistsError:
                    raise PreconditionFailed(
                        errno.EEXIST, f"{self.url(name)}: exists already; nothing was written"
                    ) from None
                except Exception as e:
                    raise self.fail(name, "put (create only)", e) from e
            else:
                now = self.stat(name)
                if mode == "create" and now is not None:
                    raise PreconditionFailed(
                        errno.EEXIST, f"{self.url(name)}: exists already; nothing was written"
                    )
                if mode == "if_match" and (now is None or now.version != expect):
                    raise PreconditionFailed(
                        errno.ESTALE,
                        f"{self.url(name)}: changed since it was read; nothing written",
                    )
                try:
                    self.fs.pipe_file(path, bytes(data))
                except Exception as e:
                    raise self.fail(name, "put", e) from e
            st = self.stat(name)
        if st is None:
            raise StorageError(errno.EIO, f"{self.url(name)}: put succeeded, yet nothing is there")
        return st.version

    def _key(self) -> Any:
        return getattr(self.fs, "_fs_token", None) or id(self.fs)

    def has_transactions(self) -> bool:
        """Whether a file opened with ``autocommit=False`` stays invisible until its
        ``commit()`` (probed once per filesystem)."""
        key = self._key()
        with _shared_lock:
            known = _transactions.get(key)
        if known is not None:
            return known
        name = f"{PROBE_PREFIX}{uuid.uuid4().hex}"  # tidy removes one left behind
        probe = self.path(name)
        works = True
        try:
            f = self.fs.open(probe, "wb", autocommit=False)
            try:
                f.write(b"1")
                f.close()
                works = not self.fs.exists(probe)
            finally:
                f.discard()
                _mark_closed(f)
        except NotImplementedError:
            works = False
        except Exception as e:
            raise self.fail(name, "probe transactions", e) from e
        finally:
            try:
                self.fs.rm(probe)
            except Exception:
                pass
        with _shared_lock:
            _transactions[key] = works
        return works

    def _enforces_create(self) -> bool:
        """Whether the filesystem refuses a create-only put over an existing object (probed
        once per filesystem); where it does not, one log line says what is not guaranteed."""
        from fsspec.spec import AbstractFileSystem

        key = self._key()
        with _shared_lock:
            known = _creates.get(key)
        if known is not None:
            return known
        # fsspec's generic pipe_file checks and then writes: no guarantee at all.
        works = type(self.fs).pipe_file is not AbstractFileSystem.pipe_file or hasattr(
            self.fs, "_pipe_file"
        )
        if works:
            name = f"{PROBE_PREFIX}{uuid.uuid4().hex}"  # tidy removes one left behind
            probe = self.path(name)
            try:
                self.fs.pipe_file(probe, b"1", mode="create")
                try:
                    self.fs.pipe_file(probe, b"2", mode="create")
                    works = False
                except FileExistsError:
                    pass
            except TypeError:  # an fsspec or filesystem older than pipe_file's mode
                works = False
            except Exception as e:
                raise self.fail(name, "probe create-only writes", e) from e
            finally:
                try:
                    self.fs.rm(probe)
                except Exception:
                    pass
        if not works:
            log.warning(
                "tardigrade: %s (%s) cannot create an object only if none exists: running in "
                "single-writer mode. Checkpoints stay atomic (data under names unique to each "
                "save, the manifest last), but two jobs saving under this root at once are not "
                "detected and one may replace the other's checkpoint; run one writer at a time.",
                self.root,
                type(self.fs).__name__,
            )
        with _shared_lock:
            _creates[key] = works
        return works

    def lease(self, name: str, *, lease_seconds: float = 30.0) -> ObjectLease:
        return ObjectLease(self, name, lease_seconds=lease_seconds)

    def preflight(self) -> None:
        super().preflight()
        self._enforces_create()


def _modified(info: Mapping[str, Any]) -> float | None:
    """When the object of ``info`` was last written (POSIX timestamp), if the filesystem says:
    a datetime (s3fs, adlfs, fsspec's memory filesystem), a number, or ISO 8601 text (gcsfs)."""
    for key in _TIMES:
        when = info.get(key)
        if isinstance(when, datetime):
            return when.timestamp()
        if isinstance(when, (int, float)) and not isinstance(when, bool):
            return float(when)
        if isinstance(when, str):
            try:
                return datetime.fromisoformat(when.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return None


def _mark_closed(f: Any) -> None:
    """Mark an fsspec file closed without closing it, so that neither its exit nor its garbage
    collection flushes it and completes its upload (s3fs #154)."""
    try:
        f.closed = True
    except (AttributeError, TypeError):  # a plain io object: its close() completes nothing
        pass


def _lock(url: str) -> threading.Lock:
    return _locks[hash(url) % len(_locks)]
