"""Hang on purpose, in a parent and a forked child, for test_runs.py.

    python _hang_script.py PIDS

Writes both process ids to PIDS, then each blocks on a pipe nobody writes to.
"""

import os
import sys


def wait_forever(r: int) -> None:
    os.read(r, 1)


if __name__ == "__main__":
    r, _w = os.pipe()
    child = os.fork()
    if child:
        with open(sys.argv[1], "w") as f:
            f.write(f"{os.getpid()} {child}\n")
    wait_forever(r)
