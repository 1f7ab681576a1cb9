"""The package's architecture, checked on its source (``ast``, nothing is imported or run).

1. Every byte of checkpoint storage goes through the storage contract: outside
   ``tardigrade/storage/`` no module calls ``open``, the file functions of ``os``/``os.path``,
   ``shutil``, ``tempfile`` or ``pathlib``'s file methods, except the few places below that
   touch files that are not checkpoint data, each with its reason. A second backend (an object
   store) then works everywhere by implementing the contract, and a new ``os.listdir`` on a
   checkpoint directory fails here instead of on S3.
2. The ``tardigrade`` command uses only public API (the facade ``tardigrade``, public modules
   such as ``tardigrade.storage`` and ``tardigrade.format``, its own ``cli`` helpers): what it
   needs, users' tools can have too.

``test_import_graph.py`` checks the import graph itself (no cycle, no upward import).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import tardigrade

ROOT = Path(tardigrade.__file__).parent


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


# os and os.path functions that touch the file system (pure path arithmetic is fine).
OS_FILE_CALLS = _names(
    """open fdopen remove unlink rmdir removedirs rename renames replace makedirs mkdir
    listdir scandir walk fwalk stat lstat statvfs fstat fsync fdatasync truncate ftruncate
    read write pread pwrite preadv pwritev link symlink readlink chmod chown utime sendfile
    copy_file_range access posix_fallocate mkfifo mknod"""
)
OS_PATH_FILE_CALLS = _names(
    """exists lexists isdir isfile islink ismount getsize getmtime getatime getctime
    realpath samefile"""
)
PATHLIB_FILE_METHODS = _names(
    """open read_text read_bytes write_text write_bytes mkdir rmdir unlink touch iterdir glob
    rglob exists is_dir is_file is_symlink stat lstat rename replace symlink_to chmod
    resolve"""
)

# Where file I/O outside storage/ is legitimate: module (or package) -> (calls, why). Keep it
# short; anything on checkpoint data belongs behind the storage contract (tardigrade.storage,
# tg.Catalog, tg.Checkpoint).
ALLOWED: dict[str, tuple[frozenset[str], str]] = {
    "tardigrade.cli": (
        frozenset({"os.open"}),
        "points stdout at /dev/null after a broken pipe (`tardigrade ls | head`)",
    ),
    "tardigrade.cli._output": (
        frozenset({"open"}),
        "reads /proc/self/io for the progress bar's byte count",
    ),
    "tardigrade.cli.export": (
        _names(
            """os.path.isdir os.path.lexists os.makedirs tempfile.mkstemp os.fdopen os.fsync
            os.chmod os.replace os.path.exists os.unlink os.path.getsize"""
        ),
        "writes the user's OUT.safetensors, a plain local file, never checkpoint data",
    ),
    "tardigrade.cli.convert": (
        _names(
            """os.path.isdir os.path.isfile os.path.exists os.path.getsize os.listdir open
            os.path.realpath os.path.lexists os.stat"""
        ),
        "reads the user's SOURCE (a torch.save file, a DCP or safetensors folder) to import it, "
        "never Tardigrade checkpoint data; the checkpoint it makes is written with tg.save",
    ),
    "tardigrade.cli.demo": (
        frozenset({"tempfile.TemporaryDirectory", "tempfile.TemporaryFile"}),
        "the demo's scratch directory and its child processes' logs",
    ),
    "tardigrade.cli._demo_run": (
        _names(
            "os.path.islink os.path.exists os.path.isdir os.listdir shutil.rmtree os.makedirs open"
        ),
        "makes, marks and clears the demo's own directory as a whole (refusing any other)",
    ),
    "tardigrade.cli._demo_ranks": (
        frozenset({"tempfile.mkdtemp", "tempfile.TemporaryDirectory", "open", "os.path.exists"}),
        "the ranks demo's scratch directory and its ranks' log files",
    ),
    "tardigrade.testing._kill": (
        _names(
            """Path.exists Path.glob Path.read_bytes Path.read_text Path.replace open os.listdir
            os.path.isdir shutil.rmtree tempfile.mkdtemp"""
        ),
        "kill_during: its report directory (the kill point's killed.json, each process's exit "
        "counts), /proc for the process group's members",
    ),
    "tardigrade.testing._killpoint": (
        _names("open os.open os.write"),
        "the dying process's report (written with os.write, no buffering, before the SIGKILL)",
    ),
    "tardigrade.testing._resume": (
        _names("Path.exists Path.mkdir Path.read_text open shutil.rmtree tempfile.mkdtemp"),
        "assert_resumes_exactly: its scratch directory and the scripts' loss logs",
    ),
    "tardigrade.testing._s3server": (
        _names("Path.exists Path.mkdir Path.read_text Path.write_text open shutil.which"),
        "the S3 server's data directory, config and log; finding the weed binary",
    ),
    "tardigrade.testing.s3server": (
        _names("Path.mkdir shutil.rmtree tempfile.mkdtemp"),
        "`python -m tardigrade.testing.s3server`: the server's own data directory",
    ),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_sources() -> Iterator[tuple[str, ast.Module]]:
    for path in sorted(ROOT.rglob("*.py")):
        yield module_name(path), ast.parse(path.read_text(), str(path))


def file_io_calls(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, call) of each file-system call in a module's source, in line order.

    ``pathlib`` methods are told by name only, in modules that import ``pathlib`` (the check
    cannot know an object's type): there, ``storage.read_bytes(...)`` counts too.
    """
    modules = {}  # local name -> "os" | "os.path" | "shutil" | "tempfile" | "io"
    functions = {}  # a function imported by name -> its dotted name
    pathlib = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in ("os", "os.path", "shutil", "tempfile", "io"):
                    # ``import os.path`` binds ``os``; ``import os.path as p`` binds os.path.
                    modules[a.asname or a.name.split(".")[0]] = (
                        a.name if a.asname else a.name.split(".")[0]
                    )
                pathlib = pathlib or a.name == "pathlib"
        elif isinstance(node, ast.ImportFrom) and not node.level:
            pathlib = pathlib or node.module == "pathlib"
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if node.module == "os" and a.name == "path":
                    modules[a.asname or "path"] = "os.path"
                elif _is_file_call(full):
                    functions[a.asname or a.name] = full
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = None
        if isinstance(f, ast.Name):
            name = "open" if f.id == "open" else functions.get(f.id)
        elif isinstance(f, ast.Attribute):
            owner = _dotted(f.value)
            if owner is not None and owner.split(".")[0] in modules:
                head, _, rest = owner.partition(".")
                owner = ".".join(p for p in (modules[head], rest) if p)
                name = f"{owner}.{f.attr}" if _is_file_call(f"{owner}.{f.attr}") else None
            elif pathlib and f.attr in PATHLIB_FILE_METHODS:
                name = f"Path.{f.attr}"
        if name is not None:
            found.append((node.lineno, name))
    return sorted(found)


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return f"{inner}.{node.attr}" if inner else None
    return None


