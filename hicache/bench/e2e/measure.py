"""The run of ``hicache bench e2e``: for each prefix length, time the request's first token
recomputed, with the prefix resident, with a bare copy of it, as a device hit and as a host
hit through hicache; check the outputs and the host hit's loaded rows.

Times are CUDA events on the forward's stream (the contiguous copy's on its side stream),
recorded after a synchronisation, so a time includes the CPU work before the first kernel
(the host hit's match and load-back) as a request's time to first token does. On a CPU
(the smoke path) they are wall times.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from hicache.factory import build_service
from hicache.service import HiCacheService

from ..workload import BenchmarkError
from .bare import BareSources, pool_sources
from .host_hit import HostHit
from .kv import DenseKV
from .model import Decoder, DecoderSpec, OwnKV
from .report import E2ERow
from .setup import Buffers, clear, put_prefix, service_config

logger = logging.getLogger(__name__)
VOCAB = 128_000
# An output of the host hit (or of the bare copy) that differs from the resident forward's
# by more than this, relative to its largest value, was computed from wrong KV.
MAX_REL_DIFF = 1e-2


@dataclass(frozen=True)
class E2EOptions:
    """What one run measures: the model, the prefix lengths (whole pages), the new tokens,
    medians of ``repeats`` after ``warmup`` untimed runs, and the service's pools."""

    spec: DecoderSpec
    device: torch.device
    cached_tokens: tuple[int, ...]
    new_tokens: int
    repeats: int
    warmup: int = 1
    page_size: int = 16
    backend: str = "auto"
    layout: str = "layer_first"
    seed: int = 0

    @property
    def capacity_tokens(self) -> int:
        """Device and host pool tokens: the longest prefix and the new tokens' pages."""
        page = self.page_size
        return max(self.cached_tokens) + -(-self.new_tokens // page) * page


class Timer:
    """Seconds of ``fn()`` and its result: CUDA events on the current stream after a
    synchronisation on a GPU, wall time on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], torch.Tensor]) -> tuple[float, torch.Tensor]:
        if not self.cuda:
            start_s = time.perf_counter()
            out = fn()
            return time.perf_counter() - start_s, out
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3, out


class E2EBench:
    """The service, model and buffers of one run (see :func:`run_e2e`)."""

    def __init__(self, opts: E2EOptions, service: HiCacheService, model: Decoder,
                 buffers: Buffers) -> None:
        self.opts = opts
        self.service = service
        self.model = model
        self.buffers = buffers
        self.timer = Timer(opts.device)

    def median_ms(self, fn: Callable[[], torch.Tensor],
                  before: Callable[[], None] | None = None) -> tuple[float, torch.Tensor]:
        """Median milliseconds of ``fn`` over the repeats (``before`` runs untimed before
        each run, warm-ups included) and the last run's result."""
        times = []
        for run in range(self.opts.warmup + self.opts.repeats):
            if before is not None:
                before()
            seconds, out = self.timer(fn)
            if run >= self.opts.warmup:
                times.append(seconds)
        return statistics.median(times) * 1e3, out

    def interleaved_ms(self, paths: list[tuple[Callable[[], torch.Tensor],
                                               Callable[[], None] | None]]
                       ) -> list[tuple[float, torch.Tensor]]:
        """:meth:`median_ms` of each ``(fn, before)`` path, the paths taking turns within
        every repeat: the host's CPU speed drifts during a run (by up to 2x on the H100 host
        measured), and taking turns makes the drift move every path alike, so the paths
        compare with each other (the forward of a few new tokens is bound by the CPU's
        launches). Each path's last result is returned."""
        times: list[list[float]] = [[] for _ in paths]
        outs: list[torch.Tensor | None] = [None] * len(paths)
        for run in range(self.opts.warmup + self.opts.repeats):
            for number, (fn, before) in enumerate(paths):
                if before is not None:
                    before()
                seconds, outs[number] = self.timer(fn)
                if run >= self.opts.warmup:
                    times[number].append(seconds)
        results = []
        for path_times, out in zip(times, outs, strict=True):
            assert out is not None, "every path ran at least once"
            results.append((statistics.median(path_times) * 1e3, out))
        return results

    def measure(self, num_cached: int) -> E2ERow:
        """Every figure of one prefix length; the tree is empty again afterwards.

        Raises:
            BenchmarkError: the host hit loaded wrong rows or computed a wrong output.
        """
        opts, model, buffers = self.opts, self.model, self.buffers
        tokens, x = self.request(num_cached)
        put_prefix(self.service, model, buffers, tokens[:num_cached], x[:num_cached])
        sources = pool_sources(self.service, tokens[:num_cached], model.spec.num_layers)
        new = x[num_cached:]
        prefix_ms, _ = self.median_ms(lambda: model.forward(x[:num_cached], 0, OwnKV()))
        recompute_ms, full = self.median_ms(lambda: model.forward(x, 0, OwnKV()))
        copy_ms = self.copy_ms(num_cached)
        hit = HostHit(self.service, model, tokens, new, opts.capacity_tokens)
        # the host hit last: its rows are the ones checked after the runs
        (device_hit_ms, device_out), (resident_ms, resident), (bare_ms, bare), (hit_ms, out) = (
            self.interleaved_ms([
                (hit.run_device, hit.make_resident),
                (lambda: model.forward(new, num_cached,
                                       DenseKV(buffers.keys, buffers.values, num_cached)), None),
                (lambda: self.bare_forward(new, num_cached, sources), None),
                (hit.run, hit.reset)]))
        rows_ok, gathered = hit.rows_match(buffers, num_cached), hit.gathered
        hit.reset()
        clear(self.service, opts.capacity_tokens)
        if not rows_ok:
            raise BenchmarkError(f"{num_cached} cached tokens: the rows loaded back differ "
                                 f"from the prefix's rows")
        check_output(num_cached, "the bare copy", bare, resident)
        check_output(num_cached, "the device hit", device_out, resident)
        hit_diff = check_output(num_cached, "the host hit", out, resident)
        reference = full[num_cached:].float()
        rel = float((out.float() - reference).abs().max() / reference.abs().max())
        row = E2ERow(num_cached, opts.new_tokens, prefix_ms, recompute_ms, copy_ms,
                     resident_ms, bare_ms, hit_ms, device_hit_ms, torch.equal(out, resident),
                     hit_diff, rel, gathered)
        logger.info("%d cached tokens: recompute %.2f ms, host hit %.2f ms (%.1f%% of the "
                    "ideal)", num_cached, recompute_ms, hit_ms, row.of_ideal_pct)
        return row

    def request(self, num_cached: int) -> tuple[list[int], torch.Tensor]:
        """The token ids of a request of ``num_cached`` + new tokens and their ``[T,
        hidden]`` hidden states, both seeded by the run's seed and the prefix length."""
        opts = self.opts
        total = num_cached + opts.new_tokens
        ids = torch.randint(0, VOCAB, (total,),
                            generator=torch.Generator().manual_seed(opts.seed + num_cached))
        gen = torch.Generator(opts.device).manual_seed(opts.seed + num_cached)
        x = torch.randn(total, opts.spec.hidden, generator=gen, device=opts.device,
                        dtype=opts.spec.dtype)
        return ids.tolist(), x

    def copy_ms(self, num_cached: int) -> float:
        """Best milliseconds of one contiguous copy of ``num_cached`` tokens' KV bytes from
        pinned host memory to the device, on a side stream (the ceiling)."""
        elems = num_cached * self.opts.spec.kv_token_bytes // self.buffers.host.element_size()
        src, dst = self.buffers.host.view(-1)[:elems], self.buffers.scratch[:elems]

        def copy() -> torch.Tensor:
            return dst.copy_(src, non_blocking=True)

        stream = self.buffers.copy_stream
        times = []
        for _ in range(self.opts.warmup + self.opts.repeats):
            if stream is None:
                times.append(self.timer(copy)[0])
                continue
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                times.append(self.timer(copy)[0])
        return min(times[self.opts.warmup:]) * 1e3  # the repeats', as every other column

    def bare_forward(self, new: torch.Tensor, num_cached: int, sources: BareSources
                     ) -> torch.Tensor:
        """The new tokens' forward overlapped with a bare layer-wise copy of the prefix's
        KV bytes from the host pool's own pages (``sources``, :mod:`.bare`) to a device
        scratch buffer: K then V of each layer, an event after each layer. The forward
        reads the dense buffers, which hold the prefix's rows."""
        buffers, stream = self.buffers, self.buffers.copy_stream
        ready: list[torch.cuda.Event] | None = None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())  # the last forward read them
            ready = []
        scratch, offset = buffers.scratch, 0
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            for pieces in sources:
                for piece in pieces:
                    size = piece.numel()
                    scratch[offset:offset + size].copy_(piece, non_blocking=True)
                    offset += size
                if ready is not None:
                    ready.append(torch.cuda.Event())
                    ready[-1].record()
        return self.model.forward(new, num_cached,
                                  DenseKV(buffers.keys, buffers.values, num_cached, ready))


