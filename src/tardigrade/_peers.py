"""The peer tier: each rank's share of a checkpoint also kept in the memory of ranks on other
nodes, and restores that gather a checkpoint's shares from memory over torch.distributed.

A rank's share of a checkpoint is what its RAM tier holds of it: the manifest and the data
files it wrote. With ``peer_replicas=k`` each rank sends its share, once the save committed
there, to ``k`` ranks on other nodes (:class:`Placement`: the same local rank on the next
nodes of a ring), which keep it in their own RAM tier's memory filesystem as a *replica*: a
namespace of its own (``<directory> (replica of rank r)``, scoped by the run id), committed by
rename only once the whole share arrived and every byte verified against the manifest's
checksums, the newest only. The transfer runs in a background thread over a gloo group of its
own (``Replicator``), point to point (``Ranks.exchange``), paused while training waits on a
save; a failure is logged and counted, never raised into training.

A restore (:class:`MemoryShares`) asks every rank what its node holds of the candidate
checkpoint: its own RAM tier, the other ranks' RAM tiers of the same node, and (for the peer
tier) the replicas kept there. The checkpoint restores from memory when every share of it (one
per rank of the job that saved it) is held somewhere under the save id the root's manifest
names: each rank reads what its node holds directly, and receives every other share, point to
point, from one rank that holds it. No byte comes from a slower tier for a share held in
memory; what is read is verified as every restore is. A world size other than the save's
loads as ``tg.load`` does (N->M).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import queue
import re
import socket
import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._catalog import STEP_NAMES
from ._commit import committed
from ._load import files_to_read, load_from
from ._open import save_id_at
from ._ramtier import RamTier, family_of, saved_alone, source_of
from ._tiers import Gate
from ._tree import flatten
from ._verify import verify_files
from .distributed._collectives import Ranks
from .errors import CorruptCheckpointError, StorageError
from .format import limits
from .format.jsonio import loads_strict
from .format.manifest import MANIFEST, SHARED_DIR, data_path, is_shared, parse
from .storage import LocalStorage, Storage
from .storage.base import Reader, Stat
from .storage.local import free_bytes
from .storage.memory import MemoryReader

log = logging.getLogger("tardigrade")

NODE_VARIABLE = "TARDIGRADE_NODE"


def node_name() -> str:
    """This process's node: ``TARDIGRADE_NODE`` when set (several simulated nodes on one
    machine), else the host name."""
    return os.environ.get(NODE_VARIABLE) or socket.gethostname()


@dataclass(frozen=True)
class Placement:
    """Which ranks keep each rank's replicas: ``nodes[r]`` is rank r's node; each rank's
    ``replicas`` go to the ranks of the same local index on the next nodes of a ring (nodes
    in the order of their first rank), never to a rank of its own node."""

    nodes: tuple[str, ...]
    replicas: int

    @classmethod
    def of(cls, nodes: Sequence[str], replicas: int, *, say: bool = True) -> Placement:
        """The placement of ``replicas`` per rank over ``nodes``. With fewer other nodes than
        that (a job restarted on fewer nodes after one was lost for good), as many as there
        are, logged (``say``): a rank never replicates to its own node."""
        order = list(dict.fromkeys(nodes))
        usable = min(replicas, len(order) - 1)
        if usable < replicas and say:
            shown = ", ".join(repr(n) for n in order[:8]) + (", ..." if len(order) > 8 else "")
            log.warning(
                "tardigrade: peer_replicas=%d, but this job's %d rank(s) run on %d node(s) (%s; "
                "a rank's node is $%s or its host name), and a rank never replicates to its "
                "own node: %s. Run on more nodes, or set %s per node",
                replicas,
                len(nodes),
                len(order),
                shown,
                NODE_VARIABLE,
                f"{usable} replica(s) per rank"
                if usable
                else "no replicas are kept (restores still read those left on this node)",
                NODE_VARIABLE,
            )
        return cls(tuple(nodes), usable)

    @property
    def order(self) -> list[str]:
        return list(dict.fromkeys(self.nodes))

    def members(self, node: str) -> list[int]:
        return [r for r, n in enumerate(self.nodes) if n == node]

    def targets(self, rank: int) -> list[int]:
        """The ranks that keep ``rank``'s replicas, nearest node first."""
        order = self.order
        at = order.index(self.nodes[rank])
        local = self.members(self.nodes[rank]).index(rank)
        out = []
        for j in range(1, self.replicas + 1):
            members = self.members(order[(at + j) % len(order)])
            out.append(members[local % len(members)])
        return out

    def sources(self, rank: int, j: int) -> list[int]:
        """The ranks whose ``j``-th replica ``rank`` keeps."""
        return [r for r in range(len(self.nodes)) if self.targets(r)[j] == rank]


