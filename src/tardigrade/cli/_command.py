"""What every subcommand's parser shares: its locations, ``--json``, ``--quiet`` and the
``--storage-option`` for whichever of its locations is a URL."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from ._storage_options import add_argument as add_storage_option


def command(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    *,
    help: str,
    description: str,
    run: Callable[[argparse.Namespace], int],
    locations: Sequence[tuple[str, str, str]],
    json: str | None = None,
    quiet: bool = False,
) -> argparse.ArgumentParser:
    """A subcommand ``name``: each of ``locations`` a positional (dest, METAVAR, help), then
    ``--json`` (``json``: what it prints), ``-q/--quiet`` (no progress bar) and
    ``--storage-option``; the caller adds the command's own options to what it returns."""
    p = sub.add_parser(name, help=help, description=description)
    for dest, metavar, what in locations:
        p.add_argument(dest, metavar=metavar, help=what)
    if json is not None:
        p.add_argument("--json", action="store_true", help=json)
    if quiet:
        p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    add_storage_option(p)
    p.set_defaults(run=run)
    return p


# The positional every directory command takes.
RUN_DIRECTORY = ("dir", "DIR", "directory holding checkpoint directories, or its URL")
