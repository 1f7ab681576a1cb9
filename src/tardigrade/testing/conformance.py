"""The storage contract as test mixins: run Tardigrade's conformance suite on your own backend.

A backend is complete when it passes these: durable writers whose abort leaves nothing, ranged
reads into caller buffers, conditional puts (create-only, if-match) that hold under concurrent
writers, stat, list by prefix, delete, its commit strategy (nothing visible before the commit,
exactly one of two racing commits wins, abort leaves nothing), the one-writer lease, and what
a tidy removes (``StoreTidyContract``: a store's sweep by reachability, and its grace period).
Tardigrade's own backends run exactly these (``tests/storage/test_conformance.py``).

Subclass each mixin in a test module of yours and give it pytest fixtures: ``root_url`` (a
fresh, empty root of your backend, by URL; a URL of a scheme you registered with
``tardigrade.storage.register_scheme``), ``storage`` (``open_root(root_url)``) and, for a
store (no rename: manifest-last commit), ``store_url``::

    import pytest
    from tardigrade.storage import open_root
    from tardigrade.testing import conformance

    @pytest.fixture
    def root_url(tmp_path):
        return make_a_fresh_root_of_my_backend()    # e.g. "mystore://bucket/<unique>/root"

    @pytest.fixture
    def storage(root_url):
        return open_root(root_url)

    store_url = root_url                             # a store: the tidy contract too

    class TestBytes(conformance.BytesContract): ...
    class TestCommit(conformance.CommitContract): ...
    class TestLease(conformance.LeaseContract): ...
    class TestTidy(conformance.TidyContract): ...
    class TestStoreTidy(conformance.StoreTidyContract): ...  # stores only

It needs pytest (and torch, as Tardigrade does); import it from tests only.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from typing import Any

import pytest
import torch

import tardigrade as tg
from tardigrade._commit import commit_for, what_is_at
from tardigrade.errors import (
    CheckpointExistsError,
    CheckpointLockedError,
    CorruptCheckpointError,
    TardigradeError,
)
from tardigrade.format.checksum import Hasher
from tardigrade.storage import PreconditionFailed, Stat, Storage, open_root
from tardigrade.storage import base as storage_base
from tardigrade.storage.base import Tidied

__all__ = [
    "BytesContract",
    "CommitContract",
    "LeaseContract",
    "StoreTidyContract",
    "TidyContract",
]

MANIFEST = b'{"format":"tardigrade","save_id":"0123456789abcdef0123456789abcdef"}'


def write(storage: Storage, name: str, data: bytes) -> None:
    w = storage.open_writer(name, size_hint=len(data))
    w.write(data)
    w.close()


def read(storage: Storage, name: str, offset: int = 0, n: int | None = None) -> bytes:
    with storage.open_reader(name) as r:
        buf = bytearray(r.size - offset if n is None else n)
        r.readinto(offset, memoryview(buf))
        return bytes(buf)


class BytesContract:
    def test_a_closed_writer_holds_exactly_what_was_written(self, storage: Storage) -> None:
        w = storage.open_writer("a/b.bin")
        hasher = Hasher()
        source = bytearray(b"x" * 1000)
        w.write(memoryview(source), hasher=hasher)
        source[:] = b"y" * 1000  # the caller's memory changes after the call
        w.write(b"tail")
        w.close()
        assert read(storage, "a/b.bin") == b"x" * 1000 + b"tail"
        reference = Hasher()
        reference.update(memoryview(b"x" * 1000))
        assert hasher.hexdigest() == reference.hexdigest()
        st = storage.stat("a/b.bin")
        assert st is not None and st.size == 1004 and not st.is_dir

    def test_an_aborted_writer_leaves_nothing(self, storage: Storage) -> None:
        write(storage, "keep", b"1")
        w = storage.open_writer("gone")
        w.write(b"partial")
        w.abort()
        assert storage.stat("gone") is None
        assert storage.list() == ["keep"]

    def test_ranged_reads_fill_the_callers_buffer(self, storage: Storage) -> None:
        write(storage, "f", bytes(range(256)))
        assert read(storage, "f", 10, 5) == bytes(range(10, 15))
        with storage.open_reader("f") as r, pytest.raises(CorruptCheckpointError):
            r.readinto(250, memoryview(bytearray(10)))  # past the end: a short object

    def test_a_missing_object_is_a_tardigrade_error(self, storage: Storage) -> None:
        with pytest.raises(TardigradeError):
            storage.open_reader("nope")
        assert storage.stat("nope") is None and not storage.exists("nope")

    def test_put_create_only_and_if_match(self, storage: Storage) -> None:
        v1 = storage.put("rec", b"one", mode="create")
        with pytest.raises(PreconditionFailed):
            storage.put("rec", b"two", mode="create")
        assert read(storage, "rec") == b"one"
        v2 = storage.put("rec", b"two", mode="if_match", expect=v1)
        assert v2 != v1 and read(storage, "rec") == b"two"
        with pytest.raises(PreconditionFailed):
            storage.put("rec", b"three", mode="if_match", expect=v1)  # stale version
        with pytest.raises(PreconditionFailed):
            storage.put("other", b"x", mode="if_match", expect=v1)  # nothing there
        assert read(storage, "rec") == b"two"
        storage.put("rec", b"four", mode="overwrite")
        assert read(storage, "rec") == b"four"
        st = storage.stat("rec")
        assert st is not None and st.size == 4

    def test_of_racing_creates_exactly_one_wins(self, storage: Storage) -> None:
        storage.put("warm/up", b"", mode="overwrite")  # the directory exists for every racer
        won: list[int] = []
        start = threading.Barrier(8)

        def race(i: int) -> None:
            start.wait()
            try:
                storage.put("warm/lease", str(i).encode(), mode="create")
                won.append(i)
            except PreconditionFailed:
                pass

        threads = [threading.Thread(target=race, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1 and read(storage, "warm/lease") == str(won[0]).encode()

    def test_list_stat_and_delete_by_prefix(self, storage: Storage) -> None:
        for name in ("d/x", "d/y/z", "d2/w", "top"):
            write(storage, name, b"1")
        assert storage.list() == ["d", "d2", "top"]
        assert storage.list("d") == ["x", "y"]
        assert storage.list("missing") == []
        st = storage.stat("d")
        assert st is not None and st.is_dir and storage.is_dir("d")
        storage.delete("d")
        assert storage.list() == ["d2", "top"] and storage.stat("d/y/z") is None
        storage.delete_many(["d2/w", "top", "never-was"])
        # (A directory emptied by deletes may remain on POSIX; it holds nothing.)
        assert storage.list("d2") == [] and storage.stat("d2/w") is None
        assert storage.stat("top") is None


class CommitContract:
    """The commit strategy Tardigrade chooses for the backend (a rename where it has
    directories, the manifest last where it has not), run over its primitives."""

    def save(self, storage: Storage, name: str, save_id: str, *, replace: bool = False) -> None:
        c = commit_for(storage)
        staging = c.begin(name, save_id)
        write(storage, f"{staging}/{c.data_name('data-0.bin', save_id)}", save_id.encode())
        manifest = MANIFEST.replace(b"0123456789abcdef" * 2, save_id.encode())
        try:
            c.commit(staging, name, manifest, save_id=save_id, replace=replace)
        except BaseException:
            c.abort(staging, name, save_id)  # the call order of a failed save
            raise

    def data_of(self, storage: Storage, name: str, save_id: str) -> bytes:
        return read(storage, f"{name}/{commit_for(storage).data_name('data-0.bin', save_id)}")

    def test_nothing_is_visible_before_the_commit(self, storage: Storage) -> None:
        c = commit_for(storage)
        staging = c.begin("ckpt", "a" * 32)
        write(storage, f"{staging}/{c.data_name('data-0.bin', 'a' * 32)}", b"bytes")
        assert what_is_at(storage, "ckpt") is None  # data without a manifest: no checkpoint
        assert not storage.exists("ckpt/manifest.json")
        c.commit(staging, "ckpt", MANIFEST, save_id="a" * 32, replace=False)
        assert what_is_at(storage, "ckpt") == "checkpoint"
        assert read(storage, "ckpt/manifest.json") == MANIFEST

    def test_an_aborted_save_leaves_nothing(self, storage: Storage) -> None:
        self.save(storage, "ckpt", "a" * 32)
        c = commit_for(storage)
        staging = c.begin("ckpt", "b" * 32)
        write(storage, f"{staging}/{c.data_name('data-0.bin', 'b' * 32)}", b"doomed")
        c.abort(staging, "ckpt", "b" * 32)
        assert storage.list() == ["ckpt"]  # no staging left behind
        assert self.data_of(storage, "ckpt", "a" * 32) == b"a" * 32  # the committed one intact

    def test_a_commit_over_a_checkpoint_needs_replace(self, storage: Storage) -> None:
        self.save(storage, "ckpt", "a" * 32)
        with pytest.raises(CheckpointExistsError):
            self.save(storage, "ckpt", "b" * 32)
        assert self.data_of(storage, "ckpt", "a" * 32) == b"a" * 32
        self.save(storage, "ckpt", "c" * 32, replace=True)
        assert self.data_of(storage, "ckpt", "c" * 32) == b"c" * 32
        assert read(storage, "ckpt/manifest.json").count(b"c" * 32) == 1
        assert storage.list() == ["ckpt"]
        assert sorted(storage.list("ckpt")) == sorted(
            ["manifest.json", commit_for(storage).data_name("data-0.bin", "c" * 32)]
        )


class LeaseContract:
    def test_one_holder_at_a_time_and_generations_rise(self, storage: Storage) -> None:
        first = tg.Catalog(storage).lease(lease_seconds=30)
        first.acquire()
        first.check()
        assert first.held and first.generation == 1
        second = tg.Catalog(storage).lease(lease_seconds=30)
        with pytest.raises(CheckpointLockedError, match="another job is writing"):
            second.acquire()
        first.release()
        first.release()  # idempotent
        second.acquire()
        assert second.held and second.generation is not None  # (+1 on a takeover, below)
        second.release()

    def test_a_holder_whose_lease_was_taken_is_fenced(self, storage: Storage) -> None:
        lease = tg.Catalog(storage).lease(lease_seconds=30)
        lease.acquire()
        # Someone else's record replaces ours (a job that judged us dead).
        record = json.dumps({"owner": "intruder", "generation": 99, "heartbeat": time.time(),
                             "lease_seconds": 30, "host": "elsewhere", "pid": 1})  # fmt: skip
        storage.put(".lock", record.encode(), mode="overwrite")
        with pytest.raises(CheckpointLockedError, match="no longer holds"):
            lease.check()
        assert not lease.held
        lease.release()  # never raises, and leaves the intruder's record alone
        assert json.loads(read(storage, ".lock"))["owner"] == "intruder"

    def test_an_expired_lease_is_taken_over(self, storage: Storage) -> None:
        record = json.dumps({"owner": "dead", "generation": 7, "heartbeat": time.time() - 600,
                             "lease_seconds": 30, "host": "elsewhere", "pid": 1})  # fmt: skip
        storage.put(".lock", record.encode(), mode="overwrite")
        lease = tg.Catalog(storage).lease(lease_seconds=30)
        lease.acquire()
        assert lease.generation == 8 and lease.held
        lease.release()


def committed(root_url: str, storage: Storage, name: str) -> list[str]:
    """Save a real checkpoint ``name`` (tidy reads its manifest); its objects."""
    sep = "/" if "://" in root_url else os.sep
    tg.save(f"{root_url}{sep}{name}", {"w": torch.ones(3)})
    return sorted(storage.list(name))


class TidyContract:
    """What a tidy (``Catalog.tidy``: the storage's, then the sweep by reachability of
    ``Catalog.collect``) removes of saves that never committed, and when (POSIX staging
    directories go by their flock instead)."""

    def test_stat_says_when_an_object_was_written(self, storage: Storage) -> None:
        before = time.time()
        write(storage, "a/b.bin", b"x")
        st = storage.stat("a/b.bin")
        # Every backend here knows it; a store's clock may differ from this machine's a little.
        assert st is not None and st.modified is not None
        assert before - 5 <= st.modified <= time.time() + 5

    def test_a_save_this_process_abandoned_goes_at_the_next_tidy(
        self, root_url: str, storage: Storage
    ) -> None:
        """Whatever the grace period: a save that failed here is no live save."""
        kept = committed(root_url, storage, "ckpt")
        for name in ("ckpt", "other"):  # a failed replace, a failed first save
            c = commit_for(storage)
            staging = c.begin(name, "b" * 32)
            write(storage, f"{staging}/{c.data_name('data-0.bin', 'b' * 32)}", b"dead")
            c.abandon(staging)  # its abort failed too (``_write.end_staging``)
        done = tg.Catalog(storage).tidy()
        assert done and all(t.action == "removed" for t in done)
        assert storage.list() == ["ckpt"]
        assert sorted(storage.list("ckpt")) == kept
        assert tg.Catalog(storage).tidy() == []
        tg.verify(f"{root_url}/ckpt" if "://" in root_url else os.path.join(root_url, "ckpt"))


def store(root_url: str, **options: float) -> Storage:
    """The object store (manifest-last) at ``root_url``, with ``options``. (A POSIX directory
    tells a live save from a dead one by its flock: these tests are for stores only.)"""
    opened = open_root(root_url, options)
    assert not opened.can_move
    return opened


def later(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Move tidy's clock ``seconds`` on from now (no sleeping)."""
    monkeypatch.setattr(storage_base, "_clock", lambda: time.time() + seconds)


