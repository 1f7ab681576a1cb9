"""Every storage operation of a save, an async save, a manager step with retention, a load, a
restore, a gc and a tier's upload fails in turn, with every error kind, on every backend (the driver is
``_fault_matrix.every_fault``; the collective save on 2 ranks is in
``test_fault_matrix_collective.py``).
"""

from __future__ import annotations

import contextlib
import io
import os
from typing import Any

import pytest
import torch
from torch import nn

import tardigrade as tg
from tardigrade._tiers import copy_checkpoint
from tardigrade.cli import main as cli
from tardigrade.errors import TardigradeError
from tardigrade.storage import open_root
from tardigrade.testing import FaultyStorage

from ._fault_matrix import Family, Outcome, every_fault, past_the_grace_period

pytestmark = pytest.mark.timeout(300)


def make_state(value: float) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.fill_(value)
        model.bias.fill_(value)
    return {"model": model, "table": torch.full((2, 300), value), "step": int(value)}


def value_of(state: dict[str, Any]) -> float:
    return float(state["model"].weight.detach()[0, 0])


def outcome(call: Any) -> Outcome:
    try:
        return Outcome(value=call())
    except Exception as e:
        return Outcome(error=e)


# -- tg.save, synchronous and asynchronous -----------------------------------------------------


def prepare_one(faulty: FaultyStorage) -> None:
    tg.save(faulty.inner.url("step-1"), make_state(1.0), step=1)


def sync_save(faulty: FaultyStorage, attempt: int) -> Outcome:
    step = 5 + attempt
    return outcome(lambda: tg.save(faulty.url(f"step-{step}"), make_state(step), step=step))


def overwrite(faulty: FaultyStorage, attempt: int) -> Outcome:
    """Replace the committed step-1 (overwrite=True): atomically, the old or the new one."""
    value = 10.0 + attempt
    return outcome(lambda: tg.save(faulty.url("step-1"), make_state(value), overwrite=True))


def async_save(faulty: FaultyStorage, attempt: int) -> Outcome:
    step = 5 + attempt

    def run() -> Any:
        with tg.AsyncCheckpointer() as ckpt:
            fut = ckpt.save(faulty.url(f"step-{step}"), make_state(step), step=step)
            assert fut is not None
            return fut.result()

    return outcome(run)


def bounded_async_save(faulty: FaultyStorage, attempt: int) -> Outcome:
    """An async save under a staging budget smaller than the state: the writers drain slabs
    while the copy goes on, so a writer that fails must not leave the copy waiting for a slab."""
    step = 5 + attempt

    def run() -> Any:
        state = {**make_state(step), "big": torch.full((3 << 18,), float(step))}  # 3 MiB
        with tg.AsyncCheckpointer(max_staging_bytes=2 << 20) as ckpt:
            fut = ckpt.save(faulty.url(f"step-{step}"), state, step=step)
            assert fut is not None
            return fut.result()

    return outcome(run)


# -- shared data (format 7) ----------------------------------------------------------------------

SHARED_N = 300_000  # 1.1 MiB of float32: a shared object


def shared_state(value: float) -> dict[str, Any]:
    """A frozen tensor (the same object in every checkpoint) and one of ``value``."""
    return {
        "frozen": torch.arange(SHARED_N, dtype=torch.float32),
        "moving": torch.full((SHARED_N,), value),
        "step": int(value),
    }


def prepare_shared(faulty: FaultyStorage) -> None:
    """Step 1 (a plain checkpoint), then step 2 sharing data with it: two shared objects."""
    tg.save(faulty.inner.url("step-1"), shared_state(1.0))
    tg.save(faulty.inner.url("step-2"), shared_state(2.0), base=faulty.inner.url("step-1"))


def shared_save(faulty: FaultyStorage, attempt: int) -> Outcome:
    """A save referencing step 2's frozen object and writing a new one for ``moving``."""
    step = 5 + attempt
    url = faulty.url(f"step-{step}")
    return outcome(lambda: tg.save(url, shared_state(step), base=faulty.url("step-2")))


