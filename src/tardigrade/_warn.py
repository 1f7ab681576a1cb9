"""``warn_user``: a warning that points at the user's line, wherever inside Tardigrade it is
raised (a fixed ``stacklevel`` points into Tardigrade when the call path changes: a save of a
manager, a framework callback, ``RNGState.state_dict`` reached from ``flatten``)."""

from __future__ import annotations

import os
import sys
import warnings
from types import FrameType

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def user_stacklevel() -> int:
    """The ``stacklevel`` of the innermost frame outside this package, for a
    ``warnings.warn`` made in the function that called this one."""
    level = 1
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame = frame.f_back
        level += 1
    return level


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message)``, attributed to the first caller outside Tardigrade."""
    warnings.warn(message, category, stacklevel=user_stacklevel())
