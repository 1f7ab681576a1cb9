"""The training state every tool saves and loads: an MLP plus Adam moments after one step.

At ``size=1.0`` the MLP has 15 square 4096-wide linear layers (251.7M fp32 parameters); with the
two Adam moments that is 3.02 GB of tensors. Smaller sizes keep the depth and shrink the width,
so the tensor count (and the per-tensor overheads the tools pay) stays the same.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

DEPTH = 15
FULL_WIDTH = 4096
# Parameters, Adam's exp_avg and exp_avg_sq: three fp32 copies of every weight.
BYTES_PER_PARAM = 12
DEFAULT_STATE_BYTES = DEPTH * (FULL_WIDTH * FULL_WIDTH + FULL_WIDTH) * BYTES_PER_PARAM

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
}


def parse_size(text: str, *, whole: int = DEFAULT_STATE_BYTES, option: str = "--size") -> int:
    """Target state bytes from ``--size``: a fraction of the default state, or bytes with a unit.

    ``"1"`` is the default ~3 GB state (``whole``), ``"0.05"`` 5% of it; ``"20MB"``, ``"1.5GB"``
    or ``"512MiB"`` ask for that many bytes of tensors.

    >>> parse_size("20MB")
    20000000
    >>> parse_size("0.5", whole=1_000_000_000)
    500000000
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if m is None or (m.group(2) and m.group(2).lower() not in _UNITS):
        raise ValueError(
            f"{option} {text!r}: give a fraction of the default {whole / 1e9:.3g} GB state "
            f"(e.g. 0.05) or a size with a unit ({', '.join(sorted(_UNITS))}), e.g. 20MB"
        )
    value = float(m.group(1))
    nbytes = int(value * _UNITS[m.group(2).lower()]) if m.group(2) else int(value * whole)
    if nbytes <= 0:
        raise ValueError(f"{option} {text!r}: the state must be larger than 0 bytes")
    return nbytes


def width_for(target_bytes: int) -> int:
    """The layer width (a multiple of 8) whose MLP + Adam state is closest to ``target_bytes``."""
    params_per_layer = target_bytes / BYTES_PER_PARAM / DEPTH
    # w*w + w = params_per_layer
    w = (-1 + math.sqrt(1 + 4 * params_per_layer)) / 2
    return max(8, round(w / 8) * 8)


@dataclass
class TrainState:
    """A model and its optimizer, plus the views of them each tool needs."""

    model: torch.nn.Module
    optim: torch.optim.Optimizer
    width: int

    @property
    def live(self) -> dict[str, Any]:
        """What ``tardigrade.save``/``load(into=)`` take: the stateful objects themselves."""
        return {"model": self.model, "optim": self.optim}

    def state_dicts(self) -> dict[str, Any]:
        """The nested state dicts (aliasing the live tensors), as torch.save and DCP take them."""
        return {"model": self.model.state_dict(), "optim": self.optim.state_dict()}

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every live tensor under a flat name: ``model.0.weight``, ``optim.state.0.exp_avg``."""
        return {name: t for name, (_, t) in self.tensor_paths().items()}

    def tensor_paths(self) -> dict[str, tuple[tuple[Any, ...], torch.Tensor]]:
        """Every live tensor by flat name, with its key path in ``state_dicts()``.

        The key path is also Tardigrade's (``tg.load(keys=[path])``): ``model.0.weight`` is
        ``("model", "0.weight")``, ``optim.state.0.exp_avg`` is ``("optim", "state", 0,
        "exp_avg")``.
        """
        out: dict[str, tuple[tuple[Any, ...], torch.Tensor]] = {
            f"model.{k}": (("model", k), v) for k, v in self.model.state_dict().items()
        }
        for i, per_param in self.optim.state_dict()["state"].items():
            for k, v in per_param.items():
                if isinstance(v, torch.Tensor):
                    out[f"optim.state.{i}.{k}"] = (("optim", "state", i, k), v)
        return out

    def train_step(self) -> None:
        """One Adam step on synthetic gradients (the first creates the moments).

        The gradients all alias one random buffer and are dropped afterwards: the state to
        checkpoint is parameters + moments, and a step allocates little besides.
        """
        grad = torch.randn(self.width * self.width) * 1e-3
        params = list(self.model.parameters())
        for p in params:
            p.grad = grad[: p.numel()].view_as(p)
        self.optim.step()
        for p in params:
            p.grad = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    @property
    def params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def fingerprint(self) -> dict[str, tuple[float, float]]:
        """First and last element of every tensor: cheap evidence that a load restored it."""
        return {k: _ends(t) for k, t in self.tensors().items()}

    def poison(self) -> None:
        """Overwrite both ends of every tensor, so a load that restores nothing is caught."""
        with torch.no_grad():
            for t in self.tensors().values():
                flat = t.view(-1)
                flat[0] = -12345.0
                flat[-1] = -12345.0

    def check(self, expected: dict[str, tuple[float, float]], tool: str) -> None:
        """Raise if the live state differs from ``expected`` after ``tool`` loaded it."""
        got = self.fingerprint()
        if got.keys() != expected.keys():
            raise RuntimeError(
                f"{tool} load changed the set of live tensors: missing "
                f"{sorted(expected.keys() - got.keys())[:5]}, extra "
                f"{sorted(got.keys() - expected.keys())[:5]}"
            )
        wrong = [k for k in expected if got[k] != expected[k]]
        if wrong:
            raise RuntimeError(
                f"{tool} load did not restore {len(wrong)} tensor(s), e.g. {wrong[0]}: "
                f"expected ends {expected[wrong[0]]}, got {got[wrong[0]]}"
            )


def _ends(t: torch.Tensor) -> tuple[float, float]:
    flat = t.detach().reshape(-1)
    return float(flat[0]), float(flat[-1])


def state_nbytes(width: int) -> int:
    """The tensor bytes of ``build_state``'s state at ``width``, without building it."""
    per_layer = width * width + width
    # Adam keeps a 4-byte step counter per parameter tensor (weight and bias of each layer).
    return DEPTH * (per_layer * BYTES_PER_PARAM + 2 * 4)


def build_state(target_bytes: int, *, seed: int = 0, stepped: bool = True) -> TrainState:
    """An MLP of ``DEPTH`` square layers sized to ``target_bytes``, after one Adam step.

    The step uses synthetic gradients that all alias one random buffer, so building the state
    allocates little beyond the parameters and moments themselves: on this VM every fresh byte
    faults in slowly, and each first save builds the state in a new process. ``stepped=False``
    stops before the step, as a fresh training run is before its first ``optimizer.step()``:
    Adam has no moments yet (``TrainState.train_step`` creates them).
    """
    torch.manual_seed(seed)
    width = width_for(target_bytes)
    layers: list[torch.nn.Module] = []
    for i in range(DEPTH):
        layers.append(torch.nn.Linear(width, width))
        if i < DEPTH - 1:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers)
    # foreach=False: one parameter at a time, so Adam's temporaries stay one layer large.
    optim = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=False)
    state = TrainState(model, optim, width)
    if stepped:
        state.train_step()
    return state
