"""``hicache bench scheduler`` (also ``python -m hicache.bench.scheduler_cli``): arguments,
the run, the printed tables and the JSON file. See :mod:`hicache.bench.scheduler` for what
each figure times and :mod:`hicache.bench.trace` for the trace replay."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from hicache.cli.output_path import check_output_path
from hicache.cli.parser import CliParser, UsageError

from . import arg_checks
from .trace_file import TraceRequest

if TYPE_CHECKING:  # the measuring modules import torch: only a run loads them
    from .scheduler import Figure
    from .scheduler_requests import RequestsRow
    from .trace import ReplayRow

# Targets of the scheduler-path issue, in microseconds (bytes for the memory row).
TARGETS_US = {
    "match of a 2k-token prompt": 20.0,
    "match of a 32k-token prompt": 300.0,
    "insert of a 2k-token prompt (backup queued)": 50.0,
    "one request's cycle (2k tokens)": 60.0,
    "evict one page": 50.0,
    "evict 10% of the tree": 3000.0,
    # a collection inside a slice stops every thread, lock or not (see background_check_holds)
    "the same, collections inside a hold excluded": 1000.0,
    "Python bytes per cached page": 400.0,
    "allocate + free 1 page, 1M-token pool": 5.0,
    "the same, pool fragmented": 5.0,
    "controller op, 1 page(s), copy excluded": 20.0,
    "controller op, 256 page(s), copy excluded": 30.0,
    "poll() per acknowledged op": 5.0,
}
DESCRIPTION = (
    "Time what hicache costs the engine's scheduler thread, on a CPU: matches, a request's "
    "cycle, eviction, integrity checks, allocation, controller bookkeeping, polls, the "
    "background thread's effect on call latency; optionally replay a request trace."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=int, nargs="+", default=None,
                        help="tree sizes in cached tokens (default: 10000 100000 1000000)")
    parser.add_argument("--repeats", type=int, default=200, help="calls per figure")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace", type=Path, metavar="JSONL",
                        help="a Mooncake trace (e.g. ../shared/data/"
                        "mooncake_conversation_trace.jsonl) to replay")
    parser.add_argument("--trace-requests", type=int, default=1000,
                        help="requests of the trace to replay")
    parser.add_argument("--capacities", nargs="+", default=["5000:5000", "5000:20000",
                                                            "20000:20000"],
                        help="DEVICE:HOST capacities of the replay, in 512-token blocks "
                        "(both >= 1; the device must hold the trace's longest request)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: sizes 10000 and 100000, 30 repeats (what the "
                        "command line names wins)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the figures here")


def run(args: argparse.Namespace) -> int:
    if args.sizes is None:
        args.sizes = [10_000, 100_000] if args.quick else [10_000, 100_000, 1_000_000]
    if args.quick:
        args.repeats = min(args.repeats, 30)
    try:
        capacities, requests = _check(args)
    except UsageError as exc:
        print(f"hicache bench scheduler: error: {exc}", file=sys.stderr)
        return 2
    import torch

    from .scheduler import few_calls
    from .scheduler_requests import render_requests
    from .trace import replay

    figures, end_to_end = _measure(args)
    print(f"hicache bench scheduler: {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, page size 16, medians of {args.repeats} calls "
          f"({few_calls(args.repeats, 3)} for the 32k match, {few_calls(args.repeats, 5)} "
          f"for 2048 pages)")
    print(render(figures, args.sizes))
    print(render_requests(end_to_end))
    rows: list[ReplayRow] = []
    if args.trace is not None:
        rows = [replay(requests, d, h, page_size=16) for d, h in capacities]
        print(render_replay(rows, args.trace.name))
    if args.json is not None:
        args.json.write_text(json.dumps({
            "figures": [{"name": f.name, "target": f.target_us, "by_size": f.by_size}
                        for f in figures],
            "requests": [{**r.__dict__, "requests_per_s": r.requests_per_s}
                         for r in end_to_end],
            "replay": [r.__dict__ for r in rows]}, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


def _check(args: argparse.Namespace) -> tuple[list[tuple[int, int]], list[TraceRequest]]:
    """The replay's capacities and the trace's requests (none without ``--trace``), read and
    validated, and the --json file writable, before anything is measured; otherwise
    :class:`UsageError` naming the option and the value."""
    arg_checks.at_least("--sizes", args.sizes, 1_000)
    _check_fits(max(args.sizes))
    arg_checks.at_least("--repeats", args.repeats, 1)
    arg_checks.at_least("--trace-requests", args.trace_requests, 1)
    capacities = arg_checks.capacities("--capacities", args.capacities,
                                       host_at_least_device=False)
    requests: list[TraceRequest] = []
    if args.trace is not None:
        requests = arg_checks.trace("--trace", args.trace, args.trace_requests)
        arg_checks.fits("--capacities", capacities, requests)
    if args.json is not None:
        check_output_path(args.json, "--json")
    return capacities, requests


def _check_fits(size: int) -> None:
    """:class:`UsageError` naming ``--sizes`` when the pools of a tree of ``size`` tokens
    (as :func:`~hicache.bench.scheduler.measure_tree` sizes them) do not fit in this
    machine's RAM: refused before the first size is measured, not after."""
    from hicache.config import ConfigError, config_from_dict

    from .scheduler import capacity_for, service_config
    try:
        config_from_dict(service_config(capacity_for(size)))
    except ConfigError as exc:
        raise UsageError(f"--sizes {size}: the pools of a tree that size do not fit in this "
                         f"machine's RAM ({exc}); give smaller sizes") from None


