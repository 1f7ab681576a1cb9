"""Starting ranks on this machine: a rendezvous store served on the loopback interface only.

The demo, the test harness and the benchmark all spawn their own ranks. ``TCPStore`` would
listen on every interface; handed a socket already bound to 127.0.0.1 it listens there alone.
"""

from __future__ import annotations

import contextlib
import datetime
import socket
from collections.abc import Iterator

import torch.distributed as dist


@contextlib.contextmanager
def loopback_store(timeout: float) -> Iterator[int]:
    """Serve a TCPStore on 127.0.0.1 only, from this process; yields its port.

    It lives in the calling process, so it outlives any rank that dies or is killed.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        port = listener.getsockname()[1]
        store = dist.TCPStore(
            "127.0.0.1",
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout),
            master_listen_fd=listener.detach(),  # the store owns and closes it from here
        )
    try:
        yield port
    finally:
        del store
