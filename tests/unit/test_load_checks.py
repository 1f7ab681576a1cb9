"""load(into=...) refuses a checkpoint before the first byte lands in the live state.

Structure, shapes, dtypes, each stateful object's class and each object's own validation are
checked up front; an object that still rejects its state afterwards gets an error that says
exactly what was restored and what was not.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tardigrade as tg
from tardigrade.errors import ChecksumMismatchError, StateMismatchError


def _trained(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optim = torch.optim.Adam(
        [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.01}]
    )
    model(torch.randn(3, 4)).sum().backward()
    optim.step()
    return {
        "model": model,
        "optim": optim,
        "data": tg.ResumableSampler(100, seed=1),
        "step": 7,
    }


def _fresh(seed: int = 1, **override: Any) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    state = {
        "model": model,
        "optim": torch.optim.Adam(
            [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.01}]
        ),
        "data": tg.ResumableSampler(100, seed=1),
        "step": 0,
    }
    state.update(override)
    return state


def _snapshot(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": {k: v.clone() for k, v in state["model"].state_dict().items()},
        "optim_state": {
            k: {n: t.clone() if isinstance(t, torch.Tensor) else t for n, t in v.items()}
            for k, v in state["optim"].state_dict()["state"].items()
        },
        "optim_groups": [
            {k: v for k, v in g.items() if k != "params"} for g in state["optim"].param_groups
        ],
        "data": state["data"].state_dict(),
        "step": state["step"],
    }


def _unchanged(before: dict[str, Any], state: dict[str, Any]) -> None:
    after = _snapshot(state)
    for k, v in before["model"].items():
        assert torch.equal(v, after["model"][k]), f"model tensor {k} was overwritten"
    assert after["optim_groups"] == before["optim_groups"], "optimizer groups changed"
    assert after["optim_state"].keys() == before["optim_state"].keys()
    for k, v in before["optim_state"].items():
        for n, t in v.items():
            assert torch.equal(t, after["optim_state"][k][n]), f"optimizer state {k}/{n} changed"
    assert after["data"] == before["data"]
    assert after["step"] == before["step"]


# --------------------------------------------------------------------------------------------
# refused before anything is read


def test_a_sampler_of_another_dataset_is_refused_before_the_model_is_touched(
    tmp_path: Path,
) -> None:
    tg.save(tmp_path / "ck", _trained())
    for strict in (True, False):
        live = _fresh(data=tg.ResumableSampler(101, seed=1))
        before = _snapshot(live)
        with pytest.raises(StateMismatchError) as info:
            tg.load(tmp_path / "ck", into=live, strict=strict)
        msg = str(info.value)
        assert "state['data']" in msg and "dataset_len=100" in msg and "101" in msg, msg
        assert "nothing was loaded" in msg
        _unchanged(before, live)


def test_an_optimizer_with_other_parameter_groups_is_refused_before_anything_is_read(
    tmp_path: Path,
) -> None:
    tg.save(tmp_path / "ck", _trained())
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    one_group = _fresh(model=model, optim=torch.optim.Adam(model.parameters()))
    before = _snapshot(one_group)
    with pytest.raises(StateMismatchError, match=r"state\['optim'\].*2 parameter group\(s\)"):
        tg.load(tmp_path / "ck", into=one_group)
    _unchanged(before, one_group)

    # Same number of groups, another split of the parameters.
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    split = torch.optim.Adam(
        [{"params": [model[0].weight]}, {"params": [model[0].bias, *model[2].parameters()]}]
    )
    other = _fresh(model=model, optim=split)
    before = _snapshot(other)
    with pytest.raises(StateMismatchError, match=r"parameter group 0 holds 2 parameter\(s\)"):
        tg.load(tmp_path / "ck", into=other, strict=False)
    _unchanged(before, other)


def test_every_refusal_is_listed_together(tmp_path: Path) -> None:
    tg.save(tmp_path / "ck", _trained())
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))  # another output size
    live = _fresh(
        model=model,
        optim=torch.optim.SGD(
            [{"params": model[0].parameters()}, {"params": model[2].parameters()}], lr=0.1
        ),
        data=tg.ResumableSampler(100, seed=2),
    )
    with pytest.raises(StateMismatchError) as info:
        tg.load(tmp_path / "ck", into=live)
    msg = str(info.value)
    lines = [ln.strip() for ln in msg.splitlines() if ln.strip().startswith("state[")]
    assert any(ln.startswith("state['model']['2.weight']:") for ln in lines), msg
    assert any(ln.startswith("state['optim']:") and "another class" in ln for ln in lines), msg
    assert any(ln.startswith("state['data']:") and "seed" in ln for ln in lines), msg
    assert "nothing was loaded" in msg


# --------------------------------------------------------------------------------------------
# classes (strict=True refuses another class; nn.Module is matched by keys and shapes)


def test_strict_load_refuses_an_adam_checkpoint_into_sgd(tmp_path: Path) -> None:
    tg.save(tmp_path / "ck", _trained())
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    sgd = torch.optim.SGD(
        [{"params": model[0].parameters()}, {"params": model[2].parameters()}],
        lr=0.1,
        momentum=0.9,
    )
    live = _fresh(model=model, optim=sgd)
    before = _snapshot(live)
    with pytest.raises(StateMismatchError) as info:
        tg.load(tmp_path / "ck", into=live)
    msg = str(info.value)
    assert "state['optim']" in msg and "torch.optim.adam.Adam" in msg, msg
    assert "torch.optim.sgd.SGD" in msg and "nothing was loaded" in msg, msg
    _unchanged(before, live)
    model(torch.randn(3, 4)).sum().backward()
    sgd.step()  # still a working SGD


def test_non_strict_load_skips_an_object_of_another_class_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    saved = _trained()
    tg.save(tmp_path / "ck", saved)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    sgd = torch.optim.SGD(
        [{"params": model[0].parameters()}, {"params": model[2].parameters()}],
        lr=0.1,
        momentum=0.9,
    )
    live = _fresh(model=model, optim=sgd)
    with caplog.at_level(logging.WARNING, logger="tardigrade"):
        tg.load(tmp_path / "ck", into=live, strict=False)
    assert "state['optim']" in caplog.text and "not loaded" in caplog.text
    for k, v in saved["model"].state_dict().items():
        assert torch.equal(v, model.state_dict()[k])  # what matches was loaded
    assert [g["momentum"] for g in sgd.param_groups] == [0.9, 0.9]
    model(torch.randn(3, 4)).sum().backward()
    sgd.step()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)


class RenamedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = sd["n"]


def test_module_classes_are_not_compared_and_other_classes_by_name(
    tmp_path: Path,
) -> None:
    net, counter = Net(), Counter()
    counter.n = 5
    tg.save(tmp_path / "ck", {"model": net, "counter": counter})

    # A model class renamed (or moved) between runs loads: its keys and shapes decide.
    other = RenamedNet()
    tg.load(tmp_path / "ck", into={"model": other, "counter": Counter()})
    assert torch.equal(other.fc.weight, net.fc.weight)

    # The same class defined in another module (`__main__.Counter` vs `train.Counter`) or in
    # a function loads.
    moved_cls = type("Counter", (Counter,), {"__module__": "train"})
    moved = moved_cls()
    tg.load(tmp_path / "ck", into={"model": Net(), "counter": moved})
    assert moved.n == 5

    class Counter2(Counter):
        pass

    Counter2.__name__ = "Counter"
    local = Counter2()
    assert "<locals>" in type(local).__qualname__
    tg.load(tmp_path / "ck", into={"model": Net(), "counter": local})
    assert local.n == 5

    # Another class of the same shape does not, under strict=True.
    other_cls = type("Tally", (Counter,), {"__module__": Counter.__module__})
    with pytest.raises(StateMismatchError, match=r"state\['counter'\].*another class"):
        tg.load(tmp_path / "ck", into={"model": Net(), "counter": other_cls()})


# --------------------------------------------------------------------------------------------
# the validate_state_dict() hook


class Picky:
    """Refuses states whose "v" is negative: in validate_state_dict or only in load."""

    def __init__(self, hook: bool) -> None:
        self.v = 1
        self.seen: list[Any] = []
        if hook:
            self.validate_state_dict = self._validate

    def state_dict(self) -> dict[str, Any]:
        return {"v": self.v, "t": torch.full((2, 3), float(self.v))}

    def _validate(self, sd: dict[str, Any]) -> None:
        self.seen.append(sd)
        if sd["v"] < 0:
            raise ValueError(f"v must be >= 0, got {sd['v']}")

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd["v"] < 0:
            raise ValueError(f"v must be >= 0, got {sd['v']}")
        self.v = sd["v"]


def test_validate_state_dict_sees_stand_ins_and_refuses_before_anything_is_read(
    tmp_path: Path,
) -> None:
    saved = _trained()
    picky = Picky(hook=True)
    picky.v = -3
    tg.save(tmp_path / "ck", {**saved, "picky": picky})

    live = {**_fresh(), "picky": Picky(hook=True)}
    before = _snapshot(live)
    with pytest.raises(StateMismatchError, match=r"state\['picky'\].*v must be >= 0, got -3"):
        tg.load(tmp_path / "ck", into=live)
    _unchanged(before, live)
    (sd,) = live["picky"].seen
    assert sd["v"] == -3
    t = sd["t"]
    assert isinstance(t, torch.Tensor) and t.is_meta, "tensors are stand-ins, not read yet"
    assert (tuple(t.shape), t.dtype) == ((2, 3), torch.float32)


def test_a_late_rejection_names_exactly_what_was_restored(tmp_path: Path) -> None:
    saved = _trained()
    picky = Picky(hook=False)  # refuses only inside load_state_dict, after the read
    picky.v = -3
    second = nn.Linear(4, 4)
    tg.save(tmp_path / "ck", {"model": saved["model"], "picky": picky, "z": second, "step": 7})

    torch.manual_seed(3)
    live = {
        "model": nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
        "picky": Picky(hook=False),
        "z": nn.Linear(4, 4),
        "step": 0,
    }
    with pytest.raises(StateMismatchError) as info:
        tg.load(tmp_path / "ck", into=live)
    msg = str(info.value)
    assert "nothing was loaded" not in msg, msg
    lines = {ln.split(":", 1)[0].strip(): ln for ln in msg.splitlines()}
    assert "state['model']" in lines["restored (load_state_dict() done)"], msg
    assert "state['picky']" in lines["rejected"] and "overwritten in place" in lines["rejected"]
    over = lines["tensors overwritten in place, load_state_dict() not called"]
    assert "state['z'] (2 tensor(s))" in over, msg
    assert "none replaced" in lines["plain values (numbers, strings, ...)"], msg
    assert "v must be >= 0" in msg
    # ... and that is what happened.
    assert torch.equal(live["model"][0].weight, saved["model"][0].weight)
    assert torch.equal(live["z"].weight, second.weight)
    assert live["picky"].v == 1
    assert live["step"] == 0


def test_a_read_failure_names_the_tensors_it_may_have_overwritten(tmp_path: Path) -> None:
    tg.save(tmp_path / "ck", _trained())
    (data,) = (tmp_path / "ck").glob("data-*.safetensors")
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(ChecksumMismatchError) as info:
        tg.load(tmp_path / "ck", into=_fresh())
    msg = str(info.value)
    assert "may be partly overwritten" in msg and "state['model'] (4 tensor(s))" in msg, msg
    assert "No load_state_dict() was called" in msg


# --------------------------------------------------------------------------------------------
# state an object grows while it trains is the checkpoint's; fixed layouts are matched strictly


def _lbfgs(seed: int, steps: int) -> tuple[nn.Module, torch.optim.LBFGS]:
    torch.manual_seed(seed)
    model = nn.Linear(4, 2)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3, history_size=20)
    x, y = torch.randn(8, 4), torch.randn(8, 2)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    for _ in range(steps):
        opt.step(closure)
    return model, opt


@pytest.mark.parametrize("live_steps", [1, 6])
def test_lbfgs_restores_into_a_live_optimizer_with_another_history_length(
    tmp_path: Path, live_steps: int
) -> None:
    model, opt = _lbfgs(0, 3)
    saved = opt.state_dict()["state"][0]
    tg.save(tmp_path / "ck", {"model": model, "optim": opt})
    live_model, live_opt = _lbfgs(1, live_steps)
    assert len(live_opt.state_dict()["state"][0]["old_dirs"]) != len(saved["old_dirs"])

    tg.load(tmp_path / "ck", into={"model": live_model, "optim": live_opt})  # strict

    got = live_opt.state_dict()["state"][0]
    for key in ("old_dirs", "old_stps", "ro"):
        assert len(got[key]) == len(saved[key]), key
        for a, b in zip(got[key], saved[key], strict=True):
            assert torch.equal(a, b), key
    assert torch.equal(got["d"], saved["d"]) and got["n_iter"] == saved["n_iter"]


class Grower:
    """State that grows as it trains: a history list, a buffer that is resized, lazy moments."""

    def __init__(self, n: int) -> None:
        self.hist = [torch.full((2,), float(i)) for i in range(n)]
        self.buf = torch.arange(float(n + 1))
        self.moments = {i: torch.ones(3) * i for i in range(n)}
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"hist": self.hist, "buf": self.buf, "moments": self.moments, "n": len(self.hist)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.loaded = sd
        self.hist, self.buf, self.moments = list(sd["hist"]), sd["buf"], dict(sd["moments"])


@pytest.mark.parametrize("live_n", [0, 1, 5])
def test_what_an_object_grows_is_the_checkpoints_to_decide(tmp_path: Path, live_n: int) -> None:
    tg.save(tmp_path / "ck", {"g": Grower(3)})
    live = Grower(live_n)
    old_buf = live.buf.clone()
    live_buf = live.buf

    tg.load(tmp_path / "ck", into={"g": live}, strict=True)

    want = Grower(3)
    assert [t.tolist() for t in live.hist] == [t.tolist() for t in want.hist]
    assert live.buf.tolist() == want.buf.tolist()
    assert {k: v.tolist() for k, v in live.moments.items()} == {
        k: v.tolist() for k, v in want.moments.items()
    }
    # A live tensor of another shape is not a read target: it is left as it was.
    assert torch.equal(live_buf, old_buf)


class WithExtra(nn.Module):
    def __init__(self, n: int, width: int = 2) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 2)
        self.seen = [torch.full((2,), float(i)) for i in range(n)]

    def get_extra_state(self) -> Any:
        return {"seen": self.seen}

    def set_extra_state(self, state: Any) -> None:
        self.seen = list(state["seen"])


def test_a_modules_extra_state_is_the_checkpoints_but_its_parameters_are_fixed(
    tmp_path: Path,
) -> None:
    saved = WithExtra(3)
    tg.save(tmp_path / "ck", {"m": saved})

    live = WithExtra(1)
    tg.load(tmp_path / "ck", into={"m": live})  # strict: the extra state's length differs
    assert [t.tolist() for t in live.seen] == [t.tolist() for t in saved.seen]
    assert torch.equal(live.fc.weight, saved.fc.weight)

    wider = WithExtra(3, width=3)
    with pytest.raises(StateMismatchError, match=r"state\['m'\]\['fc.weight'\]: .*\[2, 2\]"):
        tg.load(tmp_path / "ck", into={"m": wider})


class Twins:
    """Live state whose two entries share one tensor; the checkpoint's two differ."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
        self.a, self.b = a, b

    def state_dict(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.a, self.b = sd["a"], sd["b"]


def test_two_checkpoint_tensors_are_never_read_into_one_live_tensor(tmp_path: Path) -> None:
    tg.save(tmp_path / "ck", {"t": Twins(torch.full((4,), 1.0), torch.full((4,), 2.0))})
    shared = torch.zeros(4)
    live = Twins(shared, shared)
    tg.load(tmp_path / "ck", into={"t": live})
    assert live.a.tolist() == [1.0] * 4 and live.b.tolist() == [2.0] * 4


# --------------------------------------------------------------------------------------------
# every leaf kind restores into live state (complex tensors in place, sparse ones replaced)


class Spectral(nn.Module):
    """A complex parameter (read in place through its real view) and a sparse buffer."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = nn.Parameter(torch.randn(3, 2, dtype=torch.complex64, generator=g))
        self.register_buffer("adj", (torch.eye(3) * (seed + 1)).to_sparse())


def test_complex_and_sparse_tensors_restore_into_live_state(tmp_path: Path) -> None:
    saved = {
        "model": Spectral(0),
        "z": torch.full((4,), 1 + 2j, dtype=torch.complex128),
        "adj": (torch.eye(3) * 2).to_sparse_csr(),
    }
    tg.save(tmp_path / "ck", saved)
    live = {
        "model": Spectral(1),
        "z": torch.zeros(4, dtype=torch.complex128),
        "adj": torch.eye(3).to_sparse_csr(),
    }
    w, z = live["model"].w, live["z"]
    tg.load(tmp_path / "ck", into=live)  # strict
    assert live["model"].w is w and torch.equal(w, saved["model"].w)  # read in place
    assert live["z"] is z and torch.equal(z, saved["z"])
    assert torch.equal(live["model"].adj.to_dense(), saved["model"].adj.to_dense())
    assert live["adj"].layout == torch.sparse_csr
    assert torch.equal(live["adj"].to_dense(), saved["adj"].to_dense())

    # A dense live tensor where the checkpoint holds a sparse one is a difference.
    with pytest.raises(StateMismatchError, match=r"state\['adj'\]: checkpoint holds a sparse csr"):
        tg.load(tmp_path / "ck", into={**live, "adj": torch.zeros(3, 3)})


def test_an_enabled_grad_scaler_refuses_a_disabled_ones_state_before_anything_is_read(
    tmp_path: Path,
) -> None:
    tg.save(tmp_path / "ck", {**_trained(), "scaler": torch.amp.GradScaler("cpu", enabled=False)})
    live = {**_fresh(), "scaler": torch.amp.GradScaler("cpu")}
    before = _snapshot(live)
    with pytest.raises(StateMismatchError) as info:
        tg.load(tmp_path / "ck", into=live)
    msg = str(info.value)
    assert "state['scaler']: GradScaler rejects the state" in msg, msg
    assert "disabled GradScaler" in msg and "nothing was loaded" in msg, msg
    _unchanged(before, live)
    assert live["scaler"].get_scale() == 2.0**16


@pytest.mark.parametrize("cls", ["SequentialLR", "ChainedScheduler"])
@pytest.mark.parametrize("live_count", [1, 3])
def test_a_scheduler_wrapping_another_number_of_schedulers_is_refused_up_front(
    tmp_path: Path, cls: str, live_count: int
) -> None:
    from torch.optim import lr_scheduler as lrs

    def build(state: dict[str, Any], n: int) -> Any:
        opt = state["optim"]
        inner = [lrs.ConstantLR(opt, factor=0.5, total_iters=2), lrs.ExponentialLR(opt, 0.9)]
        inner += [lrs.StepLR(opt, step_size=2)] * (n - 2)
        inner = inner[:n]
        if cls == "SequentialLR":
            return lrs.SequentialLR(opt, inner, milestones=list(range(2, n + 1)))
        return lrs.ChainedScheduler(inner, optimizer=opt)

    saved = _trained()
    saved["sched"] = build(saved, 2)
    saved["sched"].step()
    tg.save(tmp_path / "ck", saved)
    live = _fresh()
    live["sched"] = build(live, live_count)
    before = _snapshot(live)
    with pytest.raises(StateMismatchError) as info:
        tg.load(tmp_path / "ck", into=live)
    msg = str(info.value)
    assert f"state['sched']: {cls} rejects the state" in msg, msg
    assert f"states of 2 scheduler(s), this {cls} wraps {live_count}" in msg, msg
    assert "nothing was loaded" in msg, msg
    _unchanged(before, live)
