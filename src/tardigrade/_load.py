"""The load pipeline: open + validate manifest -> select keys -> match live state -> read -> restore."""

from __future__ import annotations

import bisect
import logging
import math
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ._tree import SPARSE_LAYOUTS, decode, is_stateful, path_str
from ._units import gbps
from ._validate import class_name, same_class, standin, validate_state
from .errors import (
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    InsufficientMemoryError,
    InvalidArgumentError,
    StateMismatchError,
    TardigradeError,
)
from .format import limits
from .format import safetensors as st
from .format.checksum import Hasher
from .format.dtypes import COMPLEX_DTYPES, ITEMSIZE, TORCH_DTYPES
from .format.manifest import MANIFEST, Chunk, Manifest, TensorInfo, parse
from .storage import Storage, storage_for

Key = str | tuple[Any, ...]

# Data files read side by side by a load or a verify.
DEFAULT_READ_THREADS = max(2, min(8, os.cpu_count() or 2))
Path = tuple[Any, ...]

log = logging.getLogger("tardigrade")


def open_manifest(path: Any) -> tuple[Storage, str, Manifest]:
    storage, name = storage_for(path)
    if not storage.exists(f"{name}/{MANIFEST}"):
        what = (
            "it has no manifest.json, so the save that wrote it never committed"
            if storage.exists(name)
            else "nothing exists at this path"
        )
        raise CheckpointNotFoundError(
            f"{storage.url(name)}: no committed checkpoint here ({what}). Check the path, or use "
            "CheckpointManager.restore() to pick the newest complete checkpoint."
        )
    where = storage.url(f"{name}/{MANIFEST}")
    try:
        raw = storage.read_bytes(f"{name}/{MANIFEST}", limits.MAX_MANIFEST_BYTES)
        return storage, name, parse(raw, where)
    except MemoryError as e:
        if isinstance(e, TardigradeError):
            raise
        raise InsufficientMemoryError(
            f"{where}: ran out of memory reading the manifest. Free memory (or raise this "
            "process's memory limit) and load again."
        ) from None


def _empty(shape: Sequence[int], dtype: torch.dtype, what: str) -> torch.Tensor:
    """torch.empty, with running out of memory as a TardigradeError (torch raises RuntimeError)."""
    try:
        return torch.empty(shape, dtype=dtype)
    except (RuntimeError, MemoryError) as e:
        if isinstance(e, RuntimeError) and "can't allocate memory" not in str(e):
            raise
        nbytes = math.prod(shape) * dtype.itemsize
        raise InsufficientMemoryError(
            f"{what}: cannot allocate {nbytes} bytes for a tensor of shape {list(shape)} "
            f"{dtype}. Free memory, load fewer keys at once (keys=...), or load into "
            "preallocated live tensors (into=...)."
        ) from None


def read_manifest(path: Any) -> dict[str, Any]:
    """Read and validate a checkpoint's manifest without touching any tensor bytes.

    ``path`` is the checkpoint directory. Returns the manifest as a dict (format version, step,
    epoch, files, tensors, the state tree, metrics, metadata); its checksum is verified.

    >>> info = tg.read_manifest("ckpt/step-100")   # doctest: +SKIP
    >>> info["step"], len(info["tensors"])           # doctest: +SKIP
    """
    return open_manifest(path)[2].raw


# ----------------------------------------------------------------------------------------------
# key selection


def _key_of(node: Any, where: str) -> Any:
    def no_tensor(n: dict[str, Any], p: tuple[Any, ...]) -> Any:
        raise CorruptCheckpointError(f"{where}: a dict key is a tensor at {path_str(p)}")

    return decode(node, no_tensor, where)


def _select(tree: dict[str, Any], keys: Sequence[Key], where: str) -> dict[str, Any]:
    """A copy of ``tree`` that holds only the requested paths (nodes marked ``pruned``)."""
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
        raise InvalidArgumentError(f"keys must be a list of keys or key paths, got {keys!r}")
    out: dict[str, Any] = {"t": tree.get("t"), "v": [], "pruned": True}
    for key in keys:
        path = (key,) if not isinstance(key, tuple) else key
        if not path:
            raise InvalidArgumentError("keys may not contain an empty path")
        _graft(tree, out, path, (), where)
    return out


def _graft(
    src: dict[str, Any],
    dst: dict[str, Any],
    path: tuple[Any, ...],
    done: tuple[Any, ...],
    where: str,
) -> None:
    while src.get("t") == "stateful":
        if dst.get("t") != "stateful":
            dst.update(
                {"t": "stateful", "cls": src["cls"], "v": {"t": None, "v": [], "pruned": True}}
            )
        src, dst = src["v"], dst["v"]
        dst["t"] = src.get("t")
    head, rest = path[0], path[1:]
    if src.get("t") in ("dict", "odict"):
        for item in src["v"]:
            if _key_of(item[0], where) == head:
                existing = next((d for d in dst["v"] if _key_of(d[0], where) == head), None)
                if not rest:
                    if existing is None:
                        dst["v"].append(item)
                    else:
                        existing[1] = item[1]
                    return
                if existing is None:
                    child = {"t": item[1].get("t"), "v": [], "pruned": True}
                    if item[1].get("t") == "stateful":
                        child = {"t": None, "v": [], "pruned": True}
                    existing = [item[0], child]
                    dst["v"].append(existing)
                _graft(item[1], existing[1], rest, (*done, head), where)
                return
        available = [_key_of(i[0], where) for i in src["v"]][:50]
        raise InvalidArgumentError(
            f"{where}: key {head!r} not found at {path_str(done)}; available keys: {available}"
        )
    raise InvalidArgumentError(
        f"{where}: cannot select key {head!r} inside {path_str(done)}, which holds a "
        f"{src.get('t')!r} value, not a dict"
    )