def share_bytes(state: Any, world: int) -> int:
    """About how many bytes of ``state`` this rank writes in a collective save: its shards,
    and its part of the replicated tensors (the plan spreads them over the ranks)."""
    flat = flatten(state)
    total = 0
    for e in [*flat.entries, *flat.own_entries()]:
        total += e.tensor.nbytes if e.box is not None else e.tensor.nbytes // world
    return total


def check_room(ranks: Ranks, base: str, need: int, placement: Placement) -> None:
    """Raise StorageError (ENOSPC) on every rank unless each node's memory filesystem can hold
    its ranks' own shares and the replicas they keep (``need``: this rank's, in bytes)."""
    from ._ramtier import HEADROOM_BYTES

    here = {"need": need, "free": free_bytes(base), "base": base}
    seen = [json.loads(b) for b in ranks.all_gather("peer tier: room", lambda: _json(here))]
    for node in placement.order:
        members = placement.members(node)
        want = sum(seen[r]["need"] for r in members) + HEADROOM_BYTES
        free = min(seen[r]["free"] for r in members)
        if free < want:
            raise StorageError(
                errno.ENOSPC,
                f"the RAM and peer tiers need {want / 1e6:.1f} MB on node {node!r} (its "
                f"{len(members)} rank(s)' own shares and the {placement.replicas} replica(s) "
                f"each keeps for a rank on another node, +{HEADROOM_BYTES >> 20} MiB left "
                f"free), but {seen[members[0]]['base']} there has {free / 1e6:.1f} MB free. "
                "Free or enlarge it (`df -h /dev/shm`; `mount -o remount,size=... /dev/shm`), "
                "pass ram_tier= a larger tmpfs, or a smaller peer_replicas",
            )


