"""What a sparse tensor's stored parts must satisfy, by shape and dtype alone (no torch).

Checked while opening a checkpoint (``_open._check_refs``, also run by ``verify``) and again
before torch builds the tensor (``format.tree.decode``): a load must refuse a damaged checkpoint
before it reads a byte into live state, and the stand-ins it builds before reading (meta
tensors) skip torch's own checks of compressed layouts or fail with IndexError.
"""

from __future__ import annotations

__all__ = [
    "SPARSE_PARTS",
    "sparse_problem",
]

# The parts each layout is stored as, in order (``_tree.SPARSE_LAYOUTS`` pairs them with the
# torch layouts).
SPARSE_PARTS: dict[str, tuple[str, ...]] = {
    "coo": ("indices", "values"),
    "csr": ("crow_indices", "col_indices", "values"),
    "csc": ("ccol_indices", "row_indices", "values"),
    "bsr": ("crow_indices", "col_indices", "values"),
    "bsc": ("ccol_indices", "row_indices", "values"),
}


def sparse_problem(
    layout: str, size: list[int], parts: list[tuple[tuple[int, ...], str]]
) -> str | None:
    """What torch refuses in a sparse tensor's parts (their shapes and dtype names, in
    ``SPARSE_PARTS`` order) given its size, as a phrase; None if nothing. Index bounds need
    the values and are left to torch's invariant checks."""
    if layout == "coo":
        (ishape, idtype), (vshape, _) = parts
        if idtype != "I64" or len(ishape) != 2:
            return f"indices are {idtype}{list(ishape)}, not I64[sparse dims, nnz]"
        sparse_dim, nnz = ishape
        if not vshape or vshape[0] != nnz:
            return f"values {list(vshape)} do not hold one entry per index ({nnz})"
        if len(size) != sparse_dim + len(vshape) - 1 or tuple(size[sparse_dim:]) != vshape[1:]:
            return f"size {size} does not fit indices {list(ishape)} and values {list(vshape)}"
        return None
    (cshape, cdtype), (pshape, pdtype), (vshape, _) = parts
    if cdtype not in ("I32", "I64") or pdtype != cdtype or not cshape:
        return f"index parts are {cdtype}{list(cshape)} and {pdtype}{list(pshape)}"
    batch, block = len(cshape) - 1, 2 if layout in ("bsr", "bsc") else 0
    if (
        len(pshape) != batch + 1
        or pshape[:-1] != cshape[:-1]
        or len(vshape) < batch + 1 + block
        or vshape[:batch] != cshape[:-1]
        or vshape[batch] != pshape[-1]
    ):
        return f"parts {list(cshape)}, {list(pshape)} and {list(vshape)} do not agree"
    dense = vshape[batch + 1 + block :]
    if len(size) != batch + 2 + len(dense) or tuple(size[:batch]) != cshape[:-1]:
        return f"size {size} does not fit its parts"
    if tuple(size[batch + 2 :]) != dense:
        return f"size {size} does not fit values {list(vshape)}"
    rows, cols = size[batch], size[batch + 1]
    bs = vshape[batch + 1 : batch + 3] if block else (1, 1)
    if 0 in bs or rows % bs[0] or cols % bs[1]:
        return f"blocks {list(bs)} do not divide size {size}"
    compressed = rows // bs[0] if layout in ("csr", "bsr") else cols // bs[1]
    if cshape[-1] != compressed + 1:
        return f"compressed indices {list(cshape)} do not hold {compressed} + 1 entries"
    return None
