"""``tardigrade inspect CKPT``: what a checkpoint holds, from its manifest alone.

No tensor byte is read: the manifest records every tensor's dtype and shape and keeps small
values (step counters, learning rates, ...) inline, so this is instant for any checkpoint size.
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import re
from typing import Any

from .. import read_manifest
from ..errors import CorruptCheckpointError, InvalidArgumentError, TardigradeError
from ..format.manifest import MANIFEST, tree_for
from ..format.names import COMPLEX_STORED
from ..format.sizes import ITEMSIZE
from ..format.tree import decode, float_node
from ..storage import storage_for
from ._command import command
from ._listing import location_text, require_single
from ._output import human_bytes, table
from ._storage_options import storage_options

HELP = "show what a checkpoint holds (reads the manifest only)"

# Lists of plain values longer than this are summarised instead of printed in full.
INLINE_ITEMS = 8
MAX_TEXT = 80
SCALARS = (
    "none",
    "bool",
    "int",
    "float",
    "str",
    "bytes",
    "dtype",
    "complex",
    "npscalar",
    "size",
    "device",
    "generator",
)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = command(
        sub,
        "inspect",
        help=HELP,
        description=(
            "Summarise a checkpoint from its manifest, without reading tensor data: versions, "
            "step, epoch, metrics, files and a tree of the saved state with each tensor's "
            "dtype and shape and the value of each small leaf."
        ),
        run=run,
        locations=[("ckpt", "CKPT", "checkpoint directory (holds manifest.json), or its URL")],
        json="print the whole manifest as JSON",
    )
    p.add_argument(
        "--depth", type=int, default=None, metavar="N", help="expand the tree N levels deep"
    )
    p.add_argument(
        "--rank",
        type=int,
        default=None,
        metavar="R",
        help="of a distributed checkpoint's tg.PerRank values, show only rank R's",
    )


def run(args: argparse.Namespace) -> int:
    if args.depth is not None and args.depth < 1:
        raise InvalidArgumentError(f"--depth {args.depth}: must be at least 1")
    options = storage_options(args, args.ckpt)
    require_single(args.ckpt, options)
    m = read_manifest(args.ckpt, options)
    where = location_text(args.ckpt, options)  # an absolute path, or the URL
    ranks = _shown_ranks(m, args.rank, where)
    if args.json:
        print(json.dumps(m, indent=2))
        return 0
    # The manifest's tree is untrusted input: validate it whole before walking it. Each
    # tg.PerRank part is checked in rank 0's view of the tree and then on its own.
    decode_node(tree_for(m, 0, "rank0", where), where)
    for r, parts in enumerate(m.get("per_rank") or []):
        if len(parts) != len(m["per_rank"][0]):
            raise CorruptCheckpointError(
                f"{where}: rank {r} has {len(parts)} tg.PerRank part(s) and rank 0 has "
                f"{len(m['per_rank'][0])}; the manifest is damaged or was not written by "
                "Tardigrade"
            )
        for part in parts:
            decode_node(part, where)
    try:
        head = summary(where, m, _manifest_nbytes(args.ckpt, options))
        tree = render_tree(m, depth=args.depth)
        per_rank = render_per_rank(m, ranks, depth=args.depth)
    except (KeyError, TypeError, ValueError, RecursionError) as e:
        raise CorruptCheckpointError(
            f"{where}: the manifest is malformed ({type(e).__name__}: {e}); it was damaged or not "
            "written by Tardigrade"
        ) from None
    print("\n".join(head))
    print()
    print("state")
    print("\n".join(tree))
    if per_rank:
        print()
        print("\n".join(per_rank))
    return 0


def decode_node(node: Any, where: str = "manifest") -> Any:
    """``Checkpoint.decode_node`` without torch: torch values (a dtype, Size, device or
    Generator) come back as stand-ins whose repr is torch's, so inspect never imports torch."""
    return decode(node, lambda n, p: None, where, stand_ins=True)


def _manifest_nbytes(location: str, options: dict[str, Any] | None) -> int:
    """Bytes of the manifest object in storage (0 if it cannot be seen any more)."""
    try:
        storage, name = storage_for(location, options)
        st = storage.stat(f"{name}/{MANIFEST}")
    except (OSError, TardigradeError):
        return 0
    return st.size if st is not None else 0


def _shown_ranks(m: dict[str, Any], rank: int | None, ckpt: str) -> list[int]:
    """The ranks whose tg.PerRank values to show: all of them, or the one asked for."""
    saved = len(m.get("per_rank") or [])
    if rank is None:
        return list(range(saved))
    world = m.get("world_size", 1)
    if not 0 <= rank < world:
        raise InvalidArgumentError(
            f"--rank {rank}: {ckpt} was saved by {world} rank(s); give a rank from 0 to {world - 1}"
        )
    return [rank] if saved else []


