"""``python -m tardigrade.testing.s3server``: the documented way to try s3:// locally."""

from __future__ import annotations

import signal
import subprocess
import sys
import uuid

import pytest
import torch

import tardigrade as tg

pytestmark = [pytest.mark.s3, pytest.mark.timeout(180)]


def test_the_server_command_prints_its_environment_and_stops_on_sigterm() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tardigrade.testing.s3server"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        env: dict[str, str] = {}
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("export "):
                key, _, value = line.removeprefix("export ").strip().partition("=")
                env[key] = value
            if line.startswith("# then:"):
                break
        assert {"AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(env)
        options = {
            "endpoint": env["AWS_ENDPOINT_URL"],
            "access_key_id": env["AWS_ACCESS_KEY_ID"],
            "secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
            "region": env["AWS_REGION"],
        }
        url = f"s3://tardigrade-test/try-{uuid.uuid4().hex[:8]}/step-1"
        tg.save(url, {"w": torch.arange(4)}, storage_options=options)
        assert torch.equal(tg.load(url, storage_options=options)["w"], torch.arange(4))
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