class StoreTidyContract:
    """A store cannot tell a dead save from a live one: a zombie writer whose lease expired may
    still upload, then commit. Its data must outlive every tidy until the grace period is past,
    or that commit would make a checkpoint that is committed and unloadable."""

    def other_process_s_save(self, storage: Storage, name: str, save_id: str) -> str:
        """A data object of a save by another process (not abandoned here), no manifest."""
        data = f"{name}/{commit_for(storage).data_name('data-0.bin', save_id)}"
        write(storage, data, b"a live save's bytes")
        return data

    def test_young_data_of_another_process_survive_until_past_the_grace_period(
        self, store_url: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        storage = store(store_url, gc_grace_seconds=3600)
        kept = committed(store_url, storage, "ckpt")
        first = self.other_process_s_save(storage, "step-2", "b" * 32)
        beside = self.other_process_s_save(storage, "ckpt", "c" * 32)  # a replace
        storage.put(".probe-0123", b"", mode="overwrite")  # a preflight whose delete failed
        done = tg.Catalog(storage).tidy()
        assert [t.name for t in done] == [".probe-0123"]  # probes go at once
        assert storage.exists(first) and storage.exists(beside)
        later(monkeypatch, 3500)
        assert tg.Catalog(storage).tidy() == [] and storage.exists(first) and storage.exists(beside)
        later(monkeypatch, 3700)
        assert len(tg.Catalog(storage).tidy(dry_run=True)) == 2 and storage.exists(first)
        seen: list[Tidied] = []
        done = tg.Catalog(storage).tidy(progress=seen.append)
        assert sorted(t.name for t in done) == ["ckpt", "step-2"] and seen == done
        assert not storage.exists(first) and not storage.exists(beside)
        assert storage.list() == ["ckpt"] and sorted(storage.list("ckpt")) == kept

    def test_what_a_zombie_writes_after_this_process_abandoned_its_save_survives(
        self, store_url: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        storage = store(store_url, gc_grace_seconds=3600)
        later(monkeypatch, -100)
        commit_for(storage).abandon("step-2")  # this process's save of step-2 failed 100 s ago
        later(monkeypatch, 0)
        late = self.other_process_s_save(storage, "step-2", "d" * 32)  # then another's began
        assert tg.Catalog(storage).tidy() == [] and storage.exists(late)

    def test_an_object_of_unknown_age_counts_as_young(
        self, store_url: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        storage = store(store_url, gc_grace_seconds=3600)
        data = self.other_process_s_save(storage, "step-2", "b" * 32)
        real_stat = type(storage).stat

        def ageless(self: Storage, name: str) -> Stat | None:
            st = real_stat(self, name)
            return None if st is None else dataclasses.replace(st, modified=None)

        # The generic listing, whose stat says no age (a store's own listing may know it).
        monkeypatch.setattr(type(storage), "stat", ageless)
        monkeypatch.setattr(type(storage), "walk", lambda self: None)
        later(monkeypatch, 10 * 3600)
        assert tg.Catalog(storage).tidy() == [] and storage.exists(data)
        commit_for(storage).abandon("step-2")  # unless this process abandoned its save
        assert [t.name for t in tg.Catalog(storage).tidy()] == ["step-2"]
        assert not storage.exists(data)

    def test_a_committed_checkpoint_s_data_are_never_removed(
        self, store_url: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        storage = store(store_url, gc_grace_seconds=0)
        kept = committed(store_url, storage, "ckpt")
        commit_for(storage).abandon(
            "ckpt"
        )  # e.g. a save whose outcome was unknown, committed after all
        later(monkeypatch, 10 * 3600)
        assert tg.Catalog(storage).tidy() == [] and sorted(storage.list("ckpt")) == kept
        tg.verify(f"{store_url}/ckpt")

    def test_the_sweep_keeps_what_any_committed_manifest_references(
        self, store_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Reachability (``Catalog.collect``): once there is something to sweep, every
        committed manifest is read; an object one of them references stays, one none does
        goes, and a manifest that does not read keeps everything under its name."""
        storage = store(store_url, gc_grace_seconds=60)
        a = committed(store_url, storage, "a")
        b = committed(store_url, storage, "b")
        stray_a = self.other_process_s_save(storage, "a", "e" * 32)
        stray_b = self.other_process_s_save(storage, "b", "f" * 32)
        storage.put("b/manifest.json", b'{"not": "a manifest"}', mode="overwrite")
        reads: list[str] = []
        catalog = tg.Catalog(storage)
        real = type(catalog).manifest

        def reading(c: tg.Catalog, n: str) -> Any:
            reads.append(n)
            return real(c, n)

        monkeypatch.setattr(type(catalog), "manifest", reading)
        assert catalog.tidy() == []  # nothing old enough
        assert storage.exists(stray_a) and storage.exists(stray_b)
        reads.clear()
        later(monkeypatch, 120)
        caplog.set_level(logging.WARNING, logger="tardigrade")
        assert [t.name for t in catalog.tidy()] == ["a"]
        assert sorted(reads) == ["a", "b"]  # the mark reads every committed manifest
        assert not storage.exists(stray_a) and sorted(storage.list("a")) == a
        assert storage.exists(stray_b) and set(b) <= set(storage.list("b"))
        assert any("leaving" in r.getMessage() and "/b" in r.getMessage() for r in caplog.records)
