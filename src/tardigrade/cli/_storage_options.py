"""``--storage-option KEY=VALUE``: options for the storage backend of the URLs a command reads.

The command-line form of the ``storage_options`` every Python entry point takes: an ``s3://``
endpoint, region or credentials (``--storage-option endpoint=http://127.0.0.1:8333``), an fsspec
filesystem's arguments. For ``s3://`` values stay text (the backend converts numbers and
true/false itself, and a key id of digits stays a string); for an fsspec URL a value that
reads as JSON is that value (``anon=true`` is True, ``block_size=5`` is 5), as fsspec reads its
own ``FSSPEC_*`` variables, else text. They go to each URL on the line; a local path takes none.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from ..errors import InvalidArgumentError
from ..storage import secret_option, shown, through_fsspec

_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--storage-option",
        dest="storage_options",
        metavar="KEY=VALUE",
        action="append",
        type=_pair,
        default=[],
        help="an option for the storage backend of a URL (repeatable), e.g. "
        "endpoint=http://127.0.0.1:8333 or access_key_id=... for s3://; the usual environment "
        "variables (AWS_*) fill the rest",
    )


def _pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not _KEY.fullmatch(key):
        # argparse turns this into a usage error (exit 2) naming the option. Text that may
        # hold a secret (a key mistyped with ':' for '=') is described, not echoed.
        got = (
            f"text of {len(text)} characters (not shown: it may hold a secret)"
            if secret_option(text)
            else repr(text)
        )
        raise argparse.ArgumentTypeError(
            f"expected KEY=VALUE (e.g. endpoint=http://127.0.0.1:8333), got {got}"
        )
    return key, value


def _is_url(location: str) -> bool:
    return "://" in location and not location.lower().startswith("file://")


def storage_options(args: argparse.Namespace, location: str, *others: str) -> dict[str, Any] | None:
    """The options ``--storage-option`` gave, for ``location``: None for a local path (the
    command's other locations, ``others``, may be URLs that take them), and an error when
    options were given but no location of the command is a URL."""
    pairs: list[tuple[str, str]] = args.storage_options
    if not pairs:
        return None
    options: dict[str, Any] = {}
    for key, value in pairs:
        if options.get(key, value) != value:
            raise InvalidArgumentError(
                f"--storage-option {key} is given twice, as {shown(key, options[key])} and "
                f"{shown(key, value)}; give it once"
            )
        options[key] = value
    if not any(_is_url(loc) for loc in (location, *others)):
        raise InvalidArgumentError(
            f"--storage-option is for URLs (s3://bucket/prefix, memory://...); "
            f"{', '.join((location, *others))} is a local path, which takes none"
        )
    if not _is_url(location):
        return None
    if through_fsspec(location):
        return {key: _json_or_text(value) for key, value in options.items()}
    return options


def _json_or_text(value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        return value
