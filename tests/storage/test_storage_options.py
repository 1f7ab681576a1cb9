"""``storage_options`` on every public entry point that takes a location.

The S3 tests give the session server's endpoint and credentials ONLY as ``storage_options``:
no AWS_* variable is set, so each entry point works only if it passes its options through to
the backend. Wrong credentials fail with a TardigradeError naming the URL.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tardigrade as tg
from tardigrade.errors import InvalidArgumentError, StorageError, TardigradeError
from tardigrade.storage import open_root
from tardigrade.testing import S3Server

pytestmark = pytest.mark.s3


def state(value: float = 1.0) -> dict[str, Any]:
    return {"w": torch.full((64,), value), "b": torch.arange(8), "step": int(value)}


@pytest.fixture
def no_aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No AWS_* variable: what the code under test knows of the server is its options."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)


@pytest.fixture
def root(s3_server: S3Server, no_aws_env: None) -> Iterator[str]:
    url = f"s3://{s3_server.bucket}/opts-{uuid.uuid4().hex[:12]}"
    yield url
    open_root(url, s3_server.options()).delete("")


def test_save_load_verify_read_manifest_and_open_take_storage_options(
    root: str, s3_server: S3Server
) -> None:
    opts = s3_server.options()
    ckpt = f"{root}/step-1"
    res = tg.save(ckpt, state(1.0), step=1, storage_options=opts)
    assert isinstance(res, tg.SaveResult) and res.path == ckpt
    tree = tg.load(ckpt, storage_options=opts)
    assert torch.equal(tree["w"], torch.full((64,), 1.0)) and tree["step"] == 1
    live = state(0.0)
    tg.load(ckpt, into=live, keys=["w"], storage_options=opts)
    assert torch.equal(live["w"], torch.full((64,), 1.0))
    assert tg.verify(ckpt, storage_options=opts).tensors == 2
    assert tg.read_manifest(ckpt, storage_options=opts)["step"] == 1
    assert tg.Checkpoint.open(ckpt, storage_options=opts).step == 1
    listed = tg.Catalog(root, storage_options=opts).listing()
    assert [(c.name, c.status, c.step) for c in listed] == [("step-1", "committed", 1)]


def test_async_saves_take_storage_options(root: str, s3_server: S3Server) -> None:
    opts = s3_server.options()
    fut = tg.save(f"{root}/a", state(2.0), async_=True, storage_options=opts)
    assert isinstance(fut, tg.SaveFuture)
    fut.result(timeout=120)
    with tg.AsyncCheckpointer() as ckpt:
        fut = ckpt.save(f"{root}/b", state(3.0), step=3, storage_options=opts)
        assert fut is not None
        fut.result(timeout=120)
    assert tg.load(f"{root}/a", storage_options=opts)["step"] == 2
    assert tg.load(f"{root}/b", storage_options=opts)["step"] == 3


def test_a_manager_on_a_store_takes_storage_options(root: str, s3_server: S3Server) -> None:
    opts = s3_server.options()
    live = state(0.0)
    with tg.CheckpointManager(root, live, keep_last=1, storage_options=opts) as mgr:
        for step in (1, 2):
            live.update(state(float(step)))
            mgr.save(step)
        mgr.wait()
        assert mgr.steps() == [2]
        assert mgr.load(2, keys=["step"])["step"] == 2
    fresh = state(0.0)
    with tg.CheckpointManager(root, fresh, storage_options=opts) as mgr:
        assert mgr.restore() == 2
    assert torch.equal(fresh["w"], torch.full((64,), 2.0))
    # JobRunner takes the manager, and with it the manager's location and options.
    epochs: list[int] = []
    job = tg.Job(init=lambda: None, epoch=epochs.append, stop=lambda: len(epochs) >= 2)
    with tg.CheckpointManager(f"{root}/job", state(0.0), storage_options=opts) as mgr:
        assert tg.JobRunner(job, mgr).run() == 2
        mgr.wait()
        assert mgr.steps() == [0, 1, 2]


def test_uploads_take_their_own_storage_options(
    root: str, s3_server: S3Server, tmp_path: Path
) -> None:
    opts = s3_server.options()
    live = state(0.0)
    with tg.CheckpointManager(
        tmp_path / "a", live, upload_to=root, upload_storage_options=opts, async_save=False
    ) as mgr:
        live.update(state(5.0))
        mgr.save(5)
    assert tg.Catalog(root, storage_options=opts).steps() == [5]
    fresh = state(0.0)  # a new machine: an empty local directory, the remote tier
    with tg.CheckpointManager(
        tmp_path / "b", fresh, upload_to=root, upload_storage_options=opts
    ) as mgr:
        assert mgr.restore() == 5
    assert torch.equal(fresh["w"], torch.full((64,), 5.0))


def test_options_meant_for_the_upload_tier_are_refused_on_a_local_directory(
    s3_server: S3Server, tmp_path: Path
) -> None:
    with pytest.raises(InvalidArgumentError, match="take none") as e:
        tg.CheckpointManager(
            tmp_path / "a", state(), upload_to="memory://x/y", storage_options=s3_server.options()
        )
    assert str(tmp_path / "a") in str(e.value) and "upload_storage_options" in str(e.value)
    with pytest.raises(InvalidArgumentError, match="take none"):
        tg.save(tmp_path / "b", state(), storage_options={"endpoint": "http://127.0.0.1:1"})
    with pytest.raises(InvalidArgumentError, match="memory://"):
        tg.load("memory://x/y", storage_options={"endpoint": "http://127.0.0.1:1"})
    assert not (tmp_path / "b").exists()


def test_wrong_credentials_fail_naming_the_url(root: str, s3_server: S3Server) -> None:
    good = s3_server.options()
    tg.save(f"{root}/ok", state(), storage_options=good)
    bad = s3_server.options(secret_access_key="not-the-secret")
    with pytest.raises(TardigradeError) as e:
        tg.save(f"{root}/new", state(), storage_options=bad)
    assert root in str(e.value) and "credentials" in str(e.value)
    for call in (
        lambda: tg.load(f"{root}/ok", storage_options=bad),
        lambda: tg.verify(f"{root}/ok", storage_options=bad),
        lambda: tg.read_manifest(f"{root}/ok", storage_options=bad),
    ):
        with pytest.raises(StorageError) as e:
            call()
        assert f"{root}/ok" in str(e.value) and "credentials" in str(e.value)
    with pytest.raises(TardigradeError) as e:
        tg.CheckpointManager(root, state(), storage_options=bad)
    assert root in str(e.value)
    assert not open_root(root, good).exists("new")  # nothing was written


BAD_OPTIONS = [
    ({"endpoint": "http://127.0.0.1:99999"}, "endpoint='http://127.0.0.1:99999' is not a valid"),
    ({"endpoint": "http://[::1"}, "endpoint='http://[::1' is not a valid S3 endpoint"),
    ({"endpoint": "http://a b:80"}, "is not a valid S3 endpoint (it holds a space"),
    ({"endpoint": "ftp://host"}, "does not start with http:// or https://"),
    ({"region": "us east"}, "region='us east' is not a region name"),
    ({"max_retries": "abc"}, "max_retries='abc': give a whole number >= 0"),
    ({"part_bytes": "abc"}, "part_bytes='abc': give a whole number >= 5242880"),
    ({"part_bytes": 1024}, "part_bytes=1024: give a whole number >= 5242880"),
    ({"parts_in_flight": "x"}, "parts_in_flight='x': give a whole number"),
    ({"range_bytes": 1.5}, "range_bytes=1.5: give a whole number"),
    ({"gc_grace_seconds": "abc"}, "gc_grace_seconds='abc': give a number of seconds >= 0"),
    ({"read_timeout": "soon"}, "read_timeout='soon': give a number of seconds > 0"),
    ({"access_key_id": "a\nb"}, "access_key_id is not valid credential text"),
]


@pytest.mark.parametrize(("options", "message"), BAD_OPTIONS)
def test_malformed_s3_options_raise_tardigrade_errors_naming_the_url_and_option(
    options: dict[str, Any], message: str, no_aws_env: None, tmp_path: Path
) -> None:
    """Every entry point: no Rust panic (a BaseException), no bare ValueError."""
    url = "s3://bucket/run"
    calls = [
        lambda: tg.save(f"{url}/step-1", state(), storage_options=options),
        lambda: tg.save(f"{url}/step-1", state(), async_=True, storage_options=options),
        lambda: tg.load(f"{url}/step-1", storage_options=options),
        lambda: tg.CheckpointManager(url, state(), storage_options=options),
        lambda: tg.CheckpointManager(
            tmp_path / "local", state(), upload_to=url, upload_storage_options=options
        ),
    ]
    for call in calls:
        try:
            call()
        except BaseException as e:  # a panic is a BaseException: catch it to fail clearly
            assert isinstance(e, InvalidArgumentError), f"{type(e).__mro__}: {e}"
            assert url in str(e) and message in str(e), str(e)
        else:
            raise AssertionError("no error")


def test_the_endpoint_from_the_environment_is_checked_naming_the_variable(
    no_aws_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:99999")
    with pytest.raises(InvalidArgumentError, match="environment variable AWS_ENDPOINT_URL="):
        tg.load("s3://bucket/run/step-1")


def test_a_client_panic_becomes_a_tardigrade_error_naming_the_url(
    root: str, s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The boundary itself: whatever configuration the checks miss, a panic of the Rust
    client never escapes as a BaseException."""
    import obstore

    opts = s3_server.options()
    tg.save(f"{root}/ok", state(), storage_options=opts)
    panic = type(_a_panic())

    def panics(*args: Any, **kwargs: Any) -> Any:
        raise panic("request valid: InvalidUri(InvalidUri(InvalidUriChar))")

    monkeypatch.setattr(obstore, "head", panics)
    with pytest.raises(InvalidArgumentError, match="the S3 client rejected its configuration"):
        tg.load(f"{root}/ok", storage_options=opts)