def check_output(num_cached: int, name: str, got: torch.Tensor, resident: torch.Tensor
                 ) -> float:
    """The largest difference of ``got`` from the resident forward's output.

    Raises:
        BenchmarkError: more than ``MAX_REL_DIFF`` of the output's largest value.
    """
    diff = float((got.float() - resident.float()).abs().max())
    scale = float(resident.float().abs().max())
    if not diff <= MAX_REL_DIFF * scale:  # a NaN (rows never loaded) fails too
        raise BenchmarkError(f"{num_cached} cached tokens: the output of {name} differs from "
                             f"the resident forward's by {diff:.3g} (largest value "
                             f"{scale:.3g})")
    return diff


def run_e2e(opts: E2EOptions) -> list[E2ERow]:
    """Build the service, model and buffers, and measure every prefix length in order.

    Raises:
        BenchmarkError: no CUDA device for a GPU run, or a wrong host hit.
    """
    if opts.device.type == "cuda" and not torch.cuda.is_available():
        raise BenchmarkError("no CUDA device; --device cpu --tiny runs the small CPU path")
    # events, streams and synchronisations of the current device are those of opts.device
    with torch.cuda.device(opts.device) if opts.device.type == "cuda" else nullcontext():
        return _run(opts)


def _run(opts: E2EOptions) -> list[E2ERow]:
    config = service_config(opts.spec, opts.device, opts.capacity_tokens, opts.page_size,
                            opts.backend, opts.layout)
    model = Decoder(opts.spec, opts.device, opts.seed)
    logger.info("decoder: %d layers, %.2f GiB of weights", opts.spec.num_layers,
                model.size_bytes / 2**30)
    buffers = Buffers(opts.spec, opts.device, max(opts.cached_tokens), opts.new_tokens)
    with build_service(config) as service:
        bench = E2EBench(opts, service, model, buffers)
        return [bench.measure(n) for n in opts.cached_tokens]
