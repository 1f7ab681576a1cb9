"""The manager's tiers: each place it keeps checkpoints is one :class:`Tier`, fastest first.

A tier says what it holds, whether ``restore()`` can read a checkpoint from it, what it does
once a checkpoint committed in the run's root (copy it, upload it), which checkpoints the root
must keep for it meanwhile, and how it closes. The manager holds an ordered :class:`Tiers`
and asks it, never one tier by kind:

* :class:`MemoryTier` (``ram_tier=``): this rank's copy of the newest checkpoint in host
  memory, written from an async save's staged copy (a :class:`~tardigrade._sinks.Sink`).
* :class:`PeerTier` (``peer_replicas=``): each rank's share of the newest checkpoint also in
  the memory of ranks on other nodes, sent over torch.distributed (``_peers``).
* :class:`RootTier`: the run's directory or store prefix, where every save commits first.
* :class:`RemoteTier` (``upload_to=``): a copy of each committed checkpoint in another root,
  uploaded in the background; ``restore()`` first downloads its newest when it is newer.

A tier receives what it needs (the agreement between ranks, the lease, the catalog, a
retention callback) when it is made, and never reaches back into the manager.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any, ClassVar, TypeVar

from .._catalog import STEP_NAMES, Catalog, step_name
from .._load import load
from .._peers import MemoryShares, Placement, Replicator, check_room, node_name, share_bytes
from .._ramtier import RamTier, RamTierStats, open_ram_tier, saved_alone
from .._sinks import Sink
from .._tiers import Uploader, UploadStats, warn_of_another_run
from ..errors import InvalidArgumentError, TardigradeError
from ..storage import Storage, open_root
from ..storage.lease import Lease
from ._agreement import Agreement
from ._options import check_count, check_positive

log = logging.getLogger("tardigrade")

_T = TypeVar("_T", bound="Tier")


class Tier:
    """One place the manager keeps checkpoints (see the module docstring). Every hook has a
    default that does nothing, so a tier states only what it does."""

    speed: ClassVar[int] = 0
    """Where the tier sorts among the others: lower is faster (restored from first)."""
    where: ClassVar[str] = ""
    """How logs name it (``"the RAM tier"``)."""
    restores: ClassVar[bool] = False
    """Whether ``restore()`` reads checkpoints from it (``holds`` and ``restore``)."""

    def sinks(self, *, alone: bool = False) -> list[Sink]:
        """What an async save feeds from its staged copy to keep a copy here (``alone``: a
        save committed straight into the faster tiers, what it runs once committed)."""
        return []

    def held(self) -> AbstractContextManager[None]:
        """Pause this tier's background work while the training thread waits on a save."""
        return nullcontext()

    def takes(self, name: str) -> bool:
        """Whether this tier keeps checkpoint ``name`` (its own cadence; every one here)."""
        return True

    def target(self, name: str) -> str | None:
        """Where a save of ``name`` writes when this tier is the slowest that takes it (None:
        this tier copies from another, never a save's target)."""
        return None

    def committed(self, name: str, *, teed: bool) -> None:
        """Checkpoint ``name``, which this tier ``takes``, committed in the run's root
        (``teed``: an async save, whose sinks copied it already); on every rank."""

    def pinned(self) -> set[str]:
        """Checkpoints the root must not retire yet (this tier still copies them)."""
        return set()

    def fetch_newer(self, above: int | None = None) -> None:
        """Before ``restore()`` picks a checkpoint: bring a newer one into the root (newer
        than ``above`` too: the newest step the faster tiers hold alone)."""

    def steps(self) -> dict[int, Any]:
        """The steps whose checkpoints this tier holds whole, with their epochs, the same on
        every rank (a collective): ``restore()`` takes those the root does not hold (saved
        to faster tiers alone) as candidates too."""
        return {}

    def holds(self, name: str) -> bool:
        """Whether this rank holds its share of the root's very save ``name`` here."""
        return False

    def forget_after(self, step: int) -> None:
        """``restore()`` went back to ``step``: drop what this tier holds of later steps (a
        timeline the run abandoned)."""

    def settle(self, name: str) -> bool | None:
        """After a preemption's save of ``name``: wait for this tier's copy of it; whether
        this tier holds it (None: not this tier's to say)."""
        return None

    def restore(self, name: str, state: Any) -> str:
        """Read ``name`` into ``state``, every byte verified; return where it was read."""
        raise NotImplementedError

    def close(self, *, clean: bool) -> None:
        """Wait for this tier's work and let go (``clean``: the job ended normally)."""


