"""What pip and a user's editor see: dependency metadata, typing marker, documented parameters."""

from __future__ import annotations

import importlib.metadata
import inspect
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import tardigrade as tg

# The distribution name on the package index (`tardigrade` there is an unrelated 2018 package);
# the import name and the console script are `tardigrade`.
DIST = "tardigrade-ckpt"
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_the_distribution_is_ours_and_imports_as_tardigrade() -> None:
    assert DIST in importlib.metadata.packages_distributions()["tardigrade"]
    assert re.search(rf'^name = "{DIST}"$', PYPROJECT.read_text(), re.M)
    scripts = importlib.metadata.distribution(DIST).entry_points.select(group="console_scripts")
    assert [(s.name, s.value) for s in scripts] == [("tardigrade", "tardigrade.cli:main")]


def test_torch_requirement_is_a_floor_without_a_cap() -> None:
    # pip must be able to install Tardigrade next to any newer torch without touching it.
    reqs = [Requirement(r) for r in importlib.metadata.requires(DIST) or []]
    (torch_req,) = [r for r in reqs if r.name == "torch" and r.marker is None]
    assert torch_req.specifier.contains("2.3.0")
    assert not torch_req.specifier.contains("2.2.2"), "the code needs torch.uint16/32/64 (2.3+)"
    for newer in ("2.13.0", "2.14.0", "2.15.0", "2.15.1", "3.0.0"):
        assert torch_req.specifier.contains(newer), f"torch {newer} would be refused or replaced"


def test_metadata_version_is_the_package_version() -> None:
    assert importlib.metadata.version(DIST) == tg.__version__


def test_no_extra_without_a_use() -> None:
    extras = importlib.metadata.metadata(DIST).get_all("Provides-Extra") or []
    expected = ["accelerate", "bench", "docs", "fsspec", "lightning", "s3", "test", "transformers"]
    assert sorted(extras) == expected


def test_the_package_ships_its_typing_marker() -> None:
    assert (Path(tg.__file__).parent / "py.typed").is_file()


@pytest.mark.parametrize(
    "fn",
    [
        tg.save,
        tg.load,
        tg.verify,
        tg.read_manifest,
        tg.CheckpointManager,
        tg.AsyncCheckpointer,
        tg.Checkpoint.open,
        tg.Checkpoint.tree,
        tg.Checkpoint.read,
        tg.Checkpoint.read_into,
    ],
    ids=lambda f: f.__qualname__,
)
def test_help_documents_every_parameter(fn: object) -> None:
    doc = inspect.getdoc(fn) or ""
    params = [
        p
        for p in inspect.signature(fn).parameters.values()  # type: ignore[arg-type]
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name != "self"
    ]
    # Each parameter is named in the docstring as ``name`` (or ``name=...``).
    missing = [p.name for p in params if not re.search(rf"``{re.escape(p.name)}(``|=)", doc)]
    assert not missing, f"help({fn.__name__}) does not document {missing}"  # type: ignore[attr-defined]
