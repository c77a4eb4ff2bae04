"""Output paths checked before a command starts its work, so that a long run never ends in
an unwritable ``--json`` (or ``--plot``, ``--auto-table``, ``hicache init PATH``), nor in one
that overwrites the command's own input (:func:`check_not_input`)."""

from __future__ import annotations

import os
from pathlib import Path

from .parser import UsageError


def check_output_path(path: str | os.PathLike[str], option: str) -> None:
    """Raise :class:`UsageError` unless a file can be written at ``path``.

    The check opens the file for appending (which changes nothing in an existing file) and
    removes it again if it did not exist, so it holds for every user, root included, and
    for read-only file systems. ``option`` names the option in the message (``--json``).
    A symbolic link is written through, as the command will: the file it names is checked
    (and removed if the check made it), the link is left alone.
    """
    target = Path(os.path.realpath(path))
    if target.is_dir():
        raise UsageError(f"{option} {path}: is a directory; name a file to write")
    existed = target.exists()
    if existed and not target.is_file():
        raise UsageError(f"{option} {path}: not a regular file (a device, a pipe or a socket); "
                         f"name a file to write")
    try:
        with open(target, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise UsageError(f"{option} {path}: cannot write a file there ({reason}); name a "
                         f"file in an existing directory you can write to") from None
    if not existed:
        target.unlink(missing_ok=True)


def check_not_input(path: str | os.PathLike[str], option: str,
                    inputs: dict[str, str | os.PathLike[str] | None]) -> None:
    """Raise :class:`UsageError` when ``path`` (an output, ``option``) is one of ``inputs``
    (input option -> its path, ``None`` when not given): writing it would destroy what the
    command reads, e.g. ``--json`` naming the ``--config`` file."""
    for input_option, input_path in inputs.items():
        if input_path is not None and _same_file(path, input_path):
            raise UsageError(f"{option} {path}: is the {input_option} file, which it would "
                             f"overwrite; name another file to write")


def _same_file(first: str | os.PathLike[str], second: str | os.PathLike[str]) -> bool:
    """Whether both name one file (the same inode, or one resolved path if either is
    missing)."""
    try:
        return os.path.samefile(first, second)
    except OSError:
        return Path(first).resolve() == Path(second).resolve()
