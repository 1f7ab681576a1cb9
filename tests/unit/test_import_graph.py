"""The package's imports go one way: no module imports (even lazily) one that imports it back.

Cycles make import order matter (moving one line breaks ``import tardigrade``) and hide layering
mistakes, e.g. the save pipeline reaching up into the async facade.
"""

from __future__ import annotations

import ast
from pathlib import Path

import tardigrade

ROOT = Path(tardigrade.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """Package modules ``path`` imports anywhere (top level or inside functions)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            target = ".".join([*base, *([node.module] if node.module else [])])
            out.update(t for t in [target] if t in modules)
            out.update(f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            out.update(n for n in names if n in modules)
    # The package facade is imported by everything implicitly; only its own edges count.
    out.discard("tardigrade")
    out.discard(name)
    return out


def test_no_import_cycles() -> None:
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {m: imports_of(p, set(files)) for m, p in files.items()}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                cycles.append([*stack[stack.index(dep) :], dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)
    assert "tardigrade._save" not in graph["tardigrade._async"]


# Layers, lowest first: a module may import its own layer and those below, never one above.
# Storage moves bytes and knows nothing of what they are; the format knows bytes on disk;
# what names mean (the layout, the commit strategies: ``_commit``) and everything else
# (pipelines, manager, CLI, testing) sits on both.
LAYERS = [
    ("tardigrade.errors", "tardigrade._version", "tardigrade._units"),
    ("tardigrade.storage",),
    ("tardigrade.format",),
]


def layer_of(module: str) -> int:
    for i, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return len(LAYERS)


def test_no_upward_imports() -> None:
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    upward = [
        f"{m} -> {dep}"
        for m, p in sorted(files.items())
        for dep in sorted(imports_of(p, set(files)))
        if layer_of(dep) > layer_of(m)
    ]
    assert not upward, "imports that run upward: " + "; ".join(upward)


# The names of a root's layout: what a checkpoint's commit record is called, where saves stage,
# where the lease lives. They belong to ``tardigrade._commit``, never to the byte layer.
LAYOUT_NAMES = ("manifest.json", ".lock", ".tmp-", ".abandoned.json", ".fences.json")


def layout_names_in(path: Path) -> list[str]:
    """String constants of ``path`` that are, or start with, a layout name (messages that
    merely mention one are prose, not a name the code uses)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        value = node.value if isinstance(node, ast.Constant) else None
        if isinstance(value, str) and any(value == n or value.startswith(n) for n in LAYOUT_NAMES):
            found.append(f"{path.name}:{node.lineno}: {value!r}")
    return found


def test_storage_is_bytes_only() -> None:
    """No module of ``tardigrade.storage`` imports the format or names a file of the layout:
    a backend stores and moves bytes; what they are is decided above it."""
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    storage = {m: p for m, p in files.items() if layer_of(m) == 1}
    assert len(storage) >= 8, sorted(storage)  # the check sees the package
    into_format = [
        f"{m} -> {dep}"
        for m, p in sorted(storage.items())
        for dep in sorted(imports_of(p, set(files)))
        if dep.startswith("tardigrade.format")
    ]
    assert not into_format, "storage imports the format: " + "; ".join(into_format)
    named = [hit for p in storage.values() for hit in layout_names_in(p)]
    assert not named, "layout names in the byte layer: " + "; ".join(named)
    assert layout_names_in(ROOT / "_commit.py"), "the check sees the names where they live"
