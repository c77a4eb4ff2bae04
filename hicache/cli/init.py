"""``hicache init [PATH]``: write the built-in default config, commented, to start from."""

from __future__ import annotations

import argparse
from pathlib import Path

from hicache.config import default_config_text

from .output_path import check_output_path
from .parser import UsageError

DEFAULT_PATH = "config.yaml"


def add_init(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "init",
        help="write the default config, commented, to a file to start from",
        description="Write hicache's built-in default config (a small hybrid model that runs "
        "on a CPU; every key commented) to PATH. An existing file is kept unless --force.",
    )
    parser.add_argument("path", metavar="PATH", nargs="?", default=DEFAULT_PATH,
                        help="where to write it (default: %(default)s)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing file")
    parser.set_defaults(run=run_init)


def run_init(args: argparse.Namespace) -> int:
    """Handler of ``hicache init``."""
    path = Path(args.path)
    if path.exists() and not path.is_dir() and not args.force:
        raise UsageError(f"{path}: already exists; keep it, name another PATH, or pass "
                         f"--force to overwrite it")
    check_output_path(path, "PATH")
    path.write_text(default_config_text(), encoding="utf-8")
    print(f"wrote {path}; edit it, check it with 'hicache check-config {path}' and run "
          f"'hicache demo --config {path}'")
    return 0