def saved_what_it_says(faulty: FaultyStorage, out: Outcome) -> None:
    if out.error is None:
        got = tg.load(faulty.inner.url("step-5"), verify="all")
        assert got["step"] == 5 and float(got["moving"][-1]) == 5.0
        assert torch.equal(got["frozen"], shared_state(5.0)["frozen"])


def prepare_dedup(faulty: FaultyStorage) -> None:
    state = shared_state(0.0)
    with tg.CheckpointManager(faulty.inner.root, state, async_save=False) as mgr:
        for step in (1, 2):
            state["moving"].fill_(float(step))
            mgr.save(step)


def manager_dedup(faulty: FaultyStorage, attempt: int) -> Outcome:
    """A manager sharing data saves a step; retention (two kept) retires step 1 and sweeps
    the object only it referenced."""
    step = 3 + attempt
    state = shared_state(float(step))
    try:
        mgr = warn_manager(faulty, state, async_mode=False)
    except TardigradeError as e:
        return Outcome(error=e)
    warn_mode(lambda: mgr.step(step))
    warn_mode(mgr.close)
    return Outcome(failed=mgr.stats.failed, value=mgr.stats.succeeded)


# -- load ----------------------------------------------------------------------------------------


def load(faulty: FaultyStorage, attempt: int) -> Outcome:
    def run() -> float:
        live = make_state(-1.0)
        tg.load(faulty.url("step-1"), into=live)
        assert value_of(live) == 1.0 and float(live["table"][1, 299]) == 1.0
        return value_of(live)

    return outcome(run)


# -- the manager: a step with retention, a restore -----------------------------------------------


def prepare_two(faulty: FaultyStorage) -> None:
    state = make_state(0.0)
    with tg.CheckpointManager(faulty.inner.root, state, async_save=False) as mgr:
        for step in (1, 2):
            state["model"].weight.data.fill_(float(step))
            mgr.save(step)


def warn_mode(call: Any) -> None:
    """``call()`` on a manager in "warn" mode: whatever storage does, it does not raise."""
    try:
        call()
    except Exception as e:
        raise AssertionError(f'raised under on_save_error="warn": {e!r}') from e


def warn_manager(faulty: FaultyStorage, state: Any, async_mode: bool) -> tg.CheckpointManager:
    """The manager of the manager runs: a save every step, two kept, failures counted."""
    return tg.CheckpointManager(
        faulty.root,
        state,
        every_steps=1,
        keep_last=2,
        async_save=async_mode,
        on_save_error="warn",
    )


def manager_step(async_mode: bool) -> Any:
    """A manager is created (which may refuse the location), saves a step and closes."""

    def run(faulty: FaultyStorage, attempt: int) -> Outcome:
        step = 3 + attempt
        state = make_state(float(step))
        try:
            mgr = warn_manager(faulty, state, async_mode)
        except TardigradeError as e:
            return Outcome(error=e)
        warn_mode(lambda: mgr.step(step))
        warn_mode(mgr.close)
        return Outcome(failed=mgr.stats.failed, value=mgr.stats.succeeded)

    return run


def manager_opened(async_mode: bool) -> Any:
    """A manager is created and saves step 3 (the fault hits here; 5 on the next run), then
    goes on."""

    def run(faulty: FaultyStorage, attempt: int) -> Outcome:
        step = 3 + 2 * attempt
        state = make_state(float(step))
        try:
            mgr = warn_manager(faulty, state, async_mode)
        except TardigradeError as e:
            return Outcome(error=e)
        try:
            warn_mode(lambda: mgr.step(step))
            # The background save is part of this step: it finishes (and fails) before the
            # fault is taken away.
            warn_mode(mgr.wait)
        except BaseException:
            mgr.close()
            raise
        return Outcome(value=(mgr, state, step))

    return run


