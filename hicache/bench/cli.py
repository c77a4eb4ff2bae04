"""``hicache bench``: arguments and the command's handler.

:func:`add_bench_parser` registers the subcommand on the ``hicache`` parser (its handler is
``args.run``); ``python -m hicache.bench`` (:func:`main`) parses the same arguments with
:func:`parse_args`. The GPU part lives in :mod:`hicache.bench.transfer` and is imported only
when a run needs it, so ``--from-json`` re-renders a saved result (table, plot, auto table)
on any machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hicache.cli.output_path import check_not_input, check_output_path
from hicache.cli.parser import INTERRUPTED, CliParser, UsageError

from . import arg_checks
from .auto import DEFAULT_MAX_SLOWDOWN_PCT, DEFAULT_MIN_SHARE_OF_BEST, auto_table_of_runs
from .plot import have_matplotlib, plot
from .report import render
from .results import BenchResult, load_json, save_json

USAGE_ERROR = 2
FAILED = 1
BACKENDS = ("torch", "kernel", "staged", "direct", "auto")
LAYOUTS = ("layer_first", "page_first", "page_first_direct")
DESCRIPTION = (
    "Measure host<->device KV transfers through the cache controller (backends torch, kernel, "
    "staged, auto) against the copy-engine ceiling: GB/s per direction, both directions at "
    "once, layer-wise load readiness, the slowdown of a concurrent matmul loop; verify every "
    "configuration bit for bit; derive the auto backend's table. Needs a CUDA GPU, except "
    "with --from-json."
)
FULL: dict[str, Any] = {"tokens": 32768, "layers": 32, "repeats": 5, "auto_sizes": [256, 2048]}
QUICK: dict[str, Any] = {"tokens": 2048, "layers": 4, "repeats": 2, "auto_sizes": [256]}


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Every option of the benchmark, on ``parser``."""
    shape = parser.add_argument_group("what moves")
    shape.add_argument("--tokens", type=int, help=f"tokens per transfer ({FULL['tokens']})")
    shape.add_argument("--layers", type=int, help=f"model layers ({FULL['layers']})")
    shape.add_argument("--heads", type=int, default=8, help="KV heads (MHA, bf16)")
    shape.add_argument("--head-dim", type=int, default=128)
    shape.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16])
    shape.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    shape.add_argument("--backends", nargs="+", choices=BACKENDS,
                       help="backends to measure (default: all but direct; all with --slots "
                       "runs)")
    shape.add_argument("--slots", choices=("pages", "runs"), default="pages",
                       help="device slots of writes and loads: random pages (pages, a "
                       "fragmented pool) or one run of consecutive pages each (runs, a fresh "
                       "allocation, where auto picks direct on a layer_first host)")
    run = parser.add_argument_group("how")
    run.add_argument("--repeats", type=int,
                     help=f"timed ops per figure, median ({FULL['repeats']})")
    run.add_argument("--torch-repeats", type=int, default=2,
                     help="timed ops per figure for the slow torch reference")
    run.add_argument("--auto-sizes", type=int, nargs="+",
                     help="smaller op sizes (tokens) measured for the auto table, besides "
                     f"--tokens ({' '.join(map(str, FULL['auto_sizes']))})")
    run.add_argument("--max-slowdown-pct", type=float, default=DEFAULT_MAX_SLOWDOWN_PCT,
                     help="auto table: matmul slowdown (%%) a backend may cause to be chosen")
    run.add_argument("--min-share-of-best", type=float, default=DEFAULT_MIN_SHARE_OF_BEST,
                     help="auto table: a backend within the slowdown bound is chosen only if "
                     "its GB/s reach this share of the fastest (0 disables)")
    run.add_argument("--staging-tokens", type=int, default=1024,
                     help="staged backend: tokens per staging chunk")
    run.add_argument("--programs", type=int, default=16, help="kernel backend: grid bound")
    run.add_argument("--matmul-size", type=int, default=8192, help="N of the NxN matmul loop")
    run.add_argument("--slowdown-windows", type=int, default=3,
                     help="transfer windows per matmul-slowdown figure of a full-size op "
                     "(the median is reported)")
    run.add_argument("--window-ms", type=float, default=20.0,
                     help="small ops are issued back to back to fill this long a window")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--quick", action="store_true",
                     help=f"smoke run: defaults of {QUICK['tokens']} tokens, {QUICK['layers']} "
                     f"layers, {QUICK['repeats']} repeats, auto sizes {QUICK['auto_sizes'][0]}")
    out = parser.add_argument_group("output")
    out.add_argument("--json", type=Path, metavar="PATH",
                     help="write the results as JSON (a measuring run only: refused with "
                     "--from-json, which re-renders a result already saved)")
    out.add_argument("--plot", type=Path, metavar="PNG", help="write a chart (needs matplotlib)")
    out.add_argument("--auto-table", type=Path, metavar="PATH",
                     help="write the auto backend's table (controller/auto_table.json format)")
    out.add_argument("--from-json", type=Path, metavar="PATH", nargs="+",
                     help="no GPU: re-render the table (and --plot, --auto-table) from a saved "
                     "--json result; given several runs, the first is shown and the auto "
                     "table is derived from the median of each figure over all of them "
                     "(with --max-slowdown-pct and --min-share-of-best); no output may name one of "
                     "these files")