# ----------------------------------------------------------------------------------------------
# matching the checkpoint against live state (load(into=...))


class _Matcher:
    """Finds live tensors to read straight into and lists every difference.

    How strictly a part of the checkpoint must match depends on who owns its layout:

    - the live object, with a layout fixed when it was built: the tensors of an ``nn.Module``
      (parameters and buffers: keys, shapes, dtypes) and the plain state outside any object
      (keys, lengths, shapes). Differences are refused under ``strict=True``;
    - the checkpoint: everything else inside a stateful object's ``state_dict()`` (an
      optimizer's moments created lazily at its first step, LBFGS's history, a scheduler's
      lists, a module's ``get_extra_state()``), which grows and changes shape as training
      runs. It is handed to ``load_state_dict()`` as saved, whatever the live object held;
      live tensors are only reused as read targets where their shape and dtype fit.
    """

    def __init__(self, manifest: Manifest, where: str, strict: bool) -> None:
        self.m = manifest
        self.where = where
        self.strict = strict
        self.diffs: list[str] = []
        self.dest: dict[int, torch.Tensor] = {}
        # Byte ranges of the live memory in ``dest``, sorted by start (see _claim).
        self._spans: list[tuple[int, int]] = []
        self.live_sd: dict[int, Any] = {}  # id(stateful node) -> the state_dict() we matched
        # Stateful nodes saved from another class: a difference under strict, else not loaded.
        self.other_class: dict[int, str] = {}  # id(stateful node) -> message
        # Live tensors the read overwrites in place, by the (outermost) stateful object that
        # owns them; None for tensors outside any object.
        self.in_place: dict[Path | None, list[str]] = {}
        self._owner: Path | None = None

    def match(
        self,
        node: dict[str, Any],
        live: Any,
        path: tuple[Any, ...],
        lenient: bool,
        free: bool = False,
        module: bool = False,
    ) -> None:
        """``lenient``: keys may differ. ``free``: the checkpoint decides the layout (nothing is
        a difference). ``module``: ``node`` is a module's state_dict, whose tensors are fixed
        and whose other values (extra state) are free."""
        tag = node.get("t")
        p = path_str(path)
        if tag == "stateful":
            if not is_stateful(live):
                self.diffs.append(
                    f"{p}: checkpoint holds a {node['cls']} state, live value is "
                    f"{type(live).__name__} without load_state_dict()"
                )
                return
            if not same_class(node["cls"], live):
                # Checked before state_dict() is even asked for: nothing of it is read.
                self.other_class[id(node)] = (
                    f"{p}: checkpoint holds the state of a {node['cls']}, live object is a "
                    f"{class_name(live)} (another class)"
                )
                if self.strict:
                    self.diffs.append(self.other_class[id(node)])
                return
            sd = live.state_dict()
            self.live_sd[id(node)] = sd
            is_module = isinstance(live, torch.nn.Module)
            outer = self._owner is None
            if outer:
                self._owner = path
            try:
                if is_module:
                    # A module's keys are fixed, unless only some of them were selected.
                    strict_keys = not node["v"].get("pruned")
                    self.match(node["v"], sd, path, lenient=not strict_keys, module=True)
                else:
                    self.match(node["v"], sd, path, lenient=True, free=True)
            finally:
                if outer:
                    self._owner = None
        elif free:
            self.match_free(node, live, path)
        elif path and _plain_node(node) and _plain_live(live):
            return  # a subtree of plain values is replaced as a whole, whatever its shape
        elif tag in ("dict", "odict"):
            if not isinstance(live, Mapping):
                self.replaced(tag, live, p)
                return
            seen = set()
            for item in node["v"]:
                k = _key_of(item[0], self.where)
                seen.add(k)
                if k in live:
                    lv = live[k]
                    # A module's extra state is the checkpoint's, like any object's state.
                    extra = module and not isinstance(lv, (torch.Tensor, np.ndarray))
                    self.match(item[1], lv, (*path, k), lenient, free=extra)
                elif not lenient:
                    self.diffs.append(
                        f"{path_str((*path, k))}: unexpected key (in the checkpoint, "
                        "not in the live state)"
                    )
            if not lenient and not node.get("pruned"):
                for k in live:
                    if k not in seen:
                        self.diffs.append(
                            f"{path_str((*path, k))}: missing key (in the live "
                            "state, not in the checkpoint)"
                        )
        elif tag in ("list", "tuple"):
            if not isinstance(live, (list, tuple)):
                self.replaced(tag, live, p)
                return
            if len(live) != len(node["v"]):
                self.diffs.append(
                    f"{p}: checkpoint holds a {tag} of {len(node['v'])} items, live has {len(live)}"
                )
                return
            for i, (child, lv) in enumerate(zip(node["v"], live, strict=True)):
                self.match(child, lv, (*path, i), lenient)
        elif tag in ("tensor", "ndarray"):
            self.match_tensor(node, live, path)
        elif tag == "sparse":
            self.match_sparse(node, live, path)
        else:
            self.replaced(tag, live, p)

    def match_free(self, node: dict[str, Any], live: Any, path: tuple[Any, ...]) -> None:
        """State whose layout the checkpoint decides: find read targets, report nothing."""
        tag = node.get("t")
        if tag in ("dict", "odict") and isinstance(live, Mapping):
            for item in node["v"]:
                k = _key_of(item[0], self.where)
                if k in live:
                    self.match(item[1], live[k], (*path, k), lenient=True, free=True)
        elif tag in ("list", "tuple") and isinstance(live, (list, tuple)):
            # A history may be longer or shorter than the live one: reuse the common part.
            for i, (child, lv) in enumerate(zip(node["v"], live, strict=False)):
                self.match(child, lv, (*path, i), lenient=True, free=True)
        elif tag in ("tensor", "ndarray"):
            self.match_tensor(node, live, path, report=False)

    def replaced(self, tag: str, live: Any, p: str) -> None:
        """Plain values are simply replaced, but not a tensor or an object with state."""
        if isinstance(live, (torch.Tensor, np.ndarray)) or is_stateful(live):
            self.diffs.append(f"{p}: checkpoint holds a {tag}, live value is {type(live).__name__}")

    def match_tensor(
        self, node: dict[str, Any], live: Any, path: tuple[Any, ...], report: bool = True
    ) -> None:
        """Check a tensor leaf against its live tensor (``report``: a mismatch is a difference)
        and take the live tensor as the read target where it can hold the bytes."""
        info = self.m.tensors[node["e"]]
        shape, dtype = _leaf_shape_dtype(node, info)  # a complex tensor's, not its real view's
        p = path_str(path)
        if node["t"] == "ndarray":
            if not isinstance(live, np.ndarray):
                if report:
                    self.diffs.append(
                        f"{p}: checkpoint holds a numpy array, live is {type(live).__name__}"
                    )
                return
            live_t = (
                torch.from_numpy(live) if live.flags.c_contiguous and live.flags.writeable else None
            )
            live_shape, live_dtype = (
                live.shape,
                TORCH_DTYPES[info.dtype] if live_t is None else live_t.dtype,
            )
        else:
            if not isinstance(live, torch.Tensor):
                if report:
                    self.diffs.append(
                        f"{p}: checkpoint holds a tensor, live value is {type(live).__name__}"
                    )
                return
            if live.layout != torch.strided:
                if report:
                    self.diffs.append(
                        f"{p}: checkpoint holds a dense tensor, live tensor is {live.layout}"
                    )
                return
            live_t, live_shape, live_dtype = live, tuple(live.shape), live.dtype
        if tuple(live_shape) != shape or live_dtype != dtype:
            if report:
                self.diffs.append(
                    f"{p}: checkpoint has shape {list(shape)} {dtype}, live tensor has "
                    f"{list(live_shape)} {live_dtype}"
                )
            return
        if (
            live_t is not None
            and "view" not in node
            and node["e"] not in self.dest
            and live_t.device.type == "cpu"
            and live_t.is_contiguous()
            and not live_t.is_conj()
            and not live_t.is_neg()
            and self._claim(live_t)
        ):
            target = live_t.detach()
            # The bytes are read into the live complex tensor through its real view.
            self.dest[node["e"]] = torch.view_as_real(target) if target.is_complex() else target
            self.in_place.setdefault(self._owner, []).append(p)

    def match_sparse(self, node: dict[str, Any], live: Any, path: tuple[Any, ...]) -> None:
        """A sparse tensor must meet a live one of its layout, size and dtype.

        It is never read into: its number of stored elements changes as it trains, so the
        checkpoint's tensor replaces the live one (``load_state_dict`` copies it into a
        module's buffer).
        """
        layout, size = node["layout"], node["size"]
        values = node["v"][-1]
        _, dtype = _leaf_shape_dtype(values, self.m.tensors[values["e"]])
        if (
            isinstance(live, torch.Tensor)
            and live.layout == SPARSE_LAYOUTS[layout][0]
            and list(live.shape) == size
            and live.dtype == dtype
        ):
            return
        has = (
            f"a {live.layout} tensor of shape {list(live.shape)} {live.dtype}"
            if isinstance(live, torch.Tensor)
            else type(live).__name__
        )
        self.diffs.append(
            f"{path_str(path)}: checkpoint holds a sparse {layout} tensor of shape {size} "
            f"{dtype}, live value is {has}"
        )

    def _claim(self, t: torch.Tensor) -> bool:
        """Reserve ``t``'s bytes as a read target unless they overlap another target's.

        Two checkpoint tensors read into the same live memory would overwrite each other (live
        state can share memory where the saved state did not, e.g. a history entry aliasing
        another); the second one gets its own buffer instead.
        """
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        if end == start:
            return True
        i = bisect.bisect_left(self._spans, (start, end))
        if i > 0 and self._spans[i - 1][1] > start:
            return False
        if i < len(self._spans) and self._spans[i][0] < end:
            return False
        self._spans.insert(i, (start, end))
        return True


