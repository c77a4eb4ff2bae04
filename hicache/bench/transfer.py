"""Transfer benchmark through the real cache controller: the GPU run behind
``python -m hicache.bench`` and ``hicache bench`` (options: :mod:`hicache.bench.cli`).

One run on one GPU measures, for an MHA model's KV rows at random page-granular device slots:

1. the ceiling: one contiguous pinned copy each way (copy engine), and both ways at once;
2. per backend (``torch``, ``kernel``, ``staged``, ``auto``), page size and host layout
   (host pools have the largest page size, except ``page_first_direct``, whose host pages
   are each case's page size: that is what arranges its bytes):
   writes (device to host, all layers in one op) and loads (host to device, in layer groups
   as the controller issues them) in GB/s and percent of the ceiling; for loads also when
   layer 0 and when all layers are ready (op start event to ``layer_events[0]`` and to the
   finish event);
3. a write and a load issued together (write and load streams) against the both-ways ceiling;
4. how much a concurrent bf16 matmul loop on its own stream slows during each transfer;
5. the staged backend's staging memory;
6. writes and loads of smaller sizes for ``kernel`` and ``staged``, from which the ``auto``
   table is chosen (:mod:`hicache.bench.auto`); ``auto`` is then measured with that table.

Every configuration is verified bit for bit once (:mod:`hicache.bench.verify`); a mismatch
aborts the run. Ops go through ``CacheController.write/start_writing`` and
``load/start_loading``, so index movement, events and stream waits are in what is timed.

One backend at one page size and layout is a case (:mod:`hicache.bench.case`); this module
measures the references and runs every case of a run.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from hicache.controller import Direction, KernelBackend, TorchBackend, TransferBackend
from hicache.controller.auto import AutoBackend, AutoRow
from hicache.controller.direct import DirectBackend
from hicache.controller.kernel import kernel_available
from hicache.controller.staged import StagedBackend
from hicache.pools import HostKVPool, HostLayout

from .auto import auto_table, candidate_measurements, choose_rows
from .case import Context, bench_backend
from .engine_copy import EngineCopy
from .results import BenchResult, Ceiling, Measurement
from .timing import WARMUP_MATMULS, CeilingBuffers, MatmulLoop, matmul_slowdown, time_copy
from .verify import Verifier, randomize
from .workload import (
    BenchmarkError,
    Shape,
    host_page_sizes,
    make_device_pool,
    make_host_pool,
    make_slots,
)

logger = logging.getLogger(__name__)
CEILING_REPEATS = 5  # at least; the ceiling is the best of them


def run_benchmark(args: argparse.Namespace) -> BenchResult:
    """Run every configuration of ``args`` (see :mod:`hicache.bench.cli`) on the GPU.

    Raises:
        BenchmarkError: no CUDA device (or no Triton for ``kernel``), or a backend moved
            wrong bytes.
    """
    _require_gpu(args.backends)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    shape = Shape(args.tokens, args.layers, args.heads, args.head_dim, max(args.page_sizes))
    meta = _meta(args, shape)
    logger.info("%s: %.2f GiB per transfer", meta["device"], shape.transfer_bytes / 2**30)
    ceiling, loop, alone_s = measure_references(shape, args.repeats, args.matmul_size)
    engine = EngineCopy()
    ceiling.engine_copy_d2h_s = engine.alone_s(to_host=True)
    ceiling.engine_copy_h2d_s = engine.alone_s(to_host=False)
    ctx = Context(args, shape, ceiling, loop, make_device_pool(shape, "cuda"), engine)
    randomize(ctx.device_pool.data)
    measurements: list[Measurement] = []
    for layout in (HostLayout(name) for name in args.layouts):
        for host_page, pages in host_page_sizes(layout, args.page_sizes):
            with _host_pool(shape, layout, host_page) as host_pool:
                measurements += bench_layout(ctx, host_pool, gen, pages)
    staging = StagedBackend(args.staging_tokens)
    measured_on = {key: meta[key] for key in ("device", "torch", "triton", "date",
                                              "staging_tokens", "programs")}
    return BenchResult(
        meta=meta, ceiling=ceiling, matmul_alone_s=alone_s,
        # One lane per side stream, each two chunks of every layer (a layer-wise load's
        # chunk holds more tokens of fewer layers in the same memory).
        staging_bytes={"write": staging.staging_bytes(shape.token_bytes, shape.max_page_size),
                       "load": staging.staging_bytes(shape.token_bytes, shape.max_page_size)},
        measurements=measurements,
        auto_table=auto_table(measurements, measured_on, args.max_slowdown_pct,
                              args.min_share_of_best),
    )


def measure_references(shape: Shape, repeats: int,
                       matmul_size: int) -> tuple[Ceiling, MatmulLoop, float]:
    """The copy-engine ceilings of the transfer's bytes, the matmul loop and its pace alone
    (and while each ceiling copy runs)."""
    buffers = CeilingBuffers(shape.transfer_bytes)
    repeats = max(repeats, CEILING_REPEATS)
    d2h_s = time_copy(buffers.d2h, buffers.d2h_stream, repeats)
    h2d_s = time_copy(buffers.h2d, buffers.h2d_stream, repeats)
    both_s = buffers.both_s(repeats)
    loop = MatmulLoop(matmul_size)
    alone_s = loop.alone_s(torch.cuda.Stream(), warmup=WARMUP_MATMULS)
    slow = [matmul_slowdown(loop, functools.partial(buffers.window, to_host), seconds)
            for to_host, seconds in ((True, d2h_s), (False, h2d_s))]
    gb = shape.transfer_bytes / 1e9
    ceiling = Ceiling(shape.transfer_bytes, gb / d2h_s, gb / h2d_s, 2 * gb / both_s,
                      *(s.pct if s else None for s in slow))
    logger.info("ceiling: d2h %.1f GB/s, h2d %.1f GB/s, both %.1f GB/s; matmul %.2f ms",
                ceiling.d2h_gb_per_s, ceiling.h2d_gb_per_s, ceiling.bidir_gb_per_s,
                alone_s * 1e3)
    buffers.release()
    return ceiling, loop, alone_s


def bench_layout(ctx: Context, host_pool: HostKVPool, gen: torch.Generator,
                 page_sizes: list[int]) -> list[Measurement]:
    """Every backend at each of ``page_sizes`` over one host pool; ``auto`` last, with the
    table chosen from these measurements."""
    args, layout = ctx.args, host_pool.layout.value
    verifier = Verifier(ctx.device_pool, host_pool)
    slots = {page: make_slots(ctx.device_pool, page, ctx.shape.tokens, gen,
                              runs=args.slots == "runs")
             for page in page_sizes}
    found: list[Measurement] = []
    for page in page_sizes:
        for name in (b for b in args.backends if b != "auto"):
            found += bench_backend(ctx, name, _backend(name, args), host_pool, slots[page],
                                   verifier)
    if "auto" in args.backends:
        rows = choose_rows(candidate_measurements(found), args.max_slowdown_pct,
                           args.min_share_of_best)
        auto = _auto_backend(args, rows)
        for page in page_sizes:
            found += bench_backend(ctx, "auto", auto, host_pool, slots[page], verifier)
    del verifier
    torch.cuda.empty_cache()
    logger.info("layout %s (host pages of %d) done", layout, host_pool.page_size)
    return found


def _backend(name: str, args: argparse.Namespace) -> TransferBackend:
    if name == "torch":
        return TorchBackend()
    if name == "kernel":
        return KernelBackend(args.programs)
    if name == "direct":
        return DirectBackend()
    return StagedBackend(args.staging_tokens)


def _auto_backend(args: argparse.Namespace, rows: list[dict[str, Any]]) -> AutoBackend:
    """``auto`` over every backend with the rows this run chose (``direct`` is chosen by
    the runs of an op's slots, not by a row)."""
    table = [AutoRow(Direction(r["direction"]), HostLayout(r["layout"]), bool(r["layer_wise"]),
                     int(r["min_tokens"]), str(r["backend"])) for r in rows]
    found = {name: _backend(name, args) for name in ("torch", "kernel", "staged", "direct")}
    return AutoBackend(found, table, "kernel")


def _require_gpu(backends: Sequence[str]) -> None:
    if not torch.cuda.is_available():
        raise BenchmarkError("the transfer benchmark needs a CUDA device; --from-json PATH "
                             "re-renders a saved result without one")
    if {"kernel", "auto"} & set(backends) and not kernel_available():
        raise BenchmarkError("backends kernel and auto need Triton; install triton or pass "
                             "--backends torch staged")


def _meta(args: argparse.Namespace, shape: Shape) -> dict[str, Any]:
    try:
        import triton

        triton_version = str(triton.__version__)
    except ImportError:
        triton_version = "none"
    # Output paths by file name only: a result names no folder of the machine it ran on.
    options = {k: (v.name if isinstance(v, Path) else v) for k, v in vars(args).items()
               if k != "run"}
    return {
        **options,
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": triton_version, "cuda": str(torch.version.cuda),
        "date": datetime.date.today().isoformat(),
        "token_bytes": shape.token_bytes, "transfer_bytes": shape.transfer_bytes,
        "layer_bytes": shape.layer_bytes,
    }


@contextmanager
def _host_pool(shape: Shape, layout: HostLayout, page_size: int) -> Iterator[HostKVPool]:
    """A pinned host pool, unpinned on exit (after the GPU is done with it)."""
    pool = make_host_pool(shape, layout, pin=True, page_size=page_size)
    try:
        yield pool
    finally:
        torch.cuda.synchronize()
        pool.close()
