"""Transfer bandwidth benchmark: the copy-engine ceiling, naive torch and the Triton kernel.

``python -m hicache.bench`` moves ``--tokens`` tokens of an MHA model (``--layers`` x
``--heads`` x ``--head-dim``, bfloat16, K and V) between a device pool and a pinned host pool,
at random page-granular slots (shuffled pages of ``--page-sizes`` tokens), for each host layout
and each direction, and prints GB/s and the percentage of the ceiling measured in the same run:

- ``ceiling``: one contiguous pinned copy of the same bytes (copy engine, ``copy_``);
- ``naive torch``: device->host gathers each layer on the GPU (``index_select``), copies once
  to pinned memory and scatters on the CPU; host->device gathers on the CPU, copies once and
  scatters on the GPU;
- ``kernel``: :func:`hicache.controller.kernel.transfer_rows`, all layers in one launch;
  ``kernel per-layer`` (host->device only): one launch per layer, as layer-wise loads do.

Every kernel configuration is first checked bit for bit against the torch reference; a mismatch
aborts. Times are medians of ``--repeats`` runs after a warm-up, taken with CUDA events on the
stream the work runs on (for naive torch the CPU half is inside the timed region: the stream
is synchronised before it). Results go to a table and to JSON (``--json``). A later
``hicache bench`` front calls :func:`run_benchmark` and :func:`print_table`.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import statistics
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from hicache.controller.kernel import kernel_available, transfer_rows
from hicache.pools import (
    AttentionKind,
    DeviceKVPool,
    HostKVPool,
    HostLayout,
    IndexSpace,
    RowGeometry,
)

logger = logging.getLogger(__name__)
DTYPE = torch.bfloat16
SENTINEL_BITS = -7
QUICK = {"tokens": 2048, "layers": 4, "repeats": 3}
METHODS = ("ceiling", "naive", "kernel", "kernel-per-layer")


class BenchmarkError(RuntimeError):
    """The kernel's result differs from the torch reference (or the setup is unusable)."""


@dataclass
class Workload:
    """One configuration's buffers: pools, index pairs and contiguous staging buffers.

    ``host_indices``/``device_indices``: ``[n]`` int64 on the GPU; ``*_cpu`` the same on the
    CPU. ``staging_device``: ``[C, L, n, R]`` on the GPU; ``staging_host``: the same, pinned.
    ``host_mirror``: a GPU buffer shaped like ``host.data``, used only to verify results.
    """

    device: DeviceKVPool
    host: HostKVPool
    page_size: int
    host_indices: torch.Tensor
    device_indices: torch.Tensor
    host_indices_cpu: torch.Tensor
    device_indices_cpu: torch.Tensor
    staging_device: torch.Tensor
    staging_host: torch.Tensor
    host_mirror: torch.Tensor

    @property
    def num_bytes(self) -> int:
        return self.staging_device.numel() * self.staging_device.element_size()

    def rows(self) -> Iterator[tuple[int, int]]:
        """Every (component, layer) of the pools."""
        for component in range(self.device.data.shape[0]):
            for layer in range(self.device.num_layers):
                yield component, layer


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m hicache.bench", description=__doc__.split("\n\n")[0] if __doc__ else ""
    )
    parser.add_argument("--tokens", type=int, default=32768, help="tokens moved per transfer")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=8, help="KV heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--programs", type=int, nargs="+", default=[16],
                        help="kernel grid bound(s) (SMs the copy may occupy)")
    parser.add_argument("--tokens-per-tile", type=int, nargs="+", default=[8],
                        help="kernel tile size(s), powers of two")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs (median), >= 1")
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--layouts", nargs="+", default=[layout.value for layout in HostLayout],
                        choices=[layout.value for layout in HostLayout])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS,
                        help="what to time (the ceiling is always measured)")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke run: defaults of {QUICK['tokens']} tokens, "
                        f"{QUICK['layers']} layers, {QUICK['repeats']} repeats")
    parser.add_argument("--json", default="bench.json", help="where to write the results")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:  # smaller defaults; sizes given on the command line still win
        parser.set_defaults(**QUICK)
        args = parser.parse_args(argv)
    if args.repeats < 1 or args.tokens < 1 or min(args.page_sizes) < 1:
        parser.error("--repeats, --tokens and --page-sizes must be >= 1")
    return args


