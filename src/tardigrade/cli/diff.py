"""``tardigrade diff A B``: what differs between two checkpoints, leaf by leaf.

Structure, small values, dtypes and shapes come from the two manifests. By default both
checkpoints are verified first (every byte against its checksum, as ``tardigrade verify``
does), so that a recorded checksum stands for the bytes really on disk. Tensor contents are
then compared by their chunk checksums when both checkpoints split the tensor the same way (the
usual case: same model, same machine); otherwise the two tensors are read, one at a time, and
compared byte for byte. ``--checksums-only`` skips the verification: fast, but a copy damaged
after its save compares as whatever its manifest recorded, and the output says so.

Exit status: 0 identical, 1 different, 2 on errors (a checkpoint missing, unreadable or failing
verification) and bad usage.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .. import read_manifest
from ..errors import TardigradeError
from ..format.manifest import Manifest
from ._command import command
from ._listing import require_single
from ._output import ReadProgress, error
from ._storage_options import storage_options

if TYPE_CHECKING:
    import torch

    from .. import TensorRef


HELP = "show what differs between two checkpoints"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = command(
        sub,
        "diff",
        help=HELP,
        description=(
            "Compare the state saved in checkpoints A and B: keys only in one of them, values "
            "and container types that changed, tensors whose dtype, shape or bytes differ "
            "(bit for bit: NaNs with the same bits are equal, 0.0 and -0.0 are not). Both "
            "checkpoints are verified first (every byte against its checksum), so a damaged "
            "copy is reported, not compared. Exit status: 0 when the states are identical, 1 "
            "when they differ, 2 on errors (missing, unreadable or damaged checkpoint) and bad "
            "usage."
        ),
        run=run,
        locations=[
            ("a", "A", "a checkpoint directory, or its URL"),
            ("b", "B", "another checkpoint directory, or its URL"),
        ],
        json="print the differences as JSON",
        quiet=True,
    )
    p.add_argument(
        "--checksums-only",
        action="store_true",
        help=(
            "do not verify the bytes: compare tensors by the checksums the manifests recorded "
            "(fast; bytes are read only where the two split a tensor differently). A copy "
            "damaged after its save is not detected"
        ),
    )


def _text(t: TensorRef) -> str:
    return f"{'ndarray' if t.ndarray else 'tensor'} {t.dtype}{list(t.shape)}"


class _Side:
    """One checkpoint: its manifest and its leaves by path."""

    def __init__(self, path: str, options: Mapping[str, Any] | None = None) -> None:
        from .. import Checkpoint

        require_single(path, options)
        self.ckpt = Checkpoint.open(path, options)
        self.m = self.ckpt.manifest
        self.leaves: dict[tuple[Any, ...], Any] = {}
        self.containers: dict[tuple[Any, ...], str] = {}
        self._walk(self.ckpt.tree(rank=0), ())  # rank 0's tg.PerRank values

    def _walk(self, value: Any, path: tuple[Any, ...]) -> None:
        if isinstance(value, dict):
            self.containers[path] = type(value).__name__
            for k, v in value.items():
                self._walk(v, (*path, k))
        elif isinstance(value, (list, tuple)):
            self.containers[path] = type(value).__name__
            for i, v in enumerate(value):
                self._walk(v, (*path, i))
        else:
            self.leaves[path] = value

    def entry_bytes(self, e: int) -> torch.Tensor:
        """One stored tensor, read and checksum-verified."""
        import torch

        from ..format.dtypes import TORCH_DTYPES

        info = self.m.tensors[e]
        dest = {e: torch.empty(info.shape, dtype=TORCH_DTYPES[info.dtype])}
        self.ckpt.read_into(dest, workers=2)
        return dest[e]


def _chunking(m: Manifest, e: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    return [(c.offsets, c.shape) for c in m.tensors[e].chunks]


def _leaf_text(v: Any) -> str:
    from .. import SparseRef, TensorRef

    if isinstance(v, TensorRef):
        return _text(v)
    if isinstance(v, SparseRef):
        return f"sparse {v.layout} tensor {v.parts[-1].dtype}{list(v.size)}"
    return f"{type(v).__name__} {_short(v)}"


def _short(v: Any) -> str:
    import torch

    if isinstance(v, torch.Generator):
        digest = hashlib.blake2b(v.get_state().numpy().tobytes(), digest_size=4).hexdigest()
        return f"torch.Generator({v.device.type}, state #{digest})"
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _same_scalar(x: Any, y: Any) -> bool:
    import numpy as np
    import torch

    if type(x) is not type(y):
        return False
    if isinstance(x, np.generic):
        return x.tobytes() == y.tobytes()  # bitwise, as for floats
    if isinstance(x, complex):
        return _same_scalar(x.real, y.real) and _same_scalar(x.imag, y.imag)
    if isinstance(x, float):
        return x.hex() == y.hex() or (x != x and y != y)  # bitwise, NaN equal to NaN
    if isinstance(x, torch.Generator):  # equal when they would draw the same stream
        return x.device == y.device and torch.equal(x.get_state(), y.get_state())
    return bool(x == y)


def _bits(t: torch.Tensor) -> torch.Tensor:
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8)


def _same_tensor(a: _Side, ta: TensorRef, b: _Side, tb: TensorRef) -> bool:
    import torch

    ea, eb = ta.entry, tb.entry
    va, vb = ta.view, tb.view
    ia, ib = a.m.tensors[ea], b.m.tensors[eb]
    if va == vb and ia.shape == ib.shape and _chunking(a.m, ea) == _chunking(b.m, eb):
        return [c.checksum for c in ia.chunks] == [c.checksum for c in ib.chunks]
    # Stored differently (another split, or a view into another storage): compare bytes.
    xa, xb = a.entry_bytes(ea), b.entry_bytes(eb)
    if va:
        xa = xa.reshape(-1).as_strided(va.shape, va.stride, va.offset)
    if vb:
        xb = xb.reshape(-1).as_strided(vb.shape, vb.stride, vb.offset)
    return torch.equal(_bits(xa), _bits(xb))


def compare(
    path_a: str,
    path_b: str,
    *,
    verified: bool = True,
    options_a: Mapping[str, Any] | None = None,
    options_b: Mapping[str, Any] | None = None,
) -> list[dict[str, str]]:
    """Every difference between the states of two checkpoints, in path order.

    With ``verified`` (the default) both checkpoints pass a full checksum pass first
    (CorruptCheckpointError otherwise), so equal recorded checksums mean equal bytes on disk.
    ``options_a`` and ``options_b`` are the storage options of each location.
    """
    from .. import Checkpoint, SparseRef, TensorRef

    a, b = _Side(path_a, options_a), _Side(path_b, options_b)
    if verified:
        a.ckpt.verify()
        b.ckpt.verify()
    out: list[dict[str, str]] = []

    def add(kind: str, path: tuple[Any, ...], detail: str) -> None:
        out.append({"kind": kind, "path": Checkpoint.path_text(path), "detail": detail})

    paths = list(dict.fromkeys([*a.containers, *a.leaves, *b.containers, *b.leaves]))
    for p in paths:
        in_a = p in a.containers or p in a.leaves
        in_b = p in b.containers or p in b.leaves
        if in_a and not in_b:
            if p[:-1] in b.containers:  # report the top of a missing subtree only
                add("only in A", p, a.containers.get(p) or _leaf_text(a.leaves[p]))
            continue
        if in_b and not in_a:
            if p[:-1] in a.containers:
                add("only in B", p, b.containers.get(p) or _leaf_text(b.leaves[p]))
            continue
        ka, kb = a.containers.get(p), b.containers.get(p)
        if ka or kb:
            if ka != kb:
                left = ka or _leaf_text(a.leaves[p])
                right = kb or _leaf_text(b.leaves[p])
                add("type", p, f"{left} -> {right}")
            continue
        x, y = a.leaves[p], b.leaves[p]
        if isinstance(x, TensorRef) and isinstance(y, TensorRef):
            if (x.dtype, x.shape, x.ndarray) != (y.dtype, y.shape, y.ndarray):
                add("type", p, f"{_text(x)} -> {_text(y)}")
            elif not _same_tensor(a, x, b, y):
                add("values", p, f"{_text(x)}: bytes differ")
        elif isinstance(x, SparseRef) and isinstance(y, SparseRef):
            head_x = (x.layout, x.size, x.coalesced, x.parts[-1].dtype)
            if head_x != (y.layout, y.size, y.coalesced, y.parts[-1].dtype):
                add("type", p, f"{_leaf_text(x)} -> {_leaf_text(y)}")
            elif any(
                px.shape != py.shape or not _same_tensor(a, px, b, py)
                for px, py in zip(x.parts, y.parts, strict=True)
            ):
                add("values", p, f"{_leaf_text(x)}: indices or values differ")
        elif (
            isinstance(x, (TensorRef, SparseRef))
            or isinstance(y, (TensorRef, SparseRef))
            or type(x) is not type(y)
        ):
            add("type", p, f"{_leaf_text(x)} -> {_leaf_text(y)}")
        elif not _same_scalar(x, y):
            add("value", p, f"{_short(x)} -> {_short(y)}")
    return out


EXIT_SAME, EXIT_DIFFERENT, EXIT_ERROR = 0, 1, 2


def _data_bytes(*where: tuple[str, dict[str, Any] | None]) -> int:
    from .. import Checkpoint

    try:
        return sum(Checkpoint.open(p, options).nbytes for p, options in where)
    except TardigradeError:
        return 0  # compare() says what is wrong


def run(args: argparse.Namespace) -> int:
    verified = not args.checksums_only
    # On a terminal, a bar of the bytes read while both checkpoints are verified (stderr);
    # --checksums-only reads manifests (and rarely a tensor or two): no bar.
    show = verified and not (args.json or args.quiet)
    try:
        options_a = storage_options(args, args.a, args.b)
        options_b = storage_options(args, args.b, args.a)
        # Both are checkpoints, checked from their manifests without torch: a mistyped path
        # is said at once (torch takes seconds to import on a loaded machine).
        read_manifest(args.a, storage_options=options_a)
        read_manifest(args.b, storage_options=options_b)
        nbytes = _data_bytes((args.a, options_a), (args.b, options_b)) if show else 0
        with ReadProgress(nbytes, "diff", enabled=show):
            diffs = compare(
                args.a, args.b, verified=verified, options_a=options_a, options_b=options_b
            )
    except (TardigradeError, OSError) as e:
        # Not "different": the comparison could not be made (like cmp(1), errors exit 2).
        where = f"{e.filename}: " if isinstance(e, OSError) and e.filename else ""
        error(f"{where}{e}")
        return EXIT_ERROR
    note = (
        "both checkpoints verified: every byte matches its checksum"
        if verified
        else "bytes not verified (--checksums-only): tensors compared by their recorded "
        "checksums; run without --checksums-only to detect damage since the save"
    )
    if args.json:
        print(
            json.dumps(
                {
                    "a": args.a,
                    "b": args.b,
                    "identical": not diffs,
                    "verified": verified,
                    "diffs": diffs,
                }
            )
        )
        return EXIT_DIFFERENT if diffs else EXIT_SAME
    if not diffs:
        same = "bit for bit the same" if verified else "the same by their recorded checksums"
        print(f"identical: the states saved in {args.a} and {args.b} are {same} ({note})")
        return EXIT_SAME
    width = max(len(d["kind"]) for d in diffs)
    for d in diffs:
        print(f"{d['kind']:<{width}}  {d['path']}  {d['detail']}")
    print(f"{len(diffs)} difference(s) between {args.a} (A) and {args.b} (B) ({note})")
    return EXIT_DIFFERENT
