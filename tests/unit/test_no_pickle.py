"""No pickle anywhere: the source never reaches for it, and a full round trip works without it.

The scan reads the syntax tree, not the text, so comments and docstrings that mention pickle
(as this one does) do not count, while aliased imports (``import torch as t; t.load``) do.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import math
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tardigrade as tg

SRC = Path(__file__).resolve().parents[2] / "src" / "tardigrade"

# Modules whose only purpose is (de)serialising arbitrary Python objects.
BANNED_MODULES = {
    "pickle",
    "_pickle",
    "cPickle",
    "cloudpickle",
    "dill",
    "marshal",
    "shelve",
    "joblib",
    "pickletools",
    "copyreg",
}
# Dotted names that pickle under the hood.
BANNED_NAMES = {
    "torch.load",
    "torch.save",
    "torch.serialization",
    "numpy.load",  # flagged only when called with allow_pickle (see below)
    "np.load",
}
PICKLE_FREE_WHEN_SAFE = {"numpy.load", "np.load"}


def _root(module: str | None) -> str:
    return (module or "").split(".")[0]


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a Name/Attribute chain, else None."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _is_allow_pickle(kw: ast.keyword) -> bool:
    return kw.arg == "allow_pickle" and not (
        isinstance(kw.value, ast.Constant) and kw.value.value is False
    )


def pickle_uses(source: str, filename: str = "<string>") -> list[str]:
    """Every place in ``source`` that imports or calls a pickling API, as 'file:line: what'."""
    tree = ast.parse(source, filename)
    aliases: dict[str, str] = {}  # local name -> full dotted name it was imported as
    found: list[str] = []

    def flag(node: ast.AST, what: str) -> None:
        found.append(f"{filename}:{getattr(node, 'lineno', '?')}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else _root(a.name)
                if _root(a.name) in BANNED_MODULES:
                    flag(node, f"import {a.name}")
                if a.name in BANNED_NAMES - PICKLE_FREE_WHEN_SAFE:
                    flag(node, f"import {a.name}")
        elif isinstance(node, ast.ImportFrom):
            if _root(node.module) in BANNED_MODULES:
                flag(node, f"from {node.module} import ...")
            for a in node.names:
                full = f"{node.module}.{a.name}"
                aliases[a.asname or a.name] = full
                if any(full == b or full.startswith(b + ".") for b in BANNED_NAMES) and (
                    full not in PICKLE_FREE_WHEN_SAFE
                ):
                    flag(node, f"from {node.module} import {a.name}")

    for node in ast.walk(tree):
        if isinstance(node, (ast.Attribute, ast.Name)) and isinstance(node.ctx, ast.Load):
            dotted = _dotted(node)
            if dotted is None:
                continue
            head, _, rest = dotted.partition(".")
            full = aliases.get(head, head) + ("." + rest if rest else "")
            if isinstance(node, ast.Name) and head not in aliases:
                continue  # a plain local name, not an import
            for banned in BANNED_NAMES - PICKLE_FREE_WHEN_SAFE:
                if full == banned or full.startswith(banned + "."):
                    flag(node, f"use of {full}")
        if isinstance(node, ast.Call):
            if any(_is_allow_pickle(kw) for kw in node.keywords):
                flag(node, f"call with allow_pickle: {ast.unparse(node.func)}")
            callee = _dotted(node.func)
            if (
                callee in ("__import__", "importlib.import_module", "import_module")
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
                and _root(node.args[0].value) in BANNED_MODULES
            ):
                flag(node, f"dynamic import of {node.args[0].value}")
    # Attribute chains are visited once per link (a.b.c, a.b): report each place once.
    return sorted(set(found))


def test_source_tree_exists() -> None:
    files = list(SRC.rglob("*.py"))
    assert (SRC / "__init__.py") in files and len(files) >= 10, files


# The one importer of other tools' formats, which are pickles (a torch.save file, DCP's
# .metadata): it reads them only through torch.load(weights_only=True) and an unpickler that
# admits DCP's metadata classes alone (test_the_importer_unpickles_only_what_it_allows).
IMPORTER = "tardigrade/cli/convert.py"


def test_no_pickle_in_source() -> None:
    found: list[str] = []
    for path in sorted(SRC.rglob("*.py")):
        name = str(path.relative_to(SRC.parent))
        if name != IMPORTER:
            found += pickle_uses(path.read_text(encoding="utf-8"), name)
    assert not found, "pickling APIs in the library:\n" + "\n".join(found)


def test_the_importer_unpickles_only_what_it_allows() -> None:
    """Every torch.load of the importer passes weights_only=True, and its only Unpickler
    subclass overrides find_class; it never calls pickle.load/loads itself."""
    tree = ast.parse((SRC.parent / IMPORTER).read_text(encoding="utf-8"))
    loads = [
        n for n in ast.walk(tree) if isinstance(n, ast.Call) and _dotted(n.func) == "torch.load"
    ]
    assert loads, "the importer reads torch.save files with torch.load"
    for call in loads:
        kw = {k.arg: k.value for k in call.keywords}
        assert isinstance(kw.get("weights_only"), ast.Constant), ast.unparse(call)
        assert kw["weights_only"].value is True, ast.unparse(call)
    calls = {_dotted(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert not calls & {"pickle.load", "pickle.loads", "pickle.Unpickler"}, calls
    unpicklers = [
        c
        for c in ast.walk(tree)
        if isinstance(c, ast.ClassDef) and any(_dotted(b) == "pickle.Unpickler" for b in c.bases)
    ]
    assert len(unpicklers) == 1
    assert "find_class" in {f.name for f in unpicklers[0].body if isinstance(f, ast.FunctionDef)}


@pytest.mark.parametrize(
    "snippet",
    [
        "import pickle",
        "import pickle as p",
        "import cPickle",
        "import _pickle",
        "import dill",
        "import marshal",
        "from pickle import loads",
        "from dill import dumps as d",
        "import torch\ntorch.load(f)",
        "import torch\ntorch.save(x, f)",
        "import torch as th\nth.load(f, weights_only=False)",
        "import torch\nx = torch.load",
        "from torch import load",
        "from torch import save as s",
        "import torch.serialization",
        "from torch.serialization import load",
        "import numpy as np\nnp.load(f, allow_pickle=True)",
        "import numpy\nnumpy.load(f, allow_pickle=flag)",
        "from numpy import load\nload(f, allow_pickle=True)",
        "__import__('pickle')",
        "import importlib\nimportlib.import_module('dill')",
    ],
)
def test_scanner_flags(snippet: str) -> None:
    assert pickle_uses(snippet), snippet


@pytest.mark.parametrize(
    "snippet",
    [
        '"""Never use pickle or torch.load here."""',
        "# import pickle\nx = 1",
        "s = 'torch.load'",
        "import numpy as np\nnp.load(f)",
        "import numpy as np\nnp.load(f, allow_pickle=False)",
        "import torch\ntorch.empty(3)",
        "load = 1\nload",
        "def save(x): ...\nsave(1)",
        "self.torch.load(f)",
    ],
)
def test_scanner_ignores(snippet: str) -> None:
    assert not pickle_uses(snippet), snippet


# ----------------------------------------------------------------------------------------------
# a full round trip with every pickling entry point booby-trapped


def _trap(name: str) -> Any:
    def trapped(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"{name} was called during a Tardigrade save/load")

    return trapped


def _trap_class(cls: type, name: str) -> type:
    """A subclass (so modules that subclass it at import still can) that refuses to run."""
    return type(cls.__name__, (cls,), {"__init__": _trap(name)})


@pytest.fixture
def no_pickle(monkeypatch: pytest.MonkeyPatch) -> None:
    import _pickle

    # Warm up first: torch imports some modules lazily on the first optimizer step, and the
    # import system may legitimately touch these APIs (marshal reads .pyc files, so it is left
    # alone here; the static scan above covers it).
    _train_step(*_make(0))
    for mod in (pickle, _pickle):
        for name in ("load", "loads", "dump", "dumps"):
            monkeypatch.setattr(mod, name, _trap(f"{mod.__name__}.{name}"))
        for name in ("Pickler", "Unpickler"):
            monkeypatch.setattr(
                mod, name, _trap_class(getattr(mod, name), f"{mod.__name__}.{name}")
            )
    monkeypatch.setattr(torch, "load", _trap("torch.load"))
    monkeypatch.setattr(torch, "save", _trap("torch.save"))
    monkeypatch.setattr(np, "load", _trap("numpy.load"))
    real_import, real_import_module = builtins.__import__, importlib.import_module

    def check(name: str) -> None:
        if name.split(".")[0] in ("dill", "cloudpickle", "joblib", "shelve"):
            raise AssertionError(f"import of {name} during a Tardigrade save/load")

    def guarded_import(name: str, *args: Any, **kwargs: Any) -> Any:
        check(name)
        return real_import(name, *args, **kwargs)

    def guarded_import_module(name: str, package: str | None = None) -> Any:
        check(name)
        return real_import_module(name, package)

    monkeypatch.setattr(builtins, "__import__", guarded_import)
    monkeypatch.setattr(importlib, "import_module", guarded_import_module)


def test_traps_are_armed(no_pickle: None) -> None:
    import io

    for call in (
        lambda: pickle.dumps(1),
        lambda: pickle.loads(b"."),
        lambda: pickle.Unpickler(io.BytesIO()),
        lambda: torch.save(torch.ones(1), io.BytesIO()),
        lambda: torch.load(io.BytesIO()),
        lambda: importlib.import_module("shelve"),
    ):
        with pytest.raises(AssertionError, match="during a Tardigrade save/load"):
            call()


def _train_step(model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()


def _make(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optim


def _assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b)
    else:
        assert type(a) is type(b) and a == b


def test_round_trip_without_pickle(tmp_path: Path, no_pickle: None) -> None:
    model, optim = _make(0)
    for _ in range(2):
        _train_step(model, optim)
    extras = {"step": 2, "lr": (1e-2, float("nan")), "tag": b"\x00\xff", "arr": np.arange(5)}
    tg.save(tmp_path / "ckpt", {"model": model, "optim": optim, "extras": extras})
    assert tg.verify(tmp_path / "ckpt").tensors > 0

    model2, optim2 = _make(1)
    _train_step(model2, optim2)  # so the optimizer has state to overwrite
    live_extras = {"step": 0, "lr": (0.0, 0.0), "tag": b"", "arr": np.zeros(5, dtype=np.int64)}
    tg.load(tmp_path / "ckpt", into={"model": model2, "optim": optim2, "extras": live_extras})

    _assert_same(model.state_dict(), model2.state_dict())
    _assert_same(optim.state_dict(), optim2.state_dict())
    _assert_same(extras, live_extras)
    plain = tg.load(tmp_path / "ckpt")  # no live state: a plain tree of state dicts
    _assert_same(model.state_dict(), plain["model"])
    _assert_same(optim.state_dict(), plain["optim"])
    _assert_same(extras, plain["extras"])
    # The restored pair trains on exactly like the original.
    torch.manual_seed(7)
    _train_step(model, optim)
    torch.manual_seed(7)
    _train_step(model2, optim2)
    _assert_same(model.state_dict(), model2.state_dict())