def add_bench_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``hicache bench``; its handler is ``args.run`` (returns the exit code)."""
    parser = subparsers.add_parser(
        "bench", help="transfer bandwidth against the ceiling (GPU); 'bench scheduler': the "
        "scheduler thread's costs (CPU); 'bench storage': the shared store; 'bench fleet': "
        "a trace through several instances sharing it; 'bench e2e': time to first token of "
        "a host hit against recompute (GPU); 'bench ranks': the tensor-parallel agreement's "
        "cost a step (CPU)", description=DESCRIPTION)
    add_bench_arguments(parser)
    parser.set_defaults(run=run_bench)
    from . import e2e, fleet_cli, ranks_cli, scheduler_cli, storage_cli

    kinds = parser.add_subparsers(dest="bench_kind",
                                  metavar="scheduler|storage|fleet|e2e|ranks")
    scheduler = kinds.add_parser("scheduler", help=scheduler_cli.DESCRIPTION,
                                 description=scheduler_cli.DESCRIPTION)
    scheduler_cli.add_arguments(scheduler)
    scheduler.set_defaults(run=scheduler_cli.run)
    storage = kinds.add_parser("storage", help=storage_cli.DESCRIPTION,
                               description=storage_cli.DESCRIPTION)
    storage_cli.add_arguments(storage)
    storage.set_defaults(run=storage_cli.run)
    fleet = kinds.add_parser("fleet", help=fleet_cli.DESCRIPTION,
                             description=fleet_cli.DESCRIPTION)
    fleet_cli.add_arguments(fleet)
    fleet.set_defaults(run=fleet_cli.run)
    end_to_end = kinds.add_parser("e2e", help=e2e.cli.DESCRIPTION,
                                  description=e2e.cli.DESCRIPTION)
    e2e.add_arguments(end_to_end)
    end_to_end.set_defaults(run=e2e.run)
    ranks = kinds.add_parser("ranks", help=ranks_cli.DESCRIPTION,
                             description=ranks_cli.DESCRIPTION)
    ranks_cli.add_arguments(ranks)
    ranks.set_defaults(run=ranks_cli.run)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Arguments of ``python -m hicache.bench`` (sizes resolved, see :func:`resolve_sizes`)."""
    parser = CliParser(prog="python -m hicache.bench", description=DESCRIPTION)
    add_bench_arguments(parser)
    args = parser.parse_args(argv)
    resolve_sizes(args)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hicache.bench``: parse ``argv`` (default ``sys.argv[1:]``) and run; Ctrl-C
    ends it with one line and exit code 130, as the ``hicache`` command does."""
    try:
        return run_bench(parse_args(argv))
    except KeyboardInterrupt:
        print("hicache bench: interrupted", file=sys.stderr)
        return INTERRUPTED


def resolve_sizes(args: argparse.Namespace) -> None:
    """Fill the size options left unset: the ``--quick`` values or the full ones. What the
    command line names always wins."""
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if getattr(args, "backends", ()) is None:
        args.backends = [b for b in BACKENDS if b != "direct" or args.slots == "runs"]


def check_args(args: argparse.Namespace) -> str | None:
    """The first problem with ``args``, as a message naming the option and its value, or
    ``None``."""
    try:
        _check_counts(args)
        _check_sizes(args)
        arg_checks.in_range("--window-ms", args.window_ms, 0.0, low_open=True)
        arg_checks.in_range("--max-slowdown-pct", args.max_slowdown_pct, 0.0)
        arg_checks.in_range("--min-share-of-best", args.min_share_of_best, 0.0, 1.0)
    except UsageError as exc:
        return str(exc)
    return None


def _check_counts(args: argparse.Namespace) -> None:
    """Every count and size option is >= 1."""
    for option in ("--repeats", "--torch-repeats", "--tokens", "--layers", "--heads",
                   "--head-dim", "--page-sizes", "--auto-sizes", "--staging-tokens",
                   "--programs", "--matmul-size", "--slowdown-windows"):
        arg_checks.at_least(option, getattr(args, option[2:].replace("-", "_")), 1)


def _check_sizes(args: argparse.Namespace) -> None:
    """The transfer sizes are whole pages of every page size, the auto sizes <= --tokens."""
    largest = max(args.page_sizes)
    for option, size in [("--tokens", args.tokens),
                         *(("--auto-sizes", size) for size in args.auto_sizes)]:
        if any(size % page for page in args.page_sizes) or size % largest:
            raise UsageError(f"{option} {size}: {size} tokens is not a whole number of pages "
                             f"of every page size {args.page_sizes}; use multiples of "
                             f"{largest}")
    if max(args.auto_sizes) > args.tokens:
        raise UsageError(f"--auto-sizes {max(args.auto_sizes)}: must not exceed --tokens "
                         f"({args.tokens})")


def check_outputs(args: argparse.Namespace) -> None:
    """Raise :class:`UsageError` unless every output file can be written (and is none of the
    ``--from-json`` inputs) and ``--plot``'s matplotlib is installed (checked before a run)."""
    if args.from_json is not None and args.json is not None:
        raise UsageError(f"--json {args.json}: a --from-json re-render writes no result file; "
                         f"drop --json (the saved result is already JSON)")
    outputs = [("--plot", args.plot), ("--auto-table", args.auto_table), ("--json", args.json)]
    for option, path in outputs:
        if path is None:
            continue
        for source in args.from_json or ():
            check_not_input(path, option, {"--from-json": source})
        check_output_path(path, option)
    if args.plot is not None and not have_matplotlib():
        raise UsageError("--plot needs matplotlib: pip install 'hicache[plot]'")