class RootTier(Tier):
    """The run's directory or store prefix: the saves of the steps it takes (``every``: the
    multiples of it; None: all) commit here, and the slower tiers copy from it."""

    speed = 50
    where = "the directory"
    restores = True

    def __init__(
        self, catalog: Catalog, collective: Mapping[str, Any], every: int | None = None
    ) -> None:
        self.catalog = catalog
        self.collective = dict(collective)
        self.every = check_positive("persist_every", every)

    def takes(self, name: str) -> bool:
        step = STEP_NAMES.step(name)
        return self.every is None or step is None or step % self.every == 0

    def target(self, name: str) -> str | None:
        return self.catalog.path(name)

    def holds(self, name: str) -> bool:
        return True  # restore() picks among the committed checkpoints of the root

    def restore(self, name: str, state: Any) -> str:
        load(self.catalog.path(name), into=state, verify="all", **self.collective)
        return self.catalog.path(name)


class MemoryTier(Tier):
    """The newest checkpoint in host memory (``ram_tier=``; see ``_ramtier.RamTier``). In a
    distributed job a restore reads every rank's share from the RAM tiers of the job's nodes
    (``_peers.MemoryShares``): each rank's own, and the others' of its node or sent by them."""

    speed = 10
    where = "the RAM tier"
    restores = True

    def __init__(
        self, ram: RamTier, root: Catalog, ranks: Agreement, run: str | None = None
    ) -> None:
        self.ram = ram
        self.root = root.storage
        self.ranks = ranks
        self.run = run
        self.shares = None
        if ranks.ranks is not None:
            self.shares = MemoryShares(
                ram, ranks.ranks, self.root, run, replicas=False, where=self.where
            )

    @property
    def stats(self) -> RamTierStats:
        return self.ram.stats

    def sinks(self, *, alone: bool = False) -> list[Sink]:
        return [self.ram.retirer() if alone else self.ram.mirror(self.ranks.share)]

    def committed(self, name: str, *, teed: bool) -> None:
        # Every rank records the save here, once committed: each keeps its own files.
        self.ram.saved(self.root, name, files=self.ranks.share, teed=teed)

    def target(self, name: str) -> str | None:
        return self.ram.storage.url(name)

    def steps(self) -> dict[int, Any]:
        if self.shares is not None:
            return self.shares.steps()
        found = {}
        for name in self.ram.catalog.names():
            step = STEP_NAMES.step(name)
            if step is not None:
                with contextlib.suppress(Exception):  # an unreadable copy is no candidate
                    m = self.ram.catalog.manifest(name)
                    if saved_alone(m):
                        found[step] = m.epoch
        return found

    def forget_after(self, step: int) -> None:
        self.ram.forget_after(step)

    def settle(self, name: str) -> bool | None:
        self.ram.wait()
        return self.ram.catalog.committed(name)

    def holds(self, name: str) -> bool:
        if self.shares is not None:
            return self.shares.holds(name)
        return self.ram.copy_of(name, self.root) is not None

    def restore(self, name: str, state: Any) -> str:
        if self.shares is not None:
            return self.shares.restore(name, state, self.ranks.collective)
        return self.ram.restore(name, self.root, state, self.ranks.collective)

    def close(self, *, clean: bool) -> None:
        self.ram.close(clean=clean)


class PeerTier(Tier):
    """Each rank's share of the newest checkpoint also kept in the memory of ranks on other
    nodes (``peer_replicas=``; see ``_peers``): a node's loss restores from memory."""

    speed = 20
    where = "the peer tier"
    restores = True

    def __init__(self, memory: MemoryTier, replicator: Replicator, ranks: Agreement) -> None:
        self.memory = memory
        self.replicator = replicator
        self.ranks = ranks
        assert ranks.ranks is not None
        self.shares = MemoryShares(
            memory.ram, ranks.ranks, memory.root, memory.run, replicas=True, where=self.where
        )
        self.shares.kept = replicator.kept

    def held(self) -> AbstractContextManager[None]:
        return self.replicator.held()

    def takes(self, name: str) -> bool:
        return self.memory.takes(name)

    def committed(self, name: str, *, teed: bool) -> None:
        self.replicator.submit(name)

    def steps(self) -> dict[int, Any]:
        self.replicator.wait()
        return self.shares.steps()

    def holds(self, name: str) -> bool:
        self.replicator.wait()
        return self.shares.holds(name)

    def forget_after(self, step: int) -> None:
        self.shares.forget_after(step)

    def settle(self, name: str) -> bool | None:
        return self.replicator.wait() and name in self.replicator.sent

    def restore(self, name: str, state: Any) -> str:
        return self.shares.restore(name, state, self.ranks.collective)

    def close(self, *, clean: bool) -> None:
        self.replicator.close(None if clean else 0.0)
        if clean:
            self.replicator.remove()


