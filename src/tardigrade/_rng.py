"""RNGState: every random number generator a training run draws from, as one stateful leaf."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from ._loader_audit import audit_live_loaders
from ._warn import warn_user


class RNGState:
    """Captures and restores Python ``random``, NumPy's global RNG, torch CPU and every CUDA device.

    Put one in the state tree; saving calls :meth:`state_dict` at save time, and
    ``tg.load(..., into=state)`` calls :meth:`load_state_dict`, after which the next random
    draw equals the one the original run made after the save::

        state = {"model": model, "rng": tg.RNGState()}
        tg.save("ckpt/step-10", state)
        ...
        tg.load("ckpt/step-10", into=state)   # RNGs now continue exactly from step 10
    """

    def state_dict(self) -> dict[str, Any]:
        audit_live_loaders()  # warns of a loader whose data position the state does not hold
        sd: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": np.random.get_state(legacy=True),
            "torch": torch.get_rng_state(),
            "cuda": [],
        }
        if torch.cuda.is_available():
            sd["cuda"] = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        random.setstate(state_dict["python"])
        np.random.set_state(state_dict["numpy"])
        torch.set_rng_state(state_dict["torch"])
        cuda = list(state_dict.get("cuda") or [])
        if cuda:
            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if n != len(cuda):
                warn_user(
                    f"checkpoint holds RNG state for {len(cuda)} CUDA device(s), this process "
                    f"sees {n}; restoring the first {min(n, len(cuda))}. Results may differ "
                    "from the original run."
                )
            for i, s in enumerate(cuda[:n]):
                torch.cuda.set_rng_state(s, i)
