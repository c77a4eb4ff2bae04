"""One case of the transfer benchmark: a backend at one page size and host layout, verified
bit for bit, then timed into :class:`~hicache.bench.results.Measurement` records (writes,
loads, both ways at once, and for ``kernel`` and ``staged`` the smaller sizes the ``auto``
table is chosen from). :mod:`hicache.bench.transfer` runs the cases of a run.
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
from dataclasses import dataclass

from hicache.controller import TransferBackend
from hicache.pools import DeviceKVPool, HostKVPool

from .both_ways import BothWays, both_ways
from .engine_copy import EngineCopy
from .results import BOTH, LOAD, WRITE, Ceiling, Measurement
from .timing import MatmulLoop, OpTimes, batch_window, median_slowdown, run_batches
from .verify import Verifier
from .workload import BenchmarkError, Session, Shape, Slots

logger = logging.getLogger(__name__)
SIZE_BACKENDS = ("kernel", "staged", "direct")  # measured at the auto table's smaller sizes
WARMUP_OPS = 2  # untimed full-size ops of each direction before a case's timed ones
PROBE_OPS = 2  # untimed ops of each smaller size that set how many make a timed batch


@dataclass
class Context:
    """What every session of one run shares."""

    args: argparse.Namespace
    shape: Shape
    ceiling: Ceiling
    loop: MatmulLoop
    device_pool: DeviceKVPool
    engine: EngineCopy


def bench_backend(ctx: Context, name: str, backend: TransferBackend, host_pool: HostKVPool,
                  slots: Slots, verifier: Verifier) -> list[Measurement]:
    """Verify, then time one backend at one page size and layout."""
    args, shape = ctx.args, ctx.shape
    label = (name, slots.page_size, host_pool.layout.value)
    session = Session(ctx.device_pool, host_pool, slots, backend)
    what = f"{name} (page size {slots.page_size}, layout {label[2]})"
    verifier.check_write(session, what)
    verifier.check_load(session, what)
    repeats = args.torch_repeats if name == "torch" else args.repeats
    found = []
    for load in (False, True):
        # Untimed first: the first ops over a freshly pinned host pool read up to 9 points
        # low (seen on whichever case ran first over its pool).
        run_batches(session, load, 1, shape.tokens, WARMUP_OPS, OpTimes())
        times = OpTimes()
        run_batches(session, load, 1, shape.tokens, repeats, times)
        found.append(_measure(ctx, label, load, shape.tokens, session, times, 1))
        found[-1].engine_copy_s = ctx.engine.during_s(session, load, shape.tokens)
    found.append(_both(ctx, label, both_ways(session, repeats), repeats))
    if name in SIZE_BACKENDS:
        for size in sorted(set(args.auto_sizes) - {shape.tokens}):
            for load in (False, True):
                # the faster of two probes: an op of a size not moved before can take
                # tens of milliseconds (seen once: a staged page_first_direct write of 256
                # tokens), and a batch of one op is too short to time a matmul beside it
                probe = OpTimes()
                run_batches(session, load, 1, size, PROBE_OPS, probe)
                count = min(session.max_batch(size),
                            max(1, math.ceil(args.window_ms / 1e3 / min(probe.seconds))))
                times = OpTimes()
                run_batches(session, load, count, size, repeats, times)
                found.append(_measure(ctx, label, load, size, session, times, count))
    session.close()
    _check_clean(session)
    return found


def _measure(ctx: Context, label: tuple[str, int, str], load: bool, tokens: int,
             session: Session, times: OpTimes, count: int) -> Measurement:
    """Median op time of ``times`` and the matmul slowdown of one more batch of ``count``."""
    seconds = statistics.median(times.seconds)
    windows = ctx.args.slowdown_windows if tokens == ctx.shape.tokens else 1
    slowdown = median_slowdown(ctx.loop, lambda: batch_window(session, load, count, tokens),
                               count * seconds, windows)
    kind = LOAD if load else WRITE
    num_bytes = tokens * ctx.shape.token_bytes
    gbps = num_bytes / seconds / 1e9
    m = Measurement(
        backend=label[0], kind=kind, page_size=label[1], layout=label[2], tokens=tokens,
        bytes=num_bytes, seconds=seconds, gb_per_s=gbps,
        pct_of_ceiling=100.0 * gbps / ctx.ceiling.one_way(kind),
        slowdown_pct=slowdown.pct if slowdown else None,
        issue_s=statistics.median(times.issue_s), wall_s=statistics.median(times.wall_s),
        executed_by=",".join(sorted(times.executed_by)),
        ops=len(times.seconds),
    )
    if load:
        h2d = ctx.ceiling.h2d_gb_per_s * 1e9
        m.layer0_s = statistics.median(times.layer0_s)
        m.layer0_ratio = m.layer0_s / (tokens * ctx.shape.geometry.token_bytes(1) / h2d)
        m.all_ratio = seconds / (num_bytes / h2d)
    logger.info("%-6s %-5s page %2d %-11s %6d tokens x%-2d %6.1f GB/s %5.1f%% matmul %s%% "
                "(op %.2f ms, issue %.2f ms)", label[0], kind, label[1], label[2], tokens,
                count, gbps, m.pct_of_ceiling,
                "-" if m.slowdown_pct is None else f"{m.slowdown_pct:.1f}", seconds * 1e3,
                (m.issue_s or 0.0) * 1e3)
    return m


def _both(ctx: Context, label: tuple[str, int, str], both: BothWays, repeats: int
          ) -> Measurement:
    num_bytes = 2 * ctx.shape.transfer_bytes
    bidir = ctx.ceiling.bidir_gb_per_s
    gbps = num_bytes / both.together_s / 1e9
    separate = num_bytes / both.separate_s / 1e9
    logger.info("%-6s both  page %2d %-11s %6.1f GB/s %5.1f%% of bidir issued together, "
                "%6.1f GB/s %5.1f%% by two calls (the slower order)", label[0], label[1],
                label[2], gbps, 100.0 * gbps / bidir, separate, 100.0 * separate / bidir)
    return Measurement(
        backend=label[0], kind=BOTH, page_size=label[1], layout=label[2],
        tokens=ctx.shape.tokens, bytes=num_bytes, seconds=both.together_s, gb_per_s=gbps,
        pct_of_ceiling=100.0 * gbps / bidir, wall_s=both.together_s,
        executed_by=",".join(sorted(both.ran)), ops=repeats, separate_s=both.separate_s,
    )


def _check_clean(session: Session) -> None:
    host = session.ctrl.host_pool.allocator
    device = session.ctrl.device_allocator
    if host.num_used_tokens or device.num_free_tokens != session.tokens:
        raise BenchmarkError(
            f"session left slots behind: {host.num_used_tokens} host tokens used, "
            f"{device.num_free_tokens} device tokens free (expected {session.tokens})")