def _is_file_call(full: str) -> bool:
    module, _, fn = full.rpartition(".")
    return (
        (module == "os" and fn in OS_FILE_CALLS)
        or (module == "os.path" and fn in OS_PATH_FILE_CALLS)
        or module in ("shutil", "tempfile")
        or full == "io.open"
    )


def _allowed(module: str, call: str) -> bool:
    for prefix, (calls, _why) in ALLOWED.items():
        if module == prefix:
            return call in calls
    return False


def test_no_file_io_outside_storage() -> None:
    offending = [
        f"{module}:{line}: {call}"
        for module, tree in package_sources()
        if not module.startswith("tardigrade.storage")
        for line, call in file_io_calls(tree)
        if not _allowed(module, call)
    ]
    assert not offending, (
        "file I/O outside tardigrade/storage/ (move it behind the storage contract: Storage, "
        "tg.Catalog, tg.Checkpoint; or, if it is not checkpoint data, add it to ALLOWED with "
        "the reason):\n  " + "\n  ".join(offending)
    )


def test_every_allowance_is_still_needed() -> None:
    # An allowance nothing uses any more is a hole left open for the next bypass.
    used = {
        (module, call)
        for module, tree in package_sources()
        for _, call in file_io_calls(tree)
        if _allowed(module, call)
    }
    stale = [f"{m}: {c}" for m, (calls, _) in ALLOWED.items() for c in calls if (m, c) not in used]
    assert not stale, "ALLOWED lists calls no module makes any more: " + ", ".join(stale)


