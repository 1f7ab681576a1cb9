"""``s3://bucket/prefix``: checkpoints in an S3 bucket (AWS or any S3-compatible server).

Built on ``obstore`` (a Rust S3 client: about 1.2 s of client CPU per GB put where boto3 and
s3fs use 2.2, uploads straight from the caller's buffer; see docs/research/s3-clients.md),
imported on first use from the ``s3`` extra. ``boto3`` (same extra) serves only the two
maintenance calls obstore lacks, listing and aborting incomplete multipart uploads, for ``gc``.

How the contract maps onto S3:

- a writer streams parts of a multipart upload, several in flight, a bounded number of bytes
  buffered; ``close()`` completes the upload, ``abort()`` aborts it (nothing becomes visible).
  An upload is only ever completed by ``close()``, never by a file object's exit;
- a reader answers ``readinto`` with ranged GETs straight into the caller's buffer, large
  ranges split into parallel GETs;
- commit is manifest-last (``tardigrade._commit.ManifestLastCommit``, as on every backend that
  cannot rename): data objects under names unique to the save, then the manifest with one ``If-None-Match: *`` PUT (never a multipart completion, whose
  condition some servers do not enforce atomically under races);
- whether the server honours conditional PUTs is probed once per endpoint and bucket. Where it
  does not, the store runs in single-writer mode (a warning says so): creates check first and
  then write, which is correct only while one job writes under the root at a time;
- every request has connect/read timeouts and bounded retries with backoff on transient errors
  (5xx, throttling, resets); what still fails is a StorageError naming the URL, the operation
  and the cause, with plain words for a missing bucket, bad credentials, denied access and an
  unreachable endpoint.
"""

from __future__ import annotations

import builtins
import errno
import logging
import os
import queue
import re
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
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
    Tidied,
    Writer,
    grace_cutoff,
)
from .lease import ObjectLease

__all__ = [
    "S3Storage",
]

log = logging.getLogger("tardigrade")

SCHEME = "s3://"
EXTRA = "pip install 'tardigrade-ckpt[s3]'"

# Defaults, each overridable in storage_options (see S3Storage).
PART_BYTES = 8 * 1024 * 1024  # a multipart upload's part (S3's minimum is 5 MiB)
PARTS_IN_FLIGHT = 8  # parts uploading at once per writer
RANGE_BYTES = 8 * 1024 * 1024  # a large read is split into GETs of this size, run in parallel
RANGE_THREADS = 8

_OPTIONS = {
    "endpoint": "URL of the S3 server (default: AWS, or AWS_ENDPOINT_URL)",
    "region": "bucket region (default: AWS_REGION / AWS_DEFAULT_REGION, else us-east-1)",
    "access_key_id": "credentials (default: AWS_ACCESS_KEY_ID, the AWS profile chain)",
    "secret_access_key": "credentials (default: AWS_SECRET_ACCESS_KEY)",
    "session_token": "credentials (default: AWS_SESSION_TOKEN)",
    "allow_http": "allow http:// endpoints (default: true when the endpoint says http://)",
    "connect_timeout": "seconds to connect (default 5)",
    "read_timeout": "seconds without a byte before a request fails (default 30)",
    "request_timeout": "seconds for a whole request (default 600)",
    "max_retries": "retries of a transient failure, with backoff (default 5)",
    "part_bytes": f"multipart part size (default {PART_BYTES})",
    "parts_in_flight": f"parts uploading at once per object (default {PARTS_IN_FLIGHT})",
    "range_bytes": f"size of each parallel ranged GET (default {RANGE_BYTES})",
    "conditional_writes": "'auto' (probe the server, default), True, or False (single-writer)",
    "unsigned_payload": "skip the SigV4 body hash (default true: the loader verifies bytes)",
    "gc_grace_seconds": f"age before gc removes a leftover upload (default {GRACE_SECONDS:.0f})",
}
_ALIASES = {"endpoint_url": "endpoint", "key": "access_key_id", "secret": "secret_access_key",
            "token": "session_token"}  # fmt: skip

# Bytes moved by this process, for tests and benches (``transferred()``).
_counts = {"bytes_read": 0, "bytes_written": 0, "gets": 0, "puts": 0}
_counts_lock = threading.Lock()


def _count(**delta: int) -> None:
    with _counts_lock:
        for k, v in delta.items():
            _counts[k] += v


def transferred() -> dict[str, int]:
    """Bytes and requests this process has moved to and from S3 so far (a snapshot)."""
    with _counts_lock:
        return dict(_counts)


# The client's runtime (tokio threads) does not survive fork(): a child forked after this
# process used it would hang or crash on its first request, so it gets an error instead.
_used = False
_forked_after_use = False


def _after_fork_in_child() -> None:
    global _forked_after_use, _range_pool
    _forked_after_use = _used
    _range_pool = None  # its threads are gone


os.register_at_fork(after_in_child=_after_fork_in_child)


