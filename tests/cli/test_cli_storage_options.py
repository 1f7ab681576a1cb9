"""``--storage-option KEY=VALUE`` on the commands that take URLs, against the session's S3
server, with its endpoint and credentials given ONLY on the command line (no AWS_* variable).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import tardigrade as tg
from tardigrade.cli import main
from tardigrade.storage import open_root
from tardigrade.testing import S3Server

pytestmark = pytest.mark.s3

SRC = str(Path(__file__).resolve().parents[2] / "src")


def cli(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def flags(options: dict[str, Any]) -> list[str]:
    """``options`` as the command line gives them."""
    return [f"--storage-option={k}={v}" for k, v in options.items()]


@pytest.fixture
def no_aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)


@pytest.fixture
def root(s3_server: S3Server, no_aws_env: None) -> Iterator[str]:
    url = f"s3://{s3_server.bucket}/cli-opts-{uuid.uuid4().hex[:12]}"
    opts = s3_server.options()
    live = {"w": torch.zeros(16), "step": 0}
    with tg.CheckpointManager(url, live, async_save=False, storage_options=opts) as mgr:
        for step in (10, 20):
            live["w"].fill_(float(step))
            live["step"] = step
            mgr.save(step)
    yield url
    open_root(url, opts).delete("")


def test_every_command_reads_s3_with_options_from_the_command_line(
    root: str, s3_server: S3Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    opts = flags(s3_server.options())
    a, b = f"{root}/step-000000010", f"{root}/step-000000020"
    rc, out, err = cli(capsys, "ls", "--json", root, *opts)
    assert rc == 0, err
    assert [(e["step"], e["status"]) for e in json.loads(out)] == [
        (10, "committed"),
        (20, "committed"),
    ]
    rc, out, err = cli(capsys, "inspect", b, *opts)
    assert rc == 0, err
    assert out.splitlines()[0] == b and "step: 20" in out
    rc, out, err = cli(capsys, "verify", "-q", root, *opts)
    assert rc == 0, err
    assert "2 of 2 checkpoint(s) OK" in out
    rc, out, err = cli(capsys, "verify", "-q", a, *opts)
    assert rc == 0 and out.startswith("OK"), err
    rc, out, err = cli(capsys, "diff", "--json", a, b, *opts)
    assert rc == 1, err  # they differ
    assert sorted(d["path"] for d in json.loads(out)["diffs"]) == ["state['step']", "state['w']"]
    rc, out, err = cli(capsys, "export", "-q", b, tmp_path / "w.safetensors", *opts)
    assert rc == 0, err
    assert torch.equal(load_file(str(tmp_path / "w.safetensors"))["w"], torch.full((16,), 20.0))
    # gc: a preflight's probe left at the root is removed (no grace period for those).
    open_root(root, s3_server.options()).put(".probe-left", b"")
    rc, out, err = cli(capsys, "gc", root, *opts)
    assert rc == 0, err
    assert "removed" in out and ".probe-left" in out
    assert not open_root(root, s3_server.options()).exists(".probe-left")


def test_diff_gives_the_options_to_the_url_side_only(
    root: str, s3_server: S3Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    local = tmp_path / "here"
    tg.save(local, {"w": torch.full((16,), 20.0), "step": 20})
    rc, out, err = cli(capsys, "diff", local, f"{root}/step-000000020", *flags(s3_server.options()))
    assert rc == 0, err
    assert "identical" in out


def test_convert_writes_to_s3_with_options(
    root: str, s3_server: S3Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "model.pt"
    torch.save({"w": torch.arange(6.0)}, source)
    dest = f"{root}/converted"
    rc, _out, err = cli(capsys, "convert", "-q", source, dest, *flags(s3_server.options()))
    assert rc == 0, err
    tree = tg.load(dest, storage_options=s3_server.options())
    assert torch.equal(tree["w"], torch.arange(6.0))


def test_wrong_credentials_on_the_command_line_fail_naming_the_url(
    root: str, s3_server: S3Server, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = flags(s3_server.options(secret_access_key="not-the-secret"))
    for argv in (["ls", root], ["verify", "-q", f"{root}/step-000000010"]):
        rc, out, err = cli(capsys, *argv, *bad)
        assert rc == 1, (argv, out)
        assert root in err and "credentials" in err, (argv, err)


def test_bad_storage_option_syntax_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("endpoint", "=x", "has space=1"):
        rc, _out, err = cli(capsys, "ls", "s3://bucket/x", "--storage-option", bad)
        assert rc == 2, bad
        assert "--storage-option" in err and "expected KEY=VALUE" in err and repr(bad) in err
    rc, _out, err = cli(
        capsys,
        "ls",
        "s3://bucket/x",
        "--storage-option",
        "region=a",
        "--storage-option",
        "region=b",
    )
    assert rc == 2 and "region is given twice" in err


def test_storage_options_for_a_local_path_are_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, _out, err = cli(capsys, "ls", tmp_path, "--storage-option", "endpoint=http://127.0.0.1:1")
    assert rc == 2
    assert str(tmp_path) in err and "local path" in err


def test_the_installed_command_takes_storage_options(root: str, s3_server: S3Server) -> None:
    """The real entry point, in a process whose environment has no AWS_* variable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, "-m", "tardigrade.cli", "ls", root, *flags(s3_server.options())],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "step-000000020" in done.stdout and "2 committed" in done.stdout


def test_secret_option_values_are_never_echoed(capsys: pytest.CaptureFixture[str]) -> None:
    secret = "hunter2-AKIAsecretvalue"
    rc, out, err = cli(
        capsys,
        "ls",
        "s3://bucket/x",
        f"--storage-option=secret_access_key={secret}",
        "--storage-option=secret_access_key=other-value",
    )
    assert rc == 2 and "secret_access_key is given twice" in err
    assert secret not in err + out and "other-value" not in err + out
    for bad in (f"secret_access_key:{secret}", f"session_token {secret}", f"password{secret}"):
        rc, out, err = cli(capsys, "ls", "s3://bucket/x", "--storage-option", bad)
        assert rc == 2 and "expected KEY=VALUE" in err and "not shown" in err, err
        assert secret not in err + out
    rc, out, err = cli(capsys, "ls", "s3://bucket/x", f"--storage-option=access_key_id=a\n{secret}")
    assert rc == 2 and "access_key_id is not valid credential text" in err
    assert secret not in err + out


def test_a_malformed_endpoint_is_a_usage_error_without_a_traceback(
    capsys: pytest.CaptureFixture[str], no_aws_env: None
) -> None:
    rc, _out, err = cli(
        capsys, "ls", "s3://bucket/x", "--storage-option", "endpoint=http://127.0.0.1:99999"
    )
    assert rc == 2, err
    assert "Traceback" not in err and "panicked" not in err
    assert "endpoint='http://127.0.0.1:99999' is not a valid S3 endpoint" in err
