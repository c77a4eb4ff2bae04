"""What the always-on bounds checks cost: ``python -m hicache.bench.checks``.

Each row times one call shape, with its reference measured in the same run (the same work
without the check):

- ``set_kv`` of a decode batch into one layer: with plain ``Indices`` (checked on every
  call), with the forward's ``ForwardLocs`` (checked once per forward, so no check per
  layer), and the bare ``index_copy_`` of the same rows (no check at all). ``forward_locs``
  itself is the once-per-forward check and translation.
- ``set_kv`` of a forward's new tokens into one layer of a full-attention pool, with
  ``ForwardLocs`` made from the slots on the GPU (the indexed write and the padding clear)
  and from the same slots on the CPU (one run: a slice copy per component), against the
  two plain copies a dense cache makes; and the layer's ``key_buffer`` + ``value_buffer``.
- ``translate_page_table`` of a decode batch's table, against the bare gather.
- the CPU-side validation of a 32k-token transfer (the controller's ``write``: index checks
  and page ownership), against issuing the same write with the checks skipped is not
  possible, so the reference is the copy of the rows it queues (GPU) or the whole
  ``write`` + ``start_writing`` (CPU).

CPU time is the scheduler thread's cost per call (calls issued back to back, the device
synchronised once at the end); GPU time is from CUDA events around the same loop. Prints a
table; ``--json PATH`` writes the figures.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hicache.cli.device import device_form_problem, missing_device
from hicache.cli.parser import CliParser, integer
from hicache.controller import CacheController, TorchBackend
from hicache.pools import (
    AttentionKind,
    HostKVPool,
    HostLayout,
    HybridSWAPool,
    IndexSpace,
    Indices,
    PageTable,
    RowGeometry,
)

GEOMETRY = RowGeometry(AttentionKind.MHA, 8, 128, 0, torch.bfloat16)


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> tuple[float, float]:
    """(CPU us per call, GPU us per call or nan) over ``repeats`` back-to-back calls."""
    for _ in range(3):
        fn()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    began = time.perf_counter()
    for _ in range(repeats):
        fn()
    cpu_us = (time.perf_counter() - began) / repeats * 1e6
    if not cuda:
        return cpu_us, float("nan")
    end.record()
    torch.cuda.synchronize(device)
    return cpu_us, start.elapsed_time(end) / repeats * 1e3


def decode_rows(device: torch.device, batch: int, max_pages: int, repeats: int
                ) -> list[tuple[str, float, float]]:
    """set_kv, forward_locs and translate_page_table of one decode batch."""
    page = 16
    pool = HybridSWAPool(num_layers=2, swa_layers=[1], full_pages=4096, swa_pages=4096,
                         page_size=page, geometry=GEOMETRY, device=device)
    slots = pool.try_alloc(batch * page)
    assert slots is not None
    locs = Indices(slots.tensor[::page].to(device), IndexSpace.DEVICE_FULL)
    k = torch.randn(batch, 8, 128, device=device).to(torch.bfloat16)
    handle = pool.forward_locs(locs)
    index = handle.full.tensor
    rows = pool.full.data[0, 0]
    table = PageTable(torch.randint(1, 4097, (batch, max_pages), dtype=torch.int32,
                                    device=device), IndexSpace.DEVICE_FULL, page)
    first_slots = table.tensor.to(torch.int64) * page
    results = [
        ("set_kv, Indices (checked per call)", *timed(lambda: pool.set_kv(0, locs, k, k), device,
                                                      repeats)),
        ("set_kv, ForwardLocs (checked per forward)",
         *timed(lambda: pool.set_kv(0, handle, k, k), device, repeats)),
        ("reference: 2 x index_copy_ + padding clear",
         *timed(lambda: _bare_write(rows, index, k), device, repeats)),
        ("forward_locs (check + SWA translation)",
         *timed(lambda: pool.forward_locs(locs), device, repeats)),
        (f"translate_page_table [{batch}, {max_pages}]",
         *timed(lambda: pool.translate_page_table(table), device, repeats)),
        ("reference: the bare gather of that table",
         *timed(lambda: (pool.full_to_swa[first_slots] // page).to(torch.int32), device,
                repeats)),
    ]
    pool.raise_if_tripped()
    return results


def forward_rows(device: torch.device, tokens: int, repeats: int
                 ) -> list[tuple[str, float, float]]:
    """set_kv of ``tokens`` new tokens (one run of slots, as an allocator hands them out)
    through ForwardLocs made from GPU and from CPU slots, and the layer's views; the
    handles of CPU slots in a run (which upload nothing until ``full`` is read) and not."""
    from hicache.pools import DeviceKVPool

    pool = DeviceKVPool(name="full", space=IndexSpace.DEVICE_FULL, num_layers=2,
                        num_slots=4 * tokens + 16, geometry=GEOMETRY, device=device)
    slots = Indices(torch.arange(16, 16 + tokens), IndexSpace.DEVICE_FULL)
    scattered = Indices(slots.tensor.flip(0), IndexSpace.DEVICE_FULL)
    on_device = Indices(slots.tensor.to(device), IndexSpace.DEVICE_FULL)
    indexed, span = pool.forward_locs(on_device), pool.forward_locs(slots)
    k = torch.randn(tokens, 8, 128, device=device).to(torch.bfloat16)
    dense = torch.empty(2, tokens, 8, 128, dtype=torch.bfloat16, device=device)
    return [
        (f"set_kv of {tokens} tokens, ForwardLocs, slots given on the device",
         *timed(lambda: pool.set_kv(0, indexed, k, k), device, repeats)),
        (f"set_kv of {tokens} tokens, ForwardLocs, slots given on the CPU",
         *timed(lambda: pool.set_kv(0, span, k, k), device, repeats)),
        ("reference: 2 x copy_ into a dense cache",
         *timed(lambda: (dense[0].copy_(k), dense[1].copy_(k)), device, repeats)),
        (f"forward_locs of {tokens} CPU slots, a run (check)",
         *timed(lambda: pool.forward_locs(slots), device, repeats)),
        ("  and its .full read (the run made on the device)",
         *timed(lambda: pool.forward_locs(slots).full, device, repeats)),
        (f"forward_locs of {tokens} CPU slots, not a run (check + upload)",
         *timed(lambda: pool.forward_locs(scattered), device, repeats)),
        ("key_buffer + value_buffer of a layer",
         *timed(lambda: (pool.key_buffer(0), pool.value_buffer(0)), device, repeats)),
    ]


def _bare_write(rows: torch.Tensor, index: torch.Tensor, k: torch.Tensor) -> None:
    flat = k.flatten(1)
    for _ in range(2):
        rows.index_copy_(0, index, flat)
        rows[0].zero_()


def transfer_rows(device: torch.device, tokens: int, repeats: int
                  ) -> list[tuple[str, float, float]]:
    """The CPU-side validation of a ``tokens``-token write, and the whole issue of it."""
    from hicache.pools import DeviceKVPool, PageAllocator

    page, layers = 16, 2
    allocator = PageAllocator(tokens // page, page, IndexSpace.DEVICE_FULL, "full")
    pool = DeviceKVPool(name="full", space=IndexSpace.DEVICE_FULL, num_layers=layers,
                        num_slots=allocator.num_slots, geometry=GEOMETRY, device=device)
    host = HostKVPool(name="full", space=IndexSpace.HOST_FULL, num_layers=layers,
                      num_pages=tokens // page, page_size=page, geometry=GEOMETRY,
                      layout=HostLayout.LAYER_FIRST)
    controller = CacheController(device_pool=pool, device_allocator=allocator, host_pool=host,
                                 backend=TorchBackend())
    slots = allocator.try_alloc(tokens)
    assert slots is not None

    def write() -> None:
        host_slots = controller.write(slots)
        assert host_slots is not None
        controller.start_writing()
        controller.drain()
        controller.evict_host(host_slots)

    def validate() -> None:
        controller._checks.cpu(slots, pool, "write")
        allocator.pages_of(slots, op="write")

    try:
        return [
            (f"write of {tokens} tokens: index checks only", *timed(validate, device, repeats)),
            (f"reference: write + start_writing + drain ({layers} layers)",
             *timed(write, device, max(1, repeats // 10))),
        ]
    finally:
        host.close()


def main(argv: list[str] | None = None) -> int:
    parser = CliParser(prog="python -m hicache.bench.checks",
                       description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=integer(1), default=64, help="decode batch rows")
    parser.add_argument("--max-pages", type=integer(1), default=256, help="page-table columns")
    parser.add_argument("--tokens", type=integer(1), default=32768,
                        help="tokens of the transfer")
    parser.add_argument("--new-tokens", type=integer(1), default=16,
                        help="new tokens of a forward (set_kv rows)")
    parser.add_argument("--repeats", type=integer(1), default=200)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    problem = device_form_problem(args.device) or missing_device(args.device)
    if problem is not None:
        parser.error(f"--device {args.device}: {problem}")
    device = torch.device(args.device)
    rows = decode_rows(device, args.batch, args.max_pages, args.repeats)
    rows += forward_rows(device, args.new_tokens, args.repeats)
    rows += transfer_rows(device, args.tokens, args.repeats)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}; decode batch {args.batch} rows of 8 x 128 bf16 "
          f"per K and V; {args.repeats} calls per row")
    print(f"{'call':<62} {'CPU us':>9} {'GPU us':>9}")
    print("-" * 82)
    for label, cpu_us, gpu_us in rows:
        print(f"{label:<62} {cpu_us:>9.1f} {gpu_us:>9.1f}")
    if args.json is not None:
        args.json.write_text(json.dumps(
            {"device": name, "torch": torch.__version__, "batch": args.batch,
             "new_tokens": args.new_tokens,
             "rows": [{"call": c, "cpu_us": a, "gpu_us": b} for c, a, b in rows]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
