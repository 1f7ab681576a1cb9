"""``tardigrade convert SOURCE DEST``: another tool's checkpoint as a Tardigrade checkpoint.

Three sources, so users can move to Tardigrade from what they have:

- ``torch``: a ``torch.save`` file, read with ``torch.load(weights_only=True)``: tensors and
  plain containers and values only, never arbitrary pickled objects;
- ``dcp``: a PyTorch Distributed Checkpoint directory, read in this one process with sharded
  tensors gathered whole (its ``.metadata`` is unpickled allowing DCP's own classes only, its
  non-tensor values with ``weights_only=True``);
- ``safetensors``: a Hugging Face folder (``model.safetensors``, or shards listed in
  ``model.safetensors.index.json``) or one ``.safetensors`` file; tensors keep their flat
  dotted names (``model.layers.0.weight``), as ``module.load_state_dict`` expects them.

The state is then saved with ``tg.save``, so DEST is any location Tardigrade saves to.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import stat
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidArgumentError,
    TardigradeError,
    UnsupportedFormatError,
    UnsupportedTypeError,
)
from ._command import command
from ._output import ReadProgress, human_bytes
from ._storage_options import storage_options

if TYPE_CHECKING:
    import torch


HELP = "import a torch.save file, a PyTorch DCP checkpoint or a safetensors folder"

KINDS = ("torch", "dcp", "safetensors")
SAFETENSORS_INDEX = "model.safetensors.index.json"
DCP_METADATA = ".metadata"
# The first bytes of what torch.save writes: a zip archive (the default since torch 1.6), or
# the legacy format, which starts with a pickle protocol marker.
_TORCH_MAGIC = (b"PK\x03\x04", b"\x80")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = command(
        sub,
        "convert",
        help=HELP,
        description=(
            "Import SOURCE, a checkpoint written by another tool, into a new Tardigrade "
            "checkpoint at DEST (a path or a URL such as s3://bucket/ckpt). SOURCE is a "
            "torch.save file (read with torch.load(weights_only=True): tensors and plain "
            "values only, never arbitrary pickled objects), a PyTorch DCP checkpoint directory "
            "(sharded tensors are gathered whole), or a Hugging Face safetensors folder "
            "(model.safetensors, or the shards named in model.safetensors.index.json) or "
            "file. Nested keys are kept; safetensors names stay flat ('model.fc.weight')."
        ),
        run=run,
        locations=[
            ("source", "SOURCE", "file or directory to import"),
            ("dest", "DEST", "the Tardigrade checkpoint to create"),
        ],
        json="print what was converted as JSON",
        quiet=True,
    )  # --storage-option: for DEST; SOURCE is read from local files
    p.add_argument(
        "--from",
        dest="kind",
        choices=KINDS,
        default=None,
        help="what SOURCE is (default: detected from its files)",
    )
    p.add_argument(
        "--step", type=int, default=None, metavar="N", help="record step N in the manifest"
    )
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint at DEST")


def inside(source: str, name: object, named_by: str) -> str:
    """The path of file ``name`` that ``named_by`` (a foreign index) names, refused unless it is
    a regular file inside ``source``.

    Indexes come from other tools and may be hostile: an absolute path, a ``..`` or a symlink
    leading out would convert some other file's tensors, and a FIFO would hang the read.
    """
    if (
        not isinstance(name, str)
        or not name
        or "\x00" in name
        or os.path.isabs(name)
        or ".." in name.replace("\\", "/").split("/")
    ):
        raise CorruptCheckpointError(
            f"{named_by}: names the file {name!r}, which is not a relative path inside "
            f"{source}; an index may only name files of its own checkpoint. Refusing to read it."
        )
    path = os.path.join(source, name)
    root = os.path.realpath(source)
    real = os.path.realpath(path)
    if os.path.commonpath([root, real]) != root:
        raise CorruptCheckpointError(
            f"{named_by}: names {name!r}, a symbolic link that leads out of {source} (to "
            f"{real}); an index may only name files of its own checkpoint. Refusing to read it."
        )
    if os.path.lexists(path):  # a missing file is each reader's to report, with what to do
        regular_file(path)
    return path


def regular_file(path: str) -> None:
    """Refuse anything but a regular file (a FIFO or a device would hang or never end)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"{path}: no such file; is the checkpoint complete?"
        ) from None
    if not stat.S_ISREG(st.st_mode):
        raise UnsupportedFormatError(
            f"{path}: not a regular file (mode {stat.filemode(st.st_mode)}); convert reads "
            "regular files only. Replace it with the file itself."
        )