def private_names_used(
    module: str, tree: ast.Module, home: str = "tardigrade.cli"
) -> list[tuple[int, str]]:
    """(line, name) of each private name of the package outside ``home`` (the subpackage the
    module belongs to, whose own helpers it may use) that the module imports or reaches as an
    attribute of ``tardigrade``."""
    package = module if module == home else module.rsplit(".", 1)[0]
    found = []
    aliases = set()  # local names bound to the tardigrade package
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "tardigrade":
                    if a.name == "tardigrade":
                        aliases.add(a.asname or "tardigrade")
                    if _private_module(a.name, home):
                        found.append((node.lineno, a.name))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if target.split(".")[0] != "tardigrade":
                continue
            if _private_module(target, home):
                found.append((node.lineno, target))
                continue
            for a in node.names:
                if _private_name(a.name) and not _own(f"{target}.{a.name}", home):
                    found.append((node.lineno, f"{target}.{a.name}"))
                elif target == "tardigrade" and a.name == "tardigrade":
                    aliases.add(a.asname or a.name)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and _private_name(node.attr)
        ):
            found.append((node.lineno, f"tardigrade.{node.attr}"))
    return found


def _private_name(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own(module: str, home: str = "tardigrade.cli") -> bool:
    """A subpackage's own helpers (``tardigrade.cli._output``) are its to use."""
    return module == home or module.startswith(home + ".")


def _private_module(module: str, home: str = "tardigrade.cli") -> bool:
    return not _own(module, home) and any(_private_name(p) for p in module.split(".")[1:])


def test_the_cli_imports_no_private_name() -> None:
    offending = [
        f"{module}:{line}: {name}"
        for module, tree in package_sources()
        if _own(module)
        for line, name in private_names_used(module, tree)
    ]
    assert not offending, (
        "the CLI uses private names (give it public API instead: the tardigrade facade, "
        "tg.Checkpoint, tg.Catalog, public modules):\n  " + "\n  ".join(offending)
    )


def test_the_integrations_import_no_private_name() -> None:
    # The framework drop-ins are what a user could write: the public API only (issue 25), so
    # that a change inside the package cannot break them unseen.
    home = "tardigrade.integrations"
    offending = [
        f"{module}:{line}: {name}"
        for module, tree in package_sources()
        if _own(module, home)
        for line, name in private_names_used(module, tree, home)
    ]
    assert not offending, (
        "the integrations use private names (use the tardigrade facade and public modules):\n  "
        + "\n  ".join(offending)
    )


def test_format_and_storage_modules_say_what_they_export() -> None:
    # Each public module of format/ and storage/ lists its API in __all__ (issue 25): a name
    # another module imports from it is listed there, or private (a leading underscore).
    modules = {
        module: tree
        for module, tree in package_sources()
        if module.startswith(("tardigrade.format.", "tardigrade.storage."))
        and not module.rsplit(".", 1)[1].startswith("_")
    }
    exported: dict[str, set[str]] = {}
    for module, tree in modules.items():
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
            ):
                exported[module] = set(ast.literal_eval(node.value))
    missing = sorted(set(modules) - set(exported))
    assert not missing, "modules without __all__: " + ", ".join(missing)
    unlisted = []
    for module, tree in package_sources():
        # A package's __init__ resolves relative imports from the package itself.
        is_package = (ROOT.parent / module.replace(".", "/") / "__init__.py").is_file()
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                parts = module.split(".")
                base = parts[: len(parts) - node.level + is_package]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if target in exported and target != module:
                unlisted += [
                    f"{module} imports {target}.{a.name}"
                    for a in node.names
                    if not a.name.startswith("_") and a.name not in exported[target]
                ]
    assert not unlisted, "imported, not in __all__: " + ", ".join(unlisted)