def run_bench(args: argparse.Namespace) -> int:
    """Handler of ``hicache bench``: run (or re-render), print, write the outputs."""
    resolve_sizes(args)
    problem = check_args(args)
    if problem is None:
        try:
            check_outputs(args)
        except UsageError as exc:
            problem = str(exc)
    if problem is not None:
        print(f"hicache bench: error: {problem}", file=sys.stderr)
        return USAGE_ERROR
    if args.from_json is not None:
        try:
            result = _saved_runs(args)
        except ValueError as exc:
            print(f"hicache bench: error: {exc}", file=sys.stderr)
            return USAGE_ERROR
        return _publish(result, args, save=False)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s",
                            datefmt="%H:%M:%S")
    from .transfer import run_benchmark
    from .workload import BenchmarkError

    try:
        result = run_benchmark(args)
    except BenchmarkError as exc:
        print(f"hicache bench: error: {exc}", file=sys.stderr)
        return FAILED
    return _publish(result, args, save=True)


def _saved_runs(args: argparse.Namespace) -> BenchResult:
    """The first saved run of ``--from-json``; with several, its auto table is replaced by
    the one derived from all of them (:func:`~hicache.bench.auto.auto_table_of_runs`).
    ``ValueError`` for a file that is no saved result (naming ``--from-json`` and the file)
    or runs that do not go together."""
    results = []
    for path in args.from_json:
        try:
            results.append(load_json(path))
        except ValueError as exc:
            raise ValueError(f"--from-json {exc}") from None
    if len(results) == 1:
        return results[0]
    table = auto_table_of_runs(results, args.max_slowdown_pct, args.min_share_of_best)
    return dataclasses.replace(results[0], auto_table=table)


def _publish(result: BenchResult, args: argparse.Namespace, save: bool) -> int:
    print(render(result))
    if save and args.json is not None:
        save_json(result, args.json)
        print(f"wrote {args.json}")
    if args.auto_table is not None:
        args.auto_table.write_text(json.dumps(result.auto_table, indent=2) + "\n",
                                   encoding="utf-8")
        print(f"wrote {args.auto_table}")
    if args.plot is not None:
        plot(result, args.plot)
        print(f"wrote {args.plot}")
    return 0