def _client(where: str = "s3://") -> Any:
    """The obstore module, imported on first use (``where``: the URL, for messages)."""
    if _forked_after_use:
        raise StorageError(
            errno.EPERM,
            f"{where}: cannot be used in a process forked after its parent used S3 (the S3 "
            "client's runtime does not survive fork(); it would hang). Start such processes "
            "with the 'spawn' or 'forkserver' method (multiprocessing.set_start_method, "
            "DataLoader(multiprocessing_context='spawn')), or do the S3 I/O in the parent.",
        )
    try:
        import obstore
        import obstore.exceptions
        import obstore.store
    except ImportError as e:
        raise TardigradeError(
            f"s3:// checkpoints need the S3 client of the `s3` extra ({e}); install it with: "
            f"{EXTRA}"
        ) from None
    return obstore


def _seconds(value: Any, name: str, root: str) -> timedelta:
    try:
        seconds = float(value) if not isinstance(value, bool) else -1.0
    except (TypeError, ValueError):
        seconds = -1.0
    if not 0 < seconds <= 10**9:
        raise InvalidArgumentError(
            f"{root}: storage option {name}={value!r}: give a number of seconds > 0 (e.g. "
            f"{name}=30)"
        )
    return timedelta(seconds=seconds)


def _whole(
    root: str, opts: Mapping[str, Any], name: str, default: int, least: int, why: str = ""
) -> int:
    """Option ``name``, a whole number >= ``least`` (text of digits too: the CLI gives text)."""
    value = opts.get(name, default)
    try:
        number = int(value, 10) if isinstance(value, str) else value
    except ValueError:
        number = None
    if type(number) is not int or not least <= number <= 2**40:
        raise InvalidArgumentError(
            f"{root}: storage option {name}={value!r}: give a whole number >= {least}"
            f"{f' ({why})' if why else ''}, e.g. {name}={default}"
        )
    return number


def _first(opts: Mapping[str, Any], option: str, *variables: str) -> tuple[str, str] | None:
    """(value, where it came from) of an option, else of the first environment variable set."""
    if opts.get(option):
        return opts[option], f"storage option {option}"
    for name in variables:
        if os.environ.get(name):
            return os.environ[name], f"environment variable {name}"
    return None


def _endpoint(root: str, value: Any, source: str) -> str:
    """An http(s) URL with a host and a valid port, else an error naming where it came from."""
    problem = ""
    if not isinstance(value, str):
        problem = f"a {type(value).__name__}, not a URL"
    elif not value.isascii() or not value.isprintable() or any(c.isspace() for c in value):
        problem = "it holds a space, a control or a non-ASCII character"
    else:
        try:
            parts = urllib.parse.urlsplit(value)
            parts.port  # noqa: B018 (raises on a port out of range)
        except ValueError as e:
            problem = str(e)
        else:
            if parts.scheme not in ("http", "https"):
                problem = "it does not start with http:// or https://"
            elif not parts.hostname:
                problem = "it names no host"
    if problem:
        raise InvalidArgumentError(
            f"{root}: {source}={value!r} is not a valid S3 endpoint ({problem}); give a URL "
            "such as http://127.0.0.1:8333 or https://s3.eu-west-1.amazonaws.com"
        )
    return value


def _region(root: str, value: Any, source: str) -> str:
    if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", value):
        raise InvalidArgumentError(
            f"{root}: {source}={value!r} is not a region name; give one such as us-east-1"
        )
    return value


def _credential(root: str, opts: Mapping[str, Any], name: str) -> str | None:
    """A credential option: text a request header can carry. Its value is never echoed."""
    value = opts.get(name)
    if value is None or value == "":
        return None
    if not (isinstance(value, str) and value.isascii() and value.isprintable()) or any(
        c.isspace() for c in value
    ):
        raise InvalidArgumentError(
            f"{root}: storage option {name} is not valid credential text (it must be "
            f"printable ASCII without spaces; got a {type(value).__name__} of "
            f"{len(value) if isinstance(value, (str, bytes)) else '?'} characters, not shown)"
        )
    return value


def _flag(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def _env(*names: str) -> str | None:
    for n in names:
        v = os.environ.get(n)
        if v:
            return v
    return None


class _Config:
    """The resolved ``storage_options`` of one root (explicit options, then AWS_* variables)."""

    def __init__(self, root: str, options: Mapping[str, Any]) -> None:
        opts: dict[str, Any] = {}
        for k, v in options.items():
            key = _ALIASES.get(k, k)
            if key not in _OPTIONS:
                known = "\n".join(f"  {n}: {what}" for n, what in _OPTIONS.items())
                raise InvalidArgumentError(
                    f"{root}: unknown storage option {k!r} for s3://; known:\n{known}"
                )
            opts[key] = v
        # Everything is checked here, where it enters: the Rust client panics on a malformed
        # endpoint or header value at the first request, long after the options were given.
        given = _first(opts, "endpoint", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT")
        self.endpoint: str | None = given and _endpoint(root, *given)
        given = _first(opts, "region", "AWS_REGION", "AWS_DEFAULT_REGION")
        self.region: str = _region(root, *given) if given else "us-east-1"
        self.access_key_id = _credential(root, opts, "access_key_id")
        self.secret_access_key = _credential(root, opts, "secret_access_key")
        self.session_token = _credential(root, opts, "session_token")
        allow = opts.get("allow_http", _env("AWS_ALLOW_HTTP"))
        if allow is None:
            allow = bool(self.endpoint and self.endpoint.startswith("http://"))
        self.allow_http = _flag(allow)
        self.connect_timeout = _seconds(opts.get("connect_timeout", 5), "connect_timeout", root)
        self.read_timeout = _seconds(opts.get("read_timeout", 30), "read_timeout", root)
        self.request_timeout = _seconds(opts.get("request_timeout", 600), "request_timeout", root)
        self.max_retries = _whole(root, opts, "max_retries", 5, 0)
        self.part_bytes = _whole(root, opts, "part_bytes", PART_BYTES, 5 * 1024 * 1024,
                                 "S3's minimum part size of 5 MiB")  # fmt: skip
        self.parts_in_flight = max(1, _whole(root, opts, "parts_in_flight", PARTS_IN_FLIGHT, 0))
        self.range_bytes = max(64 * 1024, _whole(root, opts, "range_bytes", RANGE_BYTES, 0))
        conditional = opts.get("conditional_writes", "auto")
        self.conditional: bool | None = None if conditional == "auto" else _flag(conditional)
        self.unsigned_payload = _flag(opts.get("unsigned_payload", True))
        self.grace = grace_seconds(root, opts.get("gc_grace_seconds", GRACE_SECONDS))

    def key(self) -> tuple[Any, ...]:
        """What makes two roots share a client: the options and the AWS_* variables the
        client reads itself (credentials changed in the environment take effect)."""
        env = sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))
        return (*sorted((k, str(v)) for k, v in vars(self).items()), *env)


