"""What only the S3 backend has, on the session's real SeaweedFS server: multipart uploads
(streamed, aborted without a trace), racing commits, partial loads that fetch only their
bytes, gc of what crashed saves left, and the errors a user meets first (a missing bucket, bad
credentials, denied access, an unreachable endpoint, the missing extra, an unknown option).

The rest of the contract runs on S3 through the shared suites (``BACKENDS`` in conftest.py).
"""

from __future__ import annotations

import socket
import sys
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
import torch

import tardigrade as tg
from tardigrade._catalog import Catalog
from tardigrade._commit import ManifestLastCommit, commit_for, what_is_at
from tardigrade.errors import (
    CheckpointExistsError,
    InvalidArgumentError,
    StorageError,
    TardigradeError,
)
from tardigrade.storage import PreconditionFailed, open_root
from tardigrade.storage import s3 as s3mod
from tardigrade.storage.s3 import S3Storage

pytestmark = pytest.mark.s3

MiB = 1024 * 1024


@pytest.fixture
def url(s3_env: Any) -> Iterator[str]:
    """A fresh prefix of the test bucket (endpoint and credentials in AWS_* variables)."""
    root = f"s3://{s3_env.bucket}/s3-{uuid.uuid4().hex[:12]}"
    yield root
    open_root(root).delete("")


def boto(server: Any) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        region_name="us-east-1",
        aws_access_key_id=server.options()["access_key_id"],
        aws_secret_access_key=server.options()["secret_access_key"],
    )


def pending_uploads(server: Any, storage: S3Storage) -> list[str]:
    page = boto(server).list_multipart_uploads(Bucket=server.bucket, Prefix=storage.prefix + "/")
    return [u["Key"] for u in page.get("Uploads", [])]


def pattern(n: int, seed: int = 0) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes()


# -- multipart writers -------------------------------------------------------------------


def test_a_large_object_streams_as_a_multipart_upload(url: str, s3_env: Any) -> None:
    storage = S3Storage(url, {"part_bytes": 5 * MiB, "parts_in_flight": 2})
    data = pattern(12 * MiB + 12345)
    w = storage.open_writer("big.bin", size_hint=len(data))
    for i in range(0, len(data), MiB):  # the caller's buffer is reused after each write
        chunk = bytearray(data[i : i + MiB])
        w.write(memoryview(chunk))
        chunk[:] = bytes(len(chunk))
    assert storage.stat("big.bin") is None  # nothing visible before close()
    w.close()
    st = storage.stat("big.bin")
    assert st is not None and st.size == len(data)
    with storage.open_reader("big.bin") as r:
        whole = bytearray(len(data))
        r.readinto(0, memoryview(whole))  # several parallel ranged GETs
        assert whole == data
        piece = bytearray(3 * MiB)
        r.readinto(7 * MiB - 5, memoryview(piece))
        assert piece == data[7 * MiB - 5 : 10 * MiB - 5]
    assert pending_uploads(s3_env, storage) == []


def test_parts_lent_without_a_copy_are_let_go_before_write_returns(url: str) -> None:
    """An async save's staging slab is written unhashed in large blocks: whole parts go to
    the client without a copy, and ``write`` returns only when the client holds none of
    them, so the slab can be refilled at once (here: zeroed) without changing the object."""
    storage = S3Storage(url, {"part_bytes": 5 * MiB, "parts_in_flight": 2})
    head, block = pattern(1000, seed=1), pattern(17 * MiB + 3, seed=2)
    w = storage.open_writer("lent.bin")
    w.write(head)  # a part in progress: the block first completes it, then lends whole parts
    slab = bytearray(block)
    view = memoryview(slab)
    w.write(view)
    view.release()
    slab[:] = bytes(len(slab))  # would corrupt the upload if a part were still lent
    w.write(memoryview(slab)[:10])
    w.close()
    with storage.open_reader("lent.bin") as r:
        got = bytearray(r.size)
        r.readinto(0, memoryview(got))
    assert got == head + block + bytes(10)


def test_an_async_save_of_a_multipart_state_holds_the_values_at_save_time(url: str) -> None:
    state = {"w": torch.arange(6 * MiB, dtype=torch.float32), "b": torch.ones(100)}
    expected = {k: v.clone() for k, v in state.items()}
    fut = tg.save(f"{url}/ckpt", state, async_=True)
    state["w"].zero_()  # training goes on as soon as save() returns
    fut.result(timeout=120)
    out = tg.load(f"{url}/ckpt")
    assert torch.equal(out["w"], expected["w"]) and torch.equal(out["b"], expected["b"])
    assert tg.verify(f"{url}/ckpt").files == 1


