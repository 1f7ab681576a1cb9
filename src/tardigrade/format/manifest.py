"""The manifest: the one record that makes a checkpoint exist, and its validation."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeGuard, overload

if TYPE_CHECKING:
    import numpy as np
# numpy is imported where the columns of a multi-rank manifest are checked, not here: `tardigrade
# ls` and `inspect` read manifests without it (a tenth of their start-up).


from ..errors import (
    ChecksumMismatchError,
    CorruptCheckpointError,
    InsufficientMemoryError,
    StateMismatchError,
    TardigradeError,
    UnsupportedFormatError,
)
from . import limits
from .checksum import ALGORITHM, checksum
from .jsonio import gc_paused, loads_strict
from .sizes import ITEMSIZE
from .tiling import TilingError, check_exact_tiling

__all__ = [
    "CANDIDATE",
    "COLUMNAR_VERSION",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "LEASE_GENERATION",
    "MANIFEST",
    "MANIFEST_START",
    "PACKED_VERSION",
    "PER_RANK_FALLBACKS",
    "READABLE_VERSIONS",
    "SHARED_DIR",
    "SHARED_KEY",
    "SHARED_VERSION",
    "Chunk",
    "ChunkColumns",
    "Manifest",
    "TensorInfo",
    "check_name",
    "data_path",
    "is_shared",
    "one_chunk_file",
    "parse",
    "seal",
    "shared_name",
    "tree_for",
    "validate",
]

# The commit record of a checkpoint, and how every manifest Tardigrade writes begins.
MANIFEST = "manifest.json"
MANIFEST_START = b'{"format":"tardigrade"'
FORMAT_NAME = "tardigrade"
# Optional field: the generation of the lease under which a manager committed the checkpoint
# (an int >= 1). Readers that predate it ignore it; the catalog fences on it.
LEASE_GENERATION = "lease_generation"
# v2: the manifest carries its own checksum and every data file's header checksum, so every
# byte of a checkpoint is covered. v1 (no manifest or header checksum) is still read.
# v3: the state tree gains leaf kinds older readers cannot decode (torch.Size, torch.device,
# Counter, set/frozenset, complex, numpy scalars, complex and sparse tensors); sealed as v2.
# v4: distributed saves: ``per_rank`` holds each rank's ``tg.PerRank`` subtrees (the tree
# holds ``{"t": "per_rank", "i": k}`` in their place), tensors may record a ``layout``
# ("sharded", "per_rank" with its ``rank``), and data files of many ranks.
# v5: a distributed save stores each tensor's chunks as columns (``file`` indices into
# ``files``, flat ``offsets`` and ``shape``, ``checksum`` as one hex string) and each tensor's
# ``name``; a chunk's safetensors key is derived: ``name@tensor.chunk``. Single-process saves
# need none of it and stay v4, readable by v4 readers.
# v6: the state tree may hold ``packed`` lists and tuples (long runs of ints or floats as one
# base64 string of their little-endian bytes). Written only when a tree holds one, by one
# process (chunks as in v4) or several (chunks as columns, as in v5).
# v7: shared data. A data file may be a *shared object* of the root (``.shared/ab/<32 hex>
# .safetensors``, beside the checkpoints rather than inside one): one chunk under the key
# ``t``, named by the xxh3-128 of its whole file (header and bytes), so the same bytes of the
# same dtype and shape are one object, written once and referenced by every checkpoint that
# holds them (a chunk held twice in one save is one object once: the other copy goes into the
# save's own data file, so a manifest references each (file, key) once, as before). Written
# only when a manifest references one; everything else is as in v6.
FORMAT_VERSION = 4
COLUMNAR_VERSION = 5
PACKED_VERSION = 6
SHARED_VERSION = 7
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6, 7)
# Shared objects live under this directory of the root (the checkpoints' parent).
SHARED_DIR = ".shared"
SHARED_KEY = "t"  # the one key of a shared object's safetensors header
# In the name of a save's own data file that holds one chunk a shared object may hold (a copy
# a save made a plain file: ``_plan.is_candidate``); its key is SHARED_KEY too.
CANDIDATE = "-shared-"
_SHARED_FILE = re.compile(r"\.shared/([0-9a-f]{2})/\1[0-9a-f]{30}\.safetensors\Z")
LAYOUTS = ("replicated", "sharded", "per_rank")
PER_RANK_FALLBACKS = ("rank0", "error")
SEALED_SINCE = 2  # the first version whose manifests must carry a checksum

# A sealed manifest ends with this member, its checksum over the manifest without it. Putting
# it last, in a fixed spelling, lets a reader check the bytes before it parses a single one.
_SEAL_KEY = b',"manifest_checksum":"'
_SEAL = re.compile(rb',"manifest_checksum":"([0-9a-f]{16})"\}\Z')
_SEAL_LEN = len(_SEAL_KEY) + 16 + 2


def seal(body: bytes) -> bytes:
    """Append the manifest's checksum to ``body`` (compact JSON of one object)."""
    if not body.endswith(b"}") or body == b"{}":
        raise ValueError("seal() takes the compact JSON of a non-empty object")
    return body[:-1] + _SEAL_KEY + checksum(body).encode() + b'"}'