# One client per configuration and bucket (connection pools are reused across saves), and
# one conditional-write probe result per endpoint and bucket.
_stores: dict[tuple[Any, ...], Any] = {}
_probed: dict[tuple[str | None, str], bool] = {}
_buckets_seen: set[tuple[str | None, str]] = set()
_shared_lock = threading.Lock()
_range_pool: ThreadPoolExecutor | None = None


def _ranges() -> ThreadPoolExecutor:
    global _range_pool
    with _shared_lock:
        if _range_pool is None:
            _range_pool = ThreadPoolExecutor(RANGE_THREADS, thread_name_prefix="tardigrade-s3")
        return _range_pool


# Part buffers that copies (bytes written with a hasher: live tensors) may fill, across all
# writers of the process; whole parts of staged buffers are lent without a copy and not counted.
COPY_PARTS = PARTS_IN_FLIGHT + 2
_copy_parts = 0


def _budget(delta: int, *, force: bool = False) -> bool:
    """Take (``delta`` > 0) or give back part buffers of the process's copy budget."""
    global _copy_parts
    with _shared_lock:
        if delta > 0 and not force and _copy_parts + delta > COPY_PARTS:
            return False
        _copy_parts += delta
        return True


def _describe(e: BaseException) -> str:
    """The first line of a client error (obstore appends pages of debug detail)."""
    text = str(e).strip().split("\n\nDebug source:")[0]
    return " ".join(text.split())[:500]


