"""The demo's progress bars in-process (the terminal tests see them through a pty, where
no test can look at the bar's state): nothing is drawn off a terminal, one bar a phase, the
count is the phase's progress (not a sum of them), the note follows, a phase change or a
close clears the line, and a stream with no width gets 80 columns."""

from __future__ import annotations

import io

import pytest

from hicache.cli import progress
from hicache.cli.progress import PhaseBars

CLEAR = "\r" + " " * 80 + "\r"


def test_nothing_is_drawn_off_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = io.StringIO()
    with PhaseBars(stream, enabled=False) as bars:
        bars("engine", 3, 10, "a note")
    assert stream.getvalue() == ""
    for out_tty, err_tty in ((True, False), (False, True), (False, False)):
        monkeypatch.setattr(progress.sys.stdout, "isatty", lambda tty=out_tty: tty)
        monkeypatch.setattr(progress.sys.stderr, "isatty", lambda tty=err_tty: tty)
        assert not PhaseBars(stream).enabled  # a pipe on either side: no progress
    monkeypatch.setattr(progress.sys.stdout, "isatty", lambda: True)
    monkeypatch.setattr(progress.sys.stderr, "isatty", lambda: True)
    assert PhaseBars(stream).enabled


def test_one_bar_a_phase_counting_its_own_progress() -> None:
    stream = io.StringIO()
    with PhaseBars(stream, enabled=True) as bars:
        bars("baseline", 0, 5)
        first = stream.getvalue()
        assert first.startswith("\rbaseline:   0%|") and first.endswith("| 0/5 [00:00<?, ?req/s]")
        assert len(first) == 1 + 80  # no terminal width reported: 80 columns
        bar = bars._bar
        bars("baseline", 3, 5, "2 loads")
        bars("baseline", 4, 5, "2 loads")
        assert bars._bar is bar and CLEAR not in stream.getvalue()  # the same bar goes on
        assert (bar.n, bar.total, bar.desc, bar.postfix) == (4, 5, "baseline", "2 loads")
        bars("engine", 1, 10)  # a new phase: the old bar's line cleared, a new bar
        assert CLEAR + "\rengine:   0%|" in stream.getvalue()
        assert bars._bar is not bar and (bars._bar.n, bars._bar.total) == (1, 10)
        assert bars._bar.postfix is None  # the note belonged to the phase before
    assert stream.getvalue().endswith(CLEAR)  # leaving the block clears the last bar
    assert bars._bar is None


def test_a_closed_phase_called_again_starts_a_new_bar() -> None:
    stream = io.StringIO()
    bars = PhaseBars(stream, enabled=True)
    bars("engine", 2, 10)
    bars.close()
    bars.close()  # nothing left to clear
    assert stream.getvalue().count(CLEAR) == 1
    bars("engine", 6, 10)
    assert bars._bar is not None and bars._bar.n == 6
    bars.close()
