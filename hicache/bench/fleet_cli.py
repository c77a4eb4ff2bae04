"""``hicache bench fleet`` (also ``python -m hicache.bench.fleet_cli``): arguments, the runs
(each fleet size with a shared store and without one), the printed table and the JSON file.
See :mod:`hicache.bench.fleet` for what a run does and checks."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from hicache.cli.output_path import check_output_path
from hicache.cli.parser import CliParser, UsageError

from . import arg_checks
from .trace_file import TraceRequest

if TYPE_CHECKING:  # the replay imports torch: only a run loads it
    from .fleet import FleetRow

POLICIES = ("wait_complete", "timeout", "best_effort")
DESCRIPTION = (
    "Replay a Mooncake trace through N service instances in one process (CPU pools), "
    "requests routed round-robin, with one shared store (L3) and with L1+L2 only: the hit "
    "rate per tier next to the trace's ideal (a block LRU of unlimited capacity over the "
    "same requests, computed in the same run), requests/s and the store's bytes; rows "
    "reused from any tier are checked bit for bit."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path, metavar="JSONL", required=True,
                        help="a Mooncake trace (e.g. ../shared/data/"
                        "mooncake_conversation_trace.jsonl)")
    parser.add_argument("--trace-requests", type=int, default=2000,
                        help="requests of the trace to replay (from its start)")
    parser.add_argument("--instances", type=int, nargs="+", default=[2, 4],
                        help="fleet sizes; each is run with the store and without it")
    parser.add_argument("--capacities", nargs="+", default=["2000:8000"],
                        help="DEVICE:HOST capacities of each instance, in 512-token blocks "
                        "(host >= device; the device must hold the trace's longest request)")
    parser.add_argument("--storage", default="file",
                        help="the shared store: 'file' (a temporary directory), a directory, "
                        "'redis' (a redis-server started on loopback) or redis://host:port "
                        "(its pages of this run are removed at the end); checked before the run")
    parser.add_argument("--prefetch-policy", choices=POLICIES, default="wait_complete")
    parser.add_argument("--verify-every", type=int, default=1,
                        help="check the reused rows of every n-th request (0: none)")
    parser.add_argument("--no-settle", action="store_true",
                        help="do not wait for a request's backups before the next request "
                        "(the replay has no gaps between requests; the trace has seconds)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the rows here")


def run(args: argparse.Namespace) -> int:
    try:
        checked = _check(args)
    except UsageError as exc:
        print(f"hicache bench fleet: error: {exc}", file=sys.stderr)
        return 2
    if checked.storage.startswith("redis") and checked.storage != "redis":
        problem = arg_checks.reachable("--storage", checked.storage)
        if problem is not None:
            print(f"hicache bench fleet: error: {problem}", file=sys.stderr)
            return 1
    import torch

    from .fleet import FleetError

    # The copies are of a few MiB; torch's intra-op threads would only contend with the
    # store's worker threads (on 2 cores they made the replay 2-4x slower).
    torch.set_num_threads(1)
    try:
        rows = _replay_all(args, checked)
    except FleetError as exc:
        print(f"hicache bench fleet: FAILED: {exc}", file=sys.stderr)
        return 1
    print(f"hicache bench fleet: {args.trace.name}, {len(checked.requests)} requests "
          f"round-robin, 512-token pages, prefetch {args.prefetch_policy}"
          f"{', no settle' if args.no_settle else ''}")
    print(render(rows))
    if args.json is not None:
        args.json.write_text(json.dumps([as_dict(r) for r in rows], indent=1) + "\n",
                             encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


def _replay_all(args: argparse.Namespace, checked: Checked) -> list[FleetRow]:
    """One row per capacity, fleet size and store (the shared one, then none)."""
    from .fleet import FleetRow, replay_fleet
    from .trace import lru_hit_rate

    ideal = lru_hit_rate(checked.requests, 1 << 62)
    rows: list[FleetRow] = []
    with _store_location(checked.storage) as location:
        kind = "redis" if location.startswith("redis") else "file"
        for device_blocks, host_blocks in checked.capacities:
            for instances in args.instances:
                for store in (kind, "none"):
                    print(f"  {instances} instances, {device_blocks}:{host_blocks} blocks, "
                          f"store {store} ...", file=sys.stderr, flush=True)
                    row = FleetRow(instances, store, device_blocks, host_blocks,
                                   ideal_hit_rate=ideal)
                    with _run_location(location, store) as where:
                        replay_fleet(checked.requests, row, where,
                                     prefetch_policy=args.prefetch_policy,
                                     verify_every=args.verify_every,
                                     settle_backups=not args.no_settle,
                                     model_revision=uuid.uuid4().hex,
                                     clear_store=kind == "redis")
                    rows.append(row)
    return rows


class Checked(NamedTuple):
    """The validated inputs of a run."""

    capacities: list[tuple[int, int]]
    requests: list[TraceRequest]
    storage: str
    """``file``, ``redis``, a Redis URL or an absolute directory (``file://`` URLs too)."""


def _check(args: argparse.Namespace) -> Checked:
    """The inputs; :class:`UsageError` naming the option and the value for a bad number, a
    bad ``--storage``, a trace that is unreadable, empty or malformed, or an unwritable
    ``--json``, before anything runs or is made."""
    arg_checks.at_least("--trace-requests", args.trace_requests, 1)
    arg_checks.at_least("--instances", args.instances, 1)
    arg_checks.at_least("--verify-every", args.verify_every, 0)
    capacities = arg_checks.capacities("--capacities", args.capacities,
                                       host_at_least_device=True)
    storage = _check_storage(args.storage)
    requests = arg_checks.trace("--trace", args.trace, args.trace_requests)
    arg_checks.fits("--capacities", capacities, requests)
    if args.json is not None:
        check_output_path(args.json, "--json")
    return Checked(capacities, requests, storage)


def _check_storage(storage: str) -> str:
    """``--storage`` as :func:`_store_location` takes it; :class:`UsageError` if it is
    none of the forms its help names."""
    if storage == "file":
        return storage
    if storage == "redis":
        from .redis_local import have_redis

        if not have_redis():
            raise UsageError("--storage redis: redis-server is not installed: install it "
                             "(Debian: apt-get install redis-server), or name a running server "
                             "with --storage redis://host:port, or use --storage file")
        return storage
    location = arg_checks.store("--storage", storage,
                                schemes=("file", "redis", "redis+cluster"))
    # absolute, so that a directory named like "redis-pages" is never taken for a URL
    return storage if location.path is None else str(Path(location.path).absolute())


@contextmanager
def _store_location(storage: str) -> Iterator[str]:
    """Where the store lives for the whole command: a directory or a Redis URL."""
    with ExitStack() as stack:
        if storage == "file":
            yield stack.enter_context(tempfile.TemporaryDirectory(prefix="hicache-fleet-"))
        elif storage == "redis":
            from .redis_local import RedisServer

            home = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            server = RedisServer(home).start()
            stack.callback(server.stop)
            yield f"redis://127.0.0.1:{server.port}"
        else:
            yield storage


@contextmanager
def _run_location(location: str, store: str) -> Iterator[str | None]:
    """One run's store: ``None`` without one, a fresh directory under a file store's, or
    the Redis URL (each run has its own namespace)."""
    if store == "none":
        yield None
    elif store == "redis":
        yield location
    else:
        Path(location).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="run-", dir=location) as where:
            yield where


