"""``tardigrade copy CKPT DEST``: a checkpoint copied with the shared data it references."""

from __future__ import annotations

import argparse
import json

from .. import Checkpoint
from ._command import command
from ._output import human_bytes
from ._storage_options import storage_options

HELP = "copy a checkpoint, with the shared data it references, to another place"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = command(
        sub,
        "copy",
        help=HELP,
        description=(
            "Copy checkpoint CKPT to DEST (a new checkpoint: a path or URL). A checkpoint that "
            "shares data (format 7: objects under .shared/ beside it) is copied with every "
            "object it references: into DEST's directory's own .shared/ (objects there "
            "already are not copied again), or with --standalone into the copy itself, which "
            "then depends on nothing else (move it anywhere). Every byte copied is checked "
            "against the size the manifest records; verify the copy to check every byte."
        ),
        run=run,
        locations=[
            ("src", "CKPT", "the checkpoint to copy (a directory or URL)"),
            ("dest", "DEST", "the new checkpoint (a path or URL; it must not exist)"),
        ],
        json="print what was copied as JSON",
    )
    p.add_argument(
        "--standalone",
        action="store_true",
        help="put the shared data inside the copy (plain data files), sharing nothing",
    )


def run(args: argparse.Namespace) -> int:
    src = Checkpoint.open(args.src, storage_options(args, args.src, args.dest))
    copy = src.copy_to(
        args.dest,
        standalone=args.standalone,
        storage_options=storage_options(args, args.dest, args.src),
    )
    shared = len(src.shared)
    if args.json:
        print(json.dumps({"from": src.url, "to": copy.url, "nbytes": src.nbytes,
                          "shared_objects": shared, "standalone": args.standalone}))  # fmt: skip
        return 0
    where = "inside the copy" if args.standalone else "beside it, in .shared/"
    note = f" ({shared} shared objects {where})" if shared else ""
    print(f"copied {src.url} to {copy.url}: {human_bytes(src.nbytes)}{note}")
    return 0