def _json(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


# -- a share on the wire ----------------------------------------------------------------------


@dataclass
class Share:
    """One rank's share of checkpoint ``name``, as received: its manifest and the data files
    it holds (views of the payload they came in). A rank's share is what its RAM tier holds
    of the checkpoint: the data files it wrote, and the shared objects of the chunks it
    wrote (or referenced), whichever rank's chunk first wrote them."""

    share: int
    name: str
    save_id: str
    manifest: bytes
    files: dict[str, memoryview] = field(default_factory=dict)
    kept: list[str] = field(default_factory=list)
    """Shared objects of the share not sent: the receiver said it holds them already."""


class Payload:
    """The shares of one checkpoint, ready to send (what :func:`pack` returns): ``nbytes``
    long, read piece by piece by :meth:`read_into` as ``Ranks.exchange`` sends it (the sender
    holds no copy of the whole). Every data file is opened when packed, so a file the RAM tier
    replaces or retires meanwhile is still read as it was. A context manager: closing it
    closes the files."""

    def __init__(self, parts: list[tuple[int, bytes | Reader]]) -> None:
        self._parts = parts  # (offset, what): in order, end to end
        self.nbytes = sum(len(p) if isinstance(p, bytes) else p.size for _, p in parts)
        self.error: Exception | None = None  # a file that could not be read while sent

    def read_into(self, start: int, into: memoryview) -> None:
        """Fill ``into`` with the payload's bytes from ``start``. A file that fails to read
        is sent as zeros (the pair's exchange must go on): the receiver's check of every
        byte rejects it, and ``error`` says why."""
        try:
            self._read_into(start, into)
        except Exception as e:
            into[:] = bytes(len(into))
            self.error = self.error or e

    def _read_into(self, start: int, into: memoryview) -> None:
        end = start + len(into)
        for at, part in self._parts:
            size = len(part) if isinstance(part, bytes) else part.size
            lo, hi = max(start, at), min(end, at + size)
            if lo >= hi:
                continue
            dest = into[lo - start : hi - start]
            if isinstance(part, bytes):
                dest[:] = part[lo - at : hi - at]
            else:
                part.readinto(lo - at, dest)

    def close(self) -> None:
        for _, part in self._parts:
            if not isinstance(part, bytes):
                part.close()

    def __enter__(self) -> Payload:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


EMPTY = Payload([])  # sent in place of shares that could not be read (the peer's log says why)


def pack(
    shares: Sequence[tuple[int, Storage, Collection[int] | None]],
    name: str,
    skip: Collection[str] = (),
) -> Payload:
    """The shares of checkpoint ``name`` kept in each storage (``(share, storage, only)``: a
    RAM tier's, or a replica's) as one payload: a JSON head, then each share's manifest and
    the data files it holds (those of index ``only`` in its manifest, when given), each file
    opened now and read as it is sent. A shared object named in ``skip`` (the receiver holds
    it already) is not sent: the head lists it as the share's, ``kept``."""
    head: list[dict[str, Any]] = []
    blobs: list[tuple[bytes, list[Reader]]] = []
    readers: list[Reader] = []
    try:
        for k, storage, only in shares:
            raw = storage.read_bytes(f"{name}/{MANIFEST}", limits.MAX_MANIFEST_BYTES)
            m = parse(raw, storage.url(f"{name}/{MANIFEST}"))
            save_id = loads_strict(raw, storage.url(name)).get("save_id")
            files: list[tuple[str, int]] = []
            kept: list[str] = []
            opened: list[Reader] = []
            for i, f in enumerate(m.files):
                if only is not None and i not in only:
                    continue
                st = storage.stat(data_path(name, f))
                if st is None or st.is_dir:
                    continue
                if f in skip:
                    kept.append(f)
                    continue
                reader = storage.open_reader(data_path(name, f))
                readers.append(reader)
                opened.append(reader)
                files.append((f, reader.size))
            head.append({"share": k, "name": name, "save_id": str(save_id),
                         "manifest": len(raw), "files": files, "kept": kept})  # fmt: skip
            blobs.append((raw, opened))
    except BaseException:
        for reader in readers:
            reader.close()
        raise
    body = _json(head)
    parts: list[bytes | Reader] = [len(body).to_bytes(8, "little"), body]
    for raw, opened in blobs:
        parts += [raw, *opened]
    at, placed = 0, []
    for part in parts:
        placed.append((at, part))
        at += len(part) if isinstance(part, bytes) else part.size
    return Payload(placed)


def unpack(data: memoryview, sender: int) -> list[Share]:
    """The shares of a payload ``pack`` made (rank ``sender``'s), as views of it;
    CorruptCheckpointError for one that does not add up (a torn or foreign payload)."""
    what = f"the shares rank {sender} sent"
    at = 0

    def span(size: Any) -> memoryview:
        nonlocal at
        if type(size) is not int or not 0 <= size <= len(data) - at:
            raise ValueError(f"a part of {size!r} bytes at byte {at} of {len(data)}")
        at += size
        return data[at - size : at]

    try:
        head = loads_strict(bytes(span(int.from_bytes(span(8), "little"))), what)
        out = []
        for h in head:
            manifest = bytes(span(h["manifest"]))
            share = Share(int(h["share"]), str(h["name"]), str(h["save_id"]), manifest)
            for f, size in h["files"]:
                share.files[str(f)] = span(size)
            share.kept = [str(f) for f in h.get("kept", [])]
            out.append(share)
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"{what}: malformed ({e})") from e
    if at != len(data):
        raise CorruptCheckpointError(f"{what}: {len(data)} bytes, {at} expected")
    return out


# -- replication --------------------------------------------------------------------------


