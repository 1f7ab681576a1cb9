"""PyTorch's own stateful classes round trip bit-exactly through save -> load(into=...).

For every optimizer in ``torch.optim``, every LR scheduler in ``torch.optim.lr_scheduler`` (and
``swa_utils.SWALR`` with ``AveragedModel``) and ``torch.amp.GradScaler``: train k steps, save,
continue (the reference); rebuild everything from another seed, take a few steps (so histories
and lazily created state differ from the checkpoint's), restore, continue. Losses, parameters,
BatchNorm buffers, optimizer, scheduler and scaler state must be bit-identical to the reference.

The classes are enumerated from torch itself: a class a future torch adds has no recipe here and
fails ``test_every_*_class_has_a_recipe`` instead of going untested.
"""

from __future__ import annotations

import copy
import inspect
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler, swa_utils

import tardigrade as tg

K = 3  # steps before the save
MORE = 3  # steps after it
# Steps the rebuilt run takes before it restores: none (no optimizer state yet), fewer and
# more than K (LBFGS's history is then shorter, then longer than the checkpoint's).
OTHER = (0, 2, 5)  # (not K + MORE: a run that restored nothing could end in step)


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    # Tiny tensors: intra-op threads only add wake-ups (20x slower on a loaded 2-core machine).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --------------------------------------------------------------------------------------------
# the classes torch has


def _torch_optimizers() -> list[str]:
    return sorted(
        name
        for name, c in vars(torch.optim).items()
        if inspect.isclass(c)
        and issubclass(c, torch.optim.Optimizer)
        and c is not torch.optim.Optimizer
    )


def _torch_schedulers() -> list[str]:
    bases = (lr_scheduler.LRScheduler, lr_scheduler.ReduceLROnPlateau)
    found = set()
    for module in (lr_scheduler, swa_utils):
        for name, c in vars(module).items():
            if (
                inspect.isclass(c)
                and issubclass(c, bases)
                and c.__module__ == module.__name__
                and not name.startswith("_")
                and c is not lr_scheduler.LRScheduler
            ):
                found.add(name)
    return sorted(found)


# --------------------------------------------------------------------------------------------
# construction recipes: one per class, explicit


def _no_bias(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.ndim == 2]


OPTIMIZERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "SGD": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True),
    "Adam": lambda m: torch.optim.Adam(m.parameters(), lr=0.01, amsgrad=True),
    "AdamW": lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1),
    "Adagrad": lambda m: torch.optim.Adagrad(m.parameters(), lr=0.05, lr_decay=0.01),
    "Adadelta": lambda m: torch.optim.Adadelta(m.parameters(), lr=1.0),
    "Adamax": lambda m: torch.optim.Adamax(m.parameters(), lr=0.01),
    "ASGD": lambda m: torch.optim.ASGD(m.parameters(), lr=0.05, t0=2),
    "NAdam": lambda m: torch.optim.NAdam(m.parameters(), lr=0.01, decoupled_weight_decay=True),
    "RAdam": lambda m: torch.optim.RAdam(m.parameters(), lr=0.01),
    "RMSprop": lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01, centered=True, momentum=0.5),
    "Rprop": lambda m: torch.optim.Rprop(m.parameters(), lr=0.01),
    # A short max_iter and a long history: the history's length differs between runs.
    "LBFGS": lambda m: torch.optim.LBFGS(m.parameters(), lr=0.5, max_iter=2, history_size=10),
    "SparseAdam": lambda m: torch.optim.SparseAdam(list(m.emb.parameters()), lr=0.01),
    "Adafactor": lambda m: torch.optim.Adafactor(m.parameters(), lr=0.01),
    # Muon orthogonalizes 2-D updates only.
    "Muon": lambda m: torch.optim.Muon(_no_bias(m), lr=0.02),
}

# Settings that change what an optimizer keeps: a tensor learning rate (in the parameter
# groups), the fused CPU kernels. (capturable=True needs a CUDA device.)
VARIANTS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "Adam(lr=tensor)": lambda m: torch.optim.Adam(m.parameters(), lr=torch.tensor(0.01)),
    "AdamW(fused)": lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, fused=True),
    "SGD(fused)": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, fused=True),
    "Adagrad(fused)": lambda m: torch.optim.Adagrad(m.parameters(), lr=0.05, fused=True),
}

SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "LambdaLR": lambda o: lr_scheduler.LambdaLR(o, lambda e: 0.9**e),
    "MultiplicativeLR": lambda o: lr_scheduler.MultiplicativeLR(o, lambda e: 0.95),
    "StepLR": lambda o: lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "MultiStepLR": lambda o: lr_scheduler.MultiStepLR(o, milestones=[1, 4, 4, 5], gamma=0.5),
    "ConstantLR": lambda o: lr_scheduler.ConstantLR(o, factor=0.5, total_iters=4),
    "LinearLR": lambda o: lr_scheduler.LinearLR(o, start_factor=0.2, total_iters=5),
    "ExponentialLR": lambda o: lr_scheduler.ExponentialLR(o, gamma=0.9),
    "SequentialLR": lambda o: lr_scheduler.SequentialLR(
        o,
        [lr_scheduler.ConstantLR(o, factor=0.5, total_iters=2), lr_scheduler.ExponentialLR(o, 0.9)],
        milestones=[4],
    ),
    "PolynomialLR": lambda o: lr_scheduler.PolynomialLR(o, total_iters=8, power=2.0),
    "CosineAnnealingLR": lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=5, eta_min=0.001),
    "ChainedScheduler": lambda o: lr_scheduler.ChainedScheduler(
        [lr_scheduler.ConstantLR(o, factor=0.5, total_iters=4), lr_scheduler.ExponentialLR(o, 0.9)],
        optimizer=o,
    ),
    # mode="max" on a falling loss: every step is a bad one, so the LR is cut and cooldown runs.
    "ReduceLROnPlateau": lambda o: lr_scheduler.ReduceLROnPlateau(
        o, mode="max", factor=0.5, patience=0, cooldown=1
    ),
    "CyclicLR": lambda o: lr_scheduler.CyclicLR(
        o, base_lr=0.01, max_lr=0.1, step_size_up=2, mode="exp_range", gamma=0.9
    ),
    "CosineAnnealingWarmRestarts": lambda o: lr_scheduler.CosineAnnealingWarmRestarts(
        o, T_0=2, T_mult=2, eta_min=0.001
    ),
    "OneCycleLR": lambda o: lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=20),
    "SWALR": lambda o: swa_utils.SWALR(o, swa_lr=0.02, anneal_epochs=3, anneal_strategy="cos"),
}


# --------------------------------------------------------------------------------------------
# one training run