def as_dict(row: FleetRow) -> dict[str, object]:
    return {**row.__dict__, "hit_rate": row.hit_rate, "share_of_ideal": row.share_of_ideal,
            "requests_per_s": row.requests_per_s}


def render(rows: Sequence[FleetRow]) -> str:
    """One line per run: hit rates by tier (shares of every input token), the share of the
    ideal, speed, the store's bytes, what was verified."""
    header = (f"{'instances':>9} {'store':>5} {'device:host':>11} {'hit rate':>8} "
              f"{'device':>7} {'host':>7} {'L3':>7} {'ideal':>7} {'of ideal':>8} {'req/s':>6} "
              f"{'L3 MiB w':>8} {'L3 MiB r':>8} {'verified':>8}")
    lines = [header, "-" * len(header)]
    for r in rows:
        share = [t / max(1, r.input_tokens)
                 for t in (r.device_hit_tokens, r.host_hit_tokens, r.l3_hit_tokens)]
        lines.append(
            f"{r.instances:>9} {r.storage:>5} {f'{r.device_blocks}:{r.host_blocks}':>11} "
            f"{r.hit_rate:>8.1%} {share[0]:>7.1%} {share[1]:>7.1%} {share[2]:>7.1%} "
            f"{r.ideal_hit_rate:>7.1%} {r.share_of_ideal:>8.1%} {r.requests_per_s:>6.1f} "
            f"{r.l3_bytes_written / 2**20:>8.1f} {r.l3_bytes_read / 2**20:>8.1f} "
            f"{r.verified_requests:>8}")
    lines.append("(device:host: each instance's capacity in 512-token blocks; hit rates: "
                 "tokens reused from each tier over all input tokens; ideal: a block LRU of "
                 "unlimited capacity over the same requests; verified: requests whose reused "
                 "rows were checked bit for bit)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = CliParser(prog="hicache bench fleet", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
