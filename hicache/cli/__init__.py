"""The ``hicache`` command line: ``hicache init``, ``check-config``, ``demo``, ``bench``.

:func:`main` is the console script's entry point. It loads the commands on first call, so
that importing this package (as :mod:`hicache.bench` does for its parser) costs nothing.
The modules: :mod:`~hicache.cli.app` (the parser, the dispatch and the exit codes), one
module per command, :mod:`~hicache.cli.parser` (one-line errors, argument types),
:mod:`~hicache.cli.output_path` and :mod:`~hicache.cli.progress`.
"""

from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (``sys.exit(main())``)."""
    from .app import run_cli

    return run_cli(argv)


__all__ = ["main"]
