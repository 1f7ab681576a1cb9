"""``tardigrade gc DIR``: clean up what dead writers left in a checkpoint directory.

It takes the directory's lock first, exactly as a ``CheckpointManager`` would, so it refuses to
touch a directory a live job is writing into (whose ``.tmp-*`` directories may be saves in
flight). Committed checkpoints are never touched.
"""

from __future__ import annotations

import argparse
import json

from .. import Catalog
from ..errors import CheckpointNotFoundError
from ..storage.base import Tidied
from ._command import RUN_DIRECTORY, command
from ._output import ProgressBar, human_bytes
from ._storage_options import storage_options

HELP = "remove leftovers of interrupted saves from a checkpoint directory"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = command(
        sub,
        "gc",
        help=HELP,
        description=(
            "Remove the .tmp-* directories that interrupted saves and deletes left in DIR, and "
            "put back a checkpoint that a crashed replace had moved aside. Refuses (exit 1) "
            "while a live job holds the directory's lock. Committed checkpoints are never "
            "touched. On an object store (s3://, an fsspec URL) a save's data objects that no "
            "committed manifest references go once older than the grace period "
            "(--storage-option gc_grace_seconds=N, default 3600): a younger one may be a live "
            "save's."
        ),
        run=run,
        locations=[RUN_DIRECTORY],
        json="print what was done as JSON",
        quiet=True,
    )
    p.add_argument("-n", "--dry-run", action="store_true", help="only print what would be done")


def run(args: argparse.Namespace) -> int:
    catalog = Catalog(args.dir, storage_options(args, args.dir))
    here = catalog.storage.stat("")
    if here is None or not here.is_dir:
        what = "is not a directory" if here is not None else "does not exist"
        raise CheckpointNotFoundError(f"{args.dir}: {what}; pass a checkpoint directory")
    lock = catalog.lease()
    try:
        # CheckpointLockedError names the live owner. A full disk does not stop us: the lock is
        # held without its record, and removing leftovers is what frees the space.
        lock.acquire()
        lock.check()  # fencing: still ours right before anything is removed
        bar = ProgressBar(0, f"gc {args.dir}")
        if bar.enabled and not (args.json or args.quiet or args.dry_run):
            # On a terminal: count the leftovers first (a listing), then a bar of their removal.
            bar.total = max(1, len(catalog.tidy(dry_run=True)))
            freed = 0

            def progress(t: Tidied) -> None:
                nonlocal freed
                freed += t.nbytes
                bar.update(bar.n + 1, f"{human_bytes(freed)} freed")

            done = catalog.tidy(progress=progress)
            bar.close()
        else:
            done = catalog.tidy(dry_run=args.dry_run)
    finally:
        lock.release()  # never raises; the lock is free however tidy ended
    freed = sum(t.nbytes for t in done if t.action == "removed")
    if args.json:
        items = [{"action": t.action, "name": t.name, "nbytes": t.nbytes} for t in done]
        print(json.dumps({"dry_run": args.dry_run, "leftovers": items, "freed": freed}, indent=2))
        return 0
    verb = {"removed": "would remove", "recovered": "would recover"} if args.dry_run else {}
    for t in done:
        print(f"{verb.get(t.action, t.action):<13} {t.name}  ({human_bytes(t.nbytes)})")
    if not done:
        print(f"nothing to clean in {args.dir}")
    else:
        what = "would free" if args.dry_run else "freed"
        print(f"{len(done)} leftover(s); {what} {human_bytes(freed)}")
    return 0
