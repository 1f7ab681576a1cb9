"""``tardigrade verify CKPT|DIR``: a full checksum pass over one checkpoint or a whole directory."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from .. import Checkpoint, VerifyReport, verify
from ..errors import TardigradeError
from ..format.manifest import MANIFEST
from ._command import command
from ._listing import (
    COMMITTED,
    INCOMPLETE_TMP,
    NO_MANIFEST,
    UNREADABLE,
    is_directory_of_checkpoints,
    list_checkpoints,
)
from ._output import ReadProgress, human_bytes
from ._storage_options import storage_options

HELP = "check every byte of a checkpoint (or of every checkpoint in a directory)"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    command(
        sub,
        "verify",
        help=HELP,
        description=(
            "Read every data file of CKPT and check each tensor against the checksum recorded "
            "when it was written. Given a directory of checkpoints, verify each committed one. "
            "Exits 1 if any check fails."
        ),
        run=run,
        locations=[("path", "CKPT|DIR", "a checkpoint, or a directory of them (or a URL)")],
        json="print the result as JSON",
        quiet=True,
    )


def _ok_line(name: str, r: VerifyReport) -> str:
    step = "-" if r.step is None else r.step
    return (
        f"OK      {name}  step {step}: {r.tensors} tensors, {human_bytes(r.nbytes)} in "
        f"{r.files} file(s), {r.throughput_gbps:.2f} GB/s"
    )


def _data_bytes(path: str, options: Mapping[str, Any] | None) -> int:
    try:
        return Checkpoint.open(path, options).nbytes
    except TardigradeError:
        return 0  # verify() says what is wrong


def _verify(path: str, args: argparse.Namespace, label: str) -> VerifyReport:
    # The bar (stderr, a terminal only) follows the bytes this process reads.
    show = not args.quiet and not args.json
    options = storage_options(args, path)
    with ReadProgress(_data_bytes(path, options) if show else 0, f"verify {label}", enabled=show):
        return verify(path, storage_options=options)


def _report_json(name: str, r: VerifyReport | None, error: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"name": name, "ok": r is not None}
    if r is not None:
        out.update(asdict(r), gbps=round(r.throughput_gbps, 3))
    if error is not None:
        out["error"] = error
    return out


def run(args: argparse.Namespace) -> int:
    path = args.path
    options = storage_options(args, path)
    is_dir_of_ckpts = is_directory_of_checkpoints(path, options)
    candidates = list_checkpoints(path, options) if is_dir_of_ckpts else []
    if not is_dir_of_ckpts or not any(c.status in (COMMITTED, UNREADABLE) for c in candidates):
        # One checkpoint (or a directory holding none: verify() explains what is missing).
        name = os.path.basename(os.path.normpath(path))
        if args.json:
            try:
                report = _verify(path, args, name)
            except TardigradeError as e:
                print(json.dumps(_report_json(name, None, str(e)), indent=2))
                return 1
            print(json.dumps(_report_json(name, report), indent=2))
            return 0
        report = _verify(path, args, name)
        print(_ok_line(name, report))
        return 0

    failed: list[str] = []
    results: list[dict[str, Any]] = []
    passed: list[VerifyReport] = []
    checked = 0
    say = (lambda line: None) if args.json else print
    for c in candidates:
        if c.status == INCOMPLETE_TMP:
            say(f"skip    {c.name}  (incomplete save: never visible to load)")
            results.append({"name": c.name, "ok": None, "skipped": c.status})
            continue
        if c.status == NO_MANIFEST:
            say(f"skip    {c.name}  (no {MANIFEST}: not a committed checkpoint)")
            results.append({"name": c.name, "ok": None, "skipped": c.status})
            continue
        checked += 1
        try:
            report = _verify(c.path, args, c.name)
        except TardigradeError as e:
            failed.append(c.name)
            results.append(_report_json(c.name, None, str(e)))
            say(f"FAILED  {c.name}")
            if not args.json:
                print(f"tardigrade: error: {e}", file=sys.stderr)
            continue
        passed.append(report)
        results.append(_report_json(c.name, report))
        say(_ok_line(c.name, report))
    total = VerifyReport.total(path, passed)
    nbytes, rate = total.nbytes, total.throughput_gbps
    if args.json:
        summary = {"checked": checked, "failed": failed, "nbytes": nbytes, "gbps": round(rate, 3)}
        print(json.dumps({"checkpoints": results, **summary}, indent=2))
        return 1 if failed else 0
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
