"""Hang on purpose, in a parent and a forked child, for test_runs.py.

    python _hang_script.py PIDS [--orphan]

Writes both process ids to PIDS, then each blocks on a pipe nobody writes to; with --orphan the
parent exits at once instead, leaving its child behind (as a SIGKILLed rank leaves its
DataLoader workers under a fork server).
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
        if "--orphan" in sys.argv:
            sys.exit(0)
    wait_forever(r)