def _stored_shape(node: dict[str, Any], info: TensorInfo) -> tuple[int, ...]:
    view = node.get("view")
    return tuple(view["shape"]) if view else info.shape


def _leaf_shape_dtype(
    node: dict[str, Any], info: TensorInfo
) -> tuple[tuple[int, ...], torch.dtype]:
    """The shape and dtype the leaf loads as (a complex tensor is stored as its real view)."""
    shape = _stored_shape(node, info)
    if node.get("complex") in COMPLEX_DTYPES:
        return shape[:-1], COMPLEX_DTYPES[node["complex"]][0]
    return shape, TORCH_DTYPES[info.dtype]


def _plain_node(node: Any) -> bool:
    """True if a (validated) checkpoint subtree holds no tensor, array or stateful object."""
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            if n.get("t") in ("tensor", "ndarray", "stateful"):
                return False
            stack.extend(n.get("v") or () if isinstance(n.get("v"), list) else ())
        elif isinstance(n, list):
            stack.extend(n)
    return True


def _plain_live(obj: Any, depth: int = 0) -> bool:
    """True if a live value holds no tensor, array or stateful object (so it may be replaced)."""
    if isinstance(obj, (torch.Tensor, np.ndarray)) or is_stateful(obj) or depth > 100:
        return False
    if isinstance(obj, Mapping):
        return all(_plain_live(v, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return all(_plain_live(v, depth + 1) for v in obj)
    return True


class _Applier:
    """Puts loaded values into the live state; calls load_state_dict() on stateful objects.

    Every object's ``load_state_dict()`` runs first, in tree order; plain values are replaced
    after all of them accepted, so an object that still rejects its state leaves no plain value
    changed and the error can say exactly what was restored.
    """

    def __init__(self, matcher: _Matcher, strict: bool, where: str) -> None:
        self.matcher = matcher
        self.strict = strict
        self.where = where

    def objects(
        self, node: dict[str, Any], live: Any, value: Any, path: Path
    ) -> Iterator[tuple[Path, dict[str, Any], Any, Any]]:
        """Each (path, node, live object, state) that load_state_dict() is called with."""
        tag = node.get("t")
        if path and _plain_node(node) and _plain_live(live):
            return
        if tag == "stateful" and is_stateful(live):
            if id(node) not in self.matcher.other_class:
                yield path, node, live, value
        elif tag in ("dict", "odict") and isinstance(live, dict):
            for item in node["v"]:
                k = _key_of(item[0], self.where)
                if k in live:
                    yield from self.objects(item[1], live[k], value[k], (*path, k))
        elif (tag, isinstance(live, list), isinstance(live, tuple)) in (
            ("list", True, False),
            ("tuple", False, True),
        ) and len(live) == len(value):
            for i, child in enumerate(node["v"]):
                yield from self.objects(child, live[i], value[i], (*path, i))

    def validate(self, tree: dict[str, Any], into: Any, preview: Any) -> list[str]:
        """Every object's objection to its state (``preview`` holds stand-ins for tensors)."""
        out = []
        for path, _, live, sd in self.objects(tree, into, preview, ()):
            try:
                validate_state(live, sd)
            except Exception as e:  # whatever the object raises is its objection
                cls = type(live).__name__
                why = str(e) if str(e).startswith(cls) else f"{cls} rejects the state: {e}"
                out.append(f"{path_str(path)}: {why}")
        return out

    def apply(self, tree: dict[str, Any], into: Any, value: Any) -> Any:
        objects = list(self.objects(tree, into, value, ()))
        for i, (_, node, live, sd) in enumerate(objects):
            try:
                if isinstance(live, torch.nn.Module):
                    strict = self.strict and not node["v"].get("pruned")
                    if not strict:
                        sd = _fitting(sd, self.matcher.live_sd.get(id(node)))
                    live.load_state_dict(sd, strict=strict)
                else:
                    live.load_state_dict(sd)
            except Exception as e:
                raise StateMismatchError(self.partial(objects, i, e)) from e
        return self.put(tree, into, value, ())

    def partial(self, objects: list[tuple[Path, Any, Any, Any]], failed: int, e: Exception) -> str:
        """What a load that stopped at ``objects[failed]`` has changed, and what it has not."""
        in_place = self.matcher.in_place

        def objs(items: list[tuple[Path, Any, Any, Any]]) -> str:
            return ", ".join(
                path_str(p) + (f" ({len(in_place[p])} tensor(s))" if in_place.get(p) else "")
                for p, *_ in items
            )

        path, _, live, _ = objects[failed]
        rest = objects[failed + 1 :]
        lines = [
            f"{self.where}: {path_str(path)}: {type(live).__name__}.load_state_dict() rejected "
            f"the checkpoint's state: {e}",
            "The load stopped part-way; the live state now mixes the checkpoint with what it "
            "held before:",
            "  restored (load_state_dict() done): " + (objs(objects[:failed]) or "nothing"),
            f"  rejected: {path_str(path)}"
            + (
                f"; its {len(in_place[path])} tensor(s) were already overwritten in place"
                if in_place.get(path)
                else "; unchanged"
            ),
        ]
        over = [o for o in rest if in_place.get(o[0])]
        if over:
            lines.append(
                "  tensors overwritten in place, load_state_dict() not called: " + objs(over)
            )
        kept = [o for o in rest if not in_place.get(o[0])]
        if kept:
            lines.append("  not restored (unchanged): " + objs(kept))
        loose = in_place.get(None, [])
        if loose:
            shown = ", ".join(loose[:10]) + (
                f" and {len(loose) - 10} more" if len(loose) > 10 else ""
            )
            lines.append(f"  tensors outside these objects, overwritten in place: {shown}")
        lines.append("  plain values (numbers, strings, ...): none replaced")
        lines.append(
            "Give these objects a validate_state_dict() that refuses such a state before the "
            "load starts, and rebuild them (or load another checkpoint into them) before training."
        )
        return "\n".join(lines)

    def put(self, node: dict[str, Any], live: Any, value: Any, path: Path) -> Any:
        """Replace plain values and copy tensors; stateful objects are already loaded."""
        tag = node.get("t")
        if path and _plain_node(node) and _plain_live(live):
            return value
        if tag == "stateful" and is_stateful(live):
            return live
        if tag in ("dict", "odict") and isinstance(live, dict):
            for item in node["v"]:
                k = _key_of(item[0], self.where)
                live[k] = (
                    self.put(item[1], live[k], value[k], (*path, k)) if k in live else value[k]
                )
            return live
        if tag == "list" and isinstance(live, list) and len(live) == len(value):
            for i, child in enumerate(node["v"]):
                live[i] = self.put(child, live[i], value[i], (*path, i))
            return live
        if tag == "tuple" and isinstance(live, tuple) and len(live) == len(value):
            return tuple(
                self.put(c, lv, v, (*path, i))
                for i, (c, lv, v) in enumerate(zip(node["v"], live, value, strict=True))
            )
        if (
            tag == "tensor"
            and isinstance(live, torch.Tensor)
            and live.shape == value.shape
            and live.dtype == value.dtype
        ):
            if not _same_memory(live, value):
                with torch.no_grad():
                    live.copy_(value)
            return live
        if (
            tag == "ndarray"
            and isinstance(live, np.ndarray)
            and live.shape == value.shape
            and live.dtype == value.dtype
            and live.flags.writeable
        ):
            if not np.shares_memory(live, value):
                np.copyto(live, value)
            return live
        return value


def _fitting(value: Any, live_sd: Any) -> Any:
    """Drop tensors whose shape/dtype differ from the live module's (strict=False loads)."""
    if not isinstance(value, Mapping) or not isinstance(live_sd, Mapping):
        return value
    out = type(value)()
    for k, v in value.items():
        lv = live_sd.get(k)
        mismatch = isinstance(v, torch.Tensor) and isinstance(lv, torch.Tensor)
        if mismatch and (v.shape != lv.shape or v.dtype != lv.dtype):
            continue
        out[k] = v
    if hasattr(value, "_metadata"):
        out._metadata = value._metadata  # type: ignore[attr-defined]
    return out


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.data_ptr() == b.data_ptr() and a.stride() == b.stride()


# ----------------------------------------------------------------------------------------------
# reading


def _region(dest: torch.Tensor, chunk: Chunk) -> torch.Tensor:
    r = dest
    for dim, (o, n) in enumerate(zip(chunk.offsets, chunk.shape, strict=True)):
        if o != 0 or n != dest.shape[dim]:
            r = r.narrow(dim, o, n)
    return r


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


@dataclass(frozen=True)
class _ReadTask:
    entry: int
    chunk: Chunk
    path: str  # display path of the leaf, for messages


def _check_size(src: Any, recorded: int) -> None:
    """A data file must be exactly as large as the manifest recorded."""
    if src.size != recorded:
        raise CorruptCheckpointError(
            f"{src.name}: file is {src.size} bytes but the manifest recorded {recorded} "
            "(truncated or modified after commit). Delete this checkpoint or restore it from "
            "a backup."
        )


def _check_sum(src: Any, key: str, what: str, expected: str, hasher: Hasher) -> None:
    if hasher.hexdigest() != expected:
        raise ChecksumMismatchError(
            f"{src.name}: tensor {key!r}{what} fails its checksum (expected {expected}, got "
            f"{hasher.hexdigest()}); its bytes were damaged after the save. Delete this "
            "checkpoint or restore it from a backup."
        )


def _read_file(
    storage: Storage,
    ckpt: str,
    file: str,
    size: int,
    tasks: list[_ReadTask],
    dest: dict[int, torch.Tensor],
    m: Manifest,
    verify: bool,
    unread: list[tuple[int, Chunk]] | None = None,
) -> int:
    """Read ``tasks`` into ``dest``; with ``unread`` (verify="all"), also check what a full
    ``verify`` checks in this file: its header lists exactly the manifest's chunks, and the
    chunks not read here (``unread``) match their checksums. Each byte is read once."""
    with storage.open_reader(f"{ckpt}/{file}") as src:
        _check_size(src, size)
        header = st.read_header(src, m.header_checksums.get(file) if verify else None)
        if unread is not None:
            _check_listed(src, header, [c for _, c in unread] + [t.chunk for t in tasks])
        nbytes = 0
        for task in tasks:
            c, info = task.chunk, m.tensors[task.entry]
            h = header.get(c.key)
            if h is None or h.dtype != info.dtype or h.shape != c.shape:
                raise CorruptCheckpointError(
                    f"{src.name}: tensor {c.key!r} (for {task.path}) is missing from the file or "
                    "has another dtype/shape than the manifest records. Delete this checkpoint "
                    "or restore it from a backup."
                )
            region = _region(dest[task.entry], c)
            direct = region.is_contiguous()
            target = region if direct else _empty(c.shape, region.dtype, f"{src.name}: {c.key!r}")
            hasher = Hasher() if verify else None
            if target.numel():
                st.read_range(src, h.begin, _bytes_of(target), hasher)
            if hasher is not None:
                _check_sum(src, c.key, f" (for {task.path})", c.checksum, hasher)
            if not direct:
                region.copy_(target)
            nbytes += h.end - h.begin
        if unread:
            _check_chunks(src, header, m, unread)
        return nbytes


def _check_listed(src: Any, header: dict[str, Any], chunks: list[Chunk]) -> None:
    listed = {c.key for c in chunks}
    if set(header) != listed:
        raise CorruptCheckpointError(
            f"{src.name}: holds tensors {sorted(set(header) - listed)[:5]} the manifest "
            f"does not list, or lacks {sorted(listed - set(header))[:5]}."
        )


def _check_chunks(src: Any, header: dict[str, Any], m: Manifest, chunks: Any) -> None:
    """Hash each chunk's bytes (read once, through a small buffer) against the manifest."""
    buf = memoryview(bytearray(min(st.SLICE_BYTES, max(1, src.size))))
    for i, c in chunks:
        h = header[c.key]
        if h.dtype != m.tensors[i].dtype or h.shape != c.shape:
            raise CorruptCheckpointError(
                f"{src.name}: tensor {c.key!r} has dtype/shape {h.dtype}{list(h.shape)} "
                f"but the manifest records {m.tensors[i].dtype}{list(c.shape)}."
            )
        hasher = Hasher()
        pos = h.begin
        while pos < h.end:
            n = min(buf.nbytes, h.end - pos)
            src.readinto(pos, buf[:n])
            hasher.update(buf[:n])
            pos += n
        _check_sum(src, c.key, "", c.checksum, hasher)


def _verify_file(
    storage: Storage, ckpt: str, file: str, m: Manifest, chunks: list[tuple[int, Chunk]]
) -> int:
    """Check one data file entirely: size, header checksum and keys, every chunk's checksum."""
    with storage.open_reader(f"{ckpt}/{file}") as src:
        _check_size(src, m.files[file])
        header = st.read_header(src, m.header_checksums.get(file))
        _check_listed(src, header, [c for _, c in chunks])
        _check_chunks(src, header, m, chunks)
        return int(src.size)


def _entry_paths(tree: dict[str, Any]) -> dict[int, str]:
    out: dict[int, str] = {}
    stack: list[tuple[Any, tuple[Any, ...]]] = [(tree, ())]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        t = node.get("t")
        if t in ("tensor", "ndarray") and type(node.get("e")) is int:
            out.setdefault(node["e"], path_str(path))
        elif t in ("list", "tuple") and isinstance(node.get("v"), list):
            stack.extend((c, (*path, i)) for i, c in enumerate(node["v"]))
        elif t in ("dict", "odict") and isinstance(node.get("v"), list):
            for item in node["v"]:
                if isinstance(item, list) and len(item) == 2:
                    k = item[0].get("v", "?") if isinstance(item[0], dict) else "?"
                    stack.append((item[1], (*path, k)))
        elif t == "stateful":
            stack.append((node.get("v"), path))
        elif t == "sparse" and node.get("layout") in SPARSE_LAYOUTS:
            names = SPARSE_LAYOUTS[node["layout"]][1]
            stack.extend((c, (*path, n)) for c, n in zip(node.get("v") or (), names, strict=False))
    return out


_SCALAR_TAGS = frozenset(("none", "bool", "int", "float", "str", "bytes", "dtype"))


def _check_refs(tree: dict[str, Any], m: Manifest, where: str) -> set[int]:
    """Every tensor reference must name a listed tensor, and views must fit inside it."""
    refs: set[int] = set()
    stack: list[Any] = [tree]
    count = 0
    while stack:
        node = stack.pop()
        count += 1
        if count > limits.MAX_TREE_NODES:
            raise CorruptCheckpointError(
                f"{where}: state tree has more than {limits.MAX_TREE_NODES} nodes"
            )
        if isinstance(node, dict):
            t = node.get("t")
            if type(t) is str and t in _SCALAR_TAGS:
                continue  # no tensor below (decode() rejects a scalar node holding one)
            if t in ("tensor", "ndarray"):
                e = node.get("e")
                if type(e) is not int or not 0 <= e < len(m.tensors):
                    raise CorruptCheckpointError(
                        f"{where}: tree refers to tensor #{e!r}, which the manifest does not list"
                    )
                view = node.get("view")
                if view is not None:
                    _check_view(view, m.tensors[e], where)
                refs.add(e)
            else:
                stack.extend(v for k, v in node.items() if k in ("v", "meta"))
        elif isinstance(node, list):
            stack.extend(node)
    return refs


def _check_view(view: Any, info: TensorInfo, where: str) -> None:
    ok = isinstance(view, dict) and type(view.get("offset")) is int and view["offset"] >= 0
    shape, stride = (view.get("shape"), view.get("stride")) if ok else (None, None)
    ok = (
        ok
        and all(
            isinstance(x, list)
            and all(type(i) is int and 0 <= i <= limits.MAX_TORCH_EXTENT for i in x)
            for x in (shape, stride)
        )
        and len(shape) == len(stride) <= limits.MAX_DIMS
        # torch.as_strided refuses shapes whose sizes overflow int64, even empty ones.
        and limits.fits_torch(shape, ITEMSIZE[info.dtype])
        and view["offset"] <= math.prod(info.shape)
    )
    if ok and math.prod(shape):
        extent = view["offset"] + sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) + 1
        ok = extent <= math.prod(info.shape)
    if not ok:
        raise CorruptCheckpointError(f"{where}: a tensor view {view!r} does not fit its storage")


def load(
    path: Any,
    *,
    into: Any = None,
    keys: Sequence[Key] | None = None,
    strict: bool = True,
    verify: bool | str = True,
    workers: int = DEFAULT_READ_THREADS,
) -> Any:
    """Load a checkpoint as a plain tree, or restore it in place into live state with ``into=``.

    With ``into=`` everything that can refuse the checkpoint is checked before a byte lands in
    the live state, and all refusals are raised together as one StateMismatchError: under
    ``strict=True`` missing or unexpected keys, shapes, dtypes and the class of each stateful
    object (by class name, module ignored; ``nn.Module`` is matched by its keys and shapes
    only); in both modes each object's ``validate_state_dict()`` (optimizers get a built-in
    check of their parameter groups). Strict matching covers what has a fixed layout: the
    plain state outside objects (keys, lengths, shapes) and each module's parameters and
    buffers. The rest of an object's ``state_dict()`` grows as it trains (optimizer moments
    created lazily, LBFGS's history, a module's extra state) and is the checkpoint's: it goes
    to ``load_state_dict()`` as saved, whatever its keys, lengths and shapes in the live
    object. ``strict=False`` loads what matches and skips (with a
    warning) objects saved from another class. Tensor bytes are then read straight into the
    live tensors, and ``load_state_dict()`` is called on each object before plain values are
    replaced; an object that still rejects its state raises a StateMismatchError that lists
    what was restored and what was not.

    Parameters:
        ``path``: the checkpoint directory (``str`` or ``os.PathLike``).
        ``into``: live state to restore in place (the same tree you saved: modules, optimizers,
            tensors, plain values); ``None`` (default) returns a new plain tree instead, with
            CPU tensors, numpy arrays and the saved Python values.
        ``keys``: load only these top-level keys or key paths (tuples, e.g.
            ``("model", "fc.weight")``); only their bytes are read. ``None`` loads everything.
        ``strict``: with ``into``, refuse (``StateMismatchError``) any difference between the
            checkpoint and the live state; ``False`` loads what matches.
        ``verify``: check the manifest, the headers and every chunk read against their checksums
            (default ``True``); ``False`` skips the checksums of the bytes read (the manifest
            checksum and all structural validation still apply).
        ``workers``: data files read side by side (threads).

    Returns the loaded tree (with ``into``, the tree that was applied).

    >>> tg.load("ckpt/step-100", into=state)          # doctest: +SKIP
    >>> weights = tg.load("ckpt/step-100", keys=["model"])["model"]  # doctest: +SKIP
    """
    if verify not in (True, False, "all"):
        raise InvalidArgumentError(f"verify must be True, False or 'all', got {verify!r}")
    storage, name, m = open_manifest(path)
    where = storage.url(name)
    _check_refs(m.tree, m, where)
    # Validate the whole tree before walking it against keys or live state.
    decode(m.tree, lambda node, p: None, where)
    tree = m.tree if keys is None else _select(m.tree, keys, where)
    needed = _check_refs(tree, m, where)
    matcher = _Matcher(m, where, strict)
    applier = _Applier(matcher, strict, where)
    if into is not None:
        # Everything that can refuse the checkpoint does so here, before a byte is read into
        # the live state: structure, shapes and dtypes, classes, each object's own checks.
        matcher.match(tree, into, (), lenient=not strict)

        def standin_leaf(node: dict[str, Any], p: tuple[Any, ...]) -> Any:
            info = m.tensors[node["e"]]
            return standin(node, _stored_shape(node, info), info.dtype, where)

        rejected = applier.validate(tree, into, decode(tree, standin_leaf, where))
        _refuse(where, matcher.diffs if strict else [], rejected)
        for message in matcher.other_class.values():
            log.warning("tardigrade: %s: not loaded (strict=False skips it)", message)
    checked = set(m.files) if verify == "all" else set()
    _check_sizes(storage, name, m, checked | {c.file for e in needed for c in m.tensors[e].chunks})
    dest = matcher.dest
    for e in needed:
        if e not in dest:
            info = m.tensors[e]
            dest[e] = _empty(info.shape, TORCH_DTYPES[info.dtype], f"{where}: tensor #{e}")
    try:
        _read_entries(
            storage,
            name,
            m,
            needed,
            dest,
            bool(verify),
            workers,
            _entry_paths(tree),
            verify == "all",
        )
    except TardigradeError as e:
        if into is None or not matcher.dest:
            raise
        # Bytes go straight into the live tensors (no second copy of the state), so damage
        # found mid-way leaves some of them overwritten: say which, and what to do.
        owners = ", ".join(
            f"{path_str(p)} ({len(ts)} tensor(s))" if p is not None else ", ".join(ts[:10])
            for p, ts in matcher.in_place.items()
        )
        err = type(e)(
            f"{e}\nThe live tensors read in place may be partly overwritten: {owners}. No "
            "load_state_dict() was called and no plain value replaced. Restore them from "
            "another checkpoint (CheckpointManager.restore() falls back to the next older one)."
        )
        err.live_overwritten = True  # type: ignore[attr-defined]  # restore() reads this
        raise err from e

    def leaf(node: dict[str, Any], p: tuple[Any, ...]) -> Any:
        t = dest[node["e"]]
        view = node.get("view")
        if view:
            t = t.reshape(-1).as_strided(view["shape"], view["stride"], view["offset"])
        return t.numpy() if node["t"] == "ndarray" else t

    value = decode(tree, leaf, where)
    if into is None:
        return value
    applier.apply(tree, into, value)
    return value


def _refuse(where: str, diffs: list[str], rejected: list[str]) -> None:
    """Raise one StateMismatchError naming every difference and every objection, if any."""
    problems = diffs + rejected
    if not problems:
        return
    hints = []
    if diffs:
        hints.append("pass strict=False to load what matches, or fix the live state")
    if rejected:
        hints.append(
            "build the rejecting objects to fit the checkpoint, or leave them out with keys=[...]"
        )
    raise StateMismatchError(
        f"{where}: the live state does not match the checkpoint ({len(problems)} "
        "difference(s)); nothing was loaded:\n  "
        + "\n  ".join(problems)
        + "\n"
        + "; ".join(hints)[:1].upper()
        + "; ".join(hints)[1:]
        + "."
    )


def _check_sizes(storage: Storage, name: str, m: Manifest, files: set[str]) -> None:
    """Data files must be as large as the manifest says before anything is allocated for them."""
    for file in sorted(files):
        with storage.open_reader(f"{name}/{file}") as src:
            _check_size(src, m.files[file])


def _read_entries(
    storage: Storage,
    name: str,
    m: Manifest,
    needed: set[int],
    dest: dict[int, torch.Tensor],
    verify: bool,
    workers: int,
    paths: dict[int, str],
    full: bool = False,
) -> int:
    by_file: dict[str, list[_ReadTask]] = {}
    for e in sorted(needed):
        for c in m.tensors[e].chunks:
            by_file.setdefault(c.file, []).append(_ReadTask(e, c, paths.get(e, f"tensor #{e}")))
    for tasks in by_file.values():
        tasks.sort(key=lambda t: t.chunk.key)
    # With ``full``, every file is checked as ``verify`` would, each byte read once: the
    # chunks not needed here are hashed by the same pass, and files holding none are verified.
    unread: dict[str, list[tuple[int, Chunk]]] = {}
    if full:
        unread = {f: [] for f in m.files}
        for i, info in enumerate(m.tensors):
            if i not in needed:
                for c in info.chunks:
                    unread[c.file].append((i, c))

    def one(file: str) -> int:
        if file not in by_file:
            return _verify_file(storage, name, file, m, unread[file])
        return _read_file(
            storage, name, file, m.files[file], by_file[file], dest, m, verify, unread.get(file)
        )

    files = sorted(set(by_file) | set(unread))
    if len(files) <= 1 or workers <= 1:
        return sum(one(f) for f in files)
    with ThreadPoolExecutor(min(workers, len(files)), thread_name_prefix="tardigrade-read") as pool:
        return sum(pool.map(one, files))


# ----------------------------------------------------------------------------------------------
# verify


@dataclass(frozen=True)
class VerifyReport:
    """The result of a full checksum pass over one checkpoint."""

    path: str
    step: int | None
    files: int
    tensors: int
    nbytes: int
    seconds: float

    @property
    def throughput_gbps(self) -> float:
        return gbps(self.nbytes, self.seconds)


def verify(path: Any, *, workers: int = DEFAULT_READ_THREADS) -> VerifyReport:
    """Check every byte of a checkpoint against its checksums; raise CorruptCheckpointError if any fail.

    ``path`` is the checkpoint directory; ``workers`` data files are checked side by side
    (threads). Returns a :class:`VerifyReport` (files, tensors, bytes, seconds, GB/s). Damage
    raises ``ChecksumMismatchError`` (changed bytes) or ``CorruptCheckpointError`` (anything
    else), naming every damaged file.

    >>> report = tg.verify("ckpt/step-100")     # doctest: +SKIP
    >>> print(report.nbytes, report.throughput_gbps)  # doctest: +SKIP
    """
    start = time.perf_counter()
    storage, name, m = open_manifest(path)
    where = storage.url(name)
    _check_refs(m.tree, m, where)
    by_file: dict[str, list[tuple[int, Chunk]]] = {f: [] for f in m.files}
    for i, info in enumerate(m.tensors):
        for c in info.chunks:
            by_file[c.file].append((i, c))

    def one(file: str) -> int:
        return _verify_file(storage, name, file, m, by_file[file])

    files = sorted(m.files)
    errors: list[CorruptCheckpointError] = []
    nbytes = 0
    with ThreadPoolExecutor(max(1, min(workers, len(files) or 1))) as pool:
        futures = [pool.submit(one, f) for f in files]
        for f in futures:
            try:
                nbytes += f.result()
            except CorruptCheckpointError as e:
                errors.append(e)
    if errors:
        only_sums = all(isinstance(e, ChecksumMismatchError) for e in errors)
        exc = ChecksumMismatchError if only_sums else CorruptCheckpointError
        raise exc(
            f"{where}: {len(errors)} of {len(files)} data file(s) failed verification:\n  "
            + "\n  ".join(str(e) for e in errors)
        )
    return VerifyReport(
        where, m.step, len(files), len(m.tensors), nbytes, time.perf_counter() - start
    )


__all__ = ["VerifyReport", "load", "read_manifest", "verify"]