def is_shared(file: str) -> bool:
    """Whether data file name ``file`` (from a manifest) names a shared object of the root."""
    return _SHARED_FILE.match(file) is not None


def one_chunk_file(file: str) -> bool:
    """Whether data file ``file`` holds one chunk under ``SHARED_KEY``: a shared object, or a
    save's own copy of one (a chunk held twice in one save; a columnar manifest records no
    keys, so its readers derive this one from the name)."""
    return CANDIDATE in file or is_shared(file)


def shared_name(digest: str) -> str:
    """The name of the shared object whose whole file hashes to ``digest`` (32 hex digits)."""
    return f"{SHARED_DIR}/{digest[:2]}/{digest}.safetensors"


def data_path(name: str, file: str) -> str:
    """Where data file ``file`` of checkpoint ``name`` is, relative to the storage root: in
    the checkpoint, or (a shared object) in the ``.shared`` directory beside it."""
    if is_shared(file):
        parent = name.rpartition("/")[0]
        return f"{parent}/{file}" if parent else file
    return f"{name}/{file}"


def _unseal(raw: bytes, where: str) -> bool:
    """Check a sealed manifest's checksum; return whether ``raw`` carries one at all."""
    m = _SEAL.search(raw, max(0, len(raw) - _SEAL_LEN))
    if m is None:
        return False
    body = raw[: m.start()] + b"}"
    if checksum(body) != m.group(1).decode():
        raise ChecksumMismatchError(
            f"{where}: manifest fails its checksum (expected {m.group(1).decode()}, got "
            f"{checksum(body)}); it was modified or damaged after the save. Delete this "
            "checkpoint or restore it from a backup (CheckpointManager.restore() falls back to "
            "the newest checkpoint that verifies)."
        )
    return True


@dataclass(frozen=True)
class Chunk:
    file: str
    key: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    checksum: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class ChunkColumns(Sequence[Chunk]):
    """A tensor's chunks as a format-5 manifest stores them: columns, validated as arrays.

    Behaves as a tuple of Chunks, made on first use: a reader that needs a few tensors of a
    checkpoint with millions of chunks never makes objects for the rest.
    """

    __slots__ = ("_made", "files", "names", "offsets", "prefix", "shapes", "sums")

    def __init__(
        self, files: np.ndarray, names: Sequence[str], offsets: np.ndarray, shapes: np.ndarray,
        sums: str, prefix: str,
    ) -> None:  # fmt: skip
        self.files, self.names, self.offsets, self.shapes = files, names, offsets, shapes
        self.sums, self.prefix = sums, prefix
        self._made: tuple[Chunk, ...] | None = None

    def chunk(self, j: int) -> Chunk:
        if self._made is not None:
            return self._made[j]
        name = self.names[int(self.files[j])]
        return Chunk(
            name, self._key(name, j), tuple(self.offsets[j].tolist()),
            tuple(self.shapes[j].tolist()), self.sums[16 * j : 16 * j + 16],
        )  # fmt: skip

    def _key(self, file: str, j: int) -> str:
        return SHARED_KEY if one_chunk_file(file) else f"{self.prefix}{j}"

    def meeting(self, lo: Sequence[int], hi: Sequence[int]) -> list[Chunk]:
        """The chunks that share an element with the box ``[lo, hi)`` (found as arrays: a
        rank of a large job needs a few of each tensor's thousand chunks)."""
        import numpy as np

        ends = self.offsets + self.shapes
        low = np.maximum(self.offsets, np.asarray(lo, dtype=np.int64))
        high = np.minimum(ends, np.asarray(hi, dtype=np.int64))
        hits = np.flatnonzero((high > low).all(axis=1))
        return [self.chunk(j) for j in hits.tolist()]

    def _all(self) -> tuple[Chunk, ...]:
        if self._made is None:
            names, sums = self.names, self.sums
            columns = zip(
                self.files.tolist(), self.offsets.tolist(), self.shapes.tolist(), strict=True
            )
            self._made = tuple(
                [
                    Chunk(
                        names[f],
                        self._key(names[f], j),
                        tuple(o),
                        tuple(n),
                        sums[16 * j : 16 * j + 16],
                    )
                    for j, (f, o, n) in enumerate(columns)
                ]
            )
        return self._made

    def __len__(self) -> int:
        return len(self.files)

    @overload
    def __getitem__(self, k: int) -> Chunk: ...
    @overload
    def __getitem__(self, k: slice) -> tuple[Chunk, ...]: ...
    def __getitem__(self, k: int | slice) -> Chunk | tuple[Chunk, ...]:
        return self._all()[k]

    def __iter__(self) -> Iterator[Chunk]:
        return iter(self._all())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    __hash__ = None  # type: ignore[assignment]  # unhashable, as a mutable-looking value should be


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    chunks: Sequence[Chunk]
    numpy: bool
    layout: str = "replicated"  # how the saving ranks held it (LAYOUTS)
    rank: int | None = None  # the rank a per_rank tensor belongs to

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class Manifest:
    """A validated manifest. ``raw`` keeps every field, including ones newer code added."""

    raw: dict[str, Any]
    tensors: tuple[TensorInfo, ...]
    files: dict[str, int]  # name -> size in bytes
    # name -> checksum of the file's safetensors header (length prefix, JSON, padding); v2 on
    header_checksums: dict[str, str]

    @property
    def step(self) -> int | None:
        return self.raw.get("step")

    @property
    def epoch(self) -> int | None:
        return self.raw.get("epoch")

    @property
    def tree(self) -> dict[str, Any]:
        return self.raw["tree"]

    @property
    def sealed(self) -> bool:
        """Whether the manifest's format carries checksums (format 2 on)."""
        return self.raw["format_version"] >= SEALED_SINCE

    @property
    def world_size(self) -> int:
        return self.raw.get("world_size", 1)

    def tree_for(self, rank: int, fallback: str = "rank0", where: str = "") -> dict[str, Any]:
        """The state tree as rank ``rank`` sees it (see :func:`tree_for`)."""
        return tree_for(self.raw, rank, fallback, where)

    @property
    def nbytes(self) -> int:
        return sum(self.files.values())


