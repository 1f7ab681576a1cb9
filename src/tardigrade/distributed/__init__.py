"""Distributed checkpointing: what ``save``/``load`` do when ``torch.distributed`` is initialized.

Every step that involves more than one rank goes through :class:`~._collectives.Ranks`, which
turns an error on any rank into the same error on every rank, within a timeout. Public here:
``loopback_store``, the rendezvous a program that spawns its own ranks on one machine serves.
"""

from __future__ import annotations

from typing import Any

__all__ = ["loopback_store"]


def __getattr__(name: str) -> Any:
    # On first use: importing this package (as every distributed module does) stays cheap.
    if name == "loopback_store":
        from ._launch import loopback_store

        return loopback_store
    raise AttributeError(f"module 'tardigrade.distributed' has no attribute {name!r}")
