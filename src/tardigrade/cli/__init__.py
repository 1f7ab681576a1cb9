"""The ``tardigrade`` command: look into, check and export checkpoints; run the demo.

    tardigrade demo [--ranks N]             kill -9 a training run (or one rank) mid-save, resume, compare
    tardigrade ls DIR                       checkpoints in a directory
    tardigrade inspect CKPT [--json]        what a checkpoint holds (manifest only)
    tardigrade verify CKPT|DIR              full checksum pass
    tardigrade export CKPT OUT.safetensors  tensors as one safetensors file
    tardigrade convert SRC DEST             import a torch.save file, a DCP checkpoint or safetensors
    tardigrade diff A B                     what differs between two checkpoints
    tardigrade copy CKPT DEST               a checkpoint with its shared data (--standalone)
    tardigrade gc DIR                       remove leftovers of interrupted saves

Exit status: 0 success, 1 failure (corrupt checkpoint, missing path, ...), 2 bad usage.
``diff`` follows ``diff(1)``/``cmp(1)``: 0 identical, 1 different, 2 trouble (an error).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from .. import __version__
from ..errors import InvalidArgumentError, TardigradeError
from ._output import error

EXIT_FAILURE = 1
EXIT_USAGE = 2

# Each command's module and one-line help. The help is repeated here (a test keeps it equal to
# the module's HELP) so that `--help` and `--version` import no command module, and a command
# imports only its own: demo, diff and export need torch, which takes a second or more to load.
COMMANDS = {
    "demo": "kill -9 a training run mid-save, resume it, check it is bit-identical",
    "ls": "list the checkpoints in a directory",
    "inspect": "show what a checkpoint holds (reads the manifest only)",
    "verify": "check every byte of a checkpoint (or of every checkpoint in a directory)",
    "diff": "show what differs between two checkpoints",
    "export": "write a checkpoint's tensors (e.g. the model weights) to one .safetensors file",
    "convert": "import a torch.save file, a PyTorch DCP checkpoint or a safetensors folder",
    "copy": "copy a checkpoint, with the shared data it references, to another place",
    "gc": "remove leftovers of interrupted saves from a checkpoint directory",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; with ``command``, only that command's module is imported (the others get
    a placeholder that shows their help line)."""
    parser = argparse.ArgumentParser(
        prog="tardigrade",
        description="Tardigrade: PyTorch training state that survives anything.",
    )
    parser.add_argument("--version", action="version", version=f"tardigrade {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, help_line in COMMANDS.items():
        if command is None or name == command:
            importlib.import_module(f".{name}", __name__).add_parser(sub)
        else:
            sub.add_parser(name, help=help_line)
    return parser


def _command_of(argv: Sequence[str]) -> str:
    """The command named on the line ("" if none: --help, --version or a usage error)."""
    for arg in argv:
        if not arg.startswith("-"):
            return arg if arg in COMMANDS else ""
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_command_of(argv))
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