class Replicator:
    """This rank's side of the peer tier: sends its share of each checkpoint to the ranks of
    ``placement.targets``, and keeps what its sources send, in a thread over ``ranks`` (a
    fork: its exchanges never meet training's collectives). Every rank submits the same
    checkpoints in the same order (``committed`` is called on every rank alike)."""

    def __init__(self, own: RamTier, ranks: Ranks, placement: Placement, run: str | None) -> None:
        self.own = own
        self.ranks = ranks
        self.placement = placement
        self.run = run
        self.directory = own.job_directory
        self.kept: dict[int, RamTier] = {}  # source rank -> its replica here
        self._queue: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._go = Gate()  # the transfer waits on it between pieces
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0
        self.sent: list[str] = []  # the checkpoints whose share every target received
        self._thread = threading.Thread(target=self._run, name="tardigrade-peers", daemon=True)
        self._thread.start()

    def submit(self, name: str) -> None:
        with self._lock:
            self._pending += 1
        self._queue.put(name)

    def held(self) -> contextlib.AbstractContextManager[None]:
        """Pause the transfer between pieces while training waits on a save."""
        return self._go.held()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every submitted replication ended; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._pending, timeout)

    def close(self, timeout: float | None = None) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            name = self._queue.get()
            if name is None:
                return
            try:
                self._replicate(name)
            except Exception as e:
                self.own._failed(f"the replicas of {name}", e)
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _replicate(self, name: str) -> None:
        self.own.wait()  # a synchronous save's copy is made in the background
        self._go.wait()  # not while training waits on a save
        me = self.ranks.rank
        targets = self.placement.targets(me)
        if targets:
            self.sent = self.sent[-7:]  # the latest ones only are asked about
        whole = True
        for j, target in enumerate(targets):
            sources = self.placement.sources(me, j)
            held = self._held_by(target, sources, name)
            try:
                payload = pack([(me, self.own.storage, None)], name, skip=held)
            except Exception as e:  # the peers still take part: they get an empty payload
                self.own._failed(f"the replica of {name} for the peers", e)
                payload = EMPTY
            with payload:
                got = self.ranks.exchange(
                    f"peer tier: replicating {name}", {target: payload}, sources, go=self._go.wait
                )
            if payload.error is not None:
                self.own._failed(f"the replica of {name} for the peers", payload.error)
            whole = whole and bool(payload.nbytes) and payload.error is None
            self.own.count_sent(payload.nbytes)
            for source, data in sorted(got.items()):
                if data:
                    self._keep(source, data)
                else:
                    log.warning(
                        "tardigrade: rank %d sent no replica of %s (its log says why); the "
                        "peer tier keeps its previous one",
                        source,
                        name,
                    )
        if targets and whole:
            self.sent.append(name)

    def _held_by(self, target: int, sources: list[int], name: str) -> set[str]:
        """The shared objects ``target`` holds already in its replica of this rank's share
        (not sent again); this rank tells each of ``sources`` the same of theirs."""
        mine = {}
        for s in sources:
            kept = self.kept.get(s)
            objects: list[str] = []
            if kept is not None:
                try:
                    objects = kept.catalog.shared_objects()
                except OSError as e:  # then it receives them all again
                    log.warning("tardigrade: listing %s: %s", kept.storage.url(SHARED_DIR), e)
            mine[s] = Payload([(0, _json(objects))])
        got = self.ranks.exchange(
            f"peer tier: objects held for {name}", mine, [target], go=self._go.wait
        )
        try:
            return {str(f) for f in loads_strict(bytes(got[target]), f"rank {target}'s list")}
        except (CorruptCheckpointError, TypeError):
            return set()  # sent whole: the replica is complete either way

    def _keep(self, source: int, data: memoryview) -> None:
        try:
            (share,) = unpack(data, source)
            tier = self.kept.get(source)
            if tier is None:
                tier = RamTier(self.directory, self.own.base, run=self.run, replica_of=source)
                self.kept[source] = tier
            keep_share(tier, share, self._go.wait)
            self.own.count_replica(f"{share.name} of rank {source}")
        except Exception as e:
            self.own._failed(f"the replica of rank {source}'s share", e)

    def remove(self) -> None:
        """Remove the replicas kept here (the job ended normally)."""
        for tier in self.kept.values():
            tier.close(clean=True)


def keep_share(tier: RamTier, share: Share, go: Callable[[], object] = lambda: None) -> None:
    """Commit ``share`` (received from a peer) in ``tier``: every byte verified against its
    manifest, then written into a staging directory (its shared objects published under the
    tier's ``.shared/``, beside those of the previous replica the peer did not send again),
    then renamed into place (the newest only). ``go()`` is called before each file and the
    check (a pause while training waits)."""
    where = tier.storage.url(share.name)
    m = parse(share.manifest, f"{where}/{MANIFEST}")
    for f in [*share.files, *share.kept]:
        if f not in m.files or (f in share.kept and not is_shared(f)):
            raise CorruptCheckpointError(f"{where}: {f} is not a data file of its manifest")
    for f in share.kept:
        st = tier.storage.stat(data_path(share.name, f))
        if st is None or st.size != m.files[f]:
            raise CorruptCheckpointError(
                f"{where}: the peer did not send {f} (this rank said it held it), and it is "
                f"{'missing' if st is None else f'{st.size} bytes, not {m.files[f]}'} here"
            )
    go()
    order = list(m.files)
    received: dict[int, bytes | memoryview] = {order.index(f): d for f, d in share.files.items()}
    view = _SharesView(share.name, share.manifest, order, {}, received)
    verify_files(view, share.name, m, list(share.files))  # before a byte is written
    need = len(share.manifest) + sum(v.nbytes for v in share.files.values())
    tier._make_room(need, keep=share.name)
    commit = tier.catalog.commit
    staging = commit.begin(share.name, share.save_id)
    try:
        objects = []
        for f, data in share.files.items():
            go()
            at = f"{staging}/{f}"
            if is_shared(f):
                at = commit.shared_target(staging, data_path(share.name, f), f.rpartition("/")[2])
                objects.append((at, data_path(share.name, f)))
            writer = tier.storage.open_writer(at)
            try:
                writer.write(data)
            except BaseException:
                writer.abort()
                raise
            writer.close()
        for at, there in objects:
            commit.publish_shared(at, there)
        tier._commit(staging, share.name, share.manifest, share.save_id)
    except BaseException:
        with contextlib.suppress(OSError):
            commit.abort(staging, share.name, share.save_id)
        raise


