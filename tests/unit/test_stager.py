"""The one staging path (``_stager.Stager``): copies queued, made and waited for in one place.

Every save's copies to host memory go through it: an async save's file images and a
collective save's whole tensors into pooled slabs, a synchronous save's device tensors piece
by piece. Device copies are checked on a GPU by ``make gpu-check`` (tests/gpu).
"""

from __future__ import annotations

import pytest
import torch

from tardigrade import _stager
from tardigrade._stager import Stager, synchronize
from tardigrade.errors import SaveError


def test_host_copies_are_made_when_waited_for_in_pieces_and_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_stager, "COPY_PIECE", 1000)  # many pieces, several threads
    src = torch.randint(0, 256, (10_000,), dtype=torch.uint8)
    dst = torch.zeros(10_000, dtype=torch.uint8)
    stager = Stager()
    stager.copy(dst, src)
    assert stager.pending and not torch.equal(dst, src), "a host copy is made at wait()"
    stager.wait(host=False)  # device copies only: the host ones stay queued
    assert stager.pending and not torch.equal(dst, src)
    stager.wait()
    assert not stager.pending and torch.equal(dst, src)


def test_to_host_returns_the_bytes_at_once() -> None:
    src = torch.arange(300, dtype=torch.int32).view(torch.uint8)
    out = Stager().to_host(src)
    assert out.device.type == "cpu" and torch.equal(out, src) and out.data_ptr() != src.data_ptr()


def test_a_device_without_synchronize_is_refused_by_name() -> None:
    with pytest.raises(SaveError, match=r"torch\.nodevice\.synchronize is missing"):
        synchronize({_Fake()})  # type: ignore[arg-type]


class _Fake:
    type = "nodevice"
    index = None

    def __hash__(self) -> int:
        return 1

    def __str__(self) -> str:
        return "nodevice"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_copies_land_before_wait_returns() -> None:
    src = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, device="cuda")
    dst = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    stager = Stager()
    stager.copy(dst, src)
    stager.wait()
    src.zero_()  # after the wait: the copy is not affected
    assert dst.any() and not stager.pending
