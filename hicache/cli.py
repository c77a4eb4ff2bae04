"""The ``hicache`` command line.

Each subcommand is a ``_add_<name>(commands)`` function that registers its parser and sets
``run`` to a function ``(args) -> exit code``; :func:`main` dispatches. Errors the user can
fix (a bad config, a missing file) print one line ``hicache: error: ...`` and exit with 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TextIO

from .bench import add_bench_parser
from .config import (
    GIB,
    ConfigError,
    HiCacheConfig,
    WritePolicy,
    available_ram_bytes,
    load_config,
)
from .config.sizing import PoolSize, pool_layers, pool_sizes, staging_bytes

USAGE_ERROR = 2
FAILED = 1

Command = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    """The ``hicache`` parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="hicache",
        description="Hierarchical KV-cache controller: GPU pool (L1), pinned host pool (L2), "
        "asynchronous stream-safe transfers between them.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_check_config(commands)
    _add_demo(commands)
    add_bench_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (``sys.exit(main())``)."""
    args = build_parser().parse_args(argv)
    run: Command = args.run
    try:
        return run(args)
    except ConfigError as exc:
        message = " ".join(str(exc).split())
        print(f"hicache: error: {message}", file=sys.stderr)
        return USAGE_ERROR


# ---- check-config ---------------------------------------------------------------------------


def _add_check_config(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "check-config",
        help="validate a YAML config and print every pool's size",
        description="Validate a YAML config and print the size of every device and host pool "
        "(tokens, pages, bytes, GiB) with totals per tier. Allocates nothing.",
    )
    parser.add_argument("path", metavar="PATH", help="the YAML config file, e.g. config.yaml")
    parser.add_argument(
        "--skip-ram-check", action="store_true",
        help="do not check the host pools against the RAM available on this machine "
        "(for a config meant for another machine)",
    )
    parser.set_defaults(run=_check_config)


def _check_config(args: argparse.Namespace) -> int:
    config = load_config(args.path, check_ram=not args.skip_ram_check)
    sizes = pool_sizes(config)
    print(f"{args.path}: {_geometry(config)}")
    print(_pool_table(config, sizes))
    print(_ram_line(config, sizes, checked=not args.skip_ram_check))
    staging = staging_bytes(config)
    if staging:
        print(f"device staging ({config.controller.io_backend.value} backend, "
              f"{config.controller.staging_tokens} tokens per chunk): up to {staging} bytes, "
              f"{staging / GIB:.4f} GiB")
    return 0


def _geometry(config: HiCacheConfig) -> str:
    model = config.model
    geometry = model.row_geometry
    if model.latent_dim is not None:
        rows = f"mla latent row of {model.latent_dim}"
    else:
        rows = f"mha {model.num_kv_heads} KV heads x {model.head_dim} dims"
    layers = f"{model.num_layers} layers"
    if model.is_hybrid:
        swa = ", ".join(str(i) for i in model.swa_layer_ids)
        layers += f" (sliding-window {swa}, window {model.window_tokens} tokens)"
    return (
        f"{layers}, {rows}, {model.dtype.value}, {geometry.row_bytes} bytes per row x "
        f"{geometry.num_components}; page {config.page_size_tokens} tokens; device "
        f"{config.device_pool.device}; host layout {config.host.layout.value}"
    )


def _pool_table(config: HiCacheConfig, sizes: list[PoolSize]) -> str:
    rows = [["tier", "pool", "layers", "tokens", "pages", "bytes", "GiB"]]
    for tier in ("device", "host"):
        in_tier = [size for size in sizes if size.tier == tier]
        for size in in_tier:
            rows.append([tier, size.pool, str(len(pool_layers(config, size.pool))),
                         *_amounts(size.num_tokens, size.num_pages, size.size_bytes)])
        rows.append([tier, "total", "", *_amounts(sum(s.num_tokens for s in in_tier),
                                                  sum(s.num_pages for s in in_tier),
                                                  sum(s.size_bytes for s in in_tier))])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [cell.ljust(w) if i < 2 else cell.rjust(w)
                 for i, (cell, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _amounts(num_tokens: int, num_pages: int, size_bytes: int) -> list[str]:
    return [str(num_tokens), str(num_pages), str(size_bytes), f"{size_bytes / GIB:.4f}"]


def _ram_line(config: HiCacheConfig, sizes: list[PoolSize], *, checked: bool) -> str:
    need = sum(size.size_bytes for size in sizes if size.tier == "host")
    line = f"host RAM: pools take {need / GIB:.4f} GiB"
    if not checked:
        return f"{line}; not checked against this machine (--skip-ram-check)"
    available = available_ram_bytes()
    if available is None:
        return f"{line}; available RAM unknown, not checked"
    return (f"{line}, {available / GIB:.2f} GiB available, "
            f"{config.host.ram_reserve_gib:.2f} GiB kept in reserve: fits")


# ---- demo -----------------------------------------------------------------------------------


def _add_demo(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "demo",
        help="run the reference engine on a config and verify every token and loaded page",
        description="Serve many multi-turn conversations with a tiny seeded decoder through "
        "the cache service: prefixes are matched on the device, evicted to the host and "
        "loaded back. Every generated token is checked against a baseline that never "
        "evicts anything, and every page loaded back against a digest of its backup. "
        "Exit code 0: verified; 1: a mismatch (named) or the pools cannot hold one "
        "request; 2: a usage or config error.",
    )
    parser.add_argument("--config", default="config.yaml", metavar="PATH",
                        help="YAML config (default: %(default)s)")
    parser.add_argument("--device", default=None,
                        help="cpu, cuda or cuda:N (default: the config's device_pool.device); "
                        "on cuda the forward runs on its own stream")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the weights and the workload (default: %(default)s)")
    parser.add_argument("--conversations", type=_positive, default=None, metavar="N",
                        help="conversations (default: 12; 6 with --quick)")
    parser.add_argument("--turns", type=_positive, default=None, metavar="N",
                        help="most turns per conversation; each has N-1 or N (default: 4; 3 "
                        "with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="a smaller workload (6 conversations of up to 3 turns)")
    parser.add_argument("--write-policy", default="config",
                        choices=[p.value for p in WritePolicy] + ["config"],
                        help="when turns are backed up to the host (default: the config's; "
                        "config.yaml uses write_through so evicted history can come back)")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    parser.add_argument("--corrupt-host-byte", action="store_true",
                        help="testing aid: flip one byte of the host pool before the first "
                        "load-back; verification must then fail and name the page")
    parser.set_defaults(run=_demo)


def _demo(args: argparse.Namespace) -> int:
    from .engine import DemoOptions, EngineError, run_demo

    config = load_config(args.config)
    options = DemoOptions(
        seed=args.seed, device=args.device, conversations=args.conversations,
        turns=args.turns, quick=args.quick, corrupt_host_byte=args.corrupt_host_byte,
        write_policy=None if args.write_policy == "config" else WritePolicy(args.write_policy),
    )
    progress = _Progress(sys.stderr)
    try:
        report = run_demo(config, options, str(args.config), progress)
    except ValueError as exc:
        return _error(str(exc), USAGE_ERROR)
    except EngineError as exc:
        return _error(str(exc), FAILED)
    finally:
        progress.close()
    print(report.format())
    if args.json:
        try:
            report.write_json(args.json)
        except OSError as exc:
            return _error(f"{args.json}: cannot write the report ({exc.strerror})", USAGE_ERROR)
    failure = report.failure()
    if failure is not None:
        return _error(failure, FAILED)
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _error(message: str, code: int) -> int:
    print(f"hicache: error: {' '.join(message.split())}", file=sys.stderr)
    return code


class _Progress:
    """A one-line text progress bar on a terminal; silent when ``stream`` is not a TTY."""

    WIDTH = 30

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.enabled = stream.isatty()
        self.drawn = False

    def __call__(self, phase: str, done: int, total: int, note: str = "") -> None:
        if not self.enabled:
            return
        filled = self.WIDTH * done // max(total, 1)
        bar = "#" * filled + "." * (self.WIDTH - filled)
        self.stream.write(f"\r{phase:<8} [{bar}] {done}/{total} requests  {note}\x1b[K")
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.drawn = False


if __name__ == "__main__":
    sys.exit(main())
