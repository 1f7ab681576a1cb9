"""Deciding what to read and where it lands: key selection, matching live state, the read plan.

``_select`` cuts the manifest's tree down to the requested keys; ``_Matcher`` walks that tree
against the live ``into=`` state, lists every difference and picks the live tensors the bytes can
be read straight into; ``_plan_reads`` turns the result into one ``_ReadTask`` per stored chunk
(the chunk and the region of its destination tensor). Nothing here reads a data file or changes
live state, so a load can refuse the checkpoint before a byte lands anywhere.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ._read import _ReadTask
from ._sharding import Box, PerRank, Sharded, box_of, is_dtensor
from ._tree import SPARSE_LAYOUTS, decode, is_stateful, loaded_as, path_str
from ._validate import class_name, same_class
from .errors import CorruptCheckpointError, InvalidArgumentError
from .format.dtypes import COMPLEX_DTYPES, TORCH_DTYPES
from .format.manifest import Chunk, ChunkColumns, Manifest, TensorInfo

Key = str | tuple[Any, ...]
Path = tuple[Any, ...]


# ----------------------------------------------------------------------------------------------
# key selection


def _key_of(node: Any, where: str) -> Any:
    if type(node) is dict and node.get("t") == "str" and type(node.get("v")) is str:
        return node["v"]  # most keys: what decode() returns for them, without a call

    def no_tensor(n: dict[str, Any], p: tuple[Any, ...]) -> Any:
        raise CorruptCheckpointError(f"{where}: a dict key is a tensor at {path_str(p)}")

    return decode(node, no_tensor, where)


def _items(node: Any, where: str) -> list[tuple[Any, dict[str, Any]]]:
    """The (key, child node) pairs of a dict node; none for any other node."""
    if not isinstance(node, dict) or node.get("t") not in ("dict", "odict"):
        return []
    return [(_key_of(k, where), v) for k, v in node.get("v") or ()]


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
        # Live sharded leaves (DTensor, tg.Sharded): entry -> (live leaf, local tensor, box).
        # Only the part of the stored tensor inside the box is read, into the local tensor.
        self.sharded: dict[int, tuple[Any, torch.Tensor, Box]] = {}

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
        if isinstance(live, PerRank):
            live = live.value  # the checkpoint's per-rank parts are this rank's already
        tag = node.get("t")
        p = path_str(path)
        if tag in ("dict", "odict") and not free and is_stateful(live):
            # A state_dict saved as a plain tree (a converted torch.save file, a user's own
            # tg.save(path, {"model": model.state_dict()})) loads into the object that made it:
            # it stands for that object's state, in place, for the read and the apply alike.
            inner = dict(node)
            node.clear()
            node.update({"t": "stateful", "cls": class_name(live), "v": inner})
            tag = "stateful"
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
            if isinstance(live, torch.optim.Optimizer):
                sd = self.lazy_moments(node, live, sd)
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
        elif tag == "generator" and isinstance(live, torch.Generator):
            # Set in place (a DataLoader may hold it): the state must be of its device's kind.
            saved = (
                node.get("device", {}).get("type") if isinstance(node.get("device"), dict) else None
            )
            if saved != live.device.type:
                self.diffs.append(
                    f"{p}: checkpoint holds a torch.Generator of device type {saved!r}, live one "
                    f"is on {live.device.type!r}; build it on the same device type"
                )
        elif tag == "sparse":
            self.match_sparse(node, live, path)
        else:
            self.replaced(tag, live, p)

    def lazy_moments(
        self, node: dict[str, Any], optim: torch.optim.Optimizer, sd: dict[str, Any]
    ) -> dict[str, Any]:
        """``sd`` with a live target for each saved moment its optimizer has not created yet,
        where the parameter is a DTensor: an empty DTensor laid out like the parameter.

        An optimizer creates its moments at its first ``step()``, so a fresh one has none to
        read into. Read as a whole tensor, a sharded moment would cost every rank the whole
        global tensor and reach ``load_state_dict()`` as a plain tensor, which ``step()``
        refuses to mix with DTensor gradients; laid out like its parameter, each rank reads
        only its own piece and the optimizer gets the DTensor it would have made itself.
        """
        state = next(
            (v for k, v in _items(node["v"], self.where) if k == "state"),
            None,
        )
        live_state = sd.get("state")
        if state is None or not isinstance(live_state, Mapping):
            return sd
        params = {
            pid: p
            for g_live, g in zip(sd.get("param_groups", ()), optim.param_groups, strict=False)
            for pid, p in zip(g_live.get("params", ()), g["params"], strict=False)
        }
        added: dict[Any, dict[str, Any]] = {}
        for pid, moments in _items(state, self.where):
            param = params.get(pid)
            if param is None or not is_dtensor(param):
                continue
            have = live_state.get(pid) or {}
            for name, leaf in _items(moments, self.where):
                if name in have or leaf.get("t") != "tensor" or "view" in leaf:
                    continue
                info = self.m.tensors[leaf["e"]]
                if "complex" in leaf or info.shape != tuple(param.shape):
                    continue
                standin = torch.empty_like(param, dtype=TORCH_DTYPES[info.dtype])
                added.setdefault(pid, dict(have))[name] = standin
        if not added:
            return sd
        # A new dict: the live optimizer's own state is changed only by load_state_dict().
        return {**sd, "state": {**live_state, **added}}

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

    def replaced(self, tag: Any, live: Any, p: str) -> None:
        """Plain values are simply replaced, but not a tensor or an object with state."""
        if isinstance(live, (torch.Tensor, np.ndarray, torch.Generator)) or is_stateful(live):
            self.diffs.append(f"{p}: checkpoint holds a {tag}, live value is {type(live).__name__}")

    def match_tensor(
        self, node: dict[str, Any], live: Any, path: tuple[Any, ...], report: bool = True
    ) -> None:
        """Check a tensor leaf against its live tensor (``report``: a mismatch is a difference)
        and take the live tensor as the read target where it can hold the bytes."""
        info = self.m.tensors[node["e"]]
        shape, dtype = _leaf_shape_dtype(node, info)  # a complex tensor's, not its real view's
        p = path_str(path)
        if node["t"] == "tensor" and (isinstance(live, Sharded) or is_dtensor(live)):
            self.match_sharded(node, live, path, shape, dtype, report)
            return
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

    def match_sharded(
        self,
        node: dict[str, Any],
        live: Any,
        path: tuple[Any, ...],
        shape: tuple[int, ...],
        dtype: torch.dtype,
        report: bool,
    ) -> None:
        """A live piece of a global tensor receives its box of the stored tensor, whatever the
        pieces were at save time (resharding)."""
        p = path_str(path)
        local, box = box_of(live, p)  # type: ignore[misc]  # box_of returns a pair; its stub says a tuple
        problem = None
        if "view" in node or "complex" in node:
            problem = "checkpoint holds a view or complex tensor, live value is sharded"
        elif box.global_shape != shape or local.dtype != dtype:
            problem = (
                f"checkpoint has shape {list(shape)} {dtype}, live sharded tensor has global "
                f"shape {list(box.global_shape)} {local.dtype}"
            )
        elif node["e"] in self.sharded or node["e"] in self.dest:
            problem = "the stored tensor is read into another live tensor already"
        elif local.device.type != "cpu" or not local.is_contiguous():
            problem = (
                f"the live local tensor must be a contiguous CPU tensor (is on {local.device})"
            )
        if problem is not None:
            if report:
                self.diffs.append(f"{p}: {problem}")
            return
        self.sharded[node["e"]] = (live, local.detach(), box)
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
    """The shape and torch dtype the leaf loads as (``format.tree.loaded_as``)."""
    shape, name = loaded_as(node, info.shape, info.dtype)
    return shape, COMPLEX_DTYPES[name][0] if name in COMPLEX_DTYPES else TORCH_DTYPES[name]


def _plain_node(node: Any) -> bool:
    """True if a (validated) checkpoint subtree holds no tensor, array or stateful object."""
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            if n.get("t") in ("tensor", "ndarray", "stateful", "generator"):
                return False
            stack.extend(n.get("v") or () if isinstance(n.get("v"), list) else ())
        elif isinstance(n, list):
            stack.extend(n)
    return True


def _plain_live(obj: Any, depth: int = 0) -> bool:
    """True if a live value holds no tensor, array or stateful object (so it may be replaced)."""
    if (
        isinstance(obj, (torch.Tensor, np.ndarray, PerRank, Sharded, torch.Generator))
        or is_stateful(obj)
        or depth > 100
    ):
        return False
    if isinstance(obj, Mapping):
        return all(_plain_live(v, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return all(_plain_live(v, depth + 1) for v in obj)
    return True


# ----------------------------------------------------------------------------------------------
# the read plan


def _entry_paths(tree: dict[str, Any]) -> dict[int, str]:
    """Where each stored tensor sits in ``tree`` (the first path for a shared one), for messages."""
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


def _region(dest: torch.Tensor, chunk: Chunk) -> torch.Tensor:
    """The part of ``dest`` (a whole stored tensor) that ``chunk`` holds."""
    shape = tuple(dest.shape)
    if chunk.shape == shape:  # the whole tensor: most chunks
        return dest
    r = dest
    for dim, (o, n) in enumerate(zip(chunk.offsets, chunk.shape, strict=True)):
        if o != 0 or n != shape[dim]:
            r = r.narrow(dim, o, n)
    return r


def _overlap(
    chunk: Chunk, box: Box, local: torch.Tensor
) -> tuple[torch.Tensor, tuple[slice, ...] | None] | None:
    """Where a stored chunk meets a live piece: the region of the piece it fills and the part
    of the chunk that fills it (None: the whole chunk); None if they do not meet."""
    target = local
    part: list[slice] = []
    whole = True
    for d, (co, cn, bo, bn) in enumerate(
        zip(chunk.offsets, chunk.shape, box.offsets, local.shape, strict=True)
    ):
        lo, hi = max(co, bo), min(co + cn, bo + bn)
        if hi <= lo:  # disjoint, or nothing to read (an empty chunk or live piece)
            return None
        if lo != bo or hi - lo != bn:
            target = target.narrow(d, lo - bo, hi - lo)
        part.append(slice(lo - co, hi - co))
        whole = whole and lo == co and hi - lo == cn
    return target, (None if whole else tuple(part))


def _plan_reads(
    m: Manifest,
    needed: set[int],
    dest: dict[int, torch.Tensor],
    paths: dict[int, str],
    sharded: dict[int, tuple[Any, torch.Tensor, Box]] | None = None,
) -> list[_ReadTask]:
    """One read per chunk of each ``needed`` entry, into its region of the entry's ``dest``;
    for a live sharded leaf, one read per chunk that meets its box (the rest is not read).

    ``paths`` names the entries in messages (``_entry_paths``); an entry it lacks is
    ``tensor #N``.
    """
    tasks = []
    for e in sorted(needed):
        path = paths.get(e, f"tensor #{e}")
        if sharded and e in sharded:
            _, local, box = sharded[e]
            chunks = m.tensors[e].chunks
            if isinstance(chunks, ChunkColumns):
                ends = [o + n for o, n in zip(box.offsets, local.shape, strict=True)]
                chunks = chunks.meeting(box.offsets, ends)
            for c in chunks:
                hit = _overlap(c, box, local)
                if hit is not None:
                    tasks.append(_ReadTask(e, c, hit[0], path, hit[1]))
            continue
        tasks.extend(_ReadTask(e, c, _region(dest[e], c), path) for c in m.tensors[e].chunks)
    return tasks
