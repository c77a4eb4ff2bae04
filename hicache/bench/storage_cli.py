"""``hicache bench storage`` (also ``python -m hicache.bench.storage_cli``): arguments, the
run over stores and page sizes, the printed table and the JSON file. See
:mod:`hicache.bench.storage` for what each figure times and what it is compared with."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

from hicache.cli.output_path import check_output_path
from hicache.cli.parser import FAILED, USAGE_ERROR, CliParser, UsageError

from . import arg_checks

if TYPE_CHECKING:  # the measuring module imports torch: only a run loads it
    from .storage import Batch, Row

STORES = ("file", "redis", "cluster")
# option naming a running server -> (the store it serves, its URL scheme)
_SERVERS = {"--redis": ("redis", "redis"), "--cluster": ("cluster", "redis+cluster")}
DESCRIPTION = (
    "Measure the shared store (L3) on this machine: put/get GB/s and the latency of an "
    "existence check of 128 pages, for the file store and Redis (a standalone server and a "
    "3-master cluster, started on loopback unless --redis/--cluster name running ones), "
    "beside the raw store in the same run (redis-py + hiredis plain SET/GET on one "
    "connection; sequential and O_DIRECT reads of the same files)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stores", nargs="+", default=list(STORES), choices=STORES)
    parser.add_argument("--page-tokens", type=int, nargs="+", default=[2, 16, 32],
                        help="tokens per page of the 32-layer, 8 x 128 bf16 model: 2, 16, 32 "
                        "give 256 KiB, 2 MiB, 4 MiB pages")
    parser.add_argument("--batch-mib", type=int, default=128,
                        help="bytes moved per timed call (pages = this / page size)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per figure")
    parser.add_argument("--redis", metavar="URL", help="a running server (redis://host:port) "
                        "instead of a local one; its namespace is cleared; checked before the run")
    parser.add_argument("--cluster", metavar="URL", help="a running cluster "
                        "(redis+cluster://host:port,...) instead of a local one; checked "
                        "before the run")
    parser.add_argument("--dir", type=Path, help="file store directory, made if missing "
                        "(default: a temporary one on the system's temp file system)")
    parser.add_argument("--turns", type=int, default=2000,
                        help="a scheduler's turns timed alone and while each store works, "
                        "per host layout (see hicache.bench.storage_turns)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 8 MiB batches, 2 repeats, 200 turns")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the rows here")


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.batch_mib, args.repeats = min(args.batch_mib, 8), min(args.repeats, 2)
        args.turns = min(args.turns, 200)
    try:
        _check(args)
    except UsageError as exc:
        return _error(str(exc), USAGE_ERROR)
    for option, url in (("--redis", args.redis), ("--cluster", args.cluster)):
        if url is not None and _SERVERS[option][0] in args.stores:
            problem = arg_checks.reachable(option, url)
            if problem is not None:
                return _error(problem, FAILED)
    import torch

    from .storage import Batch

    rows: list[Row] = []
    with ExitStack() as stack:
        urls = _urls(args, stack)
        for tokens in args.page_tokens:
            num_pages = max(1, (args.batch_mib << 20) // (tokens * 128 << 10))
            batch = Batch(tokens, num_pages)
            for store in args.stores:
                print(f"  {store}, {batch.page_bytes >> 10} KiB pages x {num_pages} ...",
                      file=sys.stderr, flush=True)
                rows += _measure(store, urls, batch, args, stack)
    print(f"hicache bench storage: {platform.processor() or platform.machine()}, "
          f"{_cpus()} CPUs, torch {torch.__version__}, {args.batch_mib} MiB per call, "
          f"medians of {args.repeats}")
    print(render(rows))
    if args.json is not None:
        args.json.write_text(json.dumps([{**r.__dict__, "ratio": r.ratio} for r in rows],
                                        indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


def _urls(args: argparse.Namespace, stack: ExitStack) -> dict[str, str]:
    from .redis_local import RedisCluster, RedisServer

    urls = {"file": str(args.dir) if args.dir else stack.enter_context(
        tempfile.TemporaryDirectory(prefix="hicache-bench-"))}
    if "redis" in args.stores:
        if args.redis is None:
            home = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            server = RedisServer(home).start()
            stack.callback(server.stop)
            args.redis = f"redis://127.0.0.1:{server.port}"
        urls["redis"] = args.redis
    if "cluster" in args.stores:
        if args.cluster is None:
            home = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            cluster = RedisCluster(home).start()
            stack.callback(cluster.stop)
            args.cluster = cluster.url
        urls["cluster"] = args.cluster
    return urls


def _measure(store_name: str, urls: dict[str, str], batch: Batch, args: argparse.Namespace,
             stack: ExitStack) -> list[Row]:
    from ..storage import FileStore, open_store
    from .storage import Row, file_paths, measure_redis_py, measure_sequential_read, measure_store

    kib, repeats = batch.page_bytes >> 10, args.repeats
    store = open_store(urls[store_name], batch.namespace)
    unchecked = open_store(urls[store_name], batch.namespace, checksum=False)
    with store, unchecked:
        got = measure_store(store_name, store, unchecked, batch, repeats)
        rows = [Row(store_name, kib, "get GB/s, no checksum", got["get_unchecked"], None, ""),
                Row(store_name, kib, "checksum % of get", got["checksum_pct"], None, "")]
        if isinstance(store, FileStore):
            paths = file_paths(store, batch.keys[:batch.num_pages])
            header_len = store.format.header_len
            cached = measure_sequential_read(paths, header_len, batch, repeats, direct=False)
            direct = measure_sequential_read(paths, header_len, batch, repeats, direct=True)
            with FileStore(urls["file"], batch.namespace, direct_io=True) as direct_store, \
                    FileStore(urls["file"], batch.namespace, direct_io=True,
                              checksum=False) as direct_unchecked:
                direct_get = measure_store("file O_DIRECT", direct_store, direct_unchecked,
                                           batch, repeats)
            store.clear()
            turns = _turns("file", str(Path(urls["file"]) / "turns"), batch, args)
            return [
                *rows,
                Row(store_name, kib, "put GB/s", got["put"], None, ""),
                Row(store_name, kib, "get GB/s (page cache)", got["get"], cached,
                    "sequential read of the same files"),
                Row(store_name, kib, "get GB/s (O_DIRECT)", direct_get["get"], direct,
                    "O_DIRECT read of the same files"),
                Row(store_name, kib, "exists of 128, ms", got["exists_ms"], None, ""),
                *turns,
            ]
        store.clear()
    raw = measure_redis_py(_redis_py(urls[store_name]), batch, repeats)
    name = f"redis-py + hiredis{' cluster' if store_name == 'cluster' else ''}"
    return [
        *rows,
        Row(store_name, kib, "put GB/s", got["put"], raw["put"], f"{name} SET, 1 connection"),
        Row(store_name, kib, "get GB/s", got["get"], raw["get"], f"{name} GET, 1 connection"),
        Row(store_name, kib, "exists of 128, ms", got["exists_ms"], raw["exists_ms"],
            f"{name} pipeline of 128 EXISTS"),
        *_turns(store_name, urls[store_name], batch, args),
    ]


def _turns(store_name: str, location: str, batch: Batch, args: argparse.Namespace
           ) -> list[Row]:
    from .storage_turns import LAYOUTS, measure_turns

    return [row for layout in LAYOUTS for row in measure_turns(
        store_name, location, layout, batch.namespace.page_size, batch.num_pages, args.turns)]


def _redis_py(url: str) -> object:
    import redis
    from redis.cluster import ClusterNode, RedisCluster

    if url.startswith("redis+cluster://"):
        nodes = [ClusterNode(h, int(p)) for h, p in
                 (item.rsplit(":", 1) for item in url.split("://", 1)[1].split(","))]
        return RedisCluster(startup_nodes=nodes)
    return redis.Redis.from_url(url)


def render(rows: Sequence[Row]) -> str:
    """One line per figure: the store's value, the raw store's, their ratio (>1: better)."""
    lines = [f"{'store':<8} {'page':>8} {'figure':<30} {'hicache':>9} {'raw':>9} "
             f"{'ratio':>7}  raw store (same run)", "-" * 116]
    for row in sorted(rows, key=lambda r: (r.store != "file", r.store, r.page_kib)):
        page = f"{row.page_kib} KiB" if row.page_kib < 1024 else f"{row.page_kib >> 10} MiB"
        raw = "" if row.reference is None else f"{row.reference:.3f}"
        ratio = "" if row.ratio is None else f"{row.ratio:.2f}x"
        lines.append(f"{row.store:<8} {page:>8} {row.figure:<30} {row.value:>9.3f} {raw:>9} "
                     f"{ratio:>7}  {row.reference_name}")
    lines.append("(ratio: hicache over raw for GB/s, raw over hicache for ms: above 1 is "
                 "better; checksum %: XXH3 of the pages read over the time of the get; turn: a "
                 "scheduler's 0.5 ms wait and 0.1 ms of Python while the store puts and gets "
                 "a host pool of that layout, against the same turn alone)")
    return "\n".join(lines)


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        os.cpu_count() or 1


def _check(args: argparse.Namespace) -> None:
    """:class:`UsageError` naming the option and the value for a bad count, ``--json``,
    ``--dir``, ``--redis`` or ``--cluster``, or a missing redis-server, redis-py or hiredis,
    before any work."""
    arg_checks.at_least("--page-tokens", args.page_tokens, 1)
    arg_checks.at_least("--batch-mib", args.batch_mib, 1)
    arg_checks.at_least("--repeats", args.repeats, 1)
    arg_checks.at_least("--turns", args.turns, 1)
    if args.json is not None:
        check_output_path(args.json, "--json")
    if args.dir is not None:
        arg_checks.directory("--dir", args.dir)
    for option, url in (("--redis", args.redis), ("--cluster", args.cluster)):
        if url is not None:
            arg_checks.store(option, url, schemes=(_SERVERS[option][1],))
    from .redis_local import have_redis

    local_redis = {"redis": args.redis is None, "cluster": args.cluster is None}
    if any(local_redis[s] for s in args.stores if s != "file") and not have_redis():
        raise UsageError("redis-server is not installed: install it (Debian: apt-get install "
                         "redis-server), name running servers with --redis/--cluster, or "
                         "measure --stores file")
    if any(s != "file" for s in args.stores) and not _have_redis_py():
        raise UsageError("--stores redis and cluster are measured beside redis-py with "
                         "hiredis, which are not installed: pip install 'hicache[redis]', or "
                         "measure --stores file")


def _have_redis_py() -> bool:
    """redis-py and its hiredis parser are importable (the Redis reference of the bench)."""
    import importlib.util

    if importlib.util.find_spec("redis") is None or importlib.util.find_spec("hiredis") is None:
        return False
    from redis.utils import HIREDIS_AVAILABLE

    return bool(HIREDIS_AVAILABLE)


def _error(message: str, code: int) -> int:
    print(f"hicache bench storage: error: {message}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    parser = CliParser(prog="hicache bench storage", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