# -- restoring from memory ---------------------------------------------------------------


_KIND = re.compile(r" \((rank|replica of rank) (\d+)\)$")


def local_copies(base: str, directory: str, run: str | None, *, replicas: bool) -> list[Any]:
    """The RAM tier namespaces of ``directory`` in run ``run`` on this node (under ``base``):
    ``(share, storage)`` for every rank's own, and for every replica when ``replicas``."""
    stem = f"tardigrade-{os.geteuid()}-"
    out = []
    try:
        entries = [e for e in LocalStorage(base).list() if e.startswith(stem)]
    except OSError:
        return []
    suffix = "" if run is None else f" (run {run})"
    for entry in entries:
        source = RamTier._source(os.path.join(base, entry))
        if source is None or not source.endswith(suffix) or not source.startswith(directory):
            continue
        family = source[: len(source) - len(suffix)] if suffix else source
        m = _KIND.search(family)
        if m is None or family[: m.start()] != directory:
            continue
        if m.group(1) != "rank" and not replicas:
            continue
        k = int(m.group(2))
        if family != family_of(directory, rank=k) and family != family_of(directory, None, k):
            continue
        if source != source_of(family, run):
            continue
        out.append((k, LocalStorage(os.path.join(base, entry))))
    return out


class MemoryShares:
    """Restores of a collective checkpoint from the memory of the job's nodes (see the module
    docstring): ``holds`` (collective) agrees whether every share is held in memory under the
    root's save id, ``restore`` gathers and loads it."""

    def __init__(
        self,
        own: RamTier,
        ranks: Ranks,
        root: Storage,
        run: str | None,
        *,
        replicas: bool,
        where: str,
    ) -> None:
        self.own = own
        self.ranks = ranks
        self.root = root
        self.run = run
        self.replicas = replicas
        self.where = where
        self._plan: dict[str, Any] | None = None
        self._copies: dict[int, Storage] = {}
        self._present: dict[int, frozenset[int]] = {}  # per copy: the data files it holds
        self.kept: dict[int, RamTier] | None = None  # the replicas this rank keeps (peer tier)

    def _scan(self, name: str | None) -> dict[str, dict[int, _Copy]]:
        """What this node's memory holds: checkpoint name -> share -> its copy here; of
        checkpoint ``name`` only, or of every one (None)."""
        self.own.wait()
        found: dict[str, dict[int, _Copy]] = {}
        for k, storage in local_copies(
            self.own.base, self.own.job_directory, self.run, replicas=self.replicas
        ):
            try:
                names = [name] if name is not None else storage.list()
            except OSError:
                continue
            for n in names:
                if STEP_NAMES.step(n) is None:
                    continue
                try:
                    if k in found.get(n, {}) or not storage.exists(f"{n}/{MANIFEST}"):
                        continue
                    found.setdefault(n, {})[k] = _Copy.at(storage, n)
                except Exception as e:  # an unreadable copy is not held
                    log.warning("tardigrade: not restoring from %s: %s", storage.url(n), e)
        return found

    def steps(self) -> dict[int, Any]:
        """The steps whose every data file this job's nodes hold in memory, under one save
        id (a step with two whole saves is none: which is current cannot be told), with their
        epochs. Collective: the same answer on every rank."""
        found = self._scan(None)

        def mine() -> bytes:
            held = {
                n: {str(k): c.report() for k, c in shares.items() if c.alone}
                for n, shares in found.items()
            }
            return _json(held)

        seen = [json.loads(b) for b in self.ranks.all_gather(f"{self.where}: steps", mine)]
        out: dict[int, Any] = {}
        for n in sorted({n for held in seen for n in held}):
            step = STEP_NAMES.step(n)
            reports = [h.get(n, {}) for h in seen]
            sids = {v[0] for h in reports for v in h.values()}
            whole = [sid for sid in sorted(sids) if _holders(_shares(reports, sid)) is not None]
            if step is not None and len(whole) == 1:
                out[step] = next(v[4] for h in reports for v in h.values() if v[0] == whole[0])
        return out

    def holds(self, name: str) -> bool:
        self._plan = None
        copies = self._scan(name).get(name, {})

        def mine() -> bytes:
            expect = None
            if self.ranks.coordinator:
                with contextlib.suppress(Exception):  # unreadable: nothing restores from memory
                    if committed(self.root, name):
                        expect = save_id_at(self.root, name)
            held = {str(k): c.report() for k, c in copies.items()}
            return _json({"node": node_name(), "expect": expect, "held": held})

        seen = [json.loads(b) for b in self.ranks.all_gather(f"{self.where}: {name}", mine)]
        reports = [s["held"] for s in seen]
        expect = seen[0]["expect"]
        if expect is None:
            # Not in the root (a step saved to memory alone): the one save whose every data
            # file memory holds, if there is exactly one.
            sids = {v[0] for h in reports for v in h.values()}
            whole = [sid for sid in sorted(sids) if _holders(_shares(reports, sid)) is not None]
            if len(whole) != 1:
                return False
            expect = whole[0]
        held = _shares(reports, expect)
        found = _holders(held)
        if found is None:
            if self.ranks.coordinator:
                missing, total = _missing(held)
                lost = _lost_shares(held)
                log.info(
                    "tardigrade: %s is not whole in %s: no node holds %d of its %d data "
                    "file(s) in memory%s; reading it from the next tier",
                    name,
                    self.where,
                    missing,
                    total,
                    f" (the share of rank(s) {lost} is held nowhere)" if lost else "",
                )
            return False
        world, holder = found
        mine_now = {k: c for k, c in copies.items() if c.save_id == expect}
        self._copies = {k: c.storage for k, c in mine_now.items()}
        self._present = {k: c.present for k, c in mine_now.items()}
        self._plan = {
            "name": name,
            "world": world,
            "holder": holder,
            "held": [set(h) for h in held],
            "near": [set().union(*(p for _, p, _ in h.values())) for h in held],
            "seen": seen,
            "save_id": expect,
        }
        return True

    def forget_after(self, step: int) -> None:
        """Remove this rank's copies of steps after ``step`` (a restore went back to it:
        they belong to a timeline this run abandoned)."""
        tiers = [self.own] + (list(self.kept.values()) if self.kept is not None else [])
        for tier in tiers:
            tier.forget_after(step)

    def restore(self, name: str, state: Any, collective: dict[str, Any]) -> str:
        """Restore ``name``: every rank learns the manifest and which data files it reads
        (planned against its live state), receives those its node does not hold from the
        ranks that send their shares, point to point, and verifies every chunk it reads, as
        a restore from the directory does (a damaged copy fails the restore from memory,
        whichever rank reads it); nothing is read from a slower tier."""
        plan = self._plan
        assert plan is not None and plan["name"] == name
        me, where = self.ranks.rank, f"{self.where}: {name}"
        raw = self.ranks.broadcast(
            f"{where}: manifest",
            lambda: self._copies[0].read_bytes(f"{name}/{MANIFEST}", limits.MAX_MANIFEST_BYTES),
            src=plan["holder"][0],
        )
        m = parse(raw, where)
        order = list(m.files)

        def wanted() -> bytes:
            files = files_to_read(self.own.storage, name, m, into=state, rank=me)
            return _json(sorted(order.index(f) for f in files))

        reads = [json.loads(b) for b in self.ranks.all_gather(f"{where}: files read", wanted)]

        def view() -> Storage:
            received = self._gather(plan, order, reads)
            return _SharesView(name, raw, order, self._copies, received)

        load_from(view, name, into=state, verify=True, **collective)
        self._log(plan)
        self.own.restored()
        local = all(self._sender(plan, i, me) is None for i in reads[me])
        if local and me in self._copies:
            return self._copies[me].url(name)  # every byte read from this node's memory
        return f"{self.where}: {name} (rank {me} of {self.ranks.size})"

    @staticmethod
    def _sender(plan: dict[str, Any], i: int, r: int) -> int | None:
        """The rank that sends data file ``i`` to rank ``r`` (None: ``r``'s node holds it)."""
        return None if i in plan["near"][r] else int(plan["holder"][i])

    def _gather(
        self, plan: dict[str, Any], order: list[str], reads: list[list[int]]
    ) -> dict[int, bytes | memoryview]:
        """Send the files other ranks read from the shares this rank sends; receive those
        this rank reads and its node does not hold (point to point, one payload per pair).
        Returns the received files by their index in the manifest."""
        me, name = self.ranks.rank, plan["name"]
        out: dict[int, dict[int, list[int]]] = {}  # rank -> share -> file indexes
        need_from: set[int] = set()
        for r, files in enumerate(reads):
            for i in files:
                sender = self._sender(plan, i, r)
                if sender == me:  # from this rank's own copy first, else another here
                    k = next(k for k in sorted(self._present, key=lambda k: (k != me, k))
                             if i in self._present[k])  # fmt: skip
                    out.setdefault(r, {}).setdefault(k, []).append(i)
                if r == me and sender is not None:
                    need_from.add(sender)
        payloads: dict[int, Payload] = {}
        for r, shares in out.items():
            try:
                payloads[r] = pack([(k, self._copies[k], set(v)) for k, v in shares.items()], name)
            except Exception as e:
                log.warning("tardigrade: cannot send %s's files to rank %d: %s", name, r, e)
                payloads[r] = EMPTY
        try:
            got = self.ranks.exchange(f"{self.where}: {name}", payloads, sorted(need_from))
        finally:
            for r, payload in payloads.items():
                payload.close()
                if payload.error is not None:
                    log.warning(
                        "tardigrade: sending %s's files to rank %d: %s", name, r, payload.error
                    )
        received: dict[int, bytes | memoryview] = {}
        for r, data in got.items():
            if not data:
                raise CorruptCheckpointError(
                    f"{name}: rank {r} could not send the files it holds in memory (its log "
                    "says why)"
                )
            for share in unpack(data, r):
                if share.save_id != plan_save_id(plan):
                    raise CorruptCheckpointError(
                        f"{name}: rank {r} sent share {share.share} of save {share.save_id!r}, "
                        f"not {plan_save_id(plan)!r}"
                    )
                theirs = list(parse(share.manifest, f"{name} (rank {r})").files)
                for f, data_f in share.files.items():
                    if f not in theirs:
                        raise CorruptCheckpointError(
                            f"{name}: rank {r} sent {f!r}, not a data file of its manifest"
                        )
                    received[theirs.index(f)] = data_f
        return received

    def _log(self, plan: dict[str, Any]) -> None:
        if not self.ranks.coordinator:
            return
        seen, held = plan["seen"], plan["held"]
        parts = []
        for k in range(plan["world"]):
            ranks = [r for r, h in enumerate(held) if k in h]
            if not ranks:
                continue  # every file it held is held in other shares
            h = k if k in ranks else ranks[0]
            own = k < len(seen) and seen[k]["node"] == seen[h]["node"]
            kind = "own RAM" if own else "a replica"
            parts.append(f"rank {k}'s share from {kind} on node {seen[h]['node']!r} (rank {h})")
        log.info("tardigrade: %s restored from %s: %s", plan["name"], self.where, "; ".join(parts))