def manager_goes_on(faulty: FaultyStorage, out: Outcome) -> Outcome:
    """Once the fault is gone the same manager saves the next step: training went on (Caffe2)."""
    if out.error is not None:
        return out
    mgr, state, step = out.value
    state["model"].weight.data.fill_(float(step + 1))
    warn_mode(lambda: mgr.step(step + 1))
    warn_mode(mgr.wait)
    warn_mode(mgr.close)
    assert mgr.stats[-1].step == step + 1 and mgr.stats[-1].ok, mgr.stats
    return Outcome(failed=mgr.stats.failed, value=[(s.step, s.ok) for s in mgr.stats])


def saved_step_4(faulty: FaultyStorage, out: Outcome) -> None:
    """The same manager saved step 4 once the fault was gone, with step 4's values."""
    if out.error is None:
        assert out.value[-1] == (4, True), out.value
        assert float(tg.load(faulty.url("step-000000004"))["model"]["weight"][0, 0]) == 4.0


def restore(faulty: FaultyStorage, attempt: int) -> Outcome:
    def run() -> tuple[int | None, float]:
        state = make_state(-1.0)
        with tg.CheckpointManager(faulty.root, state) as mgr:
            step = mgr.restore()
        return step, value_of(state)

    return outcome(run)


def restored_what_it_says(faulty: FaultyStorage, out: Outcome) -> None:
    """A restore that returned step s put step s's values in the live state, and s is the
    newest committed step unless it logged why it skipped the newer one."""
    if out.error is None:
        step, value = out.value
        assert step in (1, 2) and value == float(step), out.value


# -- a tier's upload --------------------------------------------------------------------------

UPLOADED = "step-000000005"


def upload(faulty: FaultyStorage, attempt: int) -> Outcome:
    """A checkpoint committed in a fast tier copied here, as ``CheckpointManager(upload_to=)``
    does in the background (each try of its ``Uploader`` is one such copy)."""
    src = open_root("memory://fault-matrix-upload-source/run")  # this process's, kept
    if not src.exists(f"{UPLOADED}/manifest.json"):
        tg.save(src.url(UPLOADED), make_state(5.0), step=5)
    return outcome(lambda: copy_checkpoint(src, UPLOADED, faulty))


def uploaded_whole(faulty: FaultyStorage, out: Outcome) -> None:
    """A copy that returned is committed here, whole, with the source's values (a commit
    whose reply was lost included: it was committed, and its data must still be there)."""
    if out.error is None:
        assert out.value in ("copied", "present"), out.value
        assert float(tg.load(faulty.inner.url(UPLOADED))["model"]["weight"][0, 0]) == 5.0


# -- gc --------------------------------------------------------------------------------------


def prepare_leftover(faulty: FaultyStorage) -> None:
    """A committed checkpoint, and what a save killed before its commit left beside it."""
    prepare_one(faulty)
    if faulty.inner.can_move:  # a directory: the dead save's staging directory
        dead = ".tmp-step-2-0123456789abcdef0123456789abcdef"
    else:  # a store: the dead save's data objects under the checkpoint's name, no manifest
        dead = "step-2/0123456789abcdef.data-00000-of-00001"
    w = faulty.inner.open_writer(f"{dead}/x" if faulty.inner.can_move else dead)
    w.write(b"bytes of a save that never committed")
    w.close()


def gc(faulty: FaultyStorage, attempt: int) -> Outcome:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = cli(["gc", faulty.root])
    if rc != 0:
        return Outcome(error=TardigradeError(f"tardigrade gc exited {rc}: {err.getvalue()}"))
    return Outcome(value=rc)


def gc_later(faulty: FaultyStorage, attempt: int) -> Outcome:
    """`tardigrade gc` once the leftover (another process's) is past a store's grace period."""
    with past_the_grace_period():
        return gc(faulty, attempt)


