"""How many storage requests listing a root's committed steps costs (bounded by operations)."""

from __future__ import annotations

import uuid

import torch

import tardigrade as tg
from tardigrade import Catalog
from tardigrade.storage import open_root
from tardigrade.testing import FaultyStorage


def test_listing_a_store_s_steps_asks_once_per_step() -> None:
    # On a store a name is a directory exactly when objects lie under it: the manifest's stat
    # answers whether a step is committed (it cost three requests a step: HEAD, LIST, HEAD).
    url = f"memory://catalog-{uuid.uuid4().hex[:12]}/root"
    for step in (1, 2, 3):
        tg.save(f"{url}/step-{step:09d}", {"w": torch.ones(2)}, step=step)
    open_root(url).put("step-000000004/stray", b"no manifest", mode="create")
    faulty = FaultyStorage(url)
    assert Catalog(faulty).steps() == [1, 2, 3]
    assert faulty.ops.count("list") == 1
    assert faulty.ops.count("stat") == 4, faulty.ops
    open_root(url).delete("")
