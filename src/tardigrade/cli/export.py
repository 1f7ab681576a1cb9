"""``tardigrade export CKPT OUT.safetensors``: the tensors of a checkpoint as one safetensors file.

Tensors are named by their path in the state joined with dots (``model.fc.weight``), so the
file loads with ``safetensors.torch.load_file`` anywhere, without Tardigrade.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import struct
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from .. import read_manifest
from ..errors import CheckpointExistsError, InsufficientMemoryError, InvalidArgumentError
from ..format.manifest import Manifest
from ..storage import storage_for
from ._command import command
from ._listing import require_single
from ._output import ReadProgress, human_bytes
from ._storage_options import storage_options
from .inspect import per_rank_paths

if TYPE_CHECKING:
    import torch

    from .. import Checkpoint, TensorRef


HELP = "write a checkpoint's tensors (e.g. the model weights) to one .safetensors file"

# Bytes of tensors read before they are written: bounds memory, while letting small tensors
# share one pass over each data file (a pass reads the file's header).
BATCH_BYTES = 16 * 2**20

# The safetensors names of the dtypes it stores, in the order ``safetensors.torch.save_file``
# lays tensors out (by dtype, this order, then by name), which this writer reproduces.
_SAFETENSORS_DTYPES = (
    ("U64", "uint64"), ("I64", "int64"), ("F64", "float64"), ("C64", "complex64"),
    ("F32", "float32"), ("U32", "uint32"), ("I32", "int32"), ("BF16", "bfloat16"),
    ("F16", "float16"), ("U16", "uint16"), ("I16", "int16"),
    ("F8_E5M2FNUZ", "float8_e5m2fnuz"), ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
    ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("I8", "int8"),
    ("U8", "uint8"), ("BOOL", "bool"),
)  # fmt: skip


@functools.cache
def _dtypes() -> tuple[dict[Any, str], dict[Any, int]]:
    """(torch dtype -> safetensors name, torch dtype -> rank in the layout order); made on
    first use, so that the command's usage errors come before torch is imported."""
    import torch

    present = [(name, getattr(torch, attr)) for name, attr in _SAFETENSORS_DTYPES
               if hasattr(torch, attr)]  # fmt: skip
    return {d: n for n, d in present}, {d: i for i, (_, d) in enumerate(present)}


# Tensors in the read buffer start at multiples of this, so each can be viewed as its dtype.
_ALIGN = 64


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = command(
        sub,
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
        run=run,
        locations=[
            ("ckpt", "CKPT", "checkpoint directory, or its URL"),
            ("out", "OUT.safetensors", "file to write, or a URL (s3://bucket/model.safetensors)"),
        ],
        json="print what was written as JSON",
        quiet=True,
    )  # --storage-option: for CKPT and OUT, whichever is a URL
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
    from .. import Checkpoint

    return Checkpoint.decode_node(node)


def collect(
    value: Any,
    prefix: tuple[str, ...],
    out: dict[str, TensorRef],
    sparse: list[str] | None = None,
    leave_out: frozenset[tuple[str, ...]] = frozenset(),
    left_out: list[str] | None = None,
) -> int:
    """Gather the tensors under ``value`` (a ``Checkpoint.tree()``: TensorRef leaves) into
    ``out`` by dotted path; return how many non-tensor values were skipped.

    Sparse tensors are left out too (a safetensors file holds dense tensors only); their
    paths go to ``sparse``. Subtrees at a path in ``leave_out`` go to ``left_out`` unread.
    """
    from .. import SparseRef, TensorRef

    if prefix in leave_out:
        if left_out is not None:
            left_out.append(".".join(prefix) or "the whole state")
        return 0
    if isinstance(value, SparseRef):
        if sparse is not None:
            sparse.append(".".join(prefix) or "tensor")
        return 0
    if isinstance(value, TensorRef):
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