def detect(source: str) -> str:
    """The kind of checkpoint at ``source``: ``torch``, ``dcp`` or ``safetensors``."""
    looked_for = (
        "a torch.save file, a DCP directory (with a .metadata file) or a safetensors folder "
        f"(model.safetensors or {SAFETENSORS_INDEX})"
    )
    if os.path.isdir(source):
        if os.path.isfile(os.path.join(source, DCP_METADATA)):
            return "dcp"
        if os.path.isfile(os.path.join(source, "manifest.json")):
            raise InvalidArgumentError(
                f"{source}: looks like a Tardigrade checkpoint already; nothing to convert "
                "(copy it, or load it with tg.load)"
            )
        if safetensors_files(source, required=False):
            return "safetensors"
        raise InvalidArgumentError(
            f"{source}: cannot tell what this directory holds; expected {looked_for}. "
            "Name the kind with --from torch|dcp|safetensors."
        )
    if os.path.exists(source):
        regular_file(source)
        if source.endswith(".safetensors"):
            return "safetensors"
        with open(source, "rb") as f:
            head = f.read(4)
        if head.startswith(_TORCH_MAGIC):
            return "torch"
        raise InvalidArgumentError(
            f"{source}: cannot tell what this file is (it is not a zip or pickle as torch.save "
            f"writes, nor named .safetensors); expected {looked_for}. Name the kind with --from."
        )
    raise CheckpointNotFoundError(f"{source}: no such file or directory; give {looked_for}")


def refusal(e: BaseException) -> str:
    """What ``torch.load(weights_only=True)`` refused, from its page-long message."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
    found = re.search(r"WeightsUnpickler error: (.*?)(?:\. |\.?$)", text, re.MULTILINE)
    if found:
        return found.group(1).strip()
    return text.strip().splitlines()[0] if text.strip() else type(e).__name__


def read_torch(source: str) -> tuple[Any, dict[str, Any]]:
    """The object in a ``torch.save`` file, loaded without unpickling arbitrary objects."""
    import torch

    if not os.path.isfile(source):
        raise InvalidArgumentError(f"{source}: --from torch needs a file written by torch.save")
    with open(source, "rb") as f:
        zipped = f.read(4) == _TORCH_MAGIC[0]
    try:
        # A zip (the default format) is mapped, not read: tg.save then reads each tensor from
        # the page cache, so a file as large as memory still converts.
        state = torch.load(source, map_location="cpu", weights_only=True, mmap=zipped)
    except pickle.UnpicklingError as e:
        reason = refusal(e)
        raise UnsupportedTypeError(
            f"{source}: torch.load(weights_only=True) refuses this file: it holds pickled "
            f"Python objects, not only tensors and plain values ({reason}). Tardigrade never "
            "unpickles arbitrary objects, which can run any code. If you trust the file, load "
            "it yourself with torch.load(path, weights_only=False), keep its tensors and plain "
            "values (e.g. obj['model'] or module.state_dict()) and save those with "
            "tg.save(dest, state); or allow its classes with "
            "torch.serialization.add_safe_globals and convert again."
        ) from None
    except (RuntimeError, EOFError, ValueError) as e:
        raise UnsupportedFormatError(
            f"{source}: not a torch.save file torch can read ({e}); convert a file written by "
            "torch.save, or name another kind with --from"
        ) from None
    return state, {}


class _DcpMetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata`` file allowing only the classes DCP itself writes there."""

    def find_class(self, module: str, name: str) -> Any:
        # Classes only: constructing one of these runs no code beyond filling its fields.
        import torch

        allowed = (
            (module == "torch.distributed.checkpoint.metadata" and not name.startswith("__"))
            or (module == "torch.distributed.checkpoint.filesystem" and name == "_StorageInfo")
            or (
                module == "torch"
                and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype))
            )
            or (module == "torch.serialization" and name == "_get_layout")
            or (module == "pathlib" and name in ("PosixPath", "WindowsPath", "PurePosixPath"))
            or (module == "collections" and name == "OrderedDict")
        )
        value = super().find_class(module, name) if allowed else None
        if module.startswith("torch.distributed.") and not isinstance(value, type):
            allowed = False
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata class")
        return value