def tree_for(
    raw: dict[str, Any], rank: int, fallback: str = "rank0", where: str = ""
) -> dict[str, Any]:
    """The state tree of the (validated) manifest ``raw`` as rank ``rank`` sees it: each
    ``tg.PerRank`` part is that rank's.

    A rank the save did not have gets rank 0's parts (``fallback="rank0"``) or an error
    (``"error"``). Checkpoints without per-rank parts return the tree itself.
    """
    per_rank = raw.get("per_rank")
    if per_rank is None:
        return raw["tree"]
    if rank >= len(per_rank):
        if fallback == "error":
            raise StateMismatchError(
                f"{where}: this checkpoint was saved by {len(per_rank)} ranks and holds "
                f"no tg.PerRank values for rank {rank}; load with "
                "per_rank_fallback='rank0' to give such ranks rank 0's values."
            )
        rank = 0
    own = per_rank[rank]
    # A loop, not recursion: a tree nested to the depth limit is ~3 containers per level
    # and recursing through it exceeded Python's recursion limit (validate() bounds it).
    out: list[Any] = [None]
    stack: list[tuple[Any, Any, Any]] = [(raw["tree"], out, 0)]
    while stack:
        node, parent, slot = stack.pop()
        if isinstance(node, list):
            copy: Any = list(node)
            stack.extend((x, copy, j) for j, x in enumerate(node) if isinstance(x, (list, dict)))
        elif isinstance(node, dict) and node.get("t") == "per_rank":
            i = node.get("i")
            if type(i) is not int or not 0 <= i < len(own):
                raise _fail(where, f"a per-rank part refers to #{i!r}, which rank {rank} lacks")
            copy = own[i]
        elif isinstance(node, dict):
            copy = dict(node)
            stack.extend((v, copy, k) for k, v in node.items() if isinstance(v, (list, dict)))
        else:
            copy = node
        parent[slot] = copy
    return out[0]


def _fail(where: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{where}: {what}. The manifest is damaged or was not written by Tardigrade; restore "
        "the checkpoint from a backup or delete it."
    )


def _int_list(v: Any) -> TypeGuard[list[int]]:
    """A shape or offsets: at most MAX_DIMS ints, each one torch can hold (a plain loop: this
    runs for every chunk, and a generator costs twice as much)."""
    if type(v) is not list or len(v) > limits.MAX_DIMS:
        return False
    for x in v:  # noqa: SIM110
        if type(x) is not int or x < 0 or x > limits.MAX_TORCH_EXTENT:
            return False
    return True


def parse(raw_bytes: bytes, where: str) -> Manifest:
    """Parse and validate manifest bytes; raise a TardigradeError naming ``where``."""
    sealed = _unseal(raw_bytes, where)
    return validate(loads_strict(raw_bytes, where), where, sealed=sealed)


