"""CheckpointManager: when to save, what to keep, and resuming from the newest good checkpoint.

It unifies Paddle's ``CheckpointConfig`` (one directory per job, numbered checkpoints, step and
epoch intervals, a maximum kept, automatic restore of the latest), Caffe2's
``CheckpointManager`` (failed saves do not kill the job, per-save timing stats) and CNTK's
"external state" (anything with ``state_dict()`` in the state tree).

``CheckpointManager`` is a facade over small collaborators, each in its own module: the
argument checks (``_options``), the save policy (``_policy``, pure), retention
(``_retention``, pure), the saves in flight and their outcomes (``_pending``), the agreement
between ranks (``_ranks``; a null one in a single process), the preemption signals
(``_signals``) and the per-save records (``_stats``).
"""

from ._checkpoint_manager import CheckpointManager
from ._stats import ManagerStats, SaveStats

__all__ = ["CheckpointManager", "ManagerStats", "SaveStats"]