def run(args: argparse.Namespace) -> int:
    out_path = args.out
    keys = [k.strip() for group in args.keys or [] for k in group.split(",")]
    target = _Target(out_path, storage_options(args, out_path, args.ckpt))
    target.check(force=args.force)
    if args.no_prefix and len(keys) != 1:
        raise InvalidArgumentError("--no-prefix needs exactly one --keys KEY")
    options = storage_options(args, args.ckpt, out_path)
    require_single(args.ckpt, options)
    read_manifest(args.ckpt, storage_options=options)  # a mistyped path: said before torch loads
    from .. import Checkpoint

    ckpt = Checkpoint.open(args.ckpt, options)
    m = ckpt.manifest
    manifest = m.raw
    where = ckpt.url
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
    # Select dict keys as load(keys=...) does; a path that goes on into a list takes the list.
    select = [p[:n] for p, n in resolved] if resolved and all(n > 0 for _, n in resolved) else None
    # The selected state with a TensorRef in place of each tensor: nothing is read yet.
    tree = ckpt.tree(select, rank=rank, per_rank_fallback="error")

    tensors: dict[str, TensorRef] = {}
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
    order = file_order(tensors, where)
    # On a terminal, a bar of the bytes read (stderr): a single tensor of gigabytes moves it
    # too (a count of tensors sat at 0/1 for its whole read). Never in --json or --quiet.
    stored = {tensors[name].entry for name in order}
    total = sum(ckpt.manifest.tensors[e].nbytes for e in stored)
    bar = ReadProgress(total, f"export {os.path.basename(out_path)}",
                       enabled=not (args.json or args.quiet))  # fmt: skip
    with bar, target.writing() as f:
        write_header(f, order, tensors, metadata)
        write_tensors(f, order, tensors, ckpt)
    size = target.size()
    if args.json:
        report = {
            "out": out_path,
            "source": where,
            "tensors": len(tensors),
            "nbytes": size,
            "non_tensor_values_left_out": skipped,
            "sparse_left_out": sparse,
            "per_rank_left_out": left_out,
        }
        print(json.dumps(report, indent=2))
        return 0
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


class Appends(Protocol):
    """Where the safetensors bytes go, in order: a local file or a storage writer."""

    def write(self, data: Any, /) -> Any: ...


class _Target:
    """OUT: a local file, written beside and renamed into place, or an object at a URL
    (``s3://``, ``memory://``, an fsspec URL), written through its storage's writer, which
    makes it visible only once complete. Either way OUT is never left half-written."""

    def __init__(self, out: str, options: dict[str, Any] | None) -> None:
        self.out = out
        self.url = "://" in out and not out.lower().startswith("file://")
        if self.url:
            self.storage, self.name = storage_for(out, options)

    def check(self, *, force: bool) -> None:
        """Refuse an OUT that is a directory, or that exists (unless ``force``)."""
        if self.url:
            st = self.storage.stat(self.name)
            if st is not None and st.is_dir:
                raise InvalidArgumentError(f"{self.out}: is a prefix of objects; name an object")
            exists = st is not None
        else:
            if os.path.isdir(self.out):
                raise InvalidArgumentError(f"{self.out}: is a directory; give a file name to write")
            exists = os.path.lexists(self.out)
        if exists and not force:
            raise CheckpointExistsError(f"{self.out}: already exists; pass --force to overwrite it")

    @contextlib.contextmanager
    def writing(self) -> Iterator[Any]:
        """A file-like object to write OUT's bytes into; OUT appears when the block ends."""
        if self.url:
            writer = self.storage.open_writer(self.name)
            try:
                yield _Appender(writer)
            except BaseException:
                writer.abort()
                raise
            writer.close()
            return
        folder = os.path.dirname(os.path.abspath(self.out))
        try:
            os.makedirs(folder, exist_ok=True)  # a new folder for the export is the common case
        except FileExistsError:
            raise InvalidArgumentError(
                f"{self.out}: a file is in the way of its folder {folder}; choose another path"
            ) from None
        fd, tmp = tempfile.mkstemp(prefix=".tardigrade-export-", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)  # mkstemp made it private; OUT is an ordinary file
            os.replace(tmp, self.out)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def size(self) -> int:
        if self.url:
            st = self.storage.stat(self.name)
            return 0 if st is None else st.size
        return os.path.getsize(self.out)