def read_dcp(source: str) -> tuple[Any, dict[str, Any]]:
    """The whole state of a DCP checkpoint directory, read in this one process."""
    import torch
    from torch.distributed.checkpoint import CheckpointException, FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    if not os.path.isfile(os.path.join(source, DCP_METADATA)):
        raise InvalidArgumentError(
            f"{source}: --from dcp needs a DCP checkpoint directory (one with a {DCP_METADATA} "
            "file, as torch.distributed.checkpoint.save writes)"
        )

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as f:
                try:
                    metadata = _DcpMetadataUnpickler(f).load()
                except pickle.UnpicklingError as e:
                    raise UnsupportedTypeError(
                        f"{source}/{DCP_METADATA}: refusing to unpickle it ({e}); Tardigrade "
                        "never unpickles arbitrary objects. Convert the checkpoint with "
                        "torch.distributed.checkpoint.format_utils.dcp_to_torch_save in a "
                        "process you trust, then convert that file."
                    ) from None
            if not isinstance(metadata, Metadata):
                raise CorruptCheckpointError(f"{source}/{DCP_METADATA}: not DCP metadata")
            meta = getattr(metadata, "storage_meta", None) or StorageMeta()
            meta.load_id = self.load_id
            metadata.storage_meta = meta
            return metadata

        def set_up_storage_reader(self, metadata: Metadata, *args: Any, **kwargs: Any) -> None:
            # Here, not in read_metadata: DCP takes any error there for a missing file and
            # falls back to other metadata files; an error here reaches the user.
            named_by = os.path.join(source, DCP_METADATA)
            for info in (metadata.storage_data or {}).values():
                rel = getattr(info, "relative_path", None)
                inside(source, os.fspath(rel) if isinstance(rel, os.PathLike) else rel, named_by)
            super().set_up_storage_reader(metadata, *args, **kwargs)

    class Planner(_EmptyStateDictLoadPlanner):
        # DCP unpickles non-tensor values with weights_only=False; plain values load without.
        def load_bytes(self, read_item: Any, value: Any) -> None:
            key = read_item.dest_index.fqn
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                reason = refusal(e)
                raise UnsupportedTypeError(
                    f"{source}: the value at key {key!r} is a pickled Python object ({reason}); "
                    "Tardigrade never unpickles arbitrary objects. Save that key as tensors or "
                    "plain values, or convert with dcp_to_torch_save in a process you trust."
                ) from None
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element

                set_element(self.original_state_dict, self.mappings[key], obj)
            else:
                self.state_dict[key] = obj

    state: dict[str, Any] = {}
    try:
        _load_state_dict(state, storage_reader=Reader(source), planner=Planner(), no_dist=True)
    except CheckpointException as e:
        # DCP wraps what failed (per rank; here the one): raise our own error as it is.
        errors = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
        for exc in errors:
            if isinstance(exc, TardigradeError):
                raise exc from None
        causes = "; ".join(f"{type(x).__name__}: {x}" for x in errors)
        raise UnsupportedFormatError(
            f"{source}: torch.distributed.checkpoint cannot read it ({causes}); is it a whole "
            "DCP checkpoint, with every .distcp file its .metadata names?"
        ) from None
    return state, {}