class S3Writer(Writer):
    """One object, uploaded as it is written.

    An object that fits in one part goes up in a single PUT at ``close``; a larger one
    streams its parts into a multipart upload on a background thread, at most
    ``parts_in_flight`` uploading and one more waiting. The caller's memory may change once
    ``write`` returns, so bytes written with a ``hasher`` (live tensors) and the odd ends of
    others are copied into part buffers; whole parts of a large unhashed write (an async
    save's staging slab) are lent to the client without a copy, and ``write`` returns once the
    client has let go of them (their upload finished).
    """

    def __init__(self, storage: S3Storage, name: str) -> None:
        self._storage = storage
        self._name = name
        self._part_bytes = storage.config.part_bytes
        self._part = bytearray(self._part_bytes)
        _budget(+1, force=True)
        self._owned = 1  # part buffers counted in the process's budget
        self._fill = 0
        self._size = 0
        self._queue: queue.Queue[bytearray | memoryview | None] | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._aborted = threading.Event()
        self._open = True
        # Copied parts handed to the client: (sequence number, buffer, the view it holds).
        self._held: list[tuple[int, bytearray, memoryview]] = []
        self._sent = 0  # items handed to the upload queue
        self._taken = 0  # items the client has taken hold of (it asked for the next one)

    def write(self, data: memoryview | bytes, *, hasher: Hashes | None = None) -> None:
        if not self._open:
            raise StorageError(errno.EINVAL, f"{self._storage.url(self._name)}: writer closed")
        view = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
        self._size += view.nbytes
        step = self._part_bytes
        if hasher is None and view.nbytes >= step + (step - self._fill) % step:
            if self._fill:  # complete the part in progress, so lent parts stay aligned
                head = step - self._fill
                self._copy(view[:head], None)
                view = view[head:]
            whole = view.nbytes - view.nbytes % step
            self._lend([view[i : i + step] for i in range(0, whole, step)])
            view = view[whole:]
        self._copy(view, hasher)

    def _lend(self, pieces: list[memoryview]) -> None:
        """Upload ``pieces`` of the caller's memory without copying; return once the client
        holds none of them (a memoryview can be released only when nothing exports it)."""
        first = self._sent + 1
        try:
            for piece in pieces:
                self._send(piece)
        finally:
            for seq, piece in enumerate(pieces[: self._sent - first + 1], first):
                while True:
                    if self._taken >= seq or self._thread is None or not self._thread.is_alive():
                        try:
                            piece.release()
                            break
                        except BufferError:
                            pass  # its part is still uploading
                    time.sleep(0.002)

    def _copy(self, view: memoryview, hasher: Hashes | None) -> None:
        part = memoryview(self._part)
        while view.nbytes:
            n = min(view.nbytes, self._part_bytes - self._fill)
            part[self._fill : self._fill + n] = view[:n]
            if hasher is not None:
                hasher.update(part[self._fill : self._fill + n])
            self._fill += n
            view = view[n:]
            if self._fill == self._part_bytes:
                part.release()
                sent = memoryview(self._part)
                self._send(sent)
                self._held.append((self._sent, self._part, sent))
                self._part = self._spare_part()
                self._fill = 0
                part = memoryview(self._part)
        part.release()

    def _spare_part(self) -> bytearray:
        """A part buffer to fill: one the client has let go of, a new one while this writer
        has fewer than ``parts_in_flight`` + 2 and the process fewer than ``COPY_PARTS``
        (writers of one save run side by side), else the first to come back. Bounded memory,
        and no fresh pages to fault in for every part."""
        while True:
            alive = self._thread is not None and self._thread.is_alive()
            for i, (seq, buf, view) in enumerate(self._held):
                if self._taken >= seq or not alive:
                    try:
                        view.release()
                    except BufferError:
                        continue  # still uploading
                    del self._held[i]
                    return buf
            if len(self._held) < self._storage.config.parts_in_flight + 1 and _budget(+1):
                self._owned += 1
                return bytearray(self._part_bytes)
            if self._error is not None:
                raise self._failed("upload")
            time.sleep(0.002)

    def _send(self, part: bytearray | memoryview) -> None:
        if self._queue is None:
            self._queue = queue.Queue(maxsize=1)
            self._thread = threading.Thread(
                target=self._upload, name="tardigrade-s3-upload", daemon=True
            )
            self._thread.start()
        while True:
            if self._error is not None:
                raise self._failed("upload")
            try:
                self._queue.put(part, timeout=0.2)
                self._sent += 1
                return
            except queue.Full:
                continue

    def _parts(self) -> Iterator[bytearray | memoryview]:
        assert self._queue is not None
        while True:
            if self._aborted.is_set():
                # Raising inside the upload makes the client abort the multipart upload.
                raise _Aborted()
            try:
                item = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            if item is None:
                return
            yield item
            # The client asks for the next item only once it holds this one.
            self._taken += 1

    def _upload(self) -> None:
        store = self._storage._store
        try:
            obs = _client()
            obs.put(
                store,
                self._name,
                self._parts(),
                use_multipart=True,
                chunk_size=self._part_bytes,
                max_concurrency=self._storage.config.parts_in_flight,
            )
        except BaseException as e:
            self._error = e

    def _failed(self, op: str) -> TardigradeError:
        err = self._error
        if isinstance(err, _Aborted):
            return StorageError(errno.ECANCELED, f"{self._storage.url(self._name)}: aborted")
        assert err is not None
        return self._storage._fail(self._name, op, err)

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        try:
            self._finish()
        finally:
            self._release_buffers()

    def _release_buffers(self) -> None:
        self._part = bytearray()
        self._held = []
        _budget(-self._owned)
        self._owned = 0

    def _finish(self) -> None:
        if self._queue is None:
            self._storage._put(self._name, memoryview(self._part)[: self._fill], "write")
            _count(bytes_written=self._fill)
            self._part = bytearray()
            return
        if self._fill:
            self._send(memoryview(self._part)[: self._fill])
        self._send_end()
        assert self._thread is not None
        self._thread.join()
        self._part = bytearray()
        if self._error is not None:
            raise self._failed("upload")
        _count(bytes_written=self._size, puts=1)

    def _send_end(self) -> None:
        assert self._queue is not None and self._thread is not None
        while self._thread.is_alive():
            try:
                self._queue.put(None, timeout=0.2)
                return
            except queue.Full:
                continue

    def abort(self) -> None:
        self._open = False
        if self._thread is not None:
            self._aborted.set()
            self._thread.join()
        self._release_buffers()


class _Aborted(Exception):
    """Raised into a multipart upload to make the client abort it."""