@dataclass(frozen=True)
class _Copy:
    """One share of a checkpoint as this node's memory holds it: where, of which save (and
    world size, epoch), whether saved to memory alone, and which of the manifest's data files
    (by index) are there: a rank's share is the files its RAM tier holds."""

    storage: Storage
    save_id: str
    world: int
    epoch: Any
    alone: bool
    present: frozenset[int]
    files: int  # how many data files the manifest names

    @classmethod
    def at(cls, storage: Storage, name: str) -> _Copy:
        where = storage.url(f"{name}/{MANIFEST}")
        raw = storage.read_bytes(f"{name}/{MANIFEST}", limits.MAX_MANIFEST_BYTES)
        m = parse(raw, where)
        sid = str(loads_strict(raw, where).get("save_id"))
        present = frozenset(i for i, f in enumerate(m.files) if storage.exists(data_path(name, f)))
        return cls(storage, sid, m.world_size, m.epoch, saved_alone(m), present, len(m.files))

    def report(self) -> list[Any]:
        """What a rank tells the others of it (``_shares`` reads it)."""
        return [self.save_id, self.world, sorted(self.present), self.files, self.epoch]


def plan_save_id(plan: dict[str, Any]) -> str:
    return str(plan["save_id"])


def _shares(reports: list[dict[str, list[Any]]], sid: str) -> list[dict[int, Any]]:
    """Per rank, the shares it holds of save ``sid`` (``_Copy.report``s): share -> (world
    size, the data files held, how many the manifest names)."""
    return [
        {int(k): (v[1], frozenset(v[2]), v[3]) for k, v in h.items() if v[0] == sid}
        for h in reports
    ]