def test_an_aborted_multipart_upload_leaves_no_object_and_no_upload(url: str, s3_env: Any) -> None:
    """The s3fs #154 regression: a writer that fails mid-object never commits it."""
    storage = S3Storage(url, {"part_bytes": 5 * MiB})
    storage.put("keep", b"1", mode="create")
    w = storage.open_writer("doomed.bin")
    w.write(pattern(11 * MiB))  # two parts are uploading or uploaded
    w.abort()
    assert storage.stat("doomed.bin") is None
    assert storage.list() == ["keep"]
    assert pending_uploads(s3_env, storage) == []


def test_a_save_that_fails_mid_object_commits_nothing(url: str) -> None:
    """A write failing in the middle of a multipart data object: the save raises, the
    object is not visible, the checkpoint does not exist, and the next save works."""
    from tardigrade.testing import FaultyStorage

    faulty = FaultyStorage(url)
    state = {"w": torch.arange(3 * MiB, dtype=torch.float32)}  # 12 MiB: a multipart object
    faulty.fail("write", nth=2, error="EIO")
    with pytest.raises(TardigradeError):
        tg.save(faulty.url("step-1"), state)
    assert faulty.inner.list() == []
    faulty.heal()
    tg.save(faulty.url("step-1"), state)
    assert torch.equal(tg.load(f"{url}/step-1")["w"], state["w"])


# -- commit -------------------------------------------------------------------------------


