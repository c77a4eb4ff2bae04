"""Progress of a command's phases on the terminal, drawn by ``tqdm``.

One bar per phase (the demo's ``baseline`` and ``engine``), each with its rate and ETA,
redrawn to the terminal's current width and cleared when the phase ends, so only the
command's report stays on screen. Nothing is drawn unless both stdout and stderr are
terminals: output that goes to a file or a pipe carries no progress.
"""

from __future__ import annotations

import os
import sys
from types import TracebackType
from typing import Any, TextIO

from tqdm import tqdm


def is_interactive() -> bool:
    """Both stdout and stderr are terminals."""
    return sys.stdout.isatty() and sys.stderr.isatty()


def _columns(stream: TextIO) -> int:
    """The width of the terminal ``stream`` writes to; 0 when it reports none."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, AttributeError):
        return 0


class PhaseBars:
    """A callable ``(phase, done, total, note)`` that shows one bar per phase on ``stream``
    (stderr by default); ``enabled`` defaults to :func:`is_interactive`. Use it as a context
    manager, or call :meth:`close`, so the last bar is cleared even on an error."""

    def __init__(self, stream: TextIO | None = None, *, enabled: bool | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = is_interactive() if enabled is None else enabled
        self._phase: str | None = None
        self._bar: Any = None
        self._note = ""

    def __call__(self, phase: str, done: int, total: int, note: str = "") -> None:
        if not self.enabled:
            return
        if phase != self._phase or self._bar is None:
            self.close()
            self._phase, self._note = phase, ""
            # A terminal that reports no width (0 columns) gets a fixed 80-column bar.
            fixed = None if _columns(self.stream) else 80
            self._bar = tqdm(total=total, desc=phase, unit="req", file=self.stream,
                             ncols=fixed, dynamic_ncols=fixed is None, leave=False,
                             mininterval=0.1)
        bar = self._bar
        if note != self._note:
            self._note = note
            bar.set_postfix_str(note, refresh=False)
        bar.update(done - bar.n)

    def close(self) -> None:
        """Clear the current bar, if any."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._phase = None

    def __enter__(self) -> PhaseBars:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