def _holders(held: list[dict[int, Any]]) -> tuple[int, dict[int, int]] | None:
    """The save's world size and, for each of its data files (by index), the rank that sends
    it: one whose own share holds it, else the lowest that holds it; None unless every file
    is held somewhere (and the copies agree on the manifest)."""
    worlds = {(w, n) for h in held for w, _, n in h.values()}
    if len(worlds) != 1:
        return None
    world, n = worlds.pop()
    near = [set().union(*(p for _, p, _ in h.values())) for h in held]
    holder = {}
    for i in range(n):
        own = [r for r, h in enumerate(held) if r in h and i in h[r][1]]
        ranks = own or [r for r, p in enumerate(near) if i in p]
        if not ranks:
            return None
        holder[i] = ranks[0]
    return world, holder


def _missing(held: list[dict[int, Any]]) -> tuple[int, int]:
    """How many data files of the save no rank holds, of how many."""
    total = max((n for h in held for _, _, n in h.values()), default=0)
    near = set().union(*(p for h in held for _, p, _ in h.values()))
    return total - len(near), total


def _lost_shares(held: list[dict[int, Any]]) -> list[int]:
    world = max((w for h in held for w, _, _ in h.values()), default=0)
    return [k for k in range(world) if not any(k in h for h in held)]


