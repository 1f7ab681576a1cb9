"""Imported at start-up by every Python process of a script run by ``_runs.run`` (this folder is
on its PYTHONPATH): torchrun, the ranks, and through fork their DataLoader workers.

SIGUSR1 prints every thread's Python stack to stderr, so a run that outlives its timeout can
show where each process is stuck. A forked child inherits the handler even when it hangs
before running any Python of its own (inside ``os.fork()`` itself).
"""

import faulthandler
import importlib.machinery
import importlib.util
import os
import signal
import sys

faulthandler.register(signal.SIGUSR1, all_threads=True)

# Run the environment's own sitecustomize too, as it would have without this folder.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize")
if _spec is not None and _spec.loader is not None:
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