def tensor_nbytes(info: dict[str, Any]) -> int:
    return math.prod(info["shape"]) * ITEMSIZE[info["dtype"]]


def summary(path: str, m: dict[str, Any], manifest_bytes: int) -> list[str]:
    versions = m.get("versions") or {}
    files = m.get("files") or []
    tensors = m.get("tensors") or []
    file_bytes = sum(f["size"] for f in files)
    lines = [
        path,
        f"  format        tardigrade v{m.get('format_version')}",
        "  written by    " + ", ".join(f"{k} {v}" for k, v in versions.items()),
        f"  step          {_or_dash(m.get('step'))}",
        f"  epoch         {_or_dash(m.get('epoch'))}",
        f"  created       {_or_dash(m.get('created'))}",
        f"  world size    {_or_dash(m.get('world_size'))}",
    ]
    if m.get("per_rank"):
        lines.append(
            f"  per rank      {len(m['per_rank'][0])} tg.PerRank value(s) on each of "
            f"{len(m['per_rank'])} ranks"
        )
    if m.get("metrics"):
        lines.append(
            "  metrics       " + ", ".join(f"{k}={v:.6g}" for k, v in m["metrics"].items())
        )
    if m.get("metadata"):
        lines.append("  metadata      " + _clip(json.dumps(m["metadata"]), 200))
    lines.append(
        f"  tensors       {len(tensors)} ({human_bytes(sum(tensor_nbytes(t) for t in tensors))})"
    )
    lines.append(
        f"  total size    {human_bytes(file_bytes + manifest_bytes)} "
        f"({file_bytes + manifest_bytes} bytes: {len(files)} data file(s) + manifest "
        f"{human_bytes(manifest_bytes)})"
    )
    lines.append("  files")
    rows = [[f["name"], human_bytes(f["size"])] for f in files]
    rows.append([MANIFEST, human_bytes(manifest_bytes)])
    lines.append(table(rows, ["NAME", "SIZE"], indent="    "))
    return lines


def _or_dash(v: object) -> str:
    return "-" if v is None else str(v)


def _clip(s: str, n: int = MAX_TEXT) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


def scalar_text(node: dict[str, Any], short: bool = False) -> str:
    """A small leaf's value as Python would print it (``short``: floats to 6 digits)."""
    t, v = node.get("t"), node.get("v")
    try:
        if t == "none":
            return "None"
        if t == "bool":
            return repr(v)
        if t == "int":
            return _clip(str(v), 40)
        if t == "float":
            x = float.fromhex(str(v))
            return f"{x:.6g}" if short else repr(x)
        if t == "str":
            return _clip(repr(v))
        if t == "bytes":
            raw = base64.b64decode(str(v))
            return f"bytes[{len(raw)}]" if len(raw) > 16 else repr(raw)
        if t == "dtype":
            return f"torch.{v}"
        if t == "tuple" and isinstance(v, list):  # a dict key or set element
            body = ", ".join(scalar_text(x) for x in v if isinstance(x, dict))
            return _clip(f"({body}{',' if len(v) == 1 else ''})")
        if t in ("set", "frozenset") and isinstance(v, list):
            # in stored order (sorted when saved), so the text is the same in every run
            body = ", ".join(scalar_text(x) for x in v if isinstance(x, dict))
            return _clip(f"{{{body}}}" if t == "set" and v else f"{t}({{{body}}})")
        if t == "generator":
            device = node.get("device")
            kind = device.get("type") if isinstance(device, dict) else None
            return (
                f"torch.Generator({kind})" if isinstance(kind, str) else "<malformed 'generator'>"
            )
        if t in ("complex", "npscalar", "size", "device"):
            return _clip(repr(decode_node(node)))
    except (TypeError, ValueError, TardigradeError):
        pass
    return f"<malformed {t!r} value>"


def key_text(node: Any) -> str:
    if isinstance(node, dict) and node.get("t") == "str" and isinstance(node.get("v"), str):
        return node["v"]
    return scalar_text(node) if isinstance(node, dict) else "?"


_RANK_FILE = re.compile(r"data-r(\d+)-")