def _measure(args: argparse.Namespace) -> tuple[list[Figure], list[RequestsRow]]:
    """Every figure, and the end-to-end row of each tree size (measured right after that
    size's figures, in the same process state; ``5 * repeats`` requests, so a collection
    of the garbage collector or a stray wake-up weighs as it does in a sustained run, not
    in one short window)."""
    from .scheduler import Figure, measure_tree
    from .scheduler_ops import measure_allocator, measure_controller
    from .scheduler_requests import BATCH, measure_requests
    from .scheduler_thread import measure_thread_latency

    figures: dict[str, Figure] = {}
    end_to_end: list[RequestsRow] = []

    def add(size: int, values: dict[str, list[float]]) -> None:
        for name, timings in values.items():
            figure = figures.setdefault(name, Figure(name, TARGETS_US.get(name)))
            figure.by_size[size] = timings

    for size in args.sizes:
        print(f"  tree of {size} tokens ...", file=sys.stderr, flush=True)
        add(size, measure_tree(size, args.repeats, args.seed))
        end_to_end.append(measure_requests(size, 5 * args.repeats, args.seed))
        end_to_end.append(measure_requests(size, 5 * args.repeats, args.seed, BATCH))
    largest = max(args.sizes)
    add(largest, measure_thread_latency(largest, 10 * args.repeats, args.seed))
    add(0, measure_allocator(args.repeats))
    add(0, measure_controller(args.repeats))
    return list(figures.values()), end_to_end


def render(figures: list[Figure], sizes: Sequence[int]) -> str:
    """One row per figure and tree size: min / median / max, target, slope."""
    width = max([42, *(len(figure.name) for figure in figures)])
    lines = [f"{'figure':<{width}} {'tree':>9} {'min':>10} {'median':>10} {'max':>10} "
             f"{'target':>8} {'slope':>6}", "-" * (width + 59)]
    for figure in figures:
        slope = figure.slope()
        for size in sorted(figure.by_size):
            low, mid, high = figure.summary(size)
            target = "-" if figure.target_us is None else f"{figure.target_us:g}"
            tree = "-" if size == 0 else str(size)
            lines.append(f"{figure.name:<{width}} {tree:>9} {low:>10.1f} {mid:>10.1f} "
                         f"{high:>10.1f} {target:>8} "
                         f"{'' if slope is None else f'{slope:.2f}':>6}")
    lines.append("(microseconds, except bytes per cached page; slope: log-log of the median "
                 "against the tree size)")
    return "\n".join(lines)


def render_replay(rows: list[ReplayRow], name: str) -> str:
    lines = [f"replay of {name}: {rows[0].requests} requests of "
             f"{rows[0].input_tokens / max(1, rows[0].requests):.0f} tokens on average "
             f"(req/s: the service's calls only, each request's token list made before its "
             f"clock starts)" if rows else "no replay",
             f"{'device:host blocks':>18} {'hit rate':>9} {'device':>8} {'host':>8} "
             f"{'req/s':>8} {'LRU blocks':>10} {'LRU hit':>8}"]
    for row in rows:
        lines.append(
            f"{row.device_blocks:>8}:{row.host_blocks:<9} {row.hit_rate:>9.1%} "
            f"{row.device_hit_tokens / max(1, row.input_tokens):>8.1%} "
            f"{row.host_hit_tokens / max(1, row.input_tokens):>8.1%} "
            f"{row.requests_per_s:>8.1f} {row.lru_blocks:>10} {row.lru_hit_rate:>8.1%}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = CliParser(prog="hicache bench scheduler", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