def open_peer_tier(
    replicas: int, memory: MemoryTier | None, state: Any, ranks: Agreement
) -> PeerTier | None:
    """The peer tier of ``peer_replicas=replicas`` (None when 0) over the RAM tier ``memory``:
    the job's nodes found, the placement and the room on each node checked (the same error on
    every rank), and the replication thread started over a group of its own."""
    if not replicas:
        return None
    what = f"peer_replicas={replicas}"
    if memory is None:
        raise InvalidArgumentError(
            f"{what} keeps each rank's share in the RAM tier of ranks on other nodes: pass "
            "ram_tier=True (or a directory on a memory filesystem) with it"
        )
    group = ranks.ranks
    if group is None:
        raise InvalidArgumentError(
            f"{what} needs a distributed job (torch.distributed initialized, ranks on "
            "several nodes); a single process has no peer: pass peer_replicas=0"
        )
    nodes = group.all_gather("peer tier: nodes", lambda: node_name().encode())
    placement = Placement.of(
        [n.decode(errors="replace") for n in nodes], replicas, say=group.coordinator
    )
    check_room(group, memory.ram.base, share_bytes(state, group.size) * (1 + replicas), placement)
    forked = ranks.split.fork()
    assert forked is not None
    return PeerTier(memory, Replicator(memory.ram, forked, placement, memory.run), ranks)


class RemoteTier(Tier):
    """Each committed checkpoint uploaded to another root in the background (``upload_to=``)."""

    speed = 90
    where = "the remote tier"

    def __init__(
        self,
        uploader: Uploader,
        lease: Lease | None,
        root: Catalog,
        ranks: Agreement,
        *,
        timeout: float,
        retain: Callable[[], None],
        every: int | None = None,
    ) -> None:
        self.every = every  # its cadence: the steps that are multiples of it (None: all)
        self.uploader: Uploader | None = uploader
        self.lease: Lease | None = lease
        self.root = root
        self.ranks = ranks
        self.timeout = timeout
        self.retain = retain  # retention of the root, which spared what was still uploading
        self.final: UploadStats | None = None  # the figures once closed

    @property
    def stats(self) -> UploadStats | None:
        return self.final if self.uploader is None else self.uploader.stats

    def held(self) -> AbstractContextManager[None]:
        return nullcontext() if self.uploader is None else self.uploader.held()

    def takes(self, name: str) -> bool:
        step = STEP_NAMES.step(name)
        return self.every is None or step is None or step % self.every == 0

    def committed(self, name: str, *, teed: bool) -> None:
        if self.uploader is not None:
            self.uploader.submit(name)

    def pinned(self) -> set[str]:
        return set() if self.uploader is None else self.uploader.pinned()

    def fetch_newer(self, above: int | None = None) -> None:
        """Copy the remote's newest checkpoint into the root when it is newer than the root's
        and than ``above`` (rank 0 decides; in a distributed job every rank downloads its
        share)."""
        if self.uploader is None:
            return
        remote = Catalog(self.uploader.remote)

        def newer() -> str | None:
            try:
                theirs = remote.steps()
            except TardigradeError as e:
                log.warning("tardigrade: cannot list %s: %s", remote.root, e)
                return None
            ours = [*self.root.steps(), *([] if above is None else [above])]
            if not theirs or (ours and max(ours) >= theirs[-1]):
                return None
            return step_name(theirs[-1])

        name = self.ranks.shared(
            f"CheckpointManager({self.root.root!r}).restore(): the remote tier's newest", newer
        )
        if name is None:
            return
        try:
            self.ranks.split.copy(remote.storage, name, self.root.storage)
            if self.ranks.coordinator:
                log.info("tardigrade: downloaded %s from %s", name, remote.root)
        except Exception as e:  # the root still restores what it has
            log.warning("tardigrade: downloading %s from %s failed: %s", name, remote.root, e)

    def close(self, *, clean: bool) -> None:
        try:
            self._finish()
        finally:
            lease, self.lease = self.lease, None
            if lease is not None:
                lease.release()

    def _finish(self) -> None:
        uploader, self.uploader = self.uploader, None
        if uploader is None:
            return
        self.final = uploader.stats  # still readable after close()
        if uploader.close(self.timeout):
            self.retain()  # retention spared what was still uploading; it catches up now
            return
        log.error(
            "tardigrade: %d upload(s) to %s still pending after %.0f s (upload_timeout); "
            "abandoned: nothing half-uploaded is visible there, and the checkpoints are intact "
            "in %s",
            uploader.stats.pending,
            uploader.remote.root,
            self.timeout,
            self.root.root,
        )


