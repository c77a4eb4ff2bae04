"""The ``hicache`` command: its parser, and how every command ends.

Each subcommand is an ``add_<name>(commands)`` function that registers its parser and sets
``run`` to a handler ``(args) -> exit code``; :func:`run_cli` dispatches. How a command
ends is the same for all of them:

- 0 done, 1 failed (a verification, a benchmark), with one line on stderr;
- 2 a mistake the user can fix (an argument, a config, an output path): one line on stderr,
  ``hicache: error: ...``, raised before the command starts its work;
- a reader that goes away (``hicache check-config | head``) ends the command quietly, 1;
- 130 interrupted with Ctrl-C: one line, ``hicache: interrupted``; a running service has
  been stopped (its thread joined, its transfers drained, its metrics port closed) by the
  context managers the interrupt unwound through.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from hicache import __version__
from hicache.bench import add_bench_parser
from hicache.config import ConfigError

from .check_config import add_check_config
from .demo import add_demo
from .init import add_init
from .parser import FAILED, INTERRUPTED, USAGE_ERROR, CliParser, UsageError, one_line
from .progress import is_interactive

Command = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    """The ``hicache`` parser with every subcommand."""
    parser: argparse.ArgumentParser = CliParser(  # its subcommand parsers are CliParsers too
        prog="hicache",
        description="Hierarchical KV-cache controller: GPU pool (L1), pinned host pool (L2), "
        "asynchronous stream-safe transfers between them. Start with 'hicache demo'.",
    )
    parser.add_argument("--version", action="version", version=f"hicache {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_init(commands)
    add_check_config(commands)
    add_demo(commands)
    add_bench_parser(commands)
    return parser


def run_cli(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the command; returns the exit code."""
    try:
        args = build_parser().parse_args(argv)
        run: Command = args.run
        return run(args)
    except (ConfigError, UsageError) as exc:
        print(f"hicache: error: {one_line(str(exc))}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        # On a terminal the line replaces the "^C" the terminal echoed.
        start = "\r\x1b[K" if is_interactive() else ""
        print(f"{start}hicache: interrupted", file=sys.stderr)
        return INTERRUPTED
    except BrokenPipeError:
        # Python would report the failed flush of stdout again at exit: point it elsewhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return FAILED