def validate(doc: Any, where: str, *, sealed: bool = True) -> Manifest:
    """Validate a parsed manifest (``sealed``: its bytes ended with a checksum that matched).

    A writer checks the manifest it is about to commit with this, on the document it encoded:
    parsing its own output again would only repeat what the JSON encoder guarantees.
    """
    if not isinstance(doc, dict):
        raise _fail(where, "manifest is not a JSON object")
    if doc.get("format") != FORMAT_NAME:
        raise _fail(where, f"'format' is {doc.get('format')!r}, expected {FORMAT_NAME!r}")
    version = doc.get("format_version")
    if type(version) is not int:
        raise _fail(where, f"'format_version' is {version!r}, expected an integer")
    if version not in READABLE_VERSIONS:
        raise UnsupportedFormatError(
            f"{where}: format_version {version} is not supported by this version of Tardigrade "
            f"(it reads versions {list(READABLE_VERSIONS)}). Upgrade Tardigrade to read it."
        )
    if version >= SEALED_SINCE and not sealed:
        raise _fail(
            where,
            f"format_version {version} manifests end with their checksum, and this one does not "
            "(truncated, or edited by hand)",
        )
    if doc.get("checksum_algorithm") != ALGORITHM:
        raise UnsupportedFormatError(
            f"{where}: checksum algorithm {doc.get('checksum_algorithm')!r} is unknown "
            f"(this version uses {ALGORITHM!r})."
        )
    for field in ("step", "epoch"):
        if doc.get(field) is not None and type(doc[field]) is not int:
            raise _fail(where, f"{field!r} must be an integer or null")
    if not isinstance(doc.get("tree"), dict):
        raise _fail(where, "'tree' is missing")
    world = doc.get("world_size", 1)
    if type(world) is not int or not 1 <= world <= limits.MAX_WORLD_SIZE:
        raise _fail(where, f"'world_size' is {world!r}, expected a positive integer")
    per_rank = doc.get("per_rank")
    if per_rank is not None and (
        not isinstance(per_rank, list)
        or len(per_rank) != world
        or not all(isinstance(p, list) and all(isinstance(n, dict) for n in p) for p in per_rank)
    ):
        raise _fail(where, f"'per_rank' must list each of the {world} ranks' subtrees")
    _check_written_as(doc, version, sealed, where)
    with gc_paused():  # a walk of a million nodes: see gc_paused
        _check_tree(doc["tree"], per_rank, where, _TAGS_UNTIL.get(version))
    files, header_sums = _files(
        doc.get("files"), where, sealed=version >= SEALED_SINCE, shared=version >= SHARED_VERSION
    )
    columnar = version == COLUMNAR_VERSION or (version >= PACKED_VERSION and world > 1)
    tensors = _tensors(doc.get("tensors"), files, where, columnar=columnar)
    if not columnar:  # columns derive keys, unique by construction
        with gc_paused():  # a set of a million (file, key) tuples
            _check_keys_unique(tensors, where)
    return Manifest(doc, tensors, files, header_sums)


# The tree node tags each older format's writers wrote; a newer tag in a manifest that claims
# an older version means it was relabelled (older versions are checked less: v1 carries no
# checksum at all), so it is refused. Absent: every tag this reader knows.
_V2_TAGS = frozenset(
    ("none", "bool", "int", "float", "str", "bytes", "dtype", "list", "tuple", "dict", "odict",
     "stateful", "tensor", "ndarray")
)  # fmt: skip
_V3_TAGS = _V2_TAGS | {
    "complex",
    "counter",
    "device",
    "set",
    "frozenset",
    "npscalar",
    "size",
    "sparse",
}
# Formats 1-3 are closed (every later tag came with a later version); format 4 and on still
# gain leaf kinds (e.g. "generator"), so their tags are left to decode().
_TAGS_UNTIL: dict[int, frozenset[str]] = {1: _V2_TAGS, 2: _V2_TAGS, 3: _V3_TAGS}


def _listed(doc: dict[str, Any], key: str) -> list[Any]:
    """``doc[key]`` where it is a list; this check runs before the fields' own are checked."""
    value = doc.get(key)
    return value if isinstance(value, list) else []


def _check_written_as(doc: dict[str, Any], version: int, sealed: bool, where: str) -> None:
    """Refuse a manifest that claims an older format than what it holds shows.

    Relabelling a newer manifest as format 1 (which has no checksums) after editing it would
    otherwise switch off every checksum; so would one that claims format 2-3 and holds
    distributed parts. What each version adds is listed at ``FORMAT_VERSION``.
    """
    newer = []
    if version < SEALED_SINCE:
        if sealed:
            newer.append("a manifest checksum")
        if any(isinstance(f, dict) and "header_checksum" in f for f in _listed(doc, "files")):
            newer.append("data file header checksums")
    if version < 4:
        if "per_rank" in doc or doc.get("world_size", 1) != 1:
            newer.append("parts saved by several ranks")
        if any(
            isinstance(t, dict) and ("layout" in t or "rank" in t) for t in _listed(doc, "tensors")
        ):
            newer.append("tensor layouts")
    if newer:
        raise _fail(
            where, f"it claims format_version {version} but holds {' and '.join(newer)}, which "
            "only newer versions write: it was edited and relabelled"
        )  # fmt: skip