def test_every_type_ignore_says_why() -> None:
    # mypy runs in `make test` (pyproject's [tool.mypy]); what it is told to pass over must
    # say why, beside it, so that the next reader can tell a limit of the checker from a bug.
    bare = [
        f"{path.relative_to(ROOT.parent)}:{n}"
        for path in sorted(ROOT.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "type: ignore" in line and not re.search(r"type: ignore\[[a-z, -]+\]  # \S", line)
    ]
    assert not bare, "type: ignore without an error code and a reason: " + ", ".join(bare)


def test_the_checks_see_what_they_forbid() -> None:
    # The checks are only as good as their parsing: each form of a violation is caught.
    io = ast.parse(
        "import os, shutil\nimport os.path as osp\nfrom os import listdir\n"
        "from pathlib import Path\nimport tempfile as tf\n"
        "open('x')\nos.rename('a', 'b')\nosp.isdir('x')\nos.path.join('a', 'b')\n"
        "listdir('.')\nshutil.rmtree('x')\nPath('x').read_bytes()\ntf.mkdtemp()\n"
        "storage.read_bytes('x', 1)\n"
    )
    assert [c for _, c in file_io_calls(io)] == [
        "open", "os.rename", "os.path.isdir", "os.listdir", "shutil.rmtree", "Path.read_bytes",
        "tempfile.mkdtemp", "Path.read_bytes",
    ]  # fmt: skip
    no_pathlib = ast.parse("storage.read_bytes('x', 1)\nos.path.join('a')\n")
    assert file_io_calls(no_pathlib) == []
    cli = ast.parse(
        "import tardigrade as tg\nimport tardigrade._load\n"
        "from .. import Checkpoint, __version__\nfrom .._open import open_manifest\n"
        "from ..distributed._launch import loopback_store\nfrom ..format import _x\n"
        "from ._output import table\nfrom ..storage import storage_for\ntg._save.save\n"
    )
    assert [n for _, n in private_names_used("tardigrade.cli.diff", cli)] == [
        "tardigrade._load", "tardigrade._open", "tardigrade.distributed._launch",
        "tardigrade.format._x", "tardigrade._save",
    ]  # fmt: skip


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_the_manager_facade_stays_a_facade() -> None:
    # The facade wires collaborators and answers the public calls; restore, tiers, the
    # abandoned timeline, outcomes and retention each live in a module of their own (issue 25).
    # Grown past these bounds, it is taking their work back.
    trees = dict(package_sources())
    facade = trees["tardigrade.manager._checkpoint_manager"]
    (cls,) = [
        n for n in ast.walk(facade) if isinstance(n, ast.ClassDef) and n.name == "CheckpointManager"
    ]
    assert cls.end_lineno is not None and cls.end_lineno - cls.lineno + 1 <= 600
    long = [
        f"{module}.{f.name}: {f.end_lineno - f.lineno + 1} lines"
        for module, tree in trees.items()
        if module.startswith("tardigrade.manager")
        for f in _functions(tree)
        if f.end_lineno is not None and f.end_lineno - f.lineno + 1 > 60
    ]
    assert not long, "methods over 60 lines in the manager: " + ", ".join(long)
    # No branch on one tier's kind: the tiers are asked as a whole (``Tiers``).
    kinds = {"MemoryTier", "RemoteTier", "RamTier", "Uploader"}
    named = sorted({n.id for n in ast.walk(cls) if isinstance(n, ast.Name) and n.id in kinds})
    assert named == ["MemoryTier", "RemoteTier"], named  # ram_tier_stats and uploads only
    integration = ast.parse(
        "from .. import load, save\nfrom .. import _save\nfrom .._catalog import Catalog\n"
        "from ._plain import storable\nfrom ..data import _BatchCount\n"
    )
    home = "tardigrade.integrations"
    assert [n for _, n in private_names_used("tardigrade.integrations.x", integration, home)] == [
        "tardigrade._save", "tardigrade._catalog", "tardigrade.data._BatchCount",
    ]  # fmt: skip


def test_the_agreement_decides_and_the_split_does_the_work() -> None:
    """The manager's ``Agreement`` makes decisions the same on every rank, and collectives;
    dispatching saves, copying tiers, forking groups and sizing staging are its ``Split``'s
    (issue 25). A method of the latter kind added back to the agreement fails here."""
    trees = dict(package_sources())

    def abstract(module: str, name: str) -> set[str]:
        (cls,) = [
            n for n in ast.walk(trees[module]) if isinstance(n, ast.ClassDef) and n.name == name
        ]
        return {f.name for f in cls.body if isinstance(f, ast.FunctionDef)}

    decisions = abstract("tardigrade.manager._agreement", "Agreement")
    assert decisions == {
        "shared", "on_coordinator", "level", "record_finished", "before_save", "outcome",
        "live_touched", "barrier", "everywhere",
    }, decisions  # fmt: skip
    assert abstract("tardigrade.manager._split", "Split") == {
        "copy", "fork", "async_saves", "staging_need", "submit",
    }  # fmt: skip