def measure(fn: Callable[[], None], repeats: int, stream: torch.cuda.Stream) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after one warm-up, timed with CUDA
    events recorded on ``stream`` (``fn`` runs with ``stream`` current)."""
    with torch.cuda.stream(stream):
        fn()
        stream.synchronize()
        times = []
        for _ in range(max(1, repeats)):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def random_slots(
    num_tokens: int, page_size: int, num_slots: int, gen: torch.Generator
) -> torch.Tensor:
    """``[num_tokens]`` int64 CPU slots: shuffled whole pages of ``page_size`` slots from
    ``[page_size, num_slots)`` (page 0 is the reserved padding page)."""
    num_pages = num_slots // page_size - 1
    wanted = -(-num_tokens // page_size)
    if wanted > num_pages:
        raise BenchmarkError(f"{num_tokens} tokens do not fit in {num_pages} pages")
    pages = torch.randperm(num_pages, generator=gen)[:wanted] + 1
    slots = pages[:, None] * page_size + torch.arange(page_size)
    return slots.flatten()[:num_tokens].contiguous()


def make_pools(args: argparse.Namespace, layout: HostLayout) -> tuple[DeviceKVPool, HostKVPool]:
    """Device and pinned host pools a few percent larger than ``args.tokens`` (in pages of
    the largest page size, so every page size's slots are whole pages past page 0)."""
    geometry = RowGeometry(AttentionKind.MHA, num_kv_heads=args.heads, head_dim=args.head_dim,
                           latent_dim=0, dtype=DTYPE)
    page = max(args.page_sizes)
    num_pages = -(-args.tokens // page) + max(1, args.tokens // page // 32)
    device = DeviceKVPool(name="bench", space=IndexSpace.DEVICE_FULL, num_layers=args.layers,
                          num_slots=(num_pages + 1) * page, geometry=geometry, device="cuda")
    host = HostKVPool(name="bench", space=IndexSpace.HOST_FULL, num_layers=args.layers,
                      num_pages=num_pages, page_size=page, geometry=geometry, layout=layout,
                      pin=True)
    return device, host


def make_workload(
    device: DeviceKVPool, host: HostKVPool, page_size: int, staging: tuple[torch.Tensor, ...],
    host_mirror: torch.Tensor, gen: torch.Generator,
) -> Workload:
    num_tokens = staging[0].shape[2]
    host_cpu = random_slots(num_tokens, page_size, host.num_slots, gen)
    device_cpu = random_slots(num_tokens, page_size, device.num_slots, gen)
    return Workload(
        device=device, host=host, page_size=page_size,
        host_indices=host_cpu.cuda(), device_indices=device_cpu.cuda(),
        host_indices_cpu=host_cpu, device_indices_cpu=device_cpu,
        staging_device=staging[0], staging_host=staging[1], host_mirror=host_mirror,
    )


def naive_to_host(w: Workload) -> None:
    """Gather every layer on the GPU, one copy to pinned memory, scatter on the CPU."""
    for c, layer in w.rows():
        torch.index_select(w.device.layer_rows(c, layer), 0, w.device_indices,
                           out=w.staging_device[c, layer])
    w.staging_host.copy_(w.staging_device, non_blocking=True)
    torch.cuda.current_stream().synchronize()
    for c, layer in w.rows():
        w.host.layer_rows(c, layer).index_copy_(0, w.host_indices_cpu, w.staging_host[c, layer])


def naive_to_device(w: Workload) -> None:
    """Gather every layer on the CPU into pinned memory, one copy, scatter on the GPU."""
    gather_on_host(w)
    w.staging_device.copy_(w.staging_host, non_blocking=True)
    for c, layer in w.rows():
        w.device.layer_rows(c, layer).index_copy_(0, w.device_indices, w.staging_device[c, layer])


def gather_on_host(w: Workload) -> None:
    for c, layer in w.rows():
        torch.index_select(w.host.layer_rows(c, layer), 0, w.host_indices_cpu,
                           out=w.staging_host[c, layer])


def kernel_fn(
    w: Workload, *, to_host: bool, programs: int, tile: int, per_layer: bool = False
) -> Callable[[], None]:
    """The transfer as one all-layer launch, or one launch per layer."""
    num_layers = w.device.num_layers
    ranges = [(i, i + 1) for i in range(num_layers)] if per_layer else [(0, num_layers)]

    def run() -> None:
        for begin, end in ranges:
            transfer_rows(
                device_data=w.device.data, host_data=w.host.data, host_layout=w.host.layout,
                host_indices=w.host_indices, device_indices=w.device_indices,
                layer_begin=begin, layer_end=end, to_host=to_host,
                num_programs=programs, tokens_per_tile=tile,
            )

    return run


def fill_sentinel(data: torch.Tensor) -> None:
    data.view(torch.int16).fill_(SENTINEL_BITS)


def verify(w: Workload, run: Callable[[], None], *, to_host: bool, what: str) -> None:
    """Run ``run`` once and compare every moved row with the torch gather of its source, bit
    for bit, and every other destination row with the sentinel; raise :class:`BenchmarkError`
    naming the first bad (component, layer). The host pool is checked through its GPU mirror
    (one contiguous copy each way), so verifying costs little next to the timings."""
    stream = torch.cuda.current_stream()
    stream.synchronize()  # earlier work may still touch the pools
    mirror = canonical(w.host_mirror, w.host.layout)
    if to_host:
        source, source_indices = w.device.data, w.device_indices
        fill_sentinel(w.host_mirror)
        w.host.data.copy_(w.host_mirror, non_blocking=True)
    else:
        w.host_mirror.copy_(w.host.data, non_blocking=True)
        source, source_indices = mirror, w.host_indices
        fill_sentinel(w.device.data)
    for c, layer in w.rows():
        torch.index_select(source[c, layer], 0, source_indices, out=w.staging_device[c, layer])
    run()
    if to_host:
        w.host_mirror.copy_(w.host.data, non_blocking=True)
    dst, dst_indices = (mirror, w.host_indices) if to_host else (w.device.data, w.device_indices)
    where = f"{what} (page size {w.page_size}, layout {w.host.layout.value})"
    for c, layer in w.rows():
        got = dst[c, layer].index_select(0, dst_indices)
        if not torch.equal(got.view(torch.int16), w.staging_device[c, layer].view(torch.int16)):
            raise BenchmarkError(
                f"{where}: rows of component {c}, layer {layer} differ from the torch reference"
            )
    if not bool((untouched_rows(dst, dst_indices).view(torch.int16) == SENTINEL_BITS).all()):
        raise BenchmarkError(f"{where}: a row outside the transfer was written")


def canonical(data: torch.Tensor, layout: HostLayout) -> torch.Tensor:
    """``[C, L, S, R]`` view of a host pool buffer (or its mirror) in either layout."""
    return data if layout is HostLayout.LAYER_FIRST else data.permute(1, 2, 0, 3)


def untouched_rows(data: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Copy of the ``[C, L, S', R]`` rows of slots not in ``indices`` (same device)."""
    keep = torch.ones(data.shape[2], dtype=torch.bool, device=indices.device)
    keep[indices] = False
    return data[:, :, keep]


def result(
    method: str, direction: str, seconds: float, num_bytes: int, *,
    page_size: int | None = None, layout: str | None = None, **extra: Any,
) -> dict[str, Any]:
    return {
        "method": method, "direction": direction, "page_size": page_size, "layout": layout,
        "bytes": num_bytes, "seconds": seconds, "gb_per_s": num_bytes / seconds / 1e9, **extra,
    }


def measure_ceiling(staging: tuple[torch.Tensor, ...], repeats: int,
                    stream: torch.cuda.Stream) -> list[dict[str, Any]]:
    """One contiguous pinned copy of the transfer's bytes, each direction."""
    device_buf, host_buf = staging
    num_bytes = device_buf.numel() * device_buf.element_size()

    def to_host() -> None:
        host_buf.copy_(device_buf, non_blocking=True)

    def to_device() -> None:
        device_buf.copy_(host_buf, non_blocking=True)

    d2h = measure(to_host, repeats, stream)
    h2d = measure(to_device, repeats, stream)
    return [result("ceiling", "d2h", d2h, num_bytes), result("ceiling", "h2d", h2d, num_bytes)]


def bench_workload(w: Workload, args: argparse.Namespace,
                   stream: torch.cuda.Stream) -> list[dict[str, Any]]:
    """Verify then time every requested method of one (page size, layout) in both directions."""
    keys: dict[str, Any] = {"page_size": w.page_size, "layout": w.host.layout.value}
    rows: list[dict[str, Any]] = []
    for to_host in (True, False):
        direction = "d2h" if to_host else "h2d"
        if "naive" in args.methods:
            naive = naive_to_host if to_host else naive_to_device
            seconds = measure(functools.partial(naive, w), args.repeats, stream)
            rows.append(result("naive torch", direction, seconds, w.num_bytes, **keys))
        variants = [("kernel", False)] if "kernel" in args.methods else []
        if not to_host and "kernel-per-layer" in args.methods:
            variants.append(("kernel per-layer", True))
        for name, per_layer in variants:
            for programs in args.programs:
                for tile in args.tokens_per_tile:
                    run = kernel_fn(w, to_host=to_host, programs=programs, tile=tile,
                                    per_layer=per_layer)
                    with torch.cuda.stream(stream):
                        verify(w, run, to_host=to_host, what=f"{name} {direction}")
                    seconds = measure(run, args.repeats, stream)
                    rows.append(result(name, direction, seconds, w.num_bytes, programs=programs,
                                       tokens_per_tile=tile, **keys))
    return rows


@contextmanager
def pools_for(
    args: argparse.Namespace, layout: HostLayout
) -> Iterator[tuple[DeviceKVPool, HostKVPool]]:
    """Pools of one layout; the host pool is unpinned and freed on exit."""
    device, host = make_pools(args, layout)
    try:
        yield device, host
    finally:
        torch.cuda.synchronize()
        host.close()


def run_benchmark(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run every configuration of ``args`` (see :func:`parse_args`) and return result rows
    with ``pct_of_ceiling`` filled in. Needs CUDA and Triton."""
    if not torch.cuda.is_available() or not kernel_available():
        raise BenchmarkError("the transfer benchmark needs a CUDA device and Triton")
    stream = torch.cuda.Stream()
    gen = torch.Generator().manual_seed(args.seed)
    shape = (2, args.layers, args.tokens, args.heads * args.head_dim)
    staging = (torch.empty(shape, dtype=DTYPE, device="cuda"),
               torch.empty(shape, dtype=DTYPE, pin_memory=True))
    staging[0].view(torch.int16).random_(0, 0x4000)
    rows = measure_ceiling(staging, args.repeats, stream)
    for layout_name in args.layouts:
        with pools_for(args, HostLayout(layout_name)) as (device, host):
            device.data.view(torch.int16).random_(0, 0x4000)
            host.data.view(-1).copy_(device.data.view(-1))  # random rows, fast
            mirror = torch.empty_like(host.data, device="cuda")
            for page_size in args.page_sizes:
                w = make_workload(device, host, page_size, staging, mirror, gen)
                logger.info("timing page size %d, layout %s", page_size, layout_name)
                rows.extend(bench_workload(w, args, stream))
    ceiling = {row["direction"]: row["gb_per_s"] for row in rows if row["method"] == "ceiling"}
    for row in rows:
        row["pct_of_ceiling"] = 100.0 * row["gb_per_s"] / ceiling[row["direction"]]
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """Fixed-width table: method, direction, page size, layout, grid, GB/s, % of ceiling."""
    header = f"{'method':<18}{'dir':<5}{'page':>5}  {'layout':<12}{'grid':>8}{'GB/s':>9}" \
             f"{'% ceil':>9}"
    lines = [header, "-" * len(header)]
    for row in rows:
        grid = f"{row['programs']}x{row['tokens_per_tile']}" if "programs" in row else "-"
        page = "-" if row["page_size"] is None else str(row["page_size"])
        lines.append(
            f"{row['method']:<18}{row['direction']:<5}{page:>5}  {row['layout'] or '-':<12}"
            f"{grid:>8}{row['gb_per_s']:>9.1f}{row['pct_of_ceiling']:>9.1f}"
        )
    return "\n".join(lines)


def print_table(rows: list[dict[str, Any]]) -> None:
    print(format_table(rows))


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    try:
        rows = run_benchmark(args)
    except BenchmarkError as exc:
        print(f"benchmark aborted: {exc}", file=sys.stderr)
        return 1
    row_bytes = args.heads * args.head_dim * torch.empty((), dtype=DTYPE).element_size()
    print(f"{torch.cuda.get_device_name()}: {args.tokens} tokens x {args.layers} layers x K,V "
          f"x {row_bytes} B rows = {rows[0]['bytes'] / 2**30:.2f} GiB per transfer, bf16, "
          f"median of {args.repeats}; grid = programs x tokens per tile")
    print_table(rows)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "args": {key: value for key, value in vars(args).items() if key != "json"}}
    with open(args.json, "w", encoding="utf-8") as out:
        json.dump({"meta": meta, "results": rows}, out, indent=2)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