def _check_tree(
    tree: dict[str, Any],
    per_rank: list[list[Any]] | None,
    where: str,
    tags: frozenset[str] | None = None,
) -> None:
    """Bound the state tree's nesting as every reader counts it, each ``tg.PerRank`` part at
    the depth of the place it fills, and check each place names a part every rank has.

    Part of validation so the writer, which validates its own manifest before commit, can
    never commit a tree that ``load`` (``tree_for`` then ``decode``) refuses.
    """
    parts = min((len(p) for p in per_rank), default=0) if per_rank is not None else 0
    placed: dict[int, int] = {}  # part -> the deepest level a place for it sits at
    nodes = _tree_depth(tree, 0, placed, where, tags)
    for i in placed:
        if per_rank is None:
            raise _fail(where, f"the state tree has a place for per-rank part #{i}, and the "
                        "manifest lists no 'per_rank' parts")  # fmt: skip
        if not 0 <= i < parts:
            raise _fail(where, f"the state tree refers to per-rank part #{i}, which not every "
                        f"one of the {len(per_rank)} ranks lists")  # fmt: skip
    for own in per_rank or ():
        for i, part in enumerate(own):
            nodes += _tree_depth(part, placed.get(i, 0), None, where, tags)
    if nodes > limits.MAX_TREE_NODES:
        raise _fail(where, f"the state tree has more than {limits.MAX_TREE_NODES} nodes")


def _tree_depth(
    root: Any,
    depth: int,
    placed: dict[int, int] | None,
    where: str,
    tags: frozenset[str] | None = None,
) -> int:
    """Walk a tree node (at ``depth``) with a stack; return the nodes it visited.

    Depth counts as ``format.tree.decode`` counts it: the nodes inside a node's ``v`` and ``meta``
    (whatever lists hold them: a list's items, a dict's [key, value] pairs) are one level
    deeper. ``placed`` collects where ``{"t": "per_rank", "i": k}`` places sit (None: inside
    a per-rank part, where no such place exists and the node is left to ``decode``).
    ``tags``: the only node tags allowed (those of the format the manifest claims).

    A leaf (no ``v`` or ``meta`` holding containers) is checked from its parent and never
    pushed: most nodes are leaves, and this runs on every save and load.
    """
    limit = limits.MAX_TREE_DEPTH
    stack: list[tuple[Any, int]] = [(root, depth)]
    count = 0
    while stack:
        node, d = stack.pop()
        count += 1
        if d > limit:
            raise _fail(
                where, f"state tree at {_path_of(root, node)}: nested more than "
                f"{limit} levels deep"
            )  # fmt: skip
        t = node.get("t")
        if tags is not None and (
            (type(t) is str and t not in tags) or ("complex" in node and tags is _V2_TAGS)
        ):
            raise _fail(
                where, f"state tree at {_path_of(root, node)}: a {t!r} node "
                f"{'of a complex tensor ' if 'complex' in node else ''}in a manifest of a format "
                "that has no such node: it was edited and relabelled"
            )  # fmt: skip
        if t == "per_rank" and placed is not None:
            i = node.get("i")
            if type(i) is not int:
                raise _fail(where, f"a per-rank part refers to #{i!r}, not a part number")
            placed[i] = max(placed.get(i, d), d)
            continue
        d1 = d + 1
        todo = [node.get("v"), node.get("meta")]
        while todo:
            v = todo.pop()
            if type(v) is dict:
                vv = v.get("v")
                if (
                    d1 > limit
                    or tags is not None
                    or type(vv) is list
                    or type(vv) is dict
                    or "meta" in v
                    or v.get("t") == "per_rank"
                ):
                    stack.append((v, d1))
                else:
                    count += 1
            elif type(v) is list:
                todo.extend(v)  # a list's items, a dict's [key, value] pairs
    return count


