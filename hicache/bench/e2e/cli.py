"""``hicache bench e2e`` (also ``python -m hicache.bench.e2e``): arguments, the run, the
printed table and the JSON file. See :mod:`hicache.bench.e2e.measure` for what is timed."""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hicache.cli.output_path import check_output_path
from hicache.cli.parser import CliParser, UsageError, integer

if TYPE_CHECKING:  # the run imports torch: only a run loads it
    from .measure import E2EOptions

BACKENDS = ("torch", "kernel", "staged", "direct", "auto")
LAYOUTS = ("layer_first", "page_first", "page_first_direct")
DTYPES = ("bfloat16", "float16", "float32")
FULL_TOKENS = [512, 2048, 8192, 32768]
TINY_TOKENS = [64, 256]
DESCRIPTION = (
    "Time to first token of a request whose first N tokens are a host hit, against "
    "recomputing them: a stack of decoder layers with an 8B model's shapes (random bf16 "
    "weights, fused causal attention) runs the prefill of the new tokens while hicache loads "
    "the prefix layer by layer (each layer waits for its own load), next to the ideal "
    "(recompute over the larger of the copy at the ceiling and the forward with the KV "
    "resident) and a bare copy of the same bytes. Needs a CUDA GPU, except --device cpu "
    "--tiny (a smoke run)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    shape = parser.add_argument_group("what runs")
    shape.add_argument("--tokens", type=integer(1), nargs="+",
                       help=f"cached (host-hit) prefix lengths, whole pages "
                       f"({' '.join(map(str, FULL_TOKENS))}; "
                       f"{' '.join(map(str, TINY_TOKENS))} with --tiny)")
    shape.add_argument("--new-tokens", type=integer(1), default=16,
                       help="tokens of the request after the cached prefix (its prefill)")
    shape.add_argument("--layers", type=integer(1),
                       help="decoder layers (32; 2 with --tiny)")
    shape.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    shape.add_argument("--rope", action="store_true",
                       help="rotary positions (unfused torch ops; off: the same in every path)")
    shape.add_argument("--tiny", action="store_true",
                       help="smoke shapes: hidden 256, 4 query / 2 KV heads of 64, MLP 512")
    cache = parser.add_argument_group("the cache")
    cache.add_argument("--backend", choices=BACKENDS, default="auto", help="io backend")
    cache.add_argument("--host-layout", choices=LAYOUTS, default="layer_first")
    cache.add_argument("--page-size", type=integer(1), default=16, help="tokens per page")
    run = parser.add_argument_group("how")
    run.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (with --tiny)")
    run.add_argument("--repeats", type=integer(1), default=10, help="timed runs, median")
    run.add_argument("--warmup", type=integer(0), default=1, help="untimed runs first")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--json", type=Path, metavar="PATH", help="write the rows as JSON")


def run(args: argparse.Namespace) -> int:
    """Handler of ``hicache bench e2e``: 0 done, 1 a failed run, 2 a usage error."""
    try:
        opts = options(args)
        if args.json is not None:
            check_output_path(args.json, "--json")
    except UsageError as exc:
        print(f"hicache bench e2e: error: {exc}", file=sys.stderr)
        return 2
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s",
                            datefmt="%H:%M:%S")
    from ..workload import BenchmarkError
    from .measure import run_e2e
    from .report import render

    try:
        rows = run_e2e(opts)
    except BenchmarkError as exc:
        print(f"hicache bench e2e: error: {exc}", file=sys.stderr)
        return 1
    meta = _meta(args, opts)
    print(render(rows, _title(meta)))
    if args.json is not None:
        payload = {"meta": meta, "rows": [row.as_dict() for row in rows]}
        args.json.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


def options(args: argparse.Namespace) -> E2EOptions:
    """The run's :class:`~hicache.bench.e2e.measure.E2EOptions`.

    Raises:
        UsageError: prefix lengths that are not whole pages, a bad device.
    """
    import torch

    from .measure import E2EOptions
    from .model import TINY, DecoderSpec

    tokens = args.tokens or (TINY_TOKENS if args.tiny else FULL_TOKENS)
    ragged = [n for n in tokens if n % args.page_size]
    if ragged:
        raise UsageError(f"--tokens {ragged} are not whole pages of {args.page_size} tokens; "
                         f"use multiples of {args.page_size}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cuda", "cpu"):
        raise UsageError(f"--device {args.device!r}: expected cuda, cuda:N or cpu")
    if device.type == "cpu" and not args.tiny:
        raise UsageError("--device cpu runs only the --tiny shapes (an 8B model's prefill of "
                         "32k tokens takes hours on a CPU); add --tiny")
    base = TINY if args.tiny else DecoderSpec()
    spec = DecoderSpec(
        num_layers=args.layers or base.num_layers, hidden=base.hidden,
        num_heads=base.num_heads, num_kv_heads=base.num_kv_heads, head_dim=base.head_dim,
        mlp=base.mlp, dtype=getattr(torch, args.dtype), rope=args.rope)
    return E2EOptions(spec=spec, device=device, cached_tokens=tuple(tokens),
                      new_tokens=args.new_tokens, repeats=args.repeats, warmup=args.warmup,
                      page_size=args.page_size, backend=args.backend, layout=args.host_layout,
                      seed=args.seed)


def _meta(args: argparse.Namespace, opts: E2EOptions) -> dict[str, Any]:
    import torch

    device = (torch.cuda.get_device_name(opts.device) if opts.device.type == "cuda"
              else "cpu")
    spec = opts.spec
    return {
        "device": device, "torch": torch.__version__, "date": datetime.date.today().isoformat(),
        "layers": spec.num_layers, "hidden": spec.hidden, "heads": spec.num_heads,
        "kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "mlp": spec.mlp,
        "dtype": args.dtype, "rope": spec.rope, "new_tokens": opts.new_tokens,
        "backend": opts.backend, "host_layout": opts.layout, "page_size": opts.page_size,
        "repeats": opts.repeats, "warmup": opts.warmup, "seed": opts.seed,
    }


def _title(meta: dict[str, Any]) -> str:
    return (f"hicache bench e2e: {meta['device']}, torch {meta['torch']}; {meta['layers']} "
            f"layers, hidden {meta['hidden']}, {meta['heads']}/{meta['kv_heads']} heads of "
            f"{meta['head_dim']}, MLP {meta['mlp']}, {meta['dtype']}; {meta['new_tokens']} new "
            f"tokens; backend {meta['backend']}, host layout {meta['host_layout']}, pages of "
            f"{meta['page_size']}; medians of {meta['repeats']}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = CliParser(prog="hicache bench e2e", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))
