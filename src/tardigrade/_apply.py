"""Putting loaded values into live state, once every check before the read has passed.

Separate from matching (``_match``) because it runs at the other end of a load: matching decides
before the read what may be loaded and where, applying changes the live objects after it
(``load_state_dict()`` on each object, then plain values replaced). ``_Applier.validate`` is the
exception that runs early: each object's own objection to its state, asked before the read.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from ._match import Path, _key_of, _Matcher, _plain_live, _plain_node
from ._sharding import PerRank
from ._tree import is_stateful, path_str
from ._validate import validate_state
from .errors import StateMismatchError


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
        if isinstance(live, PerRank):
            yield from self.objects(node, live.value, value, path)
            return
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
        if isinstance(live, PerRank):
            live.value = self.put(node, live.value, value, path)
            return live
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
        if tag == "generator" and isinstance(live, torch.Generator):
            # In place: a DataLoader or sampler holding this generator draws from the restored
            # stream. A state for another kind of device is refused here by set_state().
            live.set_state(value.get_state())
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
    out: Any = type(value)()
    for k, v in value.items():
        lv = live_sd.get(k)
        tensors = isinstance(v, torch.Tensor) and isinstance(lv, torch.Tensor)
        if tensors and (v.shape != lv.shape or v.dtype != lv.dtype):  # type: ignore[union-attr]  # lv is a tensor when both are
            continue
        out[k] = v
    if hasattr(value, "_metadata"):
        out._metadata = value._metadata
    return out


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.data_ptr() == b.data_ptr() and a.stride() == b.stride()