def layout_text(info: dict[str, Any], world_size: int, files: list[Any] | None = None) -> str:
    """How the saving ranks held a tensor: ``sharded (3 chunks from 2 ranks)``, ``per rank 1``.

    Said only of distributed checkpoints, so single-process listings read as they always did.
    ``files`` is the manifest's file list (format 5 chunks name files by their index in it).
    """
    layout = info.get("layout", "replicated")
    if layout == "sharded":
        chunks = info.get("chunks") or []
        if isinstance(chunks, dict):  # format 5: columns
            column = chunks.get("file")
            count = len(str(chunks.get("checksum", ""))) // 16
            indices = column if isinstance(column, list) else [column] * count
            names = [f.get("name") if isinstance(f, dict) else "" for f in files or []]
            chunks = [{"file": names[i] if type(i) is int and 0 <= i < len(names) else ""}
                      for i in indices]  # fmt: skip
        writers = set()
        for c in chunks:
            found = _RANK_FILE.match(str(c.get("file") if isinstance(c, dict) else ""))
            writers.add(int(found.group(1)) if found else -1)
        return f"  sharded ({len(chunks)} chunk(s) from {len(writers)} rank(s))"
    if layout == "per_rank":
        return f"  per rank {info.get('rank')}"
    return "  replicated" if world_size > 1 else ""


def _tensor_text(
    node: dict[str, Any],
    tensors: list[dict[str, Any]],
    world_size: int = 1,
    files: list[Any] | None = None,
) -> str:
    e = node.get("e")
    if type(e) is not int or not 0 <= e < len(tensors):
        return "<tensor missing from the manifest>"
    info = tensors[e]
    view = node.get("view")
    shape = view["shape"] if isinstance(view, dict) else info["shape"]
    kind = "ndarray " if node.get("t") == "ndarray" else ""
    nbytes = math.prod(shape) * ITEMSIZE[info["dtype"]]
    extra = " (view of a shared tensor)" if view else ""
    dtype = info["dtype"]
    if node.get("complex") in COMPLEX_STORED:  # stored as its real view: [..., 2]
        dtype, shape = node["complex"], shape[:-1]
    layout = layout_text(info, world_size, files)
    return f"{kind}{dtype}{list(shape)}  {human_bytes(nbytes)}{extra}{layout}"


def _sparse_text(node: dict[str, Any], tensors: list[dict[str, Any]]) -> str:
    """``sparse coo F32[3, 4]  nnz=5  120 B``: the values' dtype, the size, the stored bytes."""
    parts = [c for c in node.get("v") or () if isinstance(c, dict)]
    shapes = []
    for c in parts:
        e = c.get("e")
        if type(e) is not int or not 0 <= e < len(tensors):
            return "<tensor missing from the manifest>"
        view = c.get("view")
        shapes.append(view["shape"] if isinstance(view, dict) else tensors[e]["shape"])
    if not parts:
        return "<malformed sparse tensor>"
    nbytes = sum(
        math.prod(shape) * ITEMSIZE[tensors[c["e"]]["dtype"]]
        for c, shape in zip(parts, shapes, strict=True)
    )
    values, dtype = parts[-1], tensors[parts[-1]["e"]]["dtype"]
    if values.get("complex") in COMPLEX_STORED:
        dtype = values["complex"]
    nnz = shapes[-1][0] if shapes[-1] else 0
    return (
        f"sparse {node.get('layout')} {dtype}{node.get('size')}  nnz={nnz}  {human_bytes(nbytes)}"
    )


def _plain_list_text(tag: str, items: list[dict[str, Any]]) -> str:
    kinds = sorted({str(i.get("t")) for i in items})
    if len(items) <= INLINE_ITEMS:
        body = ", ".join(scalar_text(i) for i in items)
        if tag == "tuple" and len(items) == 1:
            body += ","
        return _clip(f"({body})" if tag == "tuple" else f"[{body}]", 120)
    head = ", ".join(scalar_text(i, short=True) for i in items[:3])
    last = scalar_text(items[-1], short=True)
    return f"{tag}[{len(items)}] of {'/'.join(kinds)}: [{head}, ..., {last}]"


def _packed_text(node: dict[str, Any]) -> str:
    """A packed list or tuple (format 6), shown as the same list stored item by item is."""
    try:
        items = decode_node(node)
    except TardigradeError:
        return "<malformed 'packed' value>"
    shown = [*items[:3], items[-1]] if len(items) > INLINE_ITEMS else list(items)
    # Packed items are all ints (within int64) or all floats: the nodes flatten() gives them.
    nodes = [float_node(x) if type(x) is float else {"t": "int", "v": str(x)} for x in shown]
    if len(items) > INLINE_ITEMS:
        # Only the count, the kind and the ends are shown; every item has the first's kind.
        nodes[3:3] = [nodes[0]] * (len(items) - 4)
    return _plain_list_text(str(node.get("as")), nodes)


