"""CheckpointManager: when to save, what to keep, and resuming from the newest good checkpoint.

It unifies Paddle's ``CheckpointConfig`` (one directory per job, numbered checkpoints, step and
epoch intervals, a maximum kept, automatic restore of the latest), Caffe2's
``CheckpointManager`` (failed saves do not kill the job, per-save timing stats) and CNTK's
"external state" (anything with ``state_dict()`` in the state tree).

``CheckpointManager`` (``_checkpoint_manager``) is a facade over small collaborators, each in
its own module, each given what it needs when the facade wires them (none reaches back into
it): the argument checks (``_options``), the save policies and the cadence in force (``_policy``, pure), the tiers
(``_tiers``: one ``Tier`` protocol; the RAM tier, the run's root and the remote tier are its
instances, asked as an ordered whole), save dispatch (``_dispatch``), the background saves in
flight and the recording of every save's outcome (``_pending``), restore with its candidates
and fallback (``_restore``), the timeline ``restore(step)`` abandons (``_timeline``: rename
aside on POSIX, a record on a store, chosen from the storage's capability), retention
(``_retention``, pure, carried out by ``_retainer``), the agreement between ranks
(``_agreement``: a null one in a single process, so that path never asks whether it runs
alone), pre-flight and the run's lock (``_preflight``), the preemption signals (``_signals``)
and the per-save records (``_stats``).
"""

from ._checkpoint_manager import CheckpointManager
from ._policy import (
    AnyOf,
    Continuous,
    EveryEpochs,
    EverySeconds,
    EverySteps,
    OverheadBudget,
    Policy,
    YoungDaly,
)
from ._stats import ManagerStats, SaveStats

__all__ = [
    "AnyOf",
    "CheckpointManager",
    "Continuous",
    "EveryEpochs",
    "EverySeconds",
    "EverySteps",
    "ManagerStats",
    "OverheadBudget",
    "Policy",
    "SaveStats",
    "YoungDaly",
]