def _path_of(root: Any, target: dict[str, Any]) -> str:
    """``state['a'][0]``: where ``target`` sits below ``root``, for a message (keys that are
    not plain str/int nodes print as ``?``)."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(root, ())]
    while stack:
        node, path = stack.pop()
        if node is target:
            return "state" + "".join(f"[{p!r}]" for p in path)
        if type(node) is not dict:
            continue
        t, v = node.get("t"), node.get("v")
        if type(v) is dict:
            stack.append((v, path))
        elif t in ("dict", "odict", "counter") and type(v) is list:
            for item in v:
                if type(item) is list and len(item) == 2:
                    stack.extend([(item[0], path), (item[1], (*path, _key_text(item[0])))])
        elif t in ("list", "tuple") and type(v) is list:
            stack.extend([(x, (*path, i)) for i, x in enumerate(v)])
        elif type(v) is list:
            stack.extend([(x, path) for x in v])
        if type(node.get("meta")) is dict:
            stack.append((node["meta"], path))
    return "state"


def _key_text(node: Any) -> Any:
    """A dict key node as the key it decodes to, where that is a plain str or small int."""
    if type(node) is dict and type(node.get("v")) is str:
        v = node["v"]
        if node.get("t") == "str":
            return v
        if node.get("t") == "int" and len(v) <= 20 and v.lstrip("-").isdigit():
            return int(v)
    return "?"


def _check_keys_unique(tensors: tuple[TensorInfo, ...], where: str) -> None:
    """Two chunks naming one (file, key) would read the same bytes twice."""
    seen: set[tuple[str, str]] = set()
    for i, t in enumerate(tensors):
        for c in t.chunks:
            if (c.file, c.key) in seen:
                raise _fail(where, f"tensor #{i}: key {c.key!r} of {c.file!r} is used twice")
            seen.add((c.file, c.key))


def _files(
    v: Any, where: str, *, sealed: bool, shared: bool = False
) -> tuple[dict[str, int], dict[str, str]]:
    if not isinstance(v, list) or len(v) > limits.MAX_FILES:
        raise _fail(where, f"'files' must be a list of at most {limits.MAX_FILES} entries")
    out: dict[str, int] = {}
    sums: dict[str, str] = {}
    for f in v:
        if (
            not isinstance(f, dict)
            or type(f.get("size")) is not int
            or not 0 <= f["size"] <= limits.MAX_TORCH_EXTENT  # sizes are summed as int64
        ):
            raise _fail(
                where, f"file entry {f!r} must have a name and a size from 0 to 2**63-1 bytes"
            )
        name = check_name(f.get("name"), where, shared=shared)
        if name in out:
            raise _fail(where, f"data file {name!r} is listed twice")
        out[name] = f["size"]
        if sealed:
            if not isinstance(f.get("header_checksum"), str):
                raise _fail(where, f"data file {name!r} has no header_checksum")
            sums[name] = f["header_checksum"]
    return out, sums


def _tensors(
    v: Any, files: dict[str, int], where: str, *, columnar: bool
) -> tuple[TensorInfo, ...]:
    try:
        with gc_paused():
            return _tensors_unpaused(v, files, where, columnar)
    except MemoryError as e:
        if isinstance(e, TardigradeError):
            raise
        raise InsufficientMemoryError(
            f"{where}: ran out of memory validating {len(v)} tensors. Free memory (or raise "
            "this process's memory limit) and load again."
        ) from None


def _tensors_unpaused(
    v: Any, files: dict[str, int], where: str, columnar: bool
) -> tuple[TensorInfo, ...]:
    if not isinstance(v, list) or len(v) > limits.MAX_TENSORS:
        raise _fail(where, f"'tensors' must be a list of at most {limits.MAX_TENSORS} entries")
    out = []
    used = dict.fromkeys(files, 0)  # bytes claimed per data file, bounded by its size
    columns = _Columns(files) if columnar else None
    for i, t in enumerate(v):
        if not isinstance(t, dict):
            raise _fail(where, f"tensor #{i} is not an object")
        dtype = t.get("dtype")
        if not isinstance(dtype, str) or dtype not in ITEMSIZE:
            raise UnsupportedFormatError(
                f"{where}: tensor #{i} has unknown dtype {dtype!r}; this version of Tardigrade "
                f"reads {sorted(ITEMSIZE)}. Upgrade Tardigrade to read it."
            )
        shape = t.get("shape")
        if not _int_list(shape):
            raise _fail(where, f"tensor #{i} has an invalid shape {shape!r}")
        if not limits.fits_torch(shape, ITEMSIZE[dtype]):
            raise _fail(where, f"tensor #{i} has a shape {shape} too large for any tensor")
        chunks = t.get("chunks")
        parsed: Sequence[Chunk]
        if columns is not None:
            parsed = columns.parse(chunks, i, t.get("name"), shape, ITEMSIZE[dtype], where)
        else:
            if not isinstance(chunks, list) or (not chunks and math.prod(shape) > 0):
                raise _fail(where, f"tensor #{i} lists no chunks")
            parsed = tuple([_chunk(c, i, shape, files, where) for c in chunks])
            # Bound every size by the bytes that really exist before anything is allocated.
            itemsize = ITEMSIZE[dtype]
            for c in parsed:
                used[c.file] += math.prod(c.shape) * itemsize
                if used[c.file] > files[c.file]:
                    raise _fail(
                        where,
                        f"tensor #{i} (shape {shape}) claims more bytes than data file "
                        f"{c.file!r} holds ({files[c.file]})",
                    )
            _check_tiling(parsed, shape, i, where)
        layout, rank = t.get("layout", "replicated"), t.get("rank")
        if layout not in LAYOUTS or (rank is not None and (type(rank) is not int or rank < 0)):
            raise _fail(where, f"tensor #{i} has an unknown layout {layout!r} (rank {rank!r})")
        out.append(TensorInfo(dtype, tuple(shape), parsed, t.get("numpy") is True, layout, rank))
    return tuple(out)


def _chunk(c: Any, i: int, shape: list[int], files: dict[str, int], where: str) -> Chunk:
    if not isinstance(c, dict):
        raise _fail(where, f"tensor #{i} has a chunk that is not an object")
    name = c.get("file")
    if type(name) is not str or name not in files:  # names in 'files' were checked already
        name = check_name(name, where)
        raise _fail(where, f"tensor #{i} refers to data file {name!r}, which 'files' does not list")
    offsets, cshape = c.get("offsets"), c.get("shape")
    if not (_int_list(offsets) and _int_list(cshape) and len(offsets) == len(cshape) == len(shape)):
        raise _fail(where, f"tensor #{i} has a chunk with invalid offsets/shape")
    for o, n, s in zip(offsets, cshape, shape, strict=True):
        if o + n > s:
            raise _fail(
                where, f"tensor #{i} has a chunk at {offsets} of shape {cshape} outside {shape}"
            )
    key, checksum = c.get("key"), c.get("checksum")
    if type(key) is not str or type(checksum) is not str:
        raise _fail(where, f"tensor #{i} has a chunk without key or checksum")
    return Chunk(name, key, tuple(offsets), tuple(cshape), checksum)


def _check_tiling(chunks: tuple[Chunk, ...], shape: list[int], i: int, where: str) -> None:
    """Chunks must cover the tensor exactly once: equal volume and no two overlapping."""
    if len(chunks) == 1:
        if chunks[0].shape != tuple(shape):  # the common case, decided without arithmetic
            raise _fail(where, f"tensor #{i}: its chunks do not cover its shape {shape} exactly")
        return
    if sum(c.numel for c in chunks) != math.prod(shape):
        raise _fail(where, f"tensor #{i}: its chunks do not cover its shape {shape} exactly")
    boxes = [
        (c.offsets, tuple([o + n for o, n in zip(c.offsets, c.shape, strict=True)]))
        for c in chunks
        if 0 not in c.shape
    ]
    try:
        check_exact_tiling(boxes, shape, limits.MAX_BOX_CHUNKS)
    except TilingError as e:
        raise _fail(where, f"tensor #{i}: {e}") from None


_HEX = re.compile(r"[0-9a-f]*")


def _int_column(v: Any, n: int) -> np.ndarray | None:
    """A chunk column as int64: one int for every chunk, or a list of ``n`` ints (bools pass
    as 0/1); None if it is neither."""
    import numpy as np

    if type(v) is int:
        return np.full(n, v, dtype=np.int64) if -(2**63) <= v < 2**63 else None
    if type(v) is not list or len(v) != n:
        return None
    if not v:
        return np.zeros(0, dtype=np.int64)
    try:
        a = np.array(v)
    except (ValueError, OverflowError, TypeError):
        return None
    return a if a.dtype == np.int64 and a.ndim == 1 else None


def _box_columns(v: Any, n: int, d: int) -> np.ndarray | None:
    """Offsets or shapes: one column per dimension, as an int64 [n, d] array."""
    import numpy as np

    if type(v) is not list or len(v) != d:
        return None
    columns = [_int_column(c, n) for c in v]
    if any(c is None for c in columns):
        return None
    return (
        np.stack(columns, axis=1)  # type: ignore[arg-type]  # no column is None (checked above)
        if d
        else np.zeros((n, 0), dtype=np.int64)
    )


class _Columns:
    """Validates format-5 chunk columns as arrays: the checks ``_chunk`` and ``_check_tiling``
    make per chunk object, a tensor at a time."""

    def __init__(self, files: dict[str, int]) -> None:
        import numpy as np

        self.names = list(files)
        self.sizes = np.array(list(files.values()), dtype=np.int64)
        self.used = np.zeros(len(files), dtype=np.int64)  # bytes claimed per data file

    def parse(
        self, c: Any, i: int, name: Any, shape: list[int], itemsize: int, where: str
    ) -> Sequence[Chunk]:
        import numpy as np

        if type(name) is not str:
            raise _fail(where, f"tensor #{i} has no name (format 5 derives chunk keys from it)")
        if not isinstance(c, dict):
            raise _fail(where, f"tensor #{i}: 'chunks' must be an object of columns")
        sums = c.get("checksum")
        if type(sums) is not str or len(sums) % 16:
            raise _fail(where, f"tensor #{i}: 'checksum' must hold 16 hex digits per chunk")
        n, d = len(sums) // 16, len(shape)
        if n == 0 and math.prod(shape) > 0:
            raise _fail(where, f"tensor #{i} lists no chunks")
        if n == 1:  # most tensors: checked without arrays; anything odd takes the array path
            whole = self._whole(c, i, name, shape, itemsize, sums)
            if whole is not None:
                return whole
        files = _int_column(c.get("file"), n)
        offsets = _box_columns(c.get("offsets"), n, d)
        shapes = _box_columns(c.get("shape"), n, d)
        if files is None or offsets is None or shapes is None:
            raise _fail(
                where, f"tensor #{i}: its {n} chunks need a 'file' column and {d} 'offsets' and "
                "'shape' columns, each one integer or a list of one per chunk"
            )  # fmt: skip
        if not _HEX.fullmatch(sums):
            raise _fail(where, f"tensor #{i}: its chunk checksums are not hex digits")
        if n and (files.min() < 0 or files.max() >= len(self.names)):
            raise _fail(where, f"tensor #{i} refers to a data file 'files' does not list")
        full = np.array(shape, dtype=np.int64)
        # Compared as below, nothing overflows: every value is at most the tensor's extent.
        if bool((offsets < 0).any()) or bool((shapes < 0).any()) or bool((shapes > full).any()):
            raise _fail(where, f"tensor #{i} has a chunk with invalid offsets/shape")
        if bool((offsets > full - shapes).any()):
            k = int(np.flatnonzero((offsets > full - shapes).any(axis=1))[0])
            raise _fail(
                where, f"tensor #{i} has a chunk at {offsets[k].tolist()} of shape "
                f"{shapes[k].tolist()} outside {shape}"
            )  # fmt: skip
        volumes = np.prod(shapes, axis=1)  # each at most the tensor's, which torch can hold
        total = math.prod(shape)
        if float(volumes.sum(dtype=np.float64)) > total + 0.5 or int(volumes.sum()) != total:
            raise _fail(where, f"tensor #{i}: its chunks do not cover its shape {shape} exactly")
        # Bound every size by the bytes that really exist before anything is allocated.
        claimed = np.zeros(len(self.names), dtype=np.int64)
        np.add.at(claimed, files, volumes * itemsize)  # at most the tensor's bytes in all
        over = claimed > self.sizes - self.used
        if bool(over.any()):
            f = self.names[int(np.flatnonzero(over)[0])]
            raise _fail(
                where, f"tensor #{i} (shape {shape}) claims more bytes than data file {f!r} "
                f"holds ({self.sizes[self.names.index(f)]})"
            )  # fmt: skip
        self.used += claimed
        _check_tiling_columns(offsets, shapes, shape, i, where)
        return ChunkColumns(files, self.names, offsets, shapes, sums, f"{name}@{i}.")

    def _whole(
        self, c: dict[str, Any], i: int, name: str, shape: list[int], itemsize: int, sums: str
    ) -> tuple[Chunk] | None:
        """A valid single chunk covering the whole tensor, or None (not one, or invalid)."""
        f, offsets, shapes = _one(c.get("file")), c.get("offsets"), c.get("shape")
        if f is None or type(offsets) is not list or type(shapes) is not list:
            return None
        if len(offsets) != len(shape) or len(shapes) != len(shape):
            return None  # one column per dimension: the array path says what is wrong
        o, n = [_one(x) for x in offsets], [_one(x) for x in shapes]
        if n != shape or any(x != 0 for x in o) or not 0 <= f < len(self.names):
            return None
        nbytes = math.prod(shape) * itemsize
        if nbytes > self.sizes[f] - self.used[f] or not _HEX.fullmatch(sums):
            return None
        self.used[f] += nbytes
        key = SHARED_KEY if one_chunk_file(self.names[f]) else f"{name}@{i}.0"
        return (
            Chunk(self.names[f], key, tuple(o), tuple(shape), sums),  # type: ignore[arg-type]  # o, shape: int lists (checked above)
        )


def _one(v: Any) -> int | None:
    """A single-chunk column's value (one int, or a list of one), else None."""
    if type(v) is int:
        return v
    if type(v) is list and len(v) == 1 and type(v[0]) is int:
        return v[0]
    return None