class _Appender:
    """A storage ``Writer`` as the file object the safetensors writer appends to."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def write(self, data: Any) -> None:
        self.writer.write(data)


def file_order(tensors: dict[str, TensorRef], where: str) -> list[str]:
    """The names in the order ``safetensors.torch.save_file`` would store them."""
    for name, t in tensors.items():
        if t.torch_dtype not in _dtypes()[0]:
            raise InvalidArgumentError(
                f"{where}: tensor {name!r} is {t.torch_dtype}, which a safetensors file cannot "
                "hold; export the other tensors with --keys"
            )
    order = _dtypes()[1]
    return sorted(tensors, key=lambda name: (order[tensors[name].torch_dtype], name))


def write_header(
    f: Appends, order: list[str], tensors: dict[str, TensorRef], metadata: dict[str, str]
) -> None:
    """The safetensors header: its length (8 bytes, little-endian), then JSON padded with
    spaces to a multiple of 8 bytes; tensors follow back to back in ``order``."""
    doc: dict[str, Any] = {"__metadata__": metadata}
    at = 0
    for name in order:
        t = tensors[name]
        doc[name] = {
            "dtype": _dtypes()[0][t.torch_dtype],
            "shape": list(t.shape),
            "data_offsets": [at, at + t.nbytes],
        }
        at += t.nbytes
    header = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
    header += b" " * (-len(header) % 8)
    f.write(struct.pack("<Q", len(header)))
    f.write(header)


def batches(order: list[str], tensors: dict[str, TensorRef], m: Manifest) -> list[list[str]]:
    """``order`` cut into runs whose stored tensors (aligned) fit in ``BATCH_BYTES``; a tensor
    larger than that is a batch of its own."""
    out: list[list[str]] = []
    size = 0
    for name in order:
        n = _aligned(m.tensors[tensors[name].entry].nbytes)
        if not out or size + n > BATCH_BYTES:
            out.append([])
            size = 0
        out[-1].append(name)
        size += n
    return out


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def write_tensors(
    f: Appends,
    order: list[str],
    tensors: dict[str, TensorRef],
    ckpt: Checkpoint,
) -> None:
    """Read (and verify) the tensors a batch at a time and write their bytes in ``order``.

    Every batch is read into one buffer allocated once, as large as the largest batch: memory
    stays bounded by it, whatever the allocator does with freed blocks.
    """
    import torch

    from ..format.dtypes import TORCH_DTYPES

    m = ckpt.manifest
    entry = {name: tensors[name].entry for name in order}
    ckpt.check_sizes(sorted(set(entry.values())))
    paths = {e: name for name, e in entry.items()}
    plan = batches(order, tensors, m)
    # What is read is the stored tensor, which may be larger than a view saved of it; a tensor
    # named twice (tied weights) is read once per batch.
    need = [sum(_aligned(m.tensors[e].nbytes) for e in {entry[n] for n in b}) for b in plan]
    buf = _buffer(max(need, default=0), f"{ckpt.url}: export buffer")
    for batch in plan:
        dest: dict[int, torch.Tensor] = {}
        at = 0
        for name in batch:
            e = entry[name]
            if e not in dest:
                info = m.tensors[e]
                piece = buf[at : at + info.nbytes].view(TORCH_DTYPES[info.dtype])
                dest[e] = piece.view(info.shape)
                at += _aligned(info.nbytes)
        ckpt.read_into(dest, names=paths)
        for name in batch:
            t = dest[entry[name]]
            view = tensors[name].view
            if view:
                # as_strided counts its offset from the start of the buffer, not of the tensor.
                at = int(t.storage_offset()) + view.offset
                t = t.as_strided(view.shape, view.stride, at)
            if t.numel():
                # A complex tensor is written as the bytes of its stored real view: the same.
                f.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))  # type: ignore[arg-type]  # numpy arrays are buffers; its stubs say so from Python 3.12


def _buffer(nbytes: int, what: str) -> torch.Tensor:
    """A byte buffer, with running out of memory as a TardigradeError (torch raises
    RuntimeError)."""
    import torch

    try:
        return torch.empty((nbytes,), dtype=torch.uint8)
    except (RuntimeError, MemoryError) as e:
        if isinstance(e, RuntimeError) and "can't allocate memory" not in str(e):
            raise
        raise InsufficientMemoryError(
            f"{what}: cannot allocate {nbytes} bytes. Free memory, or export fewer keys at once "
            "(--keys)."
        ) from None
