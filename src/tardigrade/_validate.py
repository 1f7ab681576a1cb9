"""Checks a restore runs before the first byte lands in live state.

``load(into=...)`` reads tensor bytes straight into the live tensors (no second copy of the
state), so anything that can refuse the checkpoint must refuse it before the read: the
structure, shapes and dtypes (``_match._Matcher``), each stateful object's class
(:func:`same_class`) and each object's own validation (:func:`validate_state`), which gets the
checkpoint's state with cheap stand-ins (:func:`standin`) where the tensors will be.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.optim import lr_scheduler

from .errors import CorruptCheckpointError
from .format.dtypes import NUMPY_DTYPES, TORCH_DTYPES


def unwrap(obj: object) -> object:
    """The object a framework's wrapper stands for, where the wrapper only forwards its state.

    accelerate's ``AcceleratedOptimizer`` (what ``Accelerator.prepare(opt)`` returns, and HF
    ``Trainer.optimizer``) subclasses ``Optimizer`` without running ``Optimizer.__init__``, and
    ``AcceleratedScheduler`` forwards to ``.scheduler``; Lightning's ``LightningOptimizer``
    forwards to ``._optimizer``. Their ``state_dict()`` is the wrapped object's, so the
    checkpoint records (and checks) the wrapped class: a run saved with the wrapper resumes
    without it and the other way round. Recognised by shape, not by importing the frameworks.
    """
    for _ in range(8):  # wrappers of wrappers, never a cycle
        inner = None
        if isinstance(
            obj, torch.optim.Optimizer
        ) and "_optimizer_load_state_dict_pre_hooks" not in vars(obj):
            inner = getattr(obj, "optimizer", None)  # never ran Optimizer.__init__: a wrapper
        elif type(obj).__name__ == "AcceleratedScheduler":
            inner = getattr(obj, "scheduler", None)
        elif type(obj).__name__ == "LightningOptimizer":
            inner = getattr(obj, "_optimizer", None)
        if inner is None or inner is obj or not hasattr(inner, "state_dict"):
            return obj
        obj = inner
    return obj


def same_class(recorded: str, live: object) -> bool:
    """Whether a stateful node saved from class ``recorded`` may be loaded into ``live``.

    ``recorded`` is ``module.qualname`` at save time. Only the class's own name is compared,
    not its module or enclosing scope: a class defined in the training script is
    ``__main__.Counter`` when the script runs, ``train.Counter`` when a launcher imports it and
    ``main.<locals>.Counter`` when defined in a function, and library classes move between
    private modules across versions. ``nn.Module`` is not compared at all: its keys, shapes
    and dtypes are matched strictly, the contract its own ``load_state_dict(strict=True)``
    keeps, and a renamed or wrapped model class with the same parameters is the same model.
    """
    if isinstance(live, torch.nn.Module):
        return True
    return recorded.rsplit(".", 1)[-1] == type(unwrap(live)).__name__


def class_name(obj: object) -> str:
    """``module.qualname`` of ``obj``'s class (of the object a wrapper stands for)."""
    cls = type(unwrap(obj))
    return f"{cls.__module__}.{cls.__qualname__}"


def standin(node: dict[str, Any], shape: tuple[int, ...], dtype: str, where: str) -> Any:
    """A tensor (or array) of the checkpoint's shape and dtype that holds no memory."""
    try:
        if node["t"] == "ndarray" and dtype in NUMPY_DTYPES:
            return np.broadcast_to(np.zeros((), dtype=NUMPY_DTYPES[dtype]), shape)
        return torch.empty(shape, dtype=TORCH_DTYPES[dtype], device="meta")
    except (RuntimeError, TypeError, ValueError, OverflowError) as e:
        raise CorruptCheckpointError(
            f"{where}: a tensor of shape {list(shape)} {dtype} cannot exist ({e}); the manifest "
            "is damaged. Restore the checkpoint from a backup or delete it."
        ) from None


