"""Output paths checked before a command starts its work, so that a long run never ends in
an unwritable ``--json`` (or ``--plot``, ``--auto-table``, ``hicache init PATH``)."""

from __future__ import annotations

import os
from pathlib import Path

from .parser import UsageError


def check_output_path(path: str | os.PathLike[str], option: str) -> None:
    """Raise :class:`UsageError` unless a file can be written at ``path``.

    The check opens the file for appending (which changes nothing in an existing file) and
    removes it again if it did not exist, so it holds for every user, root included, and
    for read-only file systems. ``option`` names the option in the message (``--json``).
    """
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"{option} {path}: is a directory; name a file to write")
    existed = target.exists()
    try:
        with open(target, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise UsageError(f"{option} {path}: cannot write a file there ({reason}); name a "
                         f"file in an existing directory you can write to") from None
    if not existed:
        target.unlink(missing_ok=True)
