"""Imported last by the fork server of ``fresh.py``: freezes what its preloaded imports made.

Every child forked from the server then starts with torch's and the tools' objects out of the
collector's reach, so its ``settle()`` collects only what the child allocated (a full scan of
those ~250k objects costs 0.3-0.5 s and writes to every page holding them), as
``measure.freeze_imports`` does in the other processes.
"""

from .measure import freeze_imports

freeze_imports()