class S3Reader(Reader):
    """An object read by ranged GETs into the caller's buffers."""

    # Verify reads chunks through a buffer of this size (1 MiB requests would be a round trip
    # each); loads hand whole tensors to read_hashed (format.safetensors.read_range).
    read_window = 8 * RANGE_BYTES

    def __init__(self, storage: S3Storage, name: str, size: int) -> None:
        self._storage = storage
        self._key = name
        self.name = storage.url(name)
        self.size = size

    def readinto(self, offset: int, buf: memoryview) -> None:
        self.read_hashed(offset, buf, None)

    def read_hashed(self, offset: int, buf: memoryview, hasher: Hashes | None) -> None:
        """Fill ``buf`` from ``offset`` with parallel ranged GETs, updating ``hasher`` with
        each piece in order as soon as it and those before it have arrived."""
        view, end = self.byte_span(offset, buf)
        if not view.nbytes:
            return
        # Every GET thread gets a piece, down to 1 MiB pieces: a 32 MiB tensor is 8 GETs of
        # 4 MiB, not 4 of 8 MiB with half the threads idle.
        step = min(self._storage.config.range_bytes, max(1 << 20, -(-view.nbytes // RANGE_THREADS)))
        if view.nbytes <= step:
            self._get(offset, view)
            if hasher is not None:
                hasher.update(view)
            return
        pieces = [(pos, view[pos - offset : min(end, pos + step) - offset])
                  for pos in range(offset, end, step)]  # fmt: skip
        futures = [_ranges().submit(self._get, pos, piece) for pos, piece in pieces]
        try:
            for f, (_, piece) in zip(futures, pieces, strict=True):
                f.result()
                if hasher is not None:
                    hasher.update(piece)
        except BaseException:
            # No GET may still write into the caller's buffer once this returns.
            for f in futures:
                f.cancel()
            for f in futures:
                try:
                    f.result()
                except BaseException:
                    pass
            raise

    def _get(self, offset: int, view: memoryview) -> None:
        obs = _client()
        n = view.nbytes
        pos = 0
        try:
            if n <= 1024 * 1024:
                data = obs.get_range(self._storage._store, self._key, start=offset, length=n)
                pos = len(data)
                view[: min(pos, n)] = memoryview(data)[: min(pos, n)]
            else:
                result = obs.get(
                    self._storage._store, self._key, options={"range": (offset, offset + n)}
                )
                for chunk in result.stream(min_chunk_size=1024 * 1024):
                    m = len(chunk)
                    if pos + m > n:
                        break
                    view[pos : pos + m] = memoryview(chunk)
                    pos += m
        except BaseException as e:  # a client panic too (see _fail)
            raise self._storage._fail(self._key, f"read bytes {offset}-{offset + n}", e) from e
        _count(bytes_read=pos, gets=1)
        if pos != n:
            raise CorruptCheckpointError(
                f"{self.name}: object returned {pos} bytes at offset {offset} where {n} were "
                "expected (truncated or changed while reading); delete this checkpoint or "
                "restore it from a backup."
            )

    def close(self) -> None:
        pass


class S3Storage(Storage):
    implicit_directories = True  # a name is a directory exactly when objects lie under it

    """Checkpoints under ``s3://bucket/prefix``.

    ``storage_options`` (all optional; the AWS_* environment variables fill the gaps):
    ``endpoint``, ``region``, ``access_key_id``, ``secret_access_key``, ``session_token``,
    ``allow_http``; timeouts ``connect_timeout``, ``read_timeout``, ``request_timeout`` and
    ``max_retries``; transfer sizes ``part_bytes``, ``parts_in_flight``, ``range_bytes``;
    ``conditional_writes`` (``"auto"``: probe the server); ``gc_grace_seconds``.

    Example::

        storage = S3Storage("s3://bucket/ckpts", {"endpoint": "http://127.0.0.1:8333"})
        storage.put("hello", b"world")
    """

    def __init__(self, root: str, options: Mapping[str, Any] | None = None) -> None:
        if not root.startswith(SCHEME):
            raise InvalidArgumentError(f"{root}: an s3:// URL is expected")
        bucket, _, prefix = root[len(SCHEME) :].partition("/")
        if not bucket or "?" in root or "#" in root:
            raise InvalidArgumentError(
                f"{root}: name a bucket and an optional prefix, e.g. s3://bucket/checkpoints"
            )
        self.root = root.rstrip("/")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.config = _Config(root, options or {})
        self._store = self._open_store()

    def _open_store(self) -> Any:
        global _used
        obs = _client(self.root)
        _used = True
        c = self.config
        key = (self.bucket, self.prefix, c.key())
        with _shared_lock:
            store = _stores.get(key)
            if store is not None:
                return store
        kwargs: dict[str, Any] = {"region": c.region, "unsigned_payload": c.unsigned_payload}
        if c.endpoint:
            kwargs["endpoint"] = c.endpoint
        for name in ("access_key_id", "secret_access_key", "session_token"):
            if getattr(c, name):
                kwargs[name] = getattr(c, name)
        try:
            store = obs.store.S3Store(
                self.bucket,
                prefix=self.prefix or None,
                client_options={
                    "allow_http": c.allow_http,
                    "connect_timeout": c.connect_timeout,
                    "read_timeout": c.read_timeout,
                    "timeout": c.request_timeout,
                },
                retry_config={
                    "max_retries": c.max_retries,
                    "retry_timeout": timedelta(seconds=60),
                    "backoff": {
                        "init_backoff": timedelta(milliseconds=200),
                        "max_backoff": timedelta(seconds=5),
                        "base": 2,
                    },
                },
                **kwargs,
            )
        except BaseException as e:  # a client panic too
            if not isinstance(e, Exception) and type(e).__name__ != "PanicException":
                raise
            raise InvalidArgumentError(
                f"{self.root}: cannot configure the S3 client: {_describe(e)}"
            ) from None
        with _shared_lock:
            return _stores.setdefault(key, store)

    # -- errors --------------------------------------------------------------------------

    def _fail(self, name: str, op: str, e: BaseException) -> TardigradeError:
        """The error to raise for client error ``e`` during ``op`` on ``name``; re-raises what
        is not the client's (KeyboardInterrupt, SystemExit)."""
        if isinstance(e, TardigradeError):
            return e
        url = self.url(name)
        if not isinstance(e, Exception):
            if type(e).__name__ != "PanicException":
                raise e
            # The Rust client panicked (pyo3 raises that as a BaseException, which `except
            # Exception` misses): options are validated where they enter, so this is a
            # configuration the checks do not know yet. Say where, and with what.
            return InvalidArgumentError(
                f"{url}: {op} failed: the S3 client rejected its configuration ("
                f"{_describe(e)}); check storage_options (endpoint {self.config.endpoint!r}, "
                f"region {self.config.region!r}) and the AWS_* variables."
            )
        cause = _describe(e)
        where = f" at {self.config.endpoint}" if self.config.endpoint else ""
        exc = _client().exceptions
        if "169.254.169.254" in cause or "latest/api/token" in cause:
            # No key in the options or the environment: the client fell back to the EC2
            # instance-metadata service, which answered (or not) for some other reason.
            return StorageError(
                errno.EACCES,
                f"{url}: {op} failed: no S3 credentials found. Give access_key_id and "
                "secret_access_key in storage_options (--storage-option on the command line), "
                "or set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (with AWS_SESSION_TOKEN for "
                "temporary ones); on EC2, attach an instance role. (The instance-metadata "
                f"service, tried last, said: {cause})",
            )
        if "NoSuchBucket" in cause:
            return StorageError(
                errno.ENOENT,
                f"{url}: {op} failed: bucket {self.bucket!r} does not exist{where}. Create it, "
                f"or fix the URL. ({cause})",
            )
        if isinstance(e, (exc.PermissionDeniedError, exc.UnauthenticatedError)) or any(
            s in cause for s in ("SignatureDoesNotMatch", "InvalidAccessKeyId", "AccessDenied")
        ):
            refused = any(s in cause for s in ("SignatureDoesNotMatch", "InvalidAccessKeyId"))
            if not refused and "AccessDenied" not in cause:
                refused = self._credentials_refused()
            what = (
                "the credentials were refused (bad access key or secret)"
                if refused
                else "access denied"
            )
            return StorageError(
                errno.EACCES,
                f"{url}: {op} failed: {what}{where}. Check access_key_id/secret_access_key "
                f"(storage_options or AWS_* variables) and the bucket's permissions. ({cause})",
            )
        if "error sending request" in cause or "Connection refused" in cause:
            return StorageError(
                errno.ECONNREFUSED,
                f"{url}: {op} failed: cannot reach the S3 endpoint "
                f"{self.config.endpoint or '(AWS default)'} after {self.config.max_retries} "
                f"retries. Check the endpoint option / AWS_ENDPOINT_URL and that the server "
                f"runs. ({cause})",
            )
        if isinstance(e, FileNotFoundError):
            return StorageError(errno.ENOENT, f"{url}: {op} failed: no such object ({cause})")
        return StorageError(
            errno.EIO,
            f"{url}: {op} failed after {self.config.max_retries} retries with backoff: {cause}",
        )

    def _credentials_refused(self) -> bool:
        """After a bare 403 (a HEAD has no body to say why): whether a LIST, whose error
        names its cause, is refused for the credentials themselves."""
        obs = _client()
        try:
            obs.list_with_delimiter(self._store, None)
        except Exception as e:
            return any(s in str(e) for s in ("SignatureDoesNotMatch", "InvalidAccessKeyId"))
        return False

    def _check_bucket(self, name: str, op: str) -> None:
        """After a 404: raise if the bucket itself is missing (a HEAD cannot tell); one LIST
        per endpoint and bucket, the first time only."""
        key = (self.config.endpoint, self.bucket)
        if key in _buckets_seen:
            return
        obs = _client()
        try:
            next(iter(obs.list(self._store, chunk_size=1)), None)
        except BaseException as e:  # a client panic too (see _fail)
            raise self._fail(name, op, e) from None
        _buckets_seen.add(key)

    # -- the byte primitives -------------------------------------------------------------

    def _put(self, name: str, data: Any, op: str, mode: Any = None) -> str:
        obs = _client()
        try:
            result = obs.put(self._store, name, data, mode=mode, use_multipart=False)
        except BaseException as e:  # a client panic too (see _fail)
            if isinstance(e, obs.exceptions.AlreadyExistsError):
                raise PreconditionFailed(
                    errno.EEXIST, f"{self.url(name)}: exists already; nothing was written"
                ) from None
            if isinstance(e, obs.exceptions.PreconditionError):
                raise PreconditionFailed(
                    errno.ESTALE, f"{self.url(name)}: changed since it was read; nothing written"
                ) from None
            raise self._fail(name, op, e) from e
        _count(puts=1)
        return str(result.get("e_tag") or result.get("version") or "")

    def open_writer(self, name: str, *, size_hint: int | None = None) -> Writer:
        return S3Writer(self, name)

    def _head(self, name: str, op: str) -> dict[str, Any] | None:
        if not name.strip("/"):
            return None
        obs = _client()
        try:
            return obs.head(self._store, name)
        except FileNotFoundError:
            self._check_bucket(name, op)
            return None
        except BaseException as e:  # a client panic too (see _fail)
            raise self._fail(name, op, e) from e

    def open_reader(self, name: str) -> Reader:
        meta = self._head(name, "open for reading")
        if meta is None:
            raise CorruptCheckpointError(
                f"{self.url(name)}: object listed in the manifest is missing; the checkpoint is "
                "incomplete. Delete it or restore it from a backup."
            )
        return S3Reader(self, name, int(meta["size"]))

    def put(
        self, name: str, data: bytes, *, mode: PutMode = "create", expect: str | None = None
    ) -> str:
        if mode == "overwrite":
            return self._put(name, data, "put")
        if not self._conditional():
            return self._put_unconditionally(name, data, mode, expect)
        if mode == "create":
            return self._put(name, data, "put (create only)", mode="create")
        if not expect:
            raise PreconditionFailed(
                errno.ESTALE, f"{self.url(name)}: no version to match; nothing written"
            )
        return self._put(name, data, "put (if match)", mode={"e_tag": expect})

    def _put_unconditionally(
        self, name: str, data: bytes, mode: PutMode, expect: str | None
    ) -> str:
        """Single-writer mode: check, then write (not atomic; see the module docstring)."""
        now = self._head(name, "stat")
        if mode == "create" and now is not None:
            raise PreconditionFailed(
                errno.EEXIST, f"{self.url(name)}: exists already; nothing was written"
            )
        if mode == "if_match" and (now is None or now.get("e_tag") != expect):
            raise PreconditionFailed(
                errno.ESTALE, f"{self.url(name)}: changed since it was read; nothing written"
            )
        return self._put(name, data, "put")

    def _conditional(self) -> bool:
        """Whether the server enforces conditional PUTs (probed once per endpoint, bucket)."""
        if self.config.conditional is not None:
            return self.config.conditional
        key = (self.config.endpoint, self.bucket)
        with _shared_lock:
            known = _probed.get(key)
        if known is not None:
            return known
        obs = _client()
        probe = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
        works = True
        try:
            first = self._put(probe, b"1", "probe conditional writes", mode="create")
            try:
                obs.put(self._store, probe, b"2", mode="create")
                works = False
            except obs.exceptions.AlreadyExistsError:
                pass
            if works:
                try:
                    obs.put(self._store, probe, b"3", mode={"e_tag": first + "x"})
                    works = False
                except obs.exceptions.PreconditionError:
                    pass
        except PreconditionFailed:
            works = True  # a create refused on a fresh name: conditions are checked
        except BaseException as e:  # a client panic too (see _fail)
            raise self._fail(probe, "probe conditional writes", e) from e
        finally:
            try:
                obs.delete(self._store, probe)
            except Exception:
                pass
        if not works:
            log.warning(
                "tardigrade: %s does not enforce conditional writes (If-None-Match / If-Match): "
                "running in single-writer mode. Checkpoints stay atomic (the manifest is "
                "written last) but two jobs writing under the same prefix at once are not "
                "detected; run one writer at a time.",
                self.config.endpoint or "this S3 endpoint",
            )
        with _shared_lock:
            _probed[key] = works
        return works

    def stat(self, name: str) -> Stat | None:
        meta = self._head(name, "stat")
        if meta is not None:
            return Stat(
                int(meta["size"]),
                str(meta.get("e_tag") or meta.get("version") or ""),
                modified=meta["last_modified"].timestamp() if meta.get("last_modified") else None,
            )
        if self._holds_objects(name, "stat"):
            return Stat(0, "", is_dir=True)
        return None

    def _holds_objects(self, name: str, op: str) -> bool:
        """Whether any object lies under prefix ``name`` (some servers, SeaweedFS among them,
        keep listing a prefix as a folder after its last object is gone)."""
        obs = _client()
        try:
            return bool(
                next(iter(obs.list(self._store, name.strip("/") or None, chunk_size=1)), [])
            )
        except BaseException as e:  # a client panic too (see _fail)
            raise self._fail(name, op, e) from e

    def _listing(self, name: str, op: str) -> tuple[list[str], list[dict[str, Any]]]:
        """(sub-prefixes, objects) directly under ``name``, with paths relative to the root."""
        obs = _client()
        name = name.strip("/")
        try:
            result = obs.list_with_delimiter(self._store, name or None)
        except BaseException as e:  # a client panic too (see _fail)
            raise self._fail(name, op, e) from e
        return list(result["common_prefixes"]), list(result["objects"])

    def list(self, name: str = "") -> list[str]:
        prefixes, objects = self._listing(name, "list")
        cut = len(name.strip("/")) + 1 if name.strip("/") else 0
        if len(prefixes) > 2:
            full = list(_ranges().map(lambda p: self._holds_objects(p, "list"), prefixes))
        else:
            full = [self._holds_objects(p, "list") for p in prefixes]
        found = {p[cut:].strip("/") for p, f in zip(prefixes, full, strict=True) if f}
        found.update(o["path"][cut:] for o in objects)
        return sorted(n for n in found if n)

    def _walk(self, name: str, op: str) -> builtins.list[dict[str, Any]]:
        """Every object under prefix ``name`` (recursively)."""
        obs = _client()
        name = name.strip("/")
        try:
            return [meta for chunk in obs.list(self._store, name or None) for meta in chunk]
        except BaseException as e:  # a client panic too (see _fail)
            raise self._fail(name, op, e) from e

    def delete(self, name: str) -> None:
        keys = [m["path"] for m in self._walk(name, "delete")]
        if name.strip("/"):
            keys.append(name.strip("/"))
        self.delete_many(keys)

    def delete_many(self, names: builtins.list[str]) -> None:
        obs = _client()
        for i in range(0, len(names), 1000):
            batch = names[i : i + 1000]
            try:
                obs.delete(self._store, batch)
            except FileNotFoundError:
                pass
            except BaseException as e:  # a client panic too (see _fail)
                raise self._fail(batch[0], f"delete {len(batch)} object(s)", e) from e

    def lease(self, name: str, *, lease_seconds: float = 30.0) -> ObjectLease:
        return ObjectLease(self, name, lease_seconds=lease_seconds)

    def preflight(self) -> None:
        super().preflight()
        self._conditional()

    # -- cleanup -------------------------------------------------------------------------

    @property
    def gc_grace_seconds(self) -> float:  # type: ignore[override]  # from the storage options, read-only
        return self.config.grace

    @property
    def tidy_scope(self) -> str:
        # One bucket name may be two buckets on two endpoints.
        return f"{self.config.endpoint or ''} {self.root}"

    def walk(self) -> Iterator[tuple[str, Stat]]:
        """Every object under the root with its size, version and age, from one recursive
        listing (a listing per name would be a request per checkpoint)."""
        for meta in self._walk("", "gc: list"):
            yield (
                meta["path"],
                Stat(
                    int(meta["size"]),
                    str(meta.get("e_tag") or meta.get("version") or ""),
                    modified=meta["last_modified"].timestamp(),
                ),
            )

    def tidy(
        self, *, dry_run: bool = False, progress: Callable[[Tidied], None] | None = None
    ) -> builtins.list[Tidied]:
        """The incomplete multipart uploads older than the grace period (``gc_grace_seconds``,
        default 1 h: a save killed mid-upload). Data objects are the catalog's to sweep
        (``Catalog.collect``)."""
        done = super().tidy(dry_run=dry_run, progress=progress)
        cutoff = datetime.fromtimestamp(grace_cutoff(self.config.grace), timezone.utc)
        try:
            uploads = self._uploads()
        except TardigradeError as e:
            # The data objects are dealt with; an incomplete upload costs only storage (a
            # bucket lifecycle rule can expire them), so a missing boto3 or a denied listing
            # must not stop a manager's restore.
            log.warning(
                "tardigrade: %s: incomplete multipart uploads not cleaned: %s", self.root, e
            )
            uploads = []
        for key, upload_id, started in uploads:
            if started > cutoff:
                continue
            name = key[len(self.prefix) + 1 :] if self.prefix else key
            done.append(Tidied(f"{name} (incomplete upload)", "removed", 0))
            if not dry_run:
                self._abort_upload(key, upload_id)
            if progress is not None:
                progress(done[-1])
        return done

    def _boto(self) -> Any:
        client: Any = getattr(self, "_boto_client", None)  # made on first use, below
        if client is not None:
            return client
        try:
            import boto3
            from botocore.config import Config
        except ImportError as e:
            raise TardigradeError(
                f"gc on s3:// needs boto3 from the `s3` extra ({e}); install it with: {EXTRA}"
            ) from None
        c = self.config
        kw: dict[str, Any] = {"region_name": c.region}
        if c.endpoint:
            kw["endpoint_url"] = c.endpoint
        if c.access_key_id:
            kw["aws_access_key_id"] = c.access_key_id
            kw["aws_secret_access_key"] = c.secret_access_key
            kw["aws_session_token"] = c.session_token
        cfg = Config(
            connect_timeout=c.connect_timeout.total_seconds(),
            read_timeout=c.read_timeout.total_seconds(),
            retries={"max_attempts": c.max_retries + 1, "mode": "standard"},
        )
        self._boto_client = boto3.client("s3", config=cfg, **kw)
        return self._boto_client

    def _uploads(self) -> builtins.list[tuple[str, str, datetime]]:
        """(key, upload id, started) of the incomplete multipart uploads under the root."""
        out: builtins.list[tuple[str, str, datetime]] = []
        try:
            client = self._boto()
            kw: dict[str, Any] = {"Bucket": self.bucket}
            if self.prefix:
                kw["Prefix"] = self.prefix + "/"
            while True:
                page = client.list_multipart_uploads(**kw)
                for u in page.get("Uploads", []):
                    out.append((u["Key"], u["UploadId"], u["Initiated"]))
                if not page.get("IsTruncated"):
                    return out
                kw["KeyMarker"] = page.get("NextKeyMarker")
                kw["UploadIdMarker"] = page.get("NextUploadIdMarker")
        except TardigradeError:
            raise
        except BaseException as e:  # a client panic too (see _fail)
            raise self._fail("", "gc: list incomplete uploads", e) from e

    def _abort_upload(self, key: str, upload_id: str) -> None:
        try:
            self._boto().abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
        except BaseException as e:  # a client panic too (see _fail)
            raise self._fail(key, "gc: abort an incomplete upload", e) from e
