"""``tardigrade verify CKPT|DIR``: a full checksum pass over one checkpoint or a whole directory."""

from __future__ import annotations

import argparse
import os
import sys

from .. import VerifyReport, verify
from .._units import gbps
from ..errors import TardigradeError
from ..format.manifest import MANIFEST
from ._listing import COMMITTED, INCOMPLETE_TMP, NO_MANIFEST, UNREADABLE, list_checkpoints
from ._output import human_bytes

HELP = "check every byte of a checkpoint (or of every checkpoint in a directory)"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify",
        help=HELP,
        description=(
            "Read every data file of CKPT and check each tensor against the checksum recorded "
            "when it was written. Given a directory of checkpoints, verify each committed one. "
            "Exits 1 if any check fails."
        ),
    )
    p.add_argument("path", metavar="CKPT|DIR", help="a checkpoint, or a directory of them")
    p.set_defaults(run=run)


def _ok_line(name: str, r: VerifyReport) -> str:
    step = "-" if r.step is None else r.step
    return (
        f"OK      {name}  step {step}: {r.tensors} tensors, {human_bytes(r.nbytes)} in "
        f"{r.files} file(s), {r.throughput_gbps:.2f} GB/s"
    )


def run(args: argparse.Namespace) -> int:
    path = args.path
    is_dir_of_ckpts = os.path.isdir(path) and not os.path.lexists(os.path.join(path, MANIFEST))
    candidates = list_checkpoints(path) if is_dir_of_ckpts else []
    if not is_dir_of_ckpts or not any(c.status in (COMMITTED, UNREADABLE) for c in candidates):
        # One checkpoint (or a directory holding none: verify() explains what is missing).
        report = verify(path)
        print(_ok_line(os.path.basename(os.path.normpath(path)), report))
        return 0

    failed: list[str] = []
    nbytes = 0
    seconds = 0.0
    checked = 0
    for c in candidates:
        if c.status == INCOMPLETE_TMP:
            print(f"skip    {c.name}  (incomplete save: never visible to load)")
            continue
        if c.status == NO_MANIFEST:
            print(f"skip    {c.name}  (no {MANIFEST}: not a committed checkpoint)")
            continue
        checked += 1
        try:
            report = verify(c.path)
        except TardigradeError as e:
            failed.append(c.name)
            print(f"FAILED  {c.name}")
            print(f"tardigrade: error: {e}", file=sys.stderr)
            continue
        nbytes += report.nbytes
        seconds += report.seconds
        print(_ok_line(c.name, report))
    rate = gbps(nbytes, seconds)
    print(
        f"{checked - len(failed)} of {checked} checkpoint(s) OK, {human_bytes(nbytes)} "
        f"verified at {rate:.2f} GB/s"
    )
    if failed:
        print(
            f"tardigrade: error: {len(failed)} checkpoint(s) failed verification: "
            + ", ".join(failed),
            file=sys.stderr,
        )
        return 1
    return 0
