"""``tg.load``: the load pipeline, from a checkpoint path to a plain tree or restored live state.

open the manifest (``_open``) -> select keys and match live state (``_match``) -> refuse, before a
byte lands in live state -> check file sizes, allocate -> plan and read the chunks (``_match``,
``_read``) -> apply to live objects (``_apply``). This module only runs those steps in order;
``verify`` (``_verify``) is the separate full checksum pass.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ._apply import _Applier
from ._match import Key, _entry_paths, _Matcher, _plan_reads, _select, _stored_shape
from ._open import _check_refs, manifest_at, open_manifest
from ._read import DEFAULT_READ_THREADS, _check_sizes, _empty, _read_chunks
from ._tree import decode, path_str
from ._validate import standin
from .distributed._collectives import DEFAULT_TIMEOUT, Ranks
from .errors import InvalidArgumentError, StateMismatchError, TardigradeError
from .format.dtypes import TORCH_DTYPES
from .format.jsonio import gc_paused
from .format.manifest import PER_RANK_FALLBACKS, Manifest
from .storage import Storage

log = logging.getLogger("tardigrade")

__all__ = ["load"]


def load(
    path: Any,
    *,
    into: Any = None,
    keys: Sequence[Key] | None = None,
    strict: bool = True,
    verify: bool | str = True,
    workers: int = DEFAULT_READ_THREADS,
    per_rank_fallback: str = "rank0",
    process_group: Any = None,
    timeout: float = DEFAULT_TIMEOUT,
    storage_options: Mapping[str, Any] | None = None,
) -> Any:
    """Load a checkpoint as a plain tree, or restore it in place into live state with ``into=``.

    With ``into=`` everything that can refuse the checkpoint is checked before a byte lands in
    the live state, and all refusals are raised together as one StateMismatchError: under
    ``strict=True`` missing or unexpected keys, shapes, dtypes and the class of each stateful
    object (by class name, module ignored; ``nn.Module`` is matched by its keys and shapes
    only); in both modes each object's ``validate_state_dict()`` (optimizers get a built-in
    check of their parameter groups). Strict matching covers what has a fixed layout: the
    plain state outside objects (keys, lengths, shapes) and each module's parameters and
    buffers. The rest of an object's ``state_dict()`` grows as it trains (optimizer moments
    created lazily, LBFGS's history, a module's extra state) and is the checkpoint's: it goes
    to ``load_state_dict()`` as saved, whatever its keys, lengths and shapes in the live
    object. ``strict=False`` loads what matches and skips (with a
    warning) objects saved from another class. Tensor bytes are then read straight into the
    live tensors, and ``load_state_dict()`` is called on each object before plain values are
    replaced; an object that still rejects its state raises a StateMismatchError that lists
    what was restored and what was not.

    Parameters:
        ``path``: the checkpoint directory (``str`` or ``os.PathLike``) or its URL
            (``memory://``, ``s3://``, any fsspec URL).
        ``into``: live state to restore in place (the same tree you saved: modules, optimizers,
            tensors, plain values); ``None`` (default) returns a new plain tree instead, with
            CPU tensors, numpy arrays and the saved Python values.
        ``keys``: load only these top-level keys or key paths (tuples, e.g.
            ``("model", "fc.weight")``); only their bytes are read. ``None`` loads everything.
        ``strict``: with ``into``, refuse (``StateMismatchError``) any difference between the
            checkpoint and the live state; ``False`` loads what matches.
        ``verify``: check the manifest, the headers and every chunk read against their checksums
            (default ``True``); ``False`` skips the checksums of the bytes read (the manifest
            checksum and all structural validation still apply).
        ``workers``: data files read side by side (threads).
        ``per_rank_fallback``: for a rank the save did not have, ``"rank0"`` (default) loads
            rank 0's ``tg.PerRank`` values, ``"error"`` raises StateMismatchError.
        ``process_group``: when ``torch.distributed`` is initialized the load is collective:
            every rank of this group calls it; each reads only the bytes its live state needs
            (any world size: sharded tensors are resharded), gets its own ``tg.PerRank``
            values, and an error on any rank raises on every rank.
        ``timeout``: seconds a rank waits for the others in a collective load.
        ``storage_options``: options for the backend of a URL ``path`` (e.g. an ``s3://``
            ``endpoint`` and credentials; see ``tg.save``); a local path takes none.

    Returns the loaded tree (with ``into``, the tree that was applied).

    >>> tg.load("ckpt/step-100", into=state)          # doctest: +SKIP
    >>> weights = tg.load("ckpt/step-100", keys=["model"])["model"]  # doctest: +SKIP
    >>> tg.load("s3://bucket/run/step-100", into=state,
    ...         storage_options={"endpoint": "http://127.0.0.1:8333"})  # doctest: +SKIP
    """
    kw = dict(
        into=into,
        keys=keys,
        strict=strict,
        verify=verify,
        workers=workers,
        storage_options=storage_options,
    )
    return _on_ranks(
        lambda rank: _load(path, rank=rank, per_rank_fallback=per_rank_fallback, **kw),
        process_group,
        timeout,
    )


def load_from(
    view: Callable[[], Storage],
    name: str,
    *,
    into: Any,
    verify: bool | str,
    process_group: Any = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> Any:
    """``load`` of checkpoint ``name`` of the storage ``view()`` makes on each rank, a view no
    location names (the RAM tier's overlay of a rank's share on the directory); collective as
    ``load`` is, ``view()``'s error included."""
    check_read_options(verify, "rank0")

    def one(rank: int) -> Any:
        storage = view()
        m = manifest_at(storage, name)
        return load_opened(
            storage, name, m, into=into, keys=None, strict=True, verify=verify,
            workers=DEFAULT_READ_THREADS, rank=rank, per_rank_fallback="rank0",
        )  # fmt: skip

    return _on_ranks(one, process_group, timeout)


def files_to_read(storage: Storage, name: str, m: Manifest, *, into: Any, rank: int) -> set[str]:
    """The data files a restore of checkpoint ``m`` into ``into`` reads on ``rank`` (the
    chunks its tensors need, ``verify=True``); raises what that restore would raise before
    reading a byte (a state that does not fit). Nothing is read or changed."""
    out = load_opened(
        storage, name, m, into=into, keys=None, strict=True, verify=True,
        workers=DEFAULT_READ_THREADS, rank=rank, per_rank_fallback="rank0", plan_only=True,
    )  # fmt: skip
    return set(out)


def _on_ranks(one: Callable[[int], Any], process_group: Any, timeout: float) -> Any:
    """``one(rank)`` on every rank of ``process_group`` (or once, as rank 0, without one)."""
    ranks = Ranks.current(process_group, timeout=timeout)
    if ranks is None:
        return one(0)
    out: list[Any] = []

    def local() -> bytes:
        out.append(one(ranks.rank))
        return b""

    # Every rank reads on its own; the exchange makes a failure on one rank fail them all.
    ranks.all_gather("tg.load", local)
    return out[0]


def _load(
    path: Any,
    *,
    into: Any,
    keys: Sequence[Key] | None,
    strict: bool,
    verify: bool | str,
    workers: int,
    rank: int,
    per_rank_fallback: str,
    storage_options: Mapping[str, Any] | None = None,
) -> Any:
    check_read_options(verify, per_rank_fallback)
    storage, name, m = open_manifest(path, storage_options)
    return load_opened(
        storage, name, m, into=into, keys=keys, strict=strict, verify=verify, workers=workers,
        rank=rank, per_rank_fallback=per_rank_fallback,
    )  # fmt: skip


def check_read_options(verify: bool | str, per_rank_fallback: str) -> None:
    if verify not in (True, False, "all"):
        raise InvalidArgumentError(f"verify must be True, False or 'all', got {verify!r}")
    if per_rank_fallback not in PER_RANK_FALLBACKS:
        raise InvalidArgumentError(
            f"per_rank_fallback must be one of {list(PER_RANK_FALLBACKS)}, got "
            f"{per_rank_fallback!r}"
        )


def load_opened(
    storage: Storage,
    name: str,
    m: Manifest,
    *,
    into: Any,
    keys: Sequence[Key] | None,
    strict: bool,
    verify: bool | str,
    workers: int,
    rank: int,
    per_rank_fallback: str,
    plan_only: bool = False,
) -> Any:
    """``_load`` of a checkpoint already opened (``open_manifest``), its options checked.
    ``plan_only``: check and plan alone, reading nothing; return the data files it would
    read (``files_to_read``)."""
    where = storage.url(name)
    # Planning walks a tree of a node per value and a chunk object per tensor: the cycle
    # collector, left on, walks all of them again and again (a tenth of a load of many small
    # tensors). Nothing here makes cycles worth collecting.
    with gc_paused():
        full = m.tree_for(rank, per_rank_fallback, where)
        needed = _check_refs(full, m, where)
        # Validate the whole tree before walking it against keys or live state.
        decode(full, lambda node, p: None, where)
        tree = full if keys is None else _select(full, keys, where)
        if keys is not None:
            needed = _check_refs(tree, m, where)
        matcher = _Matcher(m, where, strict)
        applier = _Applier(matcher, strict, where)
        if into is not None:
            # Everything that can refuse the checkpoint does so here, before a byte is read into
            # the live state: structure, shapes and dtypes, classes, each object's own checks.
            # Differences are found either way: refused under strict, reported (a warning)
            # and skipped without it.
            matcher.match(tree, into, (), lenient=False)

            def standin_leaf(node: dict[str, Any], p: tuple[Any, ...]) -> Any:
                info = m.tensors[node["e"]]
                return standin(node, _stored_shape(node, info), info.dtype, where)

            rejected = applier.validate(tree, into, decode(tree, standin_leaf, where))
            _refuse(where, matcher.diffs if strict else [], rejected)
            skipped = [*matcher.other_class.values(), *([] if strict else matcher.diffs)]
            if skipped:
                shown = "; ".join(skipped[:50])
                more = f"; and {len(skipped) - 50} more" if len(skipped) > 50 else ""
                log.warning(
                    "tardigrade: %s: strict=False skipped %d part(s) of the state that do not "
                    "match (not loaded, the live values kept): %s%s",
                    where,
                    len(skipped),
                    shown,
                    more,
                )
        checked = set(m.files) if verify == "all" else set()
        dest = matcher.dest
        for e in needed:
            if e not in dest and e not in matcher.sharded:
                info = m.tensors[e]
                dest[e] = _empty(info.shape, TORCH_DTYPES[info.dtype], f"{where}: tensor #{e}")
        tasks = _plan_reads(m, needed, dest, _entry_paths(tree), matcher.sharded)
        reading = checked | {t.chunk.file for t in tasks}
        if plan_only:
            return reading
        _check_sizes(storage, name, m, reading)
        try:
            _read_chunks(storage, name, m, tasks, bool(verify), workers, verify == "all")
        except TardigradeError as e:
            if into is None or not (matcher.dest or matcher.sharded):
                raise
            # Bytes go straight into the live tensors (no second copy of the state), so damage
            # found mid-way leaves some of them overwritten: say which, and what to do.
            owners = ", ".join(
                f"{path_str(p)} ({len(ts)} tensor(s))" if p is not None else ", ".join(ts[:10])
                for p, ts in matcher.in_place.items()
            )
            err = type(e)(
                f"{e}\nThe live tensors read in place may be partly overwritten: {owners}. No "
                "load_state_dict() was called and no plain value replaced. Restore them from "
                "another checkpoint (CheckpointManager.restore() falls back to the next older one)."
            )
            err.live_overwritten = True  # type: ignore[attr-defined]  # restore() reads this
            raise err from e

        def leaf(node: dict[str, Any], p: tuple[Any, ...]) -> Any:
            if node["e"] in matcher.sharded:
                return matcher.sharded[node["e"]][0]  # the live DTensor / tg.Sharded, filled
            t = dest[node["e"]]
            view = node.get("view")
            if view:
                t = t.reshape(-1).as_strided(view["shape"], view["stride"], view["offset"])
            return t.numpy() if node["t"] == "ndarray" else t

        value = decode(tree, leaf, where)
    if into is None:
        return value
    applier.apply(tree, into, value)
    return value


def _refuse(where: str, diffs: list[str], rejected: list[str]) -> None:
    """Raise one StateMismatchError naming every difference and every objection, if any."""
    problems = diffs + rejected
    if not problems:
        return
    hints = []
    if diffs:
        hints.append("pass strict=False to load what matches, or fix the live state")
    if rejected:
        hints.append(
            "build the rejecting objects to fit the checkpoint, or leave them out with keys=[...]"
        )
    raise StateMismatchError(
        f"{where}: the live state does not match the checkpoint ({len(problems)} "
        "difference(s)); nothing was loaded:\n  "
        + "\n  ".join(problems)
        + "\n"
        + "; ".join(hints)[:1].upper()
        + "; ".join(hints)[1:]
        + "."
    )