def _a_panic() -> BaseException:
    """An instance of pyo3's PanicException (not importable: taken from a real panic)."""
    import obstore.store

    store = obstore.store.S3Store("b", endpoint="http://127.0.0.1:99999", access_key_id="k",
                                  secret_access_key="s", region="r", allow_http=True)  # fmt: skip
    try:
        obstore.head(store, "x")
    except BaseException as e:
        assert type(e).__name__ == "PanicException", type(e)
        return e
    raise AssertionError("no panic")


def test_no_credentials_at_all_is_said_in_plain_words(root: str, s3_server: S3Server) -> None:
    opts = {"endpoint": s3_server.endpoint, "region": "us-east-1", "allow_http": True}
    with pytest.raises(StorageError) as e:
        tg.save(f"{root}/step-1", state(), storage_options=opts)
    text = str(e.value)
    assert "no S3 credentials found" in text, text
    assert "access_key_id" in text and "AWS_ACCESS_KEY_ID" in text


@pytest.mark.parametrize("url", ["memory://grace/run", "tgfs://grace/run"])
def test_every_backend_checks_its_grace_period(url: str) -> None:
    # tgfs:// is fsspec's memory filesystem, registered by tests/storage/conftest.py.
    with pytest.raises(InvalidArgumentError, match=rf"{url}: storage option gc_grace_seconds="):
        tg.save(f"{url}/step-1", state(), storage_options={"gc_grace_seconds": "soon"})