class Net(nn.Module):
    """Tiny, with BatchNorm running statistics and a sparse embedding (for SparseAdam)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.fc1 = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.fc2 = nn.Linear(8, 2)

    def forward(self, idx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x + self.emb(idx)))))


@dataclass
class Run:
    model: Net
    optim: torch.optim.Optimizer
    sched: Any = None
    scaler: torch.amp.GradScaler | None = None
    swa: swa_utils.AveragedModel | None = None
    losses: list[float] = field(default_factory=list)
    step_no: int = 0

    def state(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "optim": self.optim, "rng": tg.RNGState()}
        for name in ("sched", "scaler", "swa"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        out["step"] = self.step_no
        out["losses"] = self.losses
        return out

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.one_step()

    def one_step(self) -> None:
        # Each step's batch depends on the step number only, so a resumed run sees the same data.
        g = torch.Generator().manual_seed(1000 + self.step_no)
        idx = torch.randint(0, 10, (16,), generator=g)
        x = torch.randn(16, 4, generator=g)
        y = torch.randn(16, 2, generator=g)
        # The scaler's overflow path: one poisoned step (skipped, scale backed off).
        poison = self.scaler is not None and self.step_no in (1, K + 1)

        def closure() -> torch.Tensor:
            self.optim.zero_grad()
            loss = nn.functional.mse_loss(self.model(idx, x), y)
            if poison:
                loss = loss * math.inf
            if self.scaler is not None:
                self.scaler.scale(loss).backward()
            else:
                loss.backward()
            return loss

        if self.scaler is not None:
            loss = closure()
            self.scaler.step(self.optim)
            self.scaler.update()
        elif isinstance(self.optim, torch.optim.LBFGS):
            loss = self.optim.step(closure)
        else:
            loss = closure()
            self.optim.step()
        if self.swa is not None:
            self.swa.update_parameters(self.model)
        if isinstance(self.sched, lr_scheduler.ReduceLROnPlateau):
            self.sched.step(float(loss.detach()))
        elif self.sched is not None:
            self.sched.step()
        self.losses.append(float(loss.detach()))
        self.step_no += 1


def _build(seed: int, optim: str = "Adam", sched: str | None = None, scaler: bool = False) -> Run:
    torch.manual_seed(seed)
    model = Net()
    if optim != "SparseAdam":
        model.emb.sparse = False  # the other optimizers take dense gradients only
    opt = {**OPTIMIZERS, **VARIANTS}[optim](model)
    run = Run(model, opt)
    if sched is not None:
        if sched == "SWALR":
            run.swa = swa_utils.AveragedModel(model)
        run.sched = SCHEDULERS[sched](opt)
    if scaler:
        run.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)
    return run


# --------------------------------------------------------------------------------------------
# bit-exact comparison


def _same(a: Any, b: Any, path: str = "") -> None:
    assert type(a) is type(b), f"{path}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.layout) == (b.dtype, b.shape, b.layout), path
        if a.layout != torch.strided:
            a, b = a.to_dense(), b.to_dense()
        # Bits, not values: -0.0 == 0.0 and NaN != NaN would hide or invent differences.
        bits = (a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        assert torch.equal(*bits), f"{path}: tensors differ"

    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), f"{path}: {a!r} vs {b!r}"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} vs {list(b)}"
        for k in a:
            _same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: {len(a)} items vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{path}[{i}]")
    elif callable(a):
        pass  # a scheduler's lambdas: the live run's own, never saved
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def _snapshot(run: Run) -> dict[str, Any]:
    out = {
        "model": run.model.state_dict(),
        "optim": run.optim.state_dict(),
        "losses": list(run.losses),
        "lr": [g["lr"] for g in run.optim.param_groups],
    }
    for name in ("sched", "scaler", "swa"):
        obj = getattr(run, name)
        if obj is not None:
            out[name] = obj.state_dict()
    if run.scaler is not None:
        out["scale"] = run.scaler.get_scale()
    return copy.deepcopy(out)


def _roundtrip(tmp_path: Path, other: int, **kind: Any) -> None:
    ref = _build(0, **kind)
    ref.train(K)
    tg.save(tmp_path / "ck", ref.state())
    at_save = _snapshot(ref)
    ref.train(MORE)

    run = _build(1, **kind)
    run.train(other)
    live = run.state()
    tg.load(tmp_path / "ck", into=live)
    run.step_no, run.losses = live["step"], live["losses"]
    _same(at_save, _snapshot(run), "restored")
    run.train(MORE)
    _same(_snapshot(ref), _snapshot(run), "continued")


# --------------------------------------------------------------------------------------------
# the matrix


def test_every_optimizer_class_has_a_recipe() -> None:
    missing = sorted(set(_torch_optimizers()) - set(OPTIMIZERS))
    assert not missing, f"torch.optim has optimizers this matrix does not test: {missing}"


def test_every_scheduler_class_has_a_recipe() -> None:
    missing = sorted(set(_torch_schedulers()) - set(SCHEDULERS))
    assert not missing, f"torch has LR schedulers this matrix does not test: {missing}"


@pytest.mark.parametrize("other", OTHER)
@pytest.mark.parametrize("name", _torch_optimizers())
def test_optimizer_round_trips_bit_exactly(tmp_path: Path, name: str, other: int) -> None:
    if name not in OPTIMIZERS:
        pytest.fail(f"no construction recipe for torch.optim.{name}; add one to OPTIMIZERS")
    _roundtrip(tmp_path, other, optim=name)


@pytest.mark.parametrize("other", OTHER)
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_optimizer_variant_round_trips_bit_exactly(tmp_path: Path, name: str, other: int) -> None:
    _roundtrip(tmp_path, other, optim=name)


@pytest.mark.parametrize("other", OTHER)
@pytest.mark.parametrize("name", _torch_schedulers())
def test_scheduler_round_trips_bit_exactly(tmp_path: Path, name: str, other: int) -> None:
    if name not in SCHEDULERS:
        pytest.fail(f"no construction recipe for LR scheduler {name}; add one to SCHEDULERS")
    _roundtrip(tmp_path, other, optim="SGD", sched=name)


@pytest.mark.parametrize("other", OTHER)
def test_grad_scaler_round_trips_bit_exactly(tmp_path: Path, other: int) -> None:
    assert torch.amp.GradScaler("cpu").is_enabled(), "this torch has a CPU GradScaler"
    _roundtrip(tmp_path, other, optim="Adam", scaler=True)


def test_milestones_come_back_as_a_counter(tmp_path: Path) -> None:
    run = _build(0, optim="SGD", sched="MultiStepLR")
    tg.save(tmp_path / "ck", {"sched": run.sched})
    tree = tg.load(tmp_path / "ck")
    milestones = tree["sched"]["milestones"]
    assert type(milestones) is type(run.sched.milestones)  # collections.Counter
    assert milestones == run.sched.milestones and milestones[3] == 0
