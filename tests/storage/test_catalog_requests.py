"""How many storage requests listing a root's committed steps costs (bounded by operations)."""

from __future__ import annotations

import uuid

import torch

import tardigrade as tg
from tardigrade import Catalog
from tardigrade.storage import open_root
from tardigrade.testing import FaultyStorage


def test_listing_a_store_s_steps_asks_once_per_step() -> None:
    # On a store a name is a directory exactly when objects lie under it: the manifest's stat
    # answers whether a step is committed (it cost three requests a step: HEAD, LIST, HEAD).
    url = f"memory://catalog-{uuid.uuid4().hex[:12]}/root"
    for step in (1, 2, 3):
        tg.save(f"{url}/step-{step:09d}", {"w": torch.ones(2)}, step=step)
    open_root(url).put("step-000000004/stray", b"no manifest", mode="create")
    faulty = FaultyStorage(url)
    assert Catalog(faulty).steps() == [1, 2, 3]
    assert faulty.ops.count("list") == 1
    assert faulty.ops.count("stat") == 4, faulty.ops
    open_root(url).delete("")


def test_a_restore_on_a_store_lists_once_and_reads_only_the_restored_manifest() -> None:
    # Restore cleans up, lists the steps and loads the newest. Each kept checkpoint costs one
    # listing of its own (tidy) and one stat (committed?): the cleanup reads no manifest of a
    # checkpoint holding only its own save's data, and the root is listed once for both the
    # committed and the uncommitted steps (it was 35 requests: each manifest read by tidy, the
    # root listed three times, every manifest stated twice).
    url = f"memory://catalog-{uuid.uuid4().hex[:12]}/root"
    state = {"w": torch.ones(4)}
    with tg.CheckpointManager(url, state, keep_last=5) as mgr:
        for step in (1, 2, 3):
            mgr.save(step)
    faulty = FaultyStorage(url)
    with tg.CheckpointManager(faulty.url(""), state) as mgr:
        before = len(faulty.log)
        assert mgr.restore() == 3
        log = faulty.log[before:]
    listed = [where for op, where in log if op == "list"]
    # The root for tidy and for the steps; each step once; the shared data once (its sweep:
    # none here, so no manifest is read for it).
    assert len(listed) == 2 + 3 + 1, listed
    assert listed.count(faulty.url(".shared")) == 1, listed
    manifests_read = [w for op, w in log if op == "open_reader" and w.endswith("manifest.json")]
    assert manifests_read and all("step-000000003" in w for w in manifests_read), log
    assert len(log) <= 23, log
    open_root(url).delete("")


def test_tidy_still_reads_the_manifest_where_two_saves_left_data() -> None:
    # A replace that neither committed nor cleaned up leaves a second save's data beside the
    # committed one's: only the manifest tells which is whose, and the stray data go.
    url = f"memory://catalog-{uuid.uuid4().hex[:12]}/root"
    tg.save(f"{url}/step-000000001", {"w": torch.ones(2)}, step=1)
    root = open_root(url)
    stray = "step-000000001/0123456789abcdef.data-00000-of-00001.safetensors"
    root.put(stray, b"a save that never committed", mode="create")
    faulty = FaultyStorage(url)
    removed = Catalog(faulty).tidy()
    assert [(t.name, t.action) for t in removed] == [("step-000000001", "removed")]
    assert not root.exists(stray)
    assert tg.load(f"{url}/step-000000001")["w"].tolist() == [1.0, 1.0]
    assert ("open_reader", faulty.url("step-000000001/manifest.json")) in faulty.log
    root.delete("")


def test_the_sweep_after_retention_stats_only_the_objects_it_deletes() -> None:
    # On a store each stat is a request: the manager's sweep (no grace period) reads the ages
    # of no object, and the sizes of those it deletes only, however many objects stay.
    url = f"memory://catalog-{uuid.uuid4().hex[:12]}/root"
    faulty = FaultyStorage(url)
    frozen = {f"f{i}": torch.full((512, 512), float(i)) for i in range(4)}  # 1 MiB each: shared
    state = {**frozen, "w": torch.zeros(512, 512)}
    with tg.CheckpointManager(faulty.url(""), state, every_steps=1, keep_last=1) as mgr:
        for step in (1, 2, 3):
            state["w"].fill_(float(step))  # each step a new object; the last one's goes
            before = len(faulty.log)
            mgr.step(step)
            mgr.wait()
            stats = [w for op, w in faulty.log[before:] if op == "stat" and "/.shared/" in w]
            # The save itself stats the 4 frozen objects it references (are they there?), and
            # twice each object it writes (one there already? its size once written): all 4 at
            # step 1 (w holds f1's bytes), w's after; the sweep adds one stat, of the object
            # it deletes.
            assert len(stats) <= (2 * 4 if step == 1 else 4 + 2 + 1), stats
    open_root(url).delete("")


def test_a_save_into_the_ram_tier_alone_asks_the_store_only_for_its_lease(tmp_path) -> None:
    # With persist_every, the steps between two persisted ones go to the RAM tier alone: the
    # store's root is not theirs to check, set aside or retain (each request costs the
    # training thread a round trip, slower still while the store ingests a persisted save);
    # only the lease is read, so that a writer that lost it writes nothing more, here either.
    url = f"memory://catalog-{uuid.uuid4().hex[:12]}/root"
    faulty = FaultyStorage(url)
    state = {"w": torch.ones(4)}
    shm = tmp_path / "shm"
    shm.mkdir()
    with tg.CheckpointManager(
        faulty.url(""), state, every_steps=1, ram_tier=shm, persist_every=10, keep_last=1
    ) as mgr:
        mgr.step(10)
        mgr.wait()
        for step in (11, 12, 13):
            before = len(faulty.log)
            mgr.step(step)
            mgr.wait()
            log = faulty.log[before:]
            assert log and all(where.endswith("/.lock") for _, where in log), log
        assert mgr.steps() == [10]
        assert [s.step for s in mgr.stats] == [10, 11, 12, 13] and all(s.ok for s in mgr.stats)
    open_root(url).delete("")
