"""``tg.save``: the public facade, dispatching to the synchronous or the asynchronous save.

Both are the same pipeline (``_save_job`` -> stage -> ``_write``): a synchronous save borrows the live
tensors as its staging (the caller waits anyway), an asynchronous one copies them into pooled
host memory first (``_async``) and writes in the background.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any

from ._async import SaveFuture, default_checkpointer
from ._open import manifest_at
from ._save_job import SaveOptions, SaveResult, make_job
from ._shared import SharedIndex
from ._write import stream_borrowed, write_and_commit
from .distributed._collectives import DEFAULT_TIMEOUT, Ranks
from .distributed._save import save_collective, stage_collective
from .errors import InvalidArgumentError
from .storage import storage_for

__all__ = ["SaveResult", "save"]


def save(
    path: str | os.PathLike[str],
    state: Any,
    *,
    async_: bool = False,
    overwrite: bool = False,
    metadata: Mapping[str, Any] | None = None,
    step: int | None = None,
    epoch: int | None = None,
    metrics: Mapping[str, float] | None = None,
    process_group: Any = None,
    timeout: float = DEFAULT_TIMEOUT,
    storage_options: Mapping[str, Any] | None = None,
    base: str | os.PathLike[str] | None = None,
) -> SaveResult | SaveFuture | None:
    """Save ``state`` atomically to the directory ``path``.

    The checkpoint appears only once complete and fsynced; a crash at any instant leaves either
    nothing or the whole checkpoint. Returns a :class:`SaveResult`; with ``async_=True`` returns
    a ``SaveFuture`` as soon as the state is copied to host memory, and writes in the background
    (one save in flight at a time; see ``AsyncCheckpointer``). Raises ``CheckpointExistsError``
    if ``path`` exists (pass ``overwrite=True``) and ``UnsupportedTypeError`` naming the path of
    any leaf the format cannot store. Every error says whether the checkpoint was committed
    nonetheless (``err.committed``, ``err.path`` and its message: True when it failed after the
    commit point, e.g. a rank died just after rank 0 committed).

    Parameters:
        ``path``: the checkpoint directory to create (its parent is created if missing), or a
            URL: ``memory://bucket/run/step-100``, ``s3://bucket/run/step-100``, or any URL an
            installed fsspec filesystem serves (``gs://``, ``az://``, ...).
        ``state``: what to save: a tree of dicts, lists and tuples whose leaves are tensors,
            numpy arrays, plain Python values and objects with ``state_dict()`` /
            ``load_state_dict()`` (modules, optimizers, schedulers, ``tg.RNGState()``, ...).
        ``async_``: return after copying the state to host memory and write in the background
            (a ``SaveFuture``); ``False`` (default) returns once the checkpoint is committed.
        ``overwrite``: replace an existing committed checkpoint at ``path`` (atomically); never
            anything else (a file or another directory there is refused).
        ``metadata``: a dict of JSON values stored in the manifest (``tardigrade inspect``).
        ``step``, ``epoch``: counters recorded in the manifest (non-negative ints or None).
        ``metrics``: a dict of name -> number recorded in the manifest (e.g. for ``keep_best``).
        ``process_group``: when ``torch.distributed`` is initialized the save is collective:
            every rank of this group (default: the whole job) calls ``save`` with its own
            state and the same ``path``, ``overwrite``, ``step``, ``epoch`` and ``metadata``
            (a difference raises ``InvalidArgumentError`` on every rank; ``metrics`` may
            differ, rank 0's are recorded), and each writes its own files into one checkpoint
            (see the README's Distributed section). Ignored in a single-process program.
            With ``async_=True`` each rank returns once its own tensors are staged, and the
            collective protocol runs in the background on a forked gloo group; errors reach
            every rank's ``SaveFuture``.
        ``timeout``: seconds any rank waits for the others in a collective save before every
            rank raises ``DistributedError`` (a rank died, hangs, or did not call ``save``).
        ``storage_options``: options for the backend of a URL ``path`` (for ``s3://``:
            ``endpoint``, ``region``, ``access_key_id``, ``secret_access_key``, ...; for an
            fsspec URL, its filesystem's arguments); the usual environment variables (AWS_*)
            fill what is not given. A local path takes none. In a collective save each rank
            passes its own (they may differ, e.g. per-rank credentials).
        ``base``: a committed checkpoint in the same directory as ``path`` to share data
            with: each chunk of 1 MiB or more is written once, as a shared object in
            ``.shared/`` beside the checkpoints, and a chunk ``base`` already holds is
            referenced rather than written (frozen weights, unchanged row blocks). A save
            with a ``base`` that shares nothing (a plain checkpoint) writes its large chunks
            as shared objects, for the next save to reference. Delete checkpoints that
            share data with ``CheckpointManager`` retention or ``tardigrade gc`` (which
            removes a shared object once no checkpoint references it), not by hand.

    >>> tg.save("ckpt/step-100", {"model": model, "optim": opt, "step": 100})  # doctest: +SKIP
    >>> tg.save("s3://bucket/run/step-100", state,
    ...         storage_options={"endpoint": "http://127.0.0.1:8333"})  # doctest: +SKIP
    >>> fut = tg.save("ckpt/step-200", state, async_=True)  # doctest: +SKIP
    >>> fut.result()  # doctest: +SKIP
    """
    if isinstance(state, (str, os.PathLike)) and not isinstance(path, (str, os.PathLike)):
        raise InvalidArgumentError(
            f"tg.save(path, state) takes the path first; got a {type(path).__name__} as the "
            f"path and {os.fspath(state)!r} as the state (torch.save's order is (obj, path)). "
            f"Call tg.save({os.fspath(state)!r}, state)."
        )
    options = SaveOptions(
        overwrite=overwrite,
        metadata=metadata,
        step=step,
        epoch=epoch,
        metrics=metrics,
        storage_options=storage_options,
        shared=None if base is None else base_index(path, base, storage_options),
    )
    return save_with(path, state, options, async_=async_, process_group=process_group,
                     timeout=timeout)  # fmt: skip


def save_with(
    path: str | os.PathLike[str],
    state: Any,
    options: SaveOptions,
    *,
    async_: bool = False,
    process_group: Any = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> SaveResult | SaveFuture | None:
    """``tg.save`` with its knobs as one ``SaveOptions`` (the manager's own saves)."""
    ranks = Ranks.current(process_group, timeout=timeout)
    if ranks is not None:
        if async_:
            stage = functools.partial(stage_collective, path=path, state=state, options=options)
            return default_checkpointer().save_collective(ranks, path, stage)
        return save_collective(ranks, path, state, options)
    if async_:
        return default_checkpointer().submit(path, state, options)
    # The synchronous save is the same pipeline with a stager that borrows the live tensors
    # instead of copying them, awaited in the caller.
    job = make_job(path, state, options)
    return write_and_commit(job, stream_borrowed(job))


def base_index(
    path: str | os.PathLike[str], base: Any, storage_options: Mapping[str, Any] | None
) -> SharedIndex:
    """The shared objects checkpoint ``base`` references, for a save to ``path`` beside it."""
    if not isinstance(base, (str, os.PathLike)):
        raise InvalidArgumentError(
            f"base must be the path of a committed checkpoint, got {type(base).__name__}"
        )
    storage, _ = storage_for(path, storage_options)
    there, name = storage_for(base, storage_options)
    if there.url("") != storage.url(""):
        raise InvalidArgumentError(
            f"base={there.url(name)} is not in the same directory as {os.fspath(path)!r}: "
            "shared data lives beside the checkpoints (in .shared/), so a base must be a "
            "checkpoint of the directory the save goes to"
        )
    return SharedIndex.of([manifest_at(there, name)])