def render_tree(
    m: dict[str, Any],
    depth: int | None = None,
    root: dict[str, Any] | None = None,
    label: str = "",
    level: int = -1,
) -> list[str]:
    """The state tree (or the subtree ``root``) as indented ``key: value`` lines."""
    tensors = m.get("tensors") or []
    world_size = m.get("world_size", 1)
    files = m.get("files") or []
    lines: list[str] = []

    def children(node: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        t, v = node.get("t"), node.get("v")
        if t in ("dict", "odict") and isinstance(v, list):
            return [
                (key_text(item[0]), item[1])
                for item in v
                if isinstance(item, list) and len(item) == 2 and isinstance(item[1], dict)
            ]
        if t == "counter" and isinstance(v, list):
            return [
                (key_text(item[0]), item[1])
                for item in v
                if isinstance(item, list) and len(item) == 2 and isinstance(item[1], dict)
            ]
        if t in ("list", "tuple") and isinstance(v, list):
            return [(f"[{i}]", c) for i, c in enumerate(v) if isinstance(c, dict)]
        return []

    def walk(node: dict[str, Any], label: str, level: int) -> None:
        pad = "  " * level
        t = node.get("t")
        cls = None
        while t == "stateful" and isinstance(node.get("v"), dict):
            cls = cls or node.get("cls")
            node = node["v"]
            t = node.get("t")
        prefix = f"{pad}{label}: " if label else pad
        tag = f"<{cls}> " if cls else ""
        if t in SCALARS:
            lines.append(f"{prefix}{tag}{scalar_text(node)}")
            return
        if t in ("tensor", "ndarray"):
            lines.append(f"{prefix}{tag}{_tensor_text(node, tensors, world_size, files)}")
            return
        if t == "packed":
            lines.append(f"{prefix}{tag}{_packed_text(node)}")
            return
        if t == "per_rank":
            lines.append(f"{prefix}{tag}tg.PerRank #{node.get('i')} (one value per rank, below)")
            return
        if t == "sparse":
            lines.append(f"{prefix}{tag}{_sparse_text(node, tensors)}")
            return
        if t in ("set", "frozenset"):
            items = node.get("v") or []
            text = scalar_text(node) if len(items) <= INLINE_ITEMS else f"{t}[{len(items)}]"
            lines.append(f"{prefix}{tag}{text}")
            return
        kids = children(node)
        if t in ("list", "tuple") and all(c.get("t") in SCALARS for _, c in kids):
            lines.append(f"{prefix}{tag}{_plain_list_text(t, [c for _, c in kids])}")
            return
        if t in ("dict", "odict", "counter", "list", "tuple"):
            noun = {"dict": "dict", "odict": "dict", "counter": "Counter"}.get(t, t)
            lines.append(f"{prefix}{tag}{noun}[{len(kids)}]" if label or tag else "")
            if depth is not None and level + 1 >= depth:
                if kids:
                    lines.append(f"{pad}  ...")
                return
            for k, c in kids:
                walk(c, k, level + 1)
            return
        lines.append(f"{prefix}{tag}<unknown node {t!r}>")

    tree = m.get("tree") if root is None else root
    if isinstance(tree, dict):
        walk(tree, label, level)
    return [ln for ln in lines if ln]


def per_rank_paths(tree: dict[str, Any]) -> dict[int, tuple[str, ...]]:
    """Where each ``tg.PerRank`` part sits in the state tree: part number -> its printed keys."""
    found: dict[int, tuple[str, ...]] = {}
    stack: list[tuple[Any, tuple[str, ...]]] = [(tree, ())]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        t, v = node.get("t"), node.get("v")
        if t == "per_rank" and type(node.get("i")) is int:
            found[node["i"]] = path
        elif t == "stateful":
            stack.append((v, path))
        elif t in ("dict", "odict", "counter") and isinstance(v, list):
            for item in v:
                if isinstance(item, list) and len(item) == 2:
                    stack.append((item[1], (*path, key_text(item[0]))))
        elif t in ("list", "tuple") and isinstance(v, list):
            stack.extend((c, (*path, str(i))) for i, c in enumerate(v))
    return found


def render_per_rank(m: dict[str, Any], ranks: list[int], depth: int | None = None) -> list[str]:
    """Each of ``ranks``' ``tg.PerRank`` values, under the path they hold in the state."""
    per_rank = m.get("per_rank") or []
    if not ranks:
        return []
    paths = per_rank_paths(m["tree"])
    lines = [f"per rank ({len(per_rank)} ranks)"]
    for r in ranks:
        lines.append(f"  rank {r}")
        for i, part in enumerate(per_rank[r]):
            label = "/".join(paths[i]) or "(the whole state)" if i in paths else f"#{i}"
            part_lines = render_tree(m, depth=depth, root=part, label=label, level=0)
            lines += ["    " + ln for ln in part_lines]
    return lines