def open_remote_tier(
    upload_to: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None,
    *,
    root: Catalog,
    ranks: Agreement,
    lease_seconds: float,
    keep_last: int | None,
    timeout: float,
    retain: Callable[[], None],
    every: int | None = None,
) -> RemoteTier:
    """Open ``upload_to`` and take its lease (rank 0's stands for the job): one job uploads
    into a remote root, as one job saves into a directory. Raises on every rank."""
    remote = open_root(upload_to, storage_options)
    leases: list[Lease] = []
    what = f"CheckpointManager({root.root!r}): upload_to={remote.root!r}"

    def check_and_lock() -> None:
        try:
            remote.preflight()
        except TardigradeError as e:
            log.error("tardigrade: uploads to %s will fail: %s", remote.root, e)
        leases.append(Catalog(remote).lease(lease_seconds=lease_seconds))
        leases[0].acquire()
        warn_of_another_run(root, Catalog(remote))

    try:
        ranks.on_coordinator(what, check_and_lock)
        # In a distributed job the upload threads agree over a group of their own.
        forked = ranks.split.fork()
    except BaseException:
        for lease in leases:
            lease.release()
        raise
    uploader = Uploader(
        root.storage,
        remote,
        keep_last_remote=keep_last,
        lease=leases[0] if leases else None,  # rank 0's: it retires remote checkpoints
        ranks=forked,
    )
    # Rank 0 holds the lease; the other ranks' tiers hold none.
    held = leases[0] if leases else None
    return RemoteTier(uploader, held, root, ranks, timeout=timeout, retain=retain, every=every)


def open_memory_tiers(
    ram_tier: Any,
    peers: int,
    tiers: Tiers,
    *,
    root: Catalog,
    ranks: Agreement,
    run: str | None,
    state: Any,
) -> list[Tier]:
    """The RAM tier of ``ram_tier=`` and the peer tier of ``peer_replicas=peers`` (none when
    off), each open on every rank or raising on all; ``tiers``: the manager's so far (a
    directory that takes only some steps needs a RAM tier for the others)."""
    peers = check_count("peer_replicas", peers)
    every = tiers.root.every
    if every is not None and (ram_tier is None or ram_tier is False):
        raise InvalidArgumentError(
            f"persist_every={every} saves the steps between its multiples to the RAM tier "
            "alone: pass ram_tier=True (or a directory on a memory filesystem) with it"
        )
    memory = open_memory_tier(ram_tier, root=root, ranks=ranks, run=run)
    try:
        peer = open_peer_tier(peers, memory, state, ranks)
    except BaseException:
        if memory is not None:
            memory.close(clean=False)
        raise
    return [t for t in (memory, peer) if t is not None]


def open_memory_tier(
    ram_tier: Any, *, root: Catalog, ranks: Agreement, run: str | None
) -> MemoryTier | None:
    """The RAM tier of ``ram_tier=`` (None when off), open on every rank or raising on all:
    a restore agrees over all of them. ``run``: the job's run id (``run_id=``)."""
    if ram_tier is None or ram_tier is False:
        return None  # off: nothing to agree on (no collective)
    error: BaseException | None = None
    ram = None
    try:
        ram = open_ram_tier(root.root, ram_tier, rank=ranks.rank, run=run)
    except BaseException as e:
        error = e
    what = f"CheckpointManager({root.root!r}): ram_tier={ram_tier!r}"
    try:
        everywhere = ranks.everywhere(error is None, what)
    except BaseException as e:
        error = error or e
        everywhere = False
    if error is None and not everywhere:
        error = InvalidArgumentError(
            f"ram_tier={ram_tier!r}: another rank of the job could not open its RAM tier "
            "(its error says why); fix it there, or pass ram_tier=False"
        )
    if error is not None:
        if ram is not None:
            ram.close(clean=True)
        raise error
    return None if ram is None else MemoryTier(ram, root, ranks, run)


