"""Framework wrappers around optimizers and schedulers save and restore through tg.save/tg.load.

accelerate's ``AcceleratedOptimizer`` (HF ``Trainer.optimizer`` is one) subclasses ``Optimizer``
without running ``Optimizer.__init__``; the checkpoint records the wrapped class, so a state
saved with the wrapper loads without it and the other way round.
"""

from __future__ import annotations

from pathlib import Path

import torch
from accelerate import Accelerator

import tardigrade as tg


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for i in range(steps):
        opt.zero_grad()
        model(torch.full((2, 4), float(i))).sum().backward()
        opt.step()


def _fresh(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return model, opt, sched


def test_accelerated_optimizer_and_scheduler_restore_in_place(tmp_path: Path) -> None:
    acc = Accelerator(cpu=True)
    model, opt, sched = acc.prepare(*_fresh(0))
    assert type(opt).__name__ == "AcceleratedOptimizer"
    _train(model, opt, 3)
    sched.step()
    tg.save(tmp_path / "c", {"model": model, "optim": opt, "sched": sched})
    want = opt.state_dict()

    model2, opt2, sched2 = acc.prepare(*_fresh(1))
    tg.load(tmp_path / "c", into={"model": model2, "optim": opt2, "sched": sched2})
    got = opt2.state_dict()
    for pid, moments in want["state"].items():
        for name, value in moments.items():
            assert torch.equal(got["state"][pid][name], value), name
    assert sched2.scheduler.last_epoch == sched.scheduler.last_epoch
    assert torch.equal(model2.weight, model.weight)


def test_wrapped_and_plain_optimizers_load_into_each_other(tmp_path: Path) -> None:
    acc = Accelerator(cpu=True)
    model, opt, sched = _fresh(0)
    _train(model, opt, 2)
    tg.save(tmp_path / "plain", {"optim": opt, "sched": sched})
    m, wrapped, wsched = acc.prepare(*_fresh(1))
    tg.load(tmp_path / "plain", into={"optim": wrapped, "sched": wsched})
    want = opt.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(wrapped.state_dict()["state"][0]["exp_avg"], want)

    _train(m, wrapped, 1)
    tg.save(tmp_path / "wrapped", {"optim": wrapped, "sched": wsched})
    _, plain, psched = _fresh(2)
    tg.load(tmp_path / "wrapped", into={"optim": plain, "sched": psched})
    assert plain.state_dict()["state"][0]["step"] == wrapped.state_dict()["state"][0]["step"]
