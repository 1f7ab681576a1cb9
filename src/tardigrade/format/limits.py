"""Hard caps that keep a malicious or damaged checkpoint from exhausting memory or time."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "MAX_BOX_CHUNKS",
    "MAX_DIMS",
    "MAX_FILES",
    "MAX_HEADER_BYTES",
    "MAX_MANIFEST_BYTES",
    "MAX_PARSE_BYTES",
    "MAX_TENSORS",
    "MAX_TENSORS_PER_FILE",
    "MAX_TORCH_EXTENT",
    "MAX_TREE_DEPTH",
    "MAX_TREE_NODES",
    "MAX_WORLD_SIZE",
    "PARSE_AMPLIFICATION",
    "fits_torch",
]

MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own cap on a data file's JSON header
# A manifest costs ~260 bytes per single-chunk tensor and ~110 per extra chunk: 128 MiB holds
# ~500k tensors or ~1M chunks. The largest real states (a 1T-parameter MoE with Adam: ~200k
# tensors) need ~50 MB; more would be parsed into 10-20x their size in Python objects.
MAX_MANIFEST_BYTES = 128 * 1024 * 1024
MAX_TENSORS_PER_FILE = 1_000_000
MAX_TENSORS = 1_000_000  # tensors listed by one manifest (no fewer than ~100 bytes each)
MAX_FILES = 100_000  # data files listed by one manifest
MAX_WORLD_SIZE = 1_000_000  # ranks of a distributed save
MAX_TREE_NODES = 50_000_000
MAX_TREE_DEPTH = 200  # nesting of the state tree in the manifest
MAX_DIMS = 64
# Parsing JSON builds Python objects: ~250 bytes per object, ~100 per list, ~50 per member.
# Dense JSON ("[[],[],...]") would take 25-40x its size; a document whose estimated cost
# exceeds both PARSE_AMPLIFICATION x its size and MAX_PARSE_BYTES is refused unparsed.
# Real manifests and headers estimate at 10-13x.
PARSE_AMPLIFICATION = 16
MAX_PARSE_BYTES = 1024 * 1024 * 1024
MAX_BOX_CHUNKS = 64  # chunks of one tensor compared pairwise when no cut separates them

# torch keeps sizes, strides and byte counts in int64: a shape whose strides or byte count
# overflow it makes torch.empty raise TypeError/RuntimeError (even when a dim is 0, since
# strides treat a 0 dim as 1), so such shapes are refused while validating.
MAX_TORCH_EXTENT = 2**63 - 1


def fits_torch(shape: Sequence[int], itemsize: int) -> bool:
    """True if torch can describe a tensor of ``shape`` (its strides and bytes fit int64)."""
    n = itemsize
    for d in shape:  # a loop, not math.prod over a generator: this runs for every tensor
        if d > 1:
            n *= d
    return n <= MAX_TORCH_EXTENT
