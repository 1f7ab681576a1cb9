"""``tardigrade ls DIR``: the checkpoints in a directory, oldest step first."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from ._command import RUN_DIRECTORY, command
from ._listing import INCOMPLETE_TMP, list_checkpoints
from ._output import human_bytes, table
from ._storage_options import storage_options

HELP = "list the checkpoints in a directory"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    command(
        sub,
        "ls",
        help=HELP,
        description=(
            "List the checkpoints in DIR with their step, epoch, size, creation time and status: "
            "'committed' (complete, loadable), 'incomplete-tmp' (a save in flight or killed; "
            "never visible to load), 'no-manifest' or 'unreadable'. Reads manifests only."
        ),
        run=run,
        locations=[RUN_DIRECTORY],
        json="print a JSON list instead of a table",
    )


def _dash(v: object) -> str:
    return "-" if v is None else str(v)


def run(args: argparse.Namespace) -> int:
    entries = list_checkpoints(args.dir, storage_options(args, args.dir))
    if args.json:
        print(json.dumps([asdict(e) for e in entries], indent=2))
        return 0
    if not entries:
        print(f"no checkpoints in {args.dir}")
        return 0
    sharing = any(e.shared for e in entries)
    rows = [
        [e.name, _dash(e.step), _dash(e.epoch), human_bytes(e.logical_bytes)]
        + ([human_bytes(e.unique_bytes)] if sharing else [])
        + [_dash(e.created), e.status]
        for e in entries
    ]
    columns = ["NAME", "STEP", "EPOCH", "SIZE"] + (["UNIQUE"] if sharing else [])
    print(table(rows, [*columns, "CREATED", "STATUS"]))
    committed = sum(e.status == "committed" for e in entries)
    tmp = sum(e.status == INCOMPLETE_TMP for e in entries)
    note = f"{committed} committed"
    if tmp:
        note += f", {tmp} incomplete (.tmp-*: a save that is running or was interrupted)"
    print(note)
    if sharing:
        objects = {o: n for e in entries for o, n in e.shared}
        print(
            f"shared data: {len(objects)} objects, {human_bytes(sum(objects.values()))} in "
            ".shared/ (SIZE: what a load reads; UNIQUE: what deleting that checkpoint alone "
            "frees)"
        )
    for e in entries:
        if e.error:
            print(f"{e.name}: {e.error}")
    return 0