def test_two_writers_racing_to_commit_one_checkpoint_exactly_one_wins(url: str) -> None:
    """Four saves of one checkpoint write their data, wait for each other, then all commit:
    one manifest lands, the others get CheckpointExistsError and their data are removed."""
    n = 4
    barrier = threading.Barrier(n)
    real_commit = ManifestLastCommit.commit

    def at_the_line(self: ManifestLastCommit, *args: Any, **kwargs: Any) -> None:
        barrier.wait(timeout=60)
        real_commit(self, *args, **kwargs)

    errors: dict[int, BaseException | None] = {}

    def save(i: int) -> None:
        try:
            tg.save(f"{url}/ckpt", {"who": torch.full((1000,), float(i))})
            errors[i] = None
        except BaseException as e:
            errors[i] = e

    ManifestLastCommit.commit = at_the_line  # type: ignore[method-assign]  # undone below
    try:
        threads = [threading.Thread(target=save, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        ManifestLastCommit.commit = real_commit  # type: ignore[method-assign]  # as it was
    winners = [i for i, e in errors.items() if e is None]
    losers = [e for e in errors.values() if e is not None]
    assert len(winners) == 1 and len(losers) == n - 1, errors
    assert all(isinstance(e, CheckpointExistsError) for e in losers), losers
    assert all("another writer committed" in str(e) for e in losers), losers
    assert float(tg.load(f"{url}/ckpt")["who"][0]) == float(winners[0])
    names = open_root(url).list("ckpt")  # the manifest and the winner's data, nothing else
    assert "manifest.json" in names and len(names) == 2, names


# -- partial loads ------------------------------------------------------------------------


def test_a_keys_load_fetches_only_the_bytes_it_needs(url: str) -> None:
    state = {"small": torch.arange(1000, dtype=torch.float32), "big": torch.zeros(4 * MiB)}
    tg.save(f"{url}/ckpt", state)  # one data file: "big" is 16 MiB of it
    before = s3mod.transferred()
    out = tg.load(f"{url}/ckpt", keys=["small"])
    fetched = s3mod.transferred()["bytes_read"] - before["bytes_read"]
    assert torch.equal(out["small"], state["small"]) and set(out) == {"small"}
    assert 4000 <= fetched < 256 * 1024, fetched  # the manifest, a header, 4 KB of floats
    before = s3mod.transferred()
    full = tg.load(f"{url}/ckpt")
    assert torch.equal(full["big"], state["big"])
    fetched = s3mod.transferred()["bytes_read"] - before["bytes_read"]
    assert 16 * MiB <= fetched < 17 * MiB, fetched  # each byte once


def test_loading_needs_no_list(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    tg.save(f"{url}/ckpt", {"x": torch.ones(10)})

    def no_list(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a load listed the store")

    import obstore

    with monkeypatch.context() as m:
        m.setattr(obstore, "list", no_list)
        m.setattr(obstore, "list_with_delimiter", no_list)
        assert torch.equal(tg.load(f"{url}/ckpt")["x"], torch.ones(10))


# -- gc -----------------------------------------------------------------------------------


def crashed_save(storage: S3Storage, s3_server: Any, name: str) -> str:
    """What a save SIGKILLed mid-upload leaves: a data object, no manifest, and an
    incomplete multipart upload of its next object."""
    save_id = uuid.uuid4().hex
    storage.put(
        f"{name}/{commit_for(storage).data_name('data-0.safetensors', save_id)}", b"x" * 100
    )
    key = f"{storage.prefix}/{name}/{commit_for(storage).data_name('data-1.safetensors', save_id)}"
    client = boto(s3_server)
    up = client.create_multipart_upload(Bucket=s3_server.bucket, Key=key)
    client.upload_part(
        Bucket=s3_server.bucket, Key=key, UploadId=up["UploadId"], PartNumber=1, Body=b"y" * 10
    )
    return key


def test_gc_removes_what_crashed_saves_left_after_the_grace_period(url: str, s3_env: Any) -> None:
    with tg.CheckpointManager(url, {"w": torch.ones(10)}, async_save=False) as mgr:
        mgr.save(1)
    young = S3Storage(url, {})  # default grace: an hour
    crashed_save(young, s3_env, "step-000000002")
    crashed_save(young, s3_env, "step-000000001")  # beside a committed checkpoint
    catalog = Catalog(young)
    assert catalog.steps() == [1]  # listing shows only what committed
    assert what_is_at(young, "step-000000002") is None
    assert catalog.tidy() == []  # too young: their saves may still be running
    assert len(pending_uploads(s3_env, young)) == 2

    old = Catalog(S3Storage(url, {"gc_grace_seconds": 0.001}))
    planned = old.tidy(dry_run=True)
    assert len(planned) == 4 and len(pending_uploads(s3_env, young)) == 2  # dry run
    seen: list[Any] = []
    done = old.tidy(progress=seen.append)  # gc's bar hears of each leftover as it goes
    assert sorted(t.action for t in done) == ["removed"] * 4 and seen == done
    assert pending_uploads(s3_env, young) == []
    assert young.list() == [".lock", "step-000000001"]
    assert len(young.list("step-000000001")) == 2  # the manifest and its data, untouched
    assert tg.verify(f"{url}/step-000000001").files == 1
    assert old.tidy() == []


def test_gc_removes_at_once_what_a_save_this_process_saw_fail_left(url: str) -> None:
    """A save whose abort failed too (``abandon``): its data go at the next tidy in this
    process, without the grace period; a young leftover of another process stays."""
    storage = S3Storage(url, {})
    save_id = uuid.uuid4().hex
    mine = f"step-000000001/{commit_for(storage).data_name('data-0.safetensors', save_id)}"
    storage.put(mine, b"x" * 10)
    commit_for(storage).abandon("step-000000001")
    other = (
        f"step-000000002/{commit_for(storage).data_name('data-0.safetensors', uuid.uuid4().hex)}"
    )
    storage.put(other, b"y" * 10)
    storage.put(".probe-0123", b"", mode="overwrite")  # a preflight whose delete failed
    done = Catalog(storage).tidy()
    assert sorted(t.name for t in done) == [".probe-0123", "step-000000001"]
    assert not storage.exists(mine)
    assert storage.list() == ["step-000000002"]


def test_gc_leaves_a_checkpoint_whose_manifest_does_not_read(url: str) -> None:
    tg.save(f"{url}/ckpt", {"x": torch.ones(3)})
    storage = S3Storage(url, {"gc_grace_seconds": 0.001})
    names = storage.list("ckpt")
    storage.put("ckpt/manifest.json", b"{damaged", mode="overwrite")
    assert Catalog(storage).tidy() == []
    assert storage.list("ckpt") == names  # evidence kept; restore skips it with a warning


def test_gc_without_boto3_still_removes_data_and_says_what_it_left(
    url: str, s3_env: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    storage = S3Storage(url, {"gc_grace_seconds": 0.001})
    key = crashed_save(storage, s3_env, "step-000000003")
    monkeypatch.setitem(sys.modules, "boto3", None)
    with caplog.at_level("WARNING", logger="tardigrade"):
        done = Catalog(storage).tidy()
    assert len(done) == 1 and storage.list("step-000000003") == []  # the data object
    assert any("incomplete multipart uploads not cleaned" in r.getMessage() for r in caplog.records)
    assert any("tardigrade-ckpt[s3]" in r.getMessage() for r in caplog.records)
    monkeypatch.delitem(sys.modules, "boto3")
    assert pending_uploads(s3_env, storage) == [key]
    assert len(Catalog(storage).tidy()) == 1  # with boto3 back: the upload goes too
    assert pending_uploads(s3_env, storage) == []


# -- errors -------------------------------------------------------------------------------


def test_a_missing_bucket_is_named(s3_env: Any) -> None:
    with pytest.raises(StorageError, match=r"bucket 'no-such-bucket' does not exist") as info:
        tg.load("s3://no-such-bucket/ckpt")
    assert "s3://no-such-bucket" in str(info.value)
    with pytest.raises(TardigradeError, match=r"bucket 'no-such-bucket' does not exist"):
        tg.save("s3://no-such-bucket/ckpt", {"x": 1})


def test_bad_credentials_are_named(s3_env: Any, url: str, monkeypatch: Any) -> None:
    tg.save(f"{url}/ckpt", {"x": torch.ones(3)})
    with monkeypatch.context() as m:
        m.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
        with pytest.raises(StorageError, match=r"credentials were refused") as info:
            tg.load(f"{url}/ckpt")
    assert info.value.errno == 13 and f"{url}/ckpt" in str(info.value)


def test_denied_access_is_named(s3_env: Any, url: str) -> None:
    tg.save(f"{url}/ckpt", {"x": torch.ones(3)})
    reader = s3_env.reader_options()
    assert torch.equal(tg.load(f"{url}/ckpt")["x"], torch.ones(3))
    storage = S3Storage(url, reader)
    with storage.open_reader("ckpt/manifest.json"):  # reading is allowed
        pass
    with pytest.raises(StorageError, match=r"access denied") as info:
        storage.put("ckpt2/manifest.json", b"{}", mode="overwrite")
    assert info.value.errno == 13 and f"{url}/ckpt2/manifest.json" in str(info.value)


def test_an_unreachable_endpoint_fails_fast_with_its_address() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    opts = {"endpoint": f"http://127.0.0.1:{port}", "access_key_id": "k",
            "secret_access_key": "s", "max_retries": 1}  # fmt: skip
    storage = S3Storage("s3://bucket/prefix", opts)
    with pytest.raises(
        StorageError, match=rf"cannot reach the S3 endpoint http://127.0.0.1:{port}"
    ):
        storage.stat("x")


def test_the_missing_extra_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "obstore", None)
    with pytest.raises(TardigradeError, match=r"pip install 'tardigrade-ckpt\[s3\]'"):
        open_root("s3://bucket/prefix")


def test_an_unknown_storage_option_lists_the_known_ones() -> None:
    with pytest.raises(
        InvalidArgumentError, match=r"(?s)unknown storage option 'endpont'.*endpoint: URL"
    ):
        S3Storage("s3://bucket/prefix", {"endpont": "http://x"})
    with pytest.raises(
        InvalidArgumentError,
        match=r"part_bytes=1024: give a whole number >= 5242880 \(S3's minimum",
    ):
        S3Storage("s3://bucket/prefix", {"part_bytes": 1024})
    with pytest.raises(InvalidArgumentError, match=r"name a bucket"):
        open_root("s3:///prefix")
    with pytest.raises(InvalidArgumentError, match=r"name a bucket and an optional prefix"):
        open_root("s3://bucket/prefix?versionId=3")
    with pytest.raises(
        InvalidArgumentError, match=r"connect_timeout=0: give a number of seconds > 0"
    ):
        S3Storage("s3://bucket/prefix", {"connect_timeout": 0})


# -- single-writer mode -------------------------------------------------------------------


def test_a_server_without_conditional_writes_runs_single_writer(
    url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The probe finds a server that ignores If-None-Match / If-Match (simulated by a client
    that drops the condition): a warning names the mode, creates and if-match puts still
    refuse what they see, and saves and loads work."""
    import obstore

    real_put = obstore.put

    def unconditional_put(store: Any, path: str, data: Any, **kw: Any) -> Any:
        kw.pop("mode", None)
        return real_put(store, path, data, **kw)

    endpoint = S3Storage(url, {}).config.endpoint
    monkeypatch.setattr(obstore, "put", unconditional_put)
    monkeypatch.setattr(s3mod, "_probed", {})
    storage = S3Storage(url, {})
    with caplog.at_level("WARNING", logger="tardigrade"):
        v1 = storage.put("rec", b"one", mode="create")
    assert any("single-writer mode" in r.getMessage() for r in caplog.records)
    assert s3mod._probed[(endpoint, storage.bucket)] is False
    with pytest.raises(PreconditionFailed):
        storage.put("rec", b"two", mode="create")
    with pytest.raises(PreconditionFailed):
        storage.put("rec", b"two", mode="if_match", expect='"stale"')
    storage.put("rec", b"two", mode="if_match", expect=v1)
    tg.save(f"{url}/ckpt", {"x": torch.ones(3)})
    with pytest.raises(CheckpointExistsError):
        tg.save(f"{url}/ckpt", {"x": torch.zeros(3)})
    assert torch.equal(tg.load(f"{url}/ckpt")["x"], torch.ones(3))


def test_conditional_writes_can_be_switched_off(url: str) -> None:
    storage = S3Storage(url, {"conditional_writes": False})
    storage.put("rec", b"one", mode="create")
    with pytest.raises(PreconditionFailed):
        storage.put("rec", b"two", mode="create")


# -- crashes ------------------------------------------------------------------------------

KILLED_SAVE = """
import os, signal, sys
import torch
import tardigrade as tg
from tardigrade.storage import s3

url, when = sys.argv[1], sys.argv[2]
if when == "mid-upload":  # the second part of a multipart data object is on its way
    send = s3.S3Writer._send
    sent = []
    def _send(self, part):
        send(self, part)
        sent.append(1)
        if len(sent) == 2:
            import time
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
    s3.S3Writer._send = _send
else:  # every data object is complete; the manifest is next
    from tardigrade._commit import ManifestLastCommit
    def commit(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)
    ManifestLastCommit.commit = commit
tg.save(f"{url}/step-000000002", {"w": torch.full((6 * 1024 * 1024,), 2.0)}, step=2)
raise SystemExit("not killed")
"""


@pytest.mark.crash
@pytest.mark.parametrize("when", ["mid-upload", "before-manifest"])
def test_a_save_killed_on_the_store_is_invisible_and_cleaned_up(
    url: str, s3_env: Any, tmp_path: Any, when: str
) -> None:
    import os
    import subprocess

    state = {"w": torch.full((1000,), 1.0)}
    with tg.CheckpointManager(url, state, async_save=False) as mgr:
        mgr.save(1)
    script = tmp_path / "killed.py"
    script.write_text(KILLED_SAVE)
    run = subprocess.run(
        [sys.executable, str(script), url, when], env=dict(os.environ), capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == -9, run.stdout + run.stderr
    storage = S3Storage(url, {})
    catalog = Catalog(storage)
    assert catalog.steps() == [1]
    with pytest.raises(tg.CheckpointNotFoundError):
        tg.load(f"{url}/step-000000002")
    if when == "mid-upload":
        assert len(pending_uploads(s3_env, storage)) == 1
    else:
        assert storage.list("step-000000002")  # its data objects, without a manifest
    # gc after the grace period removes every trace; the committed checkpoint stays.
    done = Catalog(S3Storage(url, {"gc_grace_seconds": 0.001})).tidy()
    assert done and all(t.action == "removed" for t in done)
    assert pending_uploads(s3_env, storage) == []
    assert storage.list() == [".lock", "step-000000001"]
    state = {"w": torch.zeros(1000)}
    with tg.CheckpointManager(url, state, async_save=False) as mgr:
        assert mgr.restore() == 1 and float(state["w"][0]) == 1.0
        state["w"].fill_(2.0)
        mgr.save(2)
        assert mgr.steps() == [1, 2]


# -- damage -------------------------------------------------------------------------------


def test_a_truncated_or_corrupted_object_is_detected_on_load(url: str) -> None:
    tg.save(f"{url}/ckpt", {"w": torch.arange(10_000, dtype=torch.float32)})
    storage = open_root(url)
    data = next(n for n in storage.list("ckpt") if n.endswith(".safetensors"))
    raw = storage.read_bytes(f"ckpt/{data}", 1 << 20)
    storage.put(f"ckpt/{data}", raw[:-100], mode="overwrite")
    with pytest.raises(tg.CorruptCheckpointError, match=r"truncated or modified"):
        tg.load(f"{url}/ckpt")
    flipped = bytearray(raw)
    flipped[-1] ^= 0xFF
    storage.put(f"ckpt/{data}", bytes(flipped), mode="overwrite")
    with pytest.raises(tg.ChecksumMismatchError, match=r"fails its checksum"):
        tg.load(f"{url}/ckpt")


@pytest.mark.slow
def test_the_server_killed_mid_upload_and_restarted(
    own_s3_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server of its own, SIGKILLed while a save's multipart upload is in flight: the save
    fails with a StorageError naming the URL, the committed checkpoint stays intact, and
    after the server restarts (same data) the next save succeeds."""
    server = own_s3_server
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    url = f"s3://{server.bucket}/restart"
    tg.save(f"{url}/step-1", {"w": torch.full((1000,), 1.0)})

    send = s3mod.S3Writer._send
    killed: list[bool] = []

    def kill_after_first_part(self: Any, part: Any) -> None:
        send(self, part)
        if not killed:
            killed.append(True)
            assert server.proc is not None
            server.proc.kill()  # SIGKILL: a crashed server
            server.proc.wait()
            server.proc = None

    monkeypatch.setattr(s3mod.S3Writer, "_send", kill_after_first_part)
    with pytest.raises(TardigradeError, match=r"step-2") as info:
        tg.save(f"{url}/step-2", {"w": torch.full((6 * MiB,), 2.0)})
    assert killed and "cannot reach the S3 endpoint" in str(info.value), info.value
    monkeypatch.setattr(s3mod.S3Writer, "_send", send)

    server.start()  # the same ports and data directory
    assert torch.equal(tg.load(f"{url}/step-1")["w"], torch.full((1000,), 1.0))
    with pytest.raises(tg.CheckpointNotFoundError):
        tg.load(f"{url}/step-2")
    tg.save(f"{url}/step-2", {"w": torch.full((6 * MiB,), 2.0)})
    assert float(tg.load(f"{url}/step-2")["w"][-1]) == 2.0


def test_what_is_not_a_checkpoint_is_named_as_on_a_local_disk(url: str) -> None:
    storage = open_root(url)
    storage.put("file.bin", b"hello", mode="overwrite")
    storage.put("dir/x.bin", b"hello", mode="overwrite")
    storage.put("bad/manifest.json", b'{"format":"tardigrade","junk":1}', mode="overwrite")
    with pytest.raises(tg.CheckpointNotFoundError, match=r"file\.bin: this is a file, not a"):
        tg.load(f"{url}/file.bin")
    with pytest.raises(tg.CheckpointNotFoundError, match=r"dir: .*it has no manifest\.json"):
        tg.load(f"{url}/dir")
    with pytest.raises(tg.CorruptCheckpointError, match=r"bad/manifest\.json: .*not written by"):
        tg.load(f"{url}/bad")


FORKED = """
import os, sys
import torch
import tardigrade as tg

url = sys.argv[1]
tg.save(f"{url}/a", {"x": torch.ones(3)})  # the parent uses S3: the client's threads start
pid = os.fork()
if pid == 0:
    try:
        tg.load(f"{url}/a")
        os._exit(3)
    except tg.StorageError as e:
        print(e, flush=True)
        os._exit(0)
    except BaseException:
        os._exit(4)
_, status = os.waitpid(pid, 0)
assert torch.equal(tg.load(f"{url}/a")["x"], torch.ones(3))  # the parent still works
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_a_process_forked_after_s3_was_used_gets_an_error_not_a_hang(
    url: str, tmp_path: Any
) -> None:
    import os
    import subprocess

    script = tmp_path / "forked.py"
    script.write_text(FORKED)
    run = subprocess.run(
        [sys.executable, str(script), url], env=dict(os.environ), capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert url in run.stdout and "forked after its parent used S3" in run.stdout
    assert "'spawn'" in run.stdout