def _check_tiling_columns(
    offsets: np.ndarray, shapes: np.ndarray, shape: list[int], i: int, where: str
) -> None:
    """``_check_tiling`` for columns (their volumes already add up to the tensor's)."""
    import numpy as np

    n, d = shapes.shape
    live = (shapes > 0).all(axis=1)
    if n <= 1 or d == 0 or int(live.sum()) <= 1:
        return
    full = np.array(shape, dtype=np.int64)
    if bool((offsets[live, 1:] == 0).all()) and bool((shapes[live, 1:] == full[1:]).all()):
        # Row slabs, as almost every sharded tensor is: sorted, none may overlap the next.
        order = np.argsort(offsets[live, 0], kind="stable")
        starts, ends = offsets[live, 0][order], (offsets[live, 0] + shapes[live, 0])[order]
        if bool((starts[1:] < ends[:-1]).any()):
            raise _fail(where, f"tensor #{i}: two of its chunks overlap")
        return
    boxes = [
        (tuple(o), tuple([a + b for a, b in zip(o, s, strict=True)]))
        for o, s in zip(offsets[live].tolist(), shapes[live].tolist(), strict=True)
    ]
    try:
        check_exact_tiling(boxes, shape, limits.MAX_BOX_CHUNKS)
    except TilingError as e:
        raise _fail(where, f"tensor #{i}: {e}") from None


def check_name(name: object, where: str, *, shared: bool = False) -> str:
    """A data file name from a manifest must be a plain file name inside the checkpoint, or
    (``shared``: format 7 on) exactly the name of a shared object of the root."""
    if shared and isinstance(name, str) and is_shared(name):
        return name
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\x00" in name
        or ".." in name
        or len(name) > 255
    ):
        raise CorruptCheckpointError(
            f"{where}: data file name {name!r} is not a plain file name inside the checkpoint "
            "(it contains a path separator, '..', NUL or is empty). The manifest is damaged or "
            "hostile; refusing to read it."
        )
    return name