class Tiers:
    """The manager's tiers in order, fastest first; each question asked of all of them."""

    def __init__(self, *tiers: Tier) -> None:
        self._tiers: list[Tier] = []
        self._memory_only: set[str] = set()  # saves that went to the faster tiers alone
        for tier in tiers:
            self.add(tier)

    def add(self, tier: Tier | list[Tier] | None) -> None:
        for t in tier if isinstance(tier, list) else [] if tier is None else [tier]:
            self._tiers.append(t)
            self._tiers.sort(key=lambda t: t.speed)

    @property
    def root(self) -> RootTier:
        """The run's root (every manager has one)."""
        root = self.first(RootTier)
        assert root is not None
        return root

    def target(self, name: str, *, fastest: bool = False) -> tuple[str, bool]:
        """Where a save of ``name`` writes, and whether that is the root: the root when it
        takes the step (unless ``fastest``: a preemption's save), else the fastest tier that
        can be a save's target (the RAM tier)."""
        path = self._faster_target(name) if fastest or not self.root.takes(name) else None
        if path is not None:
            self._memory_only.add(name)
            return path, False
        return self.root.catalog.path(name), True

    def alone(self, name: str) -> bool:
        """Whether a save of ``name`` (not a preemption's) goes to the faster tiers alone."""
        return not self.root.takes(name) and self._faster_target(name) is not None

    def _faster_target(self, name: str) -> str | None:
        for tier in self._tiers:
            path = tier.target(name)
            if tier is not self.root and path is not None and tier.takes(name):
                return path
        return None

    def memory_copy(self) -> Storage | None:
        """The storage of the fastest tier saves can target (the RAM tier's), if any."""
        memory = self.first(MemoryTier)
        return None if memory is None else memory.ram.storage

    def holding(self, name: str) -> list[str]:
        """The tiers that hold ``name``, once each finished its copy (``settle``)."""
        held = [t.where for t in self._tiers if t.settle(name)]
        if name not in self._memory_only:
            held.append(self.root.where)
        return held

    def persisted(self, name: str) -> None:
        """``name``, saved to the faster tiers alone, was copied into the root since: the
        slower tiers go on from there."""
        self._memory_only.discard(name)
        for tier in self._tiers:
            if tier.speed > self.root.speed and tier.takes(name):
                tier.committed(name, teed=True)

    def first(self, kind: type[_T]) -> _T | None:
        """The tier of class ``kind``, or None (for its figures)."""
        return next((t for t in self._tiers if isinstance(t, kind)), None)

    def sources(self) -> list[Tier]:
        """The tiers ``restore()`` reads from, fastest first (the root is the last)."""
        return [t for t in self._tiers if t.restores]

    def sinks(self, *, alone: bool = False) -> list[Sink]:
        return [s for t in self._tiers for s in t.sinks(alone=alone)]

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for tier in self._tiers:
                stack.enter_context(tier.held())
            yield

    def committed(self, name: str, *, teed: bool) -> None:
        """Checkpoint ``name`` committed: where the root took it, every tier that takes it
        goes on from there; else (a save into the RAM tier alone) the faster tiers only, each
        told the copy is there already (``teed``)."""
        root = self.root
        persisted = name not in self._memory_only
        while len(self._memory_only) > 64:  # only the latest ones are asked about
            self._memory_only.discard(min(self._memory_only))
        for tier in self._tiers:
            if not persisted and tier.speed >= root.speed:
                continue
            if tier.takes(name):
                tier.committed(name, teed=teed or not persisted)

    def pinned(self) -> set[str]:
        return {n for t in self._tiers for n in t.pinned()}

    def fetch_newer(self, above: int | None = None) -> None:
        for tier in self._tiers:
            tier.fetch_newer(above)

    def steps(self) -> dict[int, Any]:
        """The steps the faster tiers hold whole (``Tier.steps``), on every rank alike."""
        found: dict[int, Any] = {}
        for tier in self._tiers:
            found.update(tier.steps())
        return found

    def forget_after(self, step: int) -> None:
        for tier in self._tiers:
            tier.forget_after(step)

    def closers(self, *, clean: Callable[[], bool]) -> list[Callable[[], None]]:
        """One call per tier, slowest first (uploads finish before the RAM copy goes)."""
        return [functools.partial(_close, t, clean) for t in reversed(self._tiers)]


def _close(tier: Tier, clean: Callable[[], bool]) -> None:
    tier.close(clean=clean())
