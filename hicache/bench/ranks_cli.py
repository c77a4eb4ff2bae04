"""``hicache bench ranks``: arguments, the run on spawned ranks, the printed table and the
JSON file. See :mod:`hicache.bench.ranks` for what a run measures."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from hicache.cli.output_path import check_output_path
from hicache.cli.parser import UsageError

DESCRIPTION = (
    "What the tensor-parallel agreement costs a scheduler step (CPU): N spawned ranks in a "
    "gloo group time service.step() alone and as ranks of the group, idle and serving a "
    "request a step, without and with a file store, next to the group's bare collectives "
    "measured in the same run."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=2, help="ranks of the group (>= 2)")
    parser.add_argument("--steps", type=int, default=2000,
                        help="steps (and collectives) timed per case (>= 10)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the rows here")


def run(args: argparse.Namespace) -> int:
    problem = _check(args)
    if problem is not None:
        print(f"hicache bench ranks: error: {problem}", file=sys.stderr)
        return 2
    from .ranks import measure_ranks, render

    with tempfile.TemporaryDirectory(prefix="hicache-bench-ranks-") as workdir:
        rows = measure_ranks(args.ranks, args.steps, Path(workdir))
    print(f"hicache bench ranks: {args.ranks} ranks, {args.steps} steps a case, medians "
          f"and 99th percentiles per rank")
    print(render(rows))
    if args.json is not None:
        args.json.write_text(json.dumps({"ranks": args.ranks, "steps": args.steps,
                                         "rows": [asdict(row) for row in rows]}, indent=1))
    return 0


def _check(args: argparse.Namespace) -> str | None:
    if args.ranks < 2:
        return f"--ranks {args.ranks}: a group needs at least 2 ranks"
    if args.steps < 10:
        return f"--steps {args.steps}: time at least 10 steps a case"
    if args.json is not None:
        try:
            check_output_path(args.json, "--json")
        except UsageError as exc:
            return str(exc)
    return None
