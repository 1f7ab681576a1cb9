"""``tardigrade export CKPT OUT.safetensors``: the tensors of a checkpoint as one safetensors file.

Tensors are named by their path in the state joined with dots (``model.fc.weight``), so the
file loads with ``safetensors.torch.load_file`` anywhere, without Tardigrade.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from .._load import _load
from .._open import open_manifest
from .._read import DEFAULT_READ_THREADS
from .._tree import decode
from ..errors import CheckpointExistsError, InvalidArgumentError
from ._listing import require_single
from ._output import human_bytes
from .inspect import per_rank_paths

HELP = "write a checkpoint's tensors (e.g. the model weights) to one .safetensors file"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help=HELP,
        description=(
            "Write the tensors of CKPT (or of the subtrees named by --keys) into one "
            "safetensors file, named by their path in the state joined with dots, e.g. "
            "'model.fc.weight'. Values that are not tensors (counters, learning rates) are "
            "left out. Only the selected tensors are read, and each is verified. A sharded "
            "tensor of a distributed checkpoint is written whole, gathered from its pieces. "
            "Values saved as tg.PerRank differ per rank and are left out unless --rank names "
            "the rank whose values to write."
        ),
    )
    p.add_argument("ckpt", metavar="CKPT", help="checkpoint directory")
    p.add_argument("out", metavar="OUT.safetensors", help="file to write")
    p.add_argument(
        "--keys",
        action="append",
        metavar="KEY[,KEY...]",
        help="export only these subtrees (repeat or separate with commas); nested keys are "
        "joined with '/', e.g. model or extra/ema; default: every tensor",
    )
    p.add_argument(
        "--no-prefix",
        action="store_true",
        help="name tensors relative to the single KEY given (fc.weight, not model.fc.weight), "
        "so the file loads straight into the module",
    )
    p.add_argument(
        "--rank",
        type=int,
        default=None,
        metavar="R",
        help="of a distributed checkpoint, also export rank R's tg.PerRank values "
        "(default: leave per-rank values out)",
    )
    p.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    p.set_defaults(run=run)


def resolve_key(tree: dict[str, Any], text: str, where: str) -> tuple[tuple[Any, ...], int]:
    """``"optim/state/0"`` -> ``("optim", "state", 0)``, matching keys by their printed form.

    Also returns how many leading keys are dict keys, which ``load(keys=...)`` can select;
    the rest (list indices) are applied to the loaded value.
    """
    parts = text.split("/")
    if not text or any(not p for p in parts):
        raise InvalidArgumentError(f"--keys {text!r}: empty key; name keys like model or extra/ema")
    path: list[Any] = []
    loadable = None
    node: Any = tree
    for part in parts:
        while isinstance(node, dict) and node.get("t") == "stateful":
            node = node.get("v")
        if not isinstance(node, dict) or node.get("t") not in ("dict", "odict", "list", "tuple"):
            raise InvalidArgumentError(
                f"{where}: --keys {text!r}: {'/'.join(map(str, path)) or 'the state'} holds no "
                f"keys to select {part!r} from"
            )
        if node["t"] in ("list", "tuple"):
            if not part.isdigit() or int(part) >= len(node["v"]):
                raise InvalidArgumentError(
                    f"{where}: --keys {text!r}: {part!r} is not an index of the "
                    f"{len(node['v'])}-item {node['t']} at {'/'.join(map(str, path))}"
                )
            loadable = len(path) if loadable is None else loadable
            path.append(int(part))
            node = node["v"][int(part)]
            continue
        found = None
        available = []
        for item in node["v"]:
            k = load_key(item[0])
            available.append(str(k))
            if str(k) == part and (found is None or k == part):
                found = (k, item[1])
        if found is None:
            raise InvalidArgumentError(
                f"{where}: --keys {text!r}: no key {part!r} in "
                f"{'/'.join(map(str, path)) or 'the state'}; available: {available[:20]}"
            )
        path.append(found[0])
        node = found[1]
    return tuple(path), len(path) if loadable is None else loadable


def load_key(node: Any) -> Any:
    """The Python value of a dict key node (keys are plain values, never tensors)."""

    def no_tensor(n: dict[str, Any], p: tuple[Any, ...]) -> Any:
        raise InvalidArgumentError("a dict key in this checkpoint is a tensor")

    return decode(node, no_tensor, "manifest")


def collect(
    value: Any,
    prefix: tuple[str, ...],
    out: dict[str, torch.Tensor],
    sparse: list[str] | None = None,
    leave_out: frozenset[tuple[str, ...]] = frozenset(),
    left_out: list[str] | None = None,
) -> int:
    """Gather tensors under ``value`` into ``out`` by dotted path; return non-tensors skipped.

    Sparse tensors are left out too (a safetensors file holds dense tensors only); their
    paths go to ``sparse``. Subtrees at a path in ``leave_out`` go to ``left_out`` unread.
    """
    if prefix in leave_out:
        if left_out is not None:
            left_out.append(".".join(prefix) or "the whole state")
        return 0
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, torch.Tensor) and value.layout != torch.strided:
        if sparse is not None:
            sparse.append(".".join(prefix) or "tensor")
        return 0
    if isinstance(value, torch.Tensor):
        name = ".".join(prefix) or "tensor"
        if name in out and out[name] is not value:
            raise InvalidArgumentError(
                f"two tensors would both be named {name!r} in the exported file (a key holds a "
                "dot that collides with a nested key); export a narrower --keys"
            )
        out[name] = value
        return 0
    if isinstance(value, dict):
        return sum(
            collect(v, (*prefix, str(k)), out, sparse, leave_out, left_out)
            for k, v in value.items()
        )
    if isinstance(value, (list, tuple)):
        return sum(
            collect(v, (*prefix, str(i)), out, sparse, leave_out, left_out)
            for i, v in enumerate(value)
        )
    return 1


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied weights): give each its own bytes."""
    seen: set[int] = set()
    out = {}
    for name, t in tensors.items():
        t = t.detach()
        ptr = t.untyped_storage().data_ptr() if t.numel() else -1
        if ptr in seen or not t.is_contiguous():
            t = t.clone(memory_format=torch.contiguous_format)
        elif t.numel():
            seen.add(ptr)
        out[name] = t
    return out


