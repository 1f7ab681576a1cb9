"""``tg.Checkpoint``: one committed checkpoint, opened for reading, as typed objects.

The public face of the readers that ``load``, ``verify`` and the ``tardigrade`` command share:
opening parses and validates the manifest (``_open``) and reads no tensor byte; ``tree()``
decodes the state with a :class:`TensorRef` in place of each tensor; ``read()`` is ``tg.load``
of this checkpoint in this process, ``read_into()`` reads stored tensors into the caller's
buffers (the load's own read plan and checks), ``verify()`` is ``tg.verify``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._load import check_read_options, load_opened
from ._match import Key, _plan_reads, _select
from ._open import _check_refs, manifest_at, open_manifest
from ._read import DEFAULT_READ_THREADS, _check_sizes, _read_chunks
from ._tiers import copy_checkpoint
from ._tree import SparseRef, TensorRef, decode, flatten, path_str, tensor_ref
from ._verify import VerifyReport, verify_opened
from .errors import InvalidArgumentError, TardigradeError
from .format.dtypes import TORCH_DTYPES
from .format.jsonio import gc_paused
from .format.manifest import MANIFEST, Manifest, TensorInfo, is_shared
from .storage import Storage, storage_for

__all__ = ["Checkpoint", "DataFile"]


@dataclass(frozen=True)
class DataFile:
    """A data file of a checkpoint, as its manifest records it."""

    name: str
    nbytes: int
    header_checksum: str | None  # of its safetensors header; None before format 2


class Checkpoint:
    """Open a committed checkpoint to see what it holds and read any part of it.

    Opening reads and checks the manifest only (``CheckpointNotFoundError`` when ``location``
    holds no committed checkpoint, ``CorruptCheckpointError`` for a damaged manifest); tensor
    bytes are read only by :meth:`read`, :meth:`read_into` and :meth:`verify`, and checked
    against their checksums as ``tg.load`` checks them. Everything here runs in this process
    alone, also in a ``torch.distributed`` job (``tg.load``/``tg.verify`` are the collective
    forms).

    >>> ckpt = tg.Checkpoint.open("ckpt/step-000000100")          # doctest: +SKIP
    >>> ckpt.step, ckpt.format_version, ckpt.nbytes                  # doctest: +SKIP
    >>> {p: (t.dtype, t.shape) for p, t in ckpt.tensor_refs().items()}  # doctest: +SKIP
    >>> weights = ckpt.read(keys=["model"])["model"]                 # doctest: +SKIP
    """

    def __init__(self, storage: Storage, name: str, manifest: Manifest) -> None:
        """Use :meth:`open`; this takes a checkpoint already opened by the library."""
        self._storage, self._name, self._m = storage, name, manifest
        self.url: str = storage.url(name)
        """The checkpoint's location, as messages name it (an absolute path or a URL)."""

    @classmethod
    def open(
        cls, location: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
    ) -> Checkpoint:
        """Open the committed checkpoint at ``location`` (a path or URL such as ``memory://``).

        ``storage_options`` go to the storage backend (the fsspec convention). Reads only the
        manifest: its checksum and structure are checked here.
        """
        return cls(*open_manifest(location, storage_options))

    def __repr__(self) -> str:
        return f"Checkpoint({self.url!r}, step={self.step}, format_version={self.format_version})"

    # -- the manifest, typed --------------------------------------------------------------------

    @property
    def manifest(self) -> Manifest:
        """The validated manifest; ``manifest.raw`` is the dict ``tg.read_manifest`` returns."""
        return self._m

    @property
    def format_version(self) -> int:
        return int(self._m.raw["format_version"])

    @property
    def step(self) -> int | None:
        return self._m.step

    @property
    def epoch(self) -> int | None:
        return self._m.epoch

    @property
    def created(self) -> str | None:
        """When the save began, UTC, ISO 8601 (``None`` if the manifest does not say)."""
        created = self._m.raw.get("created")
        return created if isinstance(created, str) else None

    @property
    def metadata(self) -> dict[str, Any]:
        """The ``metadata=`` of the save (JSON values)."""
        return dict(self._m.raw.get("metadata") or {})

    @property
    def metrics(self) -> dict[str, float]:
        """The ``metrics=`` of the save (rank 0's in a distributed save)."""
        return dict(self._m.raw.get("metrics") or {})

    @property
    def versions(self) -> dict[str, str]:
        """The library versions that wrote it (``tardigrade``, ``torch``, ``python``)."""
        return dict(self._m.raw.get("versions") or {})

    @property
    def world_size(self) -> int:
        """How many ranks saved it (1 for a single-process save)."""
        return self._m.world_size

    @property
    def per_rank(self) -> int:
        """How many ``tg.PerRank`` values each saving rank has in it (0: none)."""
        parts = self._m.raw.get("per_rank")
        return len(parts[0]) if parts else 0

    @property
    def files(self) -> tuple[DataFile, ...]:
        """Its data files, sorted by name (the manifest is a separate object, ``MANIFEST``)."""
        sums = self._m.header_checksums
        return tuple(DataFile(n, size, sums.get(n)) for n, size in sorted(self._m.files.items()))

    @property
    def tensors(self) -> tuple[TensorInfo, ...]:
        """The stored tensors (dtype, shape, chunks, layout), indexed by ``TensorRef.entry``."""
        return self._m.tensors

    @property
    def nbytes(self) -> int:
        """Bytes of its data files, as the manifest records them (the manifest not counted)."""
        return self._m.nbytes

    def manifest_nbytes(self) -> int:
        """Bytes of the manifest object in storage (0 if it cannot be seen any more)."""
        try:
            st = self._storage.stat(f"{self._name}/{MANIFEST}")
        except (OSError, TardigradeError):
            return 0
        return st.size if st is not None else 0

    # -- the state, without its bytes -----------------------------------------------------------

    def tree(
        self,
        keys: Sequence[Key] | None = None,
        *,
        rank: int = 0,
        per_rank_fallback: str = "rank0",
    ) -> Any:
        """The saved state as ``read()`` would return it, with a :class:`TensorRef` in place of
        each tensor and array and a :class:`SparseRef` for each sparse tensor: nothing is read.

        ``keys``, ``rank`` and ``per_rank_fallback`` select as in ``read``.
        """
        check_read_options(True, per_rank_fallback)
        where = self.url
        m = self._m
        with gc_paused():  # an object per node: see gc_paused
            full = m.tree_for(rank, per_rank_fallback, where)
            _check_refs(full, m, where)
            tree = full if keys is None else _select(full, keys, where)

            def leaf(node: dict[str, Any], path: tuple[Any, ...]) -> TensorRef:
                info = m.tensors[node["e"]]
                return tensor_ref(node, info.shape, info.dtype)

            return decode(tree, leaf, where)

    @staticmethod
    def decode_node(node: Any, where: str = "manifest") -> Any:
        """The Python value a node of a manifest's state tree (``manifest.tree``) stands for,
        with None for each tensor: for tools that show the stored tree as it is.

        Raises ``CorruptCheckpointError`` naming ``where`` and the path of a malformed node.
        """
        return decode(node, lambda n, p: None, where)

    @staticmethod
    def encode_value(value: Any) -> dict[str, Any]:
        """The state-tree node a plain Python value (no tensors) is stored as: the inverse of
        :meth:`decode_node`."""
        tree: dict[str, Any] = flatten(value).tree
        return tree

    @staticmethod
    def path_text(path: Sequence[Any]) -> str:
        """A path in the state as messages write it: ``state['optim']['param_groups'][0]``."""
        return path_str(tuple(path))

    def tensor_refs(
        self, *, rank: int = 0, per_rank_fallback: str = "rank0"
    ) -> dict[str, TensorRef | SparseRef]:
        """Every tensor of the state by its path (``"model/fc.weight"``, ``"optim/state/0/
        exp_avg"``: keys joined with ``/``), in the order of the tree; nothing is read."""
        out: dict[str, TensorRef | SparseRef] = {}
        tree = self.tree(rank=rank, per_rank_fallback=per_rank_fallback)
        stack: list[tuple[Any, tuple[str, ...]]] = [(tree, ())]
        while stack:
            value, path = stack.pop()
            if isinstance(value, (TensorRef, SparseRef)):
                key = "/".join(path)
                if key in out:
                    raise InvalidArgumentError(
                        f"{self.url}: two tensors are both at {key!r} (a key holds a '/'); "
                        "walk tree() instead"
                    )
                out[key] = value
            elif isinstance(value, dict):
                stack.extend((v, (*path, str(k))) for k, v in reversed(value.items()))
            elif isinstance(value, (list, tuple)):
                stack.extend((v, (*path, str(i))) for i, v in reversed(list(enumerate(value))))
        return out

    # -- reading ---------------------------------------------------------------------------------

    def read(
        self,
        keys: Sequence[Key] | None = None,
        *,
        rank: int = 0,
        per_rank_fallback: str = "rank0",
        verify: bool | str = True,
        workers: int = DEFAULT_READ_THREADS,
    ) -> Any:
        """The saved state as a plain tree (CPU tensors, numpy arrays, Python values), as
        ``tg.load(location, keys=keys)`` returns it; only the bytes of ``keys`` are read.

        ``rank``: whose ``tg.PerRank`` values to take (a rank the save did not have gets rank
        0's with ``per_rank_fallback="rank0"``, an error with ``"error"``). ``verify`` and
        ``workers`` as in ``tg.load``.
        """
        check_read_options(verify, per_rank_fallback)
        return load_opened(
            self._storage, self._name, self._m, into=None, keys=keys, strict=True,
            verify=verify, workers=workers, rank=rank, per_rank_fallback=per_rank_fallback,
        )  # fmt: skip

    def read_into(
        self,
        dest: Mapping[int, torch.Tensor],
        *,
        names: Mapping[int, str] | None = None,
        verify: bool = True,
        workers: int = DEFAULT_READ_THREADS,
    ) -> int:
        """Read stored tensors, whole, into the caller's tensors; return the bytes read.

        ``dest`` maps ``TensorRef.entry`` to a CPU tensor of the stored tensor's shape and
        dtype (``tensors[entry]``; a view saved as such is read as the tensor it views, and a
        complex tensor as its real view). ``names`` names entries in error messages. Every
        chunk read is checked against its checksum unless ``verify=False``; ``workers`` data
        files are read side by side.
        """
        m = self._m
        for e, t in dest.items():
            if type(e) is not int or not 0 <= e < len(m.tensors):
                raise InvalidArgumentError(
                    f"{self.url}: read_into: no stored tensor #{e!r} (it has {len(m.tensors)})"
                )
            info = m.tensors[e]
            want = (tuple(info.shape), TORCH_DTYPES[info.dtype])
            if (tuple(t.shape), t.dtype) != want or t.device.type != "cpu":
                raise InvalidArgumentError(
                    f"{self.url}: read_into: tensor #{e} is stored as {want[1]}{list(want[0])}; "
                    f"got a {t.device.type} {t.dtype}{list(t.shape)} to read it into"
                )
        tasks = _plan_reads(m, set(dest), dict(dest), dict(names or {}))
        return _read_chunks(self._storage, self._name, m, tasks, verify, workers)

    def check_sizes(self, entries: Sequence[int]) -> None:
        """Refuse (``CorruptCheckpointError``) if a data file holding any of ``entries`` is not
        the size its manifest recorded: before the caller allocates memory to read them."""
        m = self._m
        files = {c.file for e in entries for c in m.tensors[e].chunks}
        _check_sizes(self._storage, self._name, m, files)

    def verify(self, *, workers: int = DEFAULT_READ_THREADS) -> VerifyReport:
        """Check every byte against its checksums, as ``tg.verify`` does, in this process."""
        return verify_opened(self._storage, self._name, self._m, workers)

    @property
    def shared(self) -> tuple[DataFile, ...]:
        """The shared objects it references (format 7: ``.shared/`` beside it), by name."""
        return tuple(f for f in self.files if is_shared(f.name))

    def copy_to(
        self,
        location: str | os.PathLike[str],
        *,
        standalone: bool = False,
        storage_options: Mapping[str, Any] | None = None,
    ) -> Checkpoint:
        """Copy this checkpoint to ``location`` (a new checkpoint: a path or URL) with the
        shared objects it references: into the ``.shared/`` beside the copy (those there
        already are not copied again), or with ``standalone`` into the copy itself, which then
        depends on nothing else. Every file's size is checked as it is copied; returns the
        copy, opened. ``CheckpointExistsError`` if another checkpoint is at ``location``.

        >>> tg.Checkpoint.open("runs/lora/step-000000050").copy_to("/backup/lora-50",
        ...                                                         standalone=True)  # doctest: +SKIP
        """
        dst, to = storage_for(location, storage_options)
        copy_checkpoint(self._storage, self._name, dst, to=to, standalone=standalone)
        return Checkpoint(dst, to, manifest_at(dst, to))