class _SharesView(Storage):
    """A read-only view of checkpoint ``name`` (``manifest``; ``order``: its data files):
    each data file from a copy on this node that holds it, else from the files received
    (by index). A file held by neither is not read here: its size is the manifest's, and
    opening it fails. Every copy's manifest names the same files in the same order; only
    their names may differ, by where each was copied from (a shared object's never does)."""

    def __init__(
        self,
        name: str,
        manifest: bytes,
        order: list[str],
        copies: dict[int, Storage],
        received: dict[int, bytes | memoryview],
    ) -> None:
        self.name = name
        self.root = f"memory of the job's nodes ({name})"
        self.manifest = manifest
        self.sizes = parse(manifest, self.root).files
        self.paths = {data_path(name, f): n for f, n in self.sizes.items()}
        self._files: dict[str, tuple[Storage, str] | bytes | memoryview] = {}
        for storage in copies.values():
            raw = storage.read_bytes(f"{name}/{MANIFEST}", limits.MAX_MANIFEST_BYTES)
            for f, there in zip(order, parse(raw, storage.url(name)).files, strict=True):
                key, at = data_path(name, f), data_path(name, there)
                if key not in self._files and storage.exists(at):
                    self._files[key] = (storage, at)
        for i, data in received.items():
            self._files.setdefault(data_path(name, order[i]), data)

    def open_reader(self, name: str) -> Reader:
        if name == f"{self.name}/{MANIFEST}":
            return MemoryReader(self.url(name), self.manifest)
        found = self._files.get(name)
        if found is None:
            raise StorageError(errno.ENOENT, f"{self.url(name)}: not held in memory here")
        if not isinstance(found, tuple):
            return MemoryReader(self.url(name), found)  # type: ignore[arg-type]  # a view will do
        storage, there = found
        return storage.open_reader(there)

    def stat(self, name: str) -> Stat | None:
        if name == f"{self.name}/{MANIFEST}":
            return Stat(len(self.manifest), "0")
        if name == self.name:
            return Stat(0, "0", is_dir=True)
        found = self._files.get(name)
        if found is None:
            size = self.paths.get(name)
            return None if size is None else Stat(size, "0")  # held elsewhere, not read here
        if not isinstance(found, tuple):
            return Stat(len(found), "0")
        return found[0].stat(found[1])

    def list(self, name: str = "") -> list[str]:
        if name == self.name:
            return sorted([MANIFEST, *(f for f in self.sizes if not is_shared(f))])
        return [self.name] if name == "" else []

    def _read_only(self, *args: Any, **kwargs: Any) -> Any:
        raise StorageError(errno.EROFS, f"{self.root}: a read-only view")

    open_writer = put = delete = lease = _read_only
