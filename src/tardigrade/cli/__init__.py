"""The ``tardigrade`` command: look into, check and export checkpoints; run the demo.

    tardigrade demo [--ranks N]             kill -9 a training run (or one rank) mid-save, resume, compare
    tardigrade ls DIR                       checkpoints in a directory
    tardigrade inspect CKPT [--json]        what a checkpoint holds (manifest only)
    tardigrade verify CKPT|DIR              full checksum pass
    tardigrade export CKPT OUT.safetensors  tensors as one safetensors file
    tardigrade diff A B                     what differs between two checkpoints
    tardigrade gc DIR                       remove leftovers of interrupted saves

Exit status: 0 success, 1 failure (corrupt checkpoint, missing path, ...), 2 bad usage.
``diff`` follows ``diff(1)``/``cmp(1)``: 0 identical, 1 different, 2 trouble (an error).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from .._version import __version__
from ..errors import InvalidArgumentError, TardigradeError
from . import demo, diff, export, gc, inspect, ls, verify
from ._output import error

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2

COMMANDS = (demo, ls, inspect, verify, diff, export, gc)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tardigrade",
        description="Tardigrade: PyTorch training state that survives anything.",
    )
    parser.add_argument("--version", action="version", version=f"tardigrade {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits on --help, --version and usage errors
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    try:
        return int(args.run(args))
    except InvalidArgumentError as e:
        error(str(e))
        return EXIT_USAGE
    except TardigradeError as e:
        error(str(e))
        return EXIT_FAILURE
    except BrokenPipeError:
        # `tardigrade ls DIR | head`: the reader went away; silence the final flush too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILURE
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        error(f"{where}{e.strerror or e}")
        return EXIT_FAILURE
    except KeyboardInterrupt:
        error("interrupted")
        return 130


__all__ = ["main"]