def validate_state(live: Any, state_dict: Any) -> None:
    """Raise if ``live.load_state_dict(state_dict)`` would refuse ``state_dict``.

    The object's own ``validate_state_dict`` hook decides when it has one (see
    ``tardigrade.Stateful``); optimizers get a built-in check that repeats the checks of
    ``torch.optim.Optimizer.load_state_dict``, ``GradScaler`` one for the empty state a
    disabled scaler saves, ``SequentialLR``/``ChainedScheduler`` one of how many schedulers
    they wrap. Tensors in ``state_dict`` are stand-ins: meta tensors (read-only
    zero-stride arrays for numpy) with the checkpoint's shape and dtype.
    """
    live = unwrap(live)
    hook = getattr(live, "validate_state_dict", None)
    if callable(hook):
        hook(state_dict)
    elif isinstance(live, torch.optim.Optimizer):
        _check_optimizer(live, state_dict)
    elif isinstance(live, torch.amp.GradScaler):
        _check_grad_scaler(live, state_dict)
    elif isinstance(live, (lr_scheduler.SequentialLR, lr_scheduler.ChainedScheduler)):
        _check_scheduler_list(live, state_dict)


def _check_scheduler_list(live: Any, sd: Any) -> None:
    # load_state_dict loads the saved states into the live schedulers by position: more saved
    # ones fail half-way (IndexError after the outer state was updated), fewer leave the rest
    # silently unrestored.
    saved = sd.get("_schedulers") if isinstance(sd, Mapping) else None
    if not isinstance(saved, (list, tuple)):
        raise ValueError("the checkpoint's state has no '_schedulers' list")
    if len(saved) != len(live._schedulers):
        names = ", ".join(type(s).__name__ for s in live._schedulers)
        raise ValueError(
            f"the checkpoint holds the states of {len(saved)} scheduler(s), this "
            f"{type(live).__name__} wraps {len(live._schedulers)} ({names}); build it from the "
            "same schedulers"
        )


def _check_grad_scaler(scaler: torch.amp.GradScaler, sd: Any) -> None:
    # A disabled scaler saves {}, which an enabled one's load_state_dict refuses: say so before
    # anything is read, not after the model was overwritten.
    if scaler.is_enabled() and isinstance(sd, Mapping) and not sd:
        raise ValueError(
            "the checkpoint holds the empty state of a disabled GradScaler, this one is enabled; "
            "build it with enabled=False to resume that run, or leave it out with keys=[...]"
        )


def _check_optimizer(opt: torch.optim.Optimizer, sd: Any) -> None:
    if opt._optimizer_load_state_dict_pre_hooks:
        return  # a pre-hook may reshape the state into what load_state_dict checks
    if (
        not isinstance(sd, Mapping)
        or not isinstance(sd.get("state"), Mapping)
        or not isinstance(sd.get("param_groups"), (list, tuple))
    ):
        raise ValueError("an optimizer state needs a 'state' dict and a 'param_groups' list")
    saved, groups = sd["param_groups"], opt.param_groups
    if len(saved) != len(groups):
        raise ValueError(
            f"the checkpoint has {len(saved)} parameter group(s), this optimizer has "
            f"{len(groups)}; build the optimizer with the same parameter groups"
        )
    for i, (s, g) in enumerate(zip(saved, groups, strict=True)):
        params = s.get("params") if isinstance(s, Mapping) else None
        if not isinstance(params, (list, tuple)):
            raise ValueError(f"parameter group {i} of the checkpoint has no 'params' list")
        if len(params) != len(g["params"]):
            raise ValueError(
                f"parameter group {i} holds {len(params)} parameter(s) in the checkpoint and "
                f"{len(g['params'])} in this optimizer; build the optimizer over the same "
                "parameters"
            )
        for p in params:
            try:
                hash(p)  # load_state_dict maps saved parameter ids to live parameters
            except TypeError:
                raise ValueError(
                    f"parameter group {i} of the checkpoint lists a parameter id {p!r} of type "
                    f"{type(p).__name__}"
                ) from None