def run(args: argparse.Namespace) -> int:
    out_path = args.out
    keys = [k.strip() for group in args.keys or [] for k in group.split(",")]
    if os.path.isdir(out_path):
        raise InvalidArgumentError(f"{out_path}: is a directory; give a file name to write")
    if os.path.lexists(out_path) and not args.force:
        raise CheckpointExistsError(f"{out_path}: already exists; pass --force to overwrite it")
    out_dir = os.path.dirname(os.path.abspath(out_path))
    if not os.path.isdir(out_dir):
        raise InvalidArgumentError(f"{out_path}: directory {out_dir} does not exist")
    if args.no_prefix and len(keys) != 1:
        raise InvalidArgumentError("--no-prefix needs exactly one --keys KEY")
    require_single(args.ckpt)
    m = open_manifest(args.ckpt)[2]
    manifest = m.raw
    where = os.path.abspath(args.ckpt)
    if args.rank is not None and not 0 <= args.rank < m.world_size:
        raise InvalidArgumentError(
            f"--rank {args.rank}: {where} was saved by {m.world_size} rank(s); give a rank from "
            f"0 to {m.world_size - 1}"
        )
    rank = 0 if args.rank is None else args.rank
    # A PerRank value has no one global meaning; without --rank no rank's value is exported.
    per_rank = (
        frozenset()
        if args.rank is not None or "per_rank" not in manifest
        else frozenset(per_rank_paths(m.tree).values())
    )
    resolved = [resolve_key(m.tree_for(rank, "error", where), k, where) for k in keys]
    # Everything selected is read into memory at once before the file is written.
    read = dict(
        into=None,
        strict=True,
        verify=True,
        workers=DEFAULT_READ_THREADS,
        rank=rank,
        per_rank_fallback="error",
    )
    if resolved and all(n > 0 for _, n in resolved):
        # load(keys=...) selects dict keys; a path that goes on into a list loads the list.
        tree = _load(args.ckpt, keys=[p[:n] for p, n in resolved], **read)  # type: ignore[arg-type]
    else:
        tree = _load(args.ckpt, keys=None, **read)  # type: ignore[arg-type]

    tensors: dict[str, torch.Tensor] = {}
    sparse: list[str] = []
    left_out: list[str] = []
    skipped = 0
    if resolved:
        for p, _ in resolved:
            value = tree
            for k in p:
                value = value[k]
            at = tuple(str(k) for k in p)
            prefix = () if args.no_prefix else at
            leave = frozenset(
                prefix + q[len(at) :] if q[: len(at)] == at else prefix
                for q in per_rank
                if q[: len(at)] == at or at[: len(q)] == q
            )
            skipped += collect(value, prefix, tensors, sparse, leave, left_out)
    else:
        skipped = collect(tree, (), tensors, sparse, per_rank, left_out)
    note = (
        f"; tg.PerRank values left out (they differ per rank; pass --rank R to export rank R's): "
        f"{', '.join(left_out)}"
        if left_out
        else ""
    )
    if not tensors:
        what = "under " + ", ".join(keys) if keys else "in the checkpoint"
        raise InvalidArgumentError(f"{where}: no tensors {what}; nothing to export{note}")

    metadata = {"format": "pt", "tardigrade_source": where}
    if manifest.get("step") is not None:
        metadata["tardigrade_step"] = str(manifest["step"])
    if args.rank is not None:
        metadata["tardigrade_rank"] = str(args.rank)
    # Write beside OUT and rename, so OUT is never left half-written.
    fd, tmp = tempfile.mkstemp(prefix=".tardigrade-export-", suffix=".tmp", dir=out_dir)
    os.close(fd)
    try:
        save_file(_unshared(tensors), tmp, metadata=metadata)
        os.chmod(tmp, 0o644)  # mkstemp made it private; OUT is an ordinary file
        os.replace(tmp, out_path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    size = os.path.getsize(out_path)
    print(
        f"wrote {out_path}: {len(tensors)} tensors, {human_bytes(size)}"
        + (f" ({skipped} non-tensor value(s) left out)" if skipped else "")
        + (
            f"; sparse tensors left out (safetensors holds dense tensors only; export "
            f"t.to_dense() yourself if you need them): {', '.join(sparse[:10])}"
            + (f" and {len(sparse) - 10} more" if len(sparse) > 10 else "")
            if sparse
            else ""
        )
        + note
    )
    return 0