def tidy_leftovers(faulty: FaultyStorage) -> None:
    """The design's cleanup once the fault is gone: `tardigrade gc` (or the next manager)
    removes what dead saves left and takes over a lease this process could not release. It
    runs at once: what a run of this process left (a save that failed, a retired checkpoint
    not all deleted) it abandoned, so a store's grace period does not apply."""
    out = gc(faulty, 1)
    assert out.error is None, out


def tidy_later(faulty: FaultyStorage) -> None:
    """As :func:`tidy_leftovers`, past a store's grace period (another process's leftovers)."""
    out = gc_later(faulty, 1)
    assert out.error is None, out


FAMILIES = {
    "sync-save": Family("sync-save", prepare_one, sync_save, tidy_leftovers),
    "async-save": Family("async-save", prepare_one, async_save, tidy_leftovers),
    "overwrite": Family(
        "overwrite", prepare_one, overwrite, tidy_leftovers, may_replace=frozenset({"step-1"})
    ),
    "async-save-bounded": Family(
        "async-save-bounded", prepare_one, bounded_async_save, tidy_leftovers
    ),
    "load": Family("load", prepare_one, load, tidy_leftovers),
    "manager-step": Family(
        "manager-step",
        prepare_two,
        manager_step(async_mode=False),
        tidy_leftovers,
        may_retire=frozenset({"step-000000001"}),
    ),
    "manager-step-async": Family(
        "manager-step-async",
        prepare_two,
        manager_step(async_mode=True),
        tidy_leftovers,
        may_retire=frozenset({"step-000000001"}),
    ),
    "manager-goes-on": Family(
        "manager-goes-on",
        prepare_two,
        manager_opened(async_mode=False),
        tidy_leftovers,
        saved_step_4,
        may_retire=frozenset({"step-000000001", "step-000000002"}),
        then=manager_goes_on,
    ),
    "manager-goes-on-async": Family(
        "manager-goes-on-async",
        prepare_two,
        manager_opened(async_mode=True),
        tidy_leftovers,
        saved_step_4,
        may_retire=frozenset({"step-000000001", "step-000000002"}),
        then=manager_goes_on,
    ),
    "restore": Family("restore", prepare_two, restore, tidy_leftovers, restored_what_it_says),
    "gc": Family("gc", prepare_leftover, gc_later, tidy_later),
    "upload": Family("upload", prepare_one, upload, tidy_leftovers, uploaded_whole),
    "shared-save": Family(
        "shared-save", prepare_shared, shared_save, tidy_leftovers, saved_what_it_says
    ),
    "manager-dedup": Family(
        "manager-dedup",
        prepare_dedup,
        manager_dedup,
        tidy_leftovers,
        may_retire=frozenset({"step-000000001"}),
    ),
}


# Runs that cost tens of milliseconds on a disk (a manager, its fsynced preflight and lease, two
# checkpoints laid down before each trial; megabytes staged under a budget): there, each operation k fails with one error kind
# (taken in turn, so every kind hits every op kind) and one outage, not with every kind; on
# memory:// (the same code above the byte layer, at a fraction of the cost) with every kind.
# s3:// (a store over the network) is sampled in every family.
# FAULT_MATRIX_FULL=1 runs every error kind everywhere (the full cross product, minutes).
FULL = os.environ.get("FAULT_MATRIX_FULL", "") not in ("", "0")
SAMPLED_ON_DISK = {
    "async-save-bounded", "manager-step", "manager-step-async", "manager-goes-on",
    "manager-goes-on-async", "restore", "shared-save", "manager-dedup",
}  # fmt: skip


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_operation_fails_in_turn(root_url: str, family: str) -> None:
    faulty = FaultyStorage(root_url)
    backend = root_url.partition("://")[0] if "://" in root_url else "local"
    # A store over the network (s3://) is sampled in every family: each request is a round trip.
    sample = not FULL and (backend == "s3" or (backend == "local" and family in SAMPLED_ON_DISK))
    how = every_fault(faulty, FAMILIES[family], sample=sample, label=f"{family}[{backend}]")
    print(f"{family} on {backend}: {dict(how)}")