def safetensors_files(source: str, *, required: bool = True) -> list[str]:
    """The safetensors files of a folder: the shards its index names, else every file."""
    index = os.path.join(source, SAFETENSORS_INDEX)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CorruptCheckpointError(
                f"{index}: not a safetensors index (a JSON object with a 'weight_map' of "
                f"tensor name -> file): {e}"
            ) from None
        missing = [n for n in names if not os.path.lexists(os.path.join(source, str(n)))]
        if missing:
            raise CheckpointNotFoundError(
                f"{source}: {SAFETENSORS_INDEX} names shard(s) that are not there: "
                f"{', '.join(map(str, missing))}; download every shard, then convert again"
            )
        return [inside(source, n, index) for n in names]
    files = sorted(n for n in os.listdir(source) if n.endswith(".safetensors"))
    if not files and required:
        raise InvalidArgumentError(
            f"{source}: no .safetensors file here (looked for model.safetensors, "
            f"{SAFETENSORS_INDEX} and *.safetensors)"
        )
    return [inside(source, n, f"{source} (its .safetensors files)") for n in files]


def read_safetensors(source: str) -> tuple[Any, dict[str, Any]]:
    """Every tensor of a safetensors folder (or file), by its name in the files."""
    from safetensors import SafetensorError, safe_open

    files = [source] if os.path.isfile(source) else safetensors_files(source)
    state: dict[str, torch.Tensor] = {}
    metadata: dict[str, str] = {}
    for path in files:
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                metadata.update(f.metadata() or {})
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if name in state:
                        raise CorruptCheckpointError(
                            f"{path}: tensor {name!r} is also in another file of {source}; "
                            "keep one copy"
                        )
                    state[name] = f.get_tensor(name)
        except SafetensorError as e:
            raise UnsupportedFormatError(
                f"{path}: not a safetensors file safetensors can read ({e})"
            ) from None
    return state, {"safetensors_metadata": metadata} if metadata else {}


READERS: dict[str, Callable[[str], tuple[Any, dict[str, Any]]]] = {
    "torch": read_torch,
    "dcp": read_dcp,
    "safetensors": read_safetensors,
}


def count_tensors(value: Any) -> tuple[int, int, int]:
    """(tensors, their bytes, other leaves) in a tree of dicts, lists and tuples."""
    import torch

    if isinstance(value, torch.Tensor):
        return 1, value.numel() * value.element_size(), 0
    if isinstance(value, dict):
        items: Any = value.values()
    elif isinstance(value, (list, tuple)):
        items = value
    else:
        return 0, 0, 1
    total = [0, 0, 0]
    for v in items:
        for i, n in enumerate(count_tensors(v)):
            total[i] += n
    return total[0], total[1], total[2]


def source_bytes(source: str) -> int:
    """Bytes of the files of ``source`` (a file, or a directory's own files), for the bar."""
    if os.path.isfile(source):
        return os.path.getsize(source)
    return sum(
        os.path.getsize(os.path.join(source, n))
        for n in os.listdir(source)
        if os.path.isfile(os.path.join(source, n))
    )


def run(args: argparse.Namespace) -> int:
    source = args.source
    if args.step is not None and args.step < 0:
        raise InvalidArgumentError(f"--step {args.step}: give a non-negative step")
    if not os.path.exists(source):
        detect(source)  # raises the not-found error
    if not os.path.isdir(source):
        regular_file(source)
    kind = args.kind or detect(source)
    quiet = args.json or args.quiet
    with ReadProgress(source_bytes(source), f"read {kind}", enabled=not quiet):
        state, extra = READERS[kind](source)
    tensors, nbytes, others = count_tensors(state)
    metadata = {"converted_from": {"kind": kind, "source": os.path.abspath(source)}, **extra}
    from .. import save  # torch: only once SOURCE was found and read

    try:
        save(
            args.dest,
            state,
            overwrite=args.overwrite,
            step=args.step,
            metadata=metadata,
            storage_options=storage_options(args, args.dest),
        )
    except CheckpointExistsError as e:  # name the flag, not tg.save's argument
        raise CheckpointExistsError(str(e).replace("overwrite=True", "--overwrite")) from None
    report = {
        "source": source,
        "kind": kind,
        "dest": args.dest,
        "tensors": tensors,
        "nbytes": nbytes,
        "other_values": others,
        "step": args.step,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"converted {source} ({kind}) to {args.dest}: {tensors} tensors, {human_bytes(nbytes)}"
        + (f", {others} other value(s)" if others else "")
    )
    return 0
