"""The command line's parser and its error contract.

Every mistake the user can fix ends the command with one line on stderr,
``hicache: error: ...``, and exit code 2: argparse's own errors (:class:`CliParser`), an
option value of the wrong kind (:func:`integer` names the rule it breaks, never a Python
function), and :class:`UsageError` raised by a command before it starts its work.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NoReturn

FAILED = 1
USAGE_ERROR = 2
INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command ended by Ctrl-C


class UsageError(Exception):
    """A mistake on the command line (a bad value, an unwritable output path): one line,
    exit code 2."""


def one_line(message: str) -> str:
    """``message`` with every run of whitespace (newlines included) made one space."""
    return " ".join(message.split())


class CliParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line: ``PROG: error: MESSAGE; see 'PROG
    --help'`` (exit code 2) instead of the usage block and the message. Subcommand parsers
    made with ``add_subparsers`` are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR,
                  f"{self.prog}: error: {one_line(message)}; see '{self.prog} --help'\n")


def integer(minimum: int | None = None, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse ``type`` for a whole number (``>= minimum``, ``<= maximum`` when given),
    whose error says what is expected and what was given: ``expected a whole number >= 1,
    got 'x'``; a value above ``maximum``: ``expected a whole number <= 1000, got 5000``."""
    rule = "a whole number" if minimum is None else f"a whole number >= {minimum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {rule}, got {text!r}") from None
        if minimum is not None and value < minimum:
            raise argparse.ArgumentTypeError(f"expected {rule}, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"expected a whole number <= {maximum}, got {value}")
        return value

    return parse
