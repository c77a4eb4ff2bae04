"""``hicache demo``: the reference engine on a config, every token and loaded page verified."""

from __future__ import annotations

import argparse
import sys

from hicache.config import (
    DEFAULT_CONFIG_NAME,
    HiCacheConfig,
    WritePolicy,
    load_config,
    load_default_config,
)

from .demo_checks import check_demo_args
from .parser import FAILED, USAGE_ERROR, UsageError, integer, one_line
from .progress import PhaseBars

MAX_SEED = 2**64 - 1  # torch's generator takes an unsigned 64-bit seed
MAX_CONVERSATIONS = 10_000  # the workload is drawn up front: bound its size
MAX_TURNS = 1_000  # far past what the default pools hold (that fails as a named EngineError)


def add_demo(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "demo",
        help="run the reference engine on a config and verify every token and loaded page",
        description="Serve many multi-turn conversations with a tiny seeded decoder through "
        "the cache service: prefixes are matched on the device, evicted to the host and "
        "loaded back. Every generated token is checked against a baseline that never "
        "evicts anything, and every page loaded back against a digest of its backup. "
        "Exit code 0: verified; 1: a mismatch (named) or the pools cannot hold one "
        "request; 2: a usage or config error; 130: interrupted (Ctrl-C).",
    )
    parser.add_argument("--config", default=None, metavar="PATH",
                        help="YAML config (default: the built-in default config; 'hicache "
                        "init' writes a copy of it to edit)")
    parser.add_argument("--device", default=None,
                        help="cpu, cuda or cuda:N (default: the config's device_pool.device); "
                        "on cuda the forward runs on its own stream")
    parser.add_argument("--seed", type=integer(0, MAX_SEED), default=0,
                        help="seed of the weights and the workload (default: %(default)s)")
    parser.add_argument("--conversations", type=integer(1, MAX_CONVERSATIONS), default=None,
                        metavar="N",
                        help="conversations (default: 12; 6 with --quick)")
    parser.add_argument("--turns", type=integer(1, MAX_TURNS), default=None, metavar="N",
                        help="most turns per conversation; each has N-1 or N (default: 4; 3 "
                        "with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="a smaller workload (6 conversations of up to 3 turns)")
    parser.add_argument("--write-policy", default="config",
                        choices=[p.value for p in WritePolicy] + ["config"],
                        help="when turns are backed up to the host (default: the config's; "
                        "the default config uses write_through so evicted history can come "
                        "back)")
    parser.add_argument("--storage", default=None, metavar="STORE",
                        help="add a shared store (L3): 'file' (a temporary directory), a "
                        "directory, or redis://host:port (redis+cluster://h:p,... for a "
                        "cluster); after the run a second, empty instance serves the same "
                        "requests from the store, verified the same way")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    parser.add_argument("--corrupt-host-byte", action="store_true",
                        help="testing aid: flip one byte of the host pool before the first "
                        "load-back; verification must then fail and name the page")
    parser.set_defaults(run=run_demo_command)


def run_demo_command(args: argparse.Namespace) -> int:
    """Handler of ``hicache demo``: check the outputs, run, print the report."""
    config, name = _config(args.config)
    check_demo_args(args, config)
    from hicache.engine import DemoOptions, EngineError, run_demo
    from hicache.metrics.exporter import MetricsBindError

    options = DemoOptions(
        seed=args.seed, device=args.device, conversations=args.conversations,
        turns=args.turns, quick=args.quick, corrupt_host_byte=args.corrupt_host_byte,
        storage=args.storage,
        write_policy=None if args.write_policy == "config" else WritePolicy(args.write_policy),
    )
    try:
        with PhaseBars() as progress:
            report = run_demo(config, options, name, progress)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    except MetricsBindError as exc:  # the service's metrics address (the config's)
        return _failed(exc.strerror or str(exc), USAGE_ERROR)
    except EngineError as exc:
        return _failed(str(exc))
    print(report.format())
    if args.json is not None:
        try:
            report.write_json(args.json)
        except OSError as exc:  # checked at the start; something changed since
            return _failed(f"{args.json}: cannot write the report ({exc.strerror})")
    failure = report.failure()
    if failure is not None:
        return _failed(failure)
    return 0


def _config(path: str | None) -> tuple[HiCacheConfig, str]:
    if path is None:
        return load_default_config(), DEFAULT_CONFIG_NAME
    return load_config(path), path


def _failed(message: str, code: int = FAILED) -> int:
    print(f"hicache: error: {one_line(message)}", file=sys.stderr)
    return code


__all__ = ["add_demo", "run_demo_command"]
