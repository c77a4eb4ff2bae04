"""The CLI on a real terminal (a pseudo-terminal driven by pexpect) and under Ctrl-C: progress
bars that fit the width and show an ETA for every phase, no progress when output is
redirected, and one line with exit code 130 on an interrupt, the service stopped."""

from __future__ import annotations

import _thread
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pexpect
import pytest
from thread_helpers import service_thread_names

from hicache.bench.redis_local import free_port
from hicache.cli import main
from hicache.config import default_config_text

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
DEMO = [sys.executable, "-m", "hicache.cli", "demo"]



def config_on_port(directory: Path, port: int) -> Path:
    """The default config, serving metrics on ``port``."""
    path = directory / "config.yaml"
    path.write_text(default_config_text().replace("metrics_port: 9400",
                                                  f"metrics_port: {port}"))
    return path


def screen_chunks(output: str) -> list[str]:
    """What each carriage return or newline leaves on a line, escape sequences removed."""
    return [ANSI.sub("", chunk) for chunk in re.split(r"[\r\n]", output)]


def run_on_terminal(command: str, columns: int, timeout_s: float = 120) -> tuple[str, int]:
    """Run ``command`` (a shell line) on a pseudo-terminal of ``columns``; its output and
    exit status."""
    child = pexpect.spawn("/bin/sh", ["-c", command], dimensions=(24, columns),
                          encoding="utf-8", codec_errors="replace", timeout=timeout_s)
    output = child.read()
    child.close()
    assert child.exitstatus is not None, f"killed by signal {child.signalstatus}"
    return output, child.exitstatus


@pytest.mark.parametrize("columns", [80, 48])
def test_progress_fits_the_terminal_with_an_eta_per_phase(columns: int) -> None:
    """Every line the bars draw fits the terminal; baseline and engine each show an ETA."""
    demo = " ".join(DEMO)
    output, status = run_on_terminal(f"{demo} --quick", columns)
    assert status == 0, output
    chunks = screen_chunks(output)
    bars = [c for c in chunks if c.startswith(("baseline:", "engine:"))]
    assert bars, output
    assert max(len(c.rstrip()) for c in bars) < columns
    for phase in ("baseline:", "engine:"):
        assert any(c.startswith(phase) and re.search(r"<\d\d:\d\d", c) for c in bars), phase
    assert "result             PASS" in output


def test_no_progress_when_stdout_is_redirected(tmp_path: Path) -> None:
    """On a terminal, with stdout going to a file, nothing is drawn on stderr."""
    report = tmp_path / "report.txt"
    demo = " ".join(DEMO)
    output, status = run_on_terminal(f"{demo} --quick > {report}", 80)
    assert status == 0, output
    assert output == ""
    assert "result             PASS" in report.read_text()


def test_no_progress_through_pipes() -> None:
    """Without a terminal at all, stderr stays empty."""
    result = subprocess.run([*DEMO, "--quick"], capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


def test_ctrl_c_on_a_terminal_is_one_line_and_130(tmp_path: Path) -> None:
    """Ctrl-C while the engine serves: one line 'hicache: interrupted', exit code 130, no
    traceback, and the metrics port is free again."""
    port = free_port()
    config = config_on_port(tmp_path, port)
    # PYTHONFAULTHANDLER: should the demo hang after the Ctrl-C, SIGABRT makes it print
    # every thread's stack, which the failure then shows
    child = pexpect.spawn(DEMO[0], [*DEMO[1:], "--config", str(config)], dimensions=(24, 80),
                          encoding="utf-8", codec_errors="replace", timeout=120,
                          env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    child.expect("engine:")
    child.sendintr()
    try:
        child.expect(pexpect.EOF)
    except pexpect.TIMEOUT:
        child.kill(signal.SIGABRT)
        child.expect(pexpect.EOF, timeout=30)
        pytest.fail(f"the demo did not exit within 120 s of Ctrl-C; its threads:\n"
                    f"{child.before}")
    child.close()
    output = child.before
    assert child.exitstatus == 130, output
    assert "Traceback" not in output
    lines = [c.strip() for c in screen_chunks(output) if c.strip() and c.strip() != "^C"]
    assert lines[-1] == "hicache: interrupted"
    assert not any(c.startswith(("hicache demo:", "Traceback")) for c in lines)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))


def test_interrupt_stops_the_service(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An interrupt while the service runs returns 130 with the service's thread joined and
    its metrics endpoint closed."""
    port = free_port()
    config = config_on_port(tmp_path, port)

    def interrupt_once_serving() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
            except OSError:
                time.sleep(0.005)
                continue
            _thread.interrupt_main()
            return

    watcher = threading.Thread(target=interrupt_once_serving, daemon=True)
    watcher.start()
    assert main(["demo", "--config", str(config)]) == 130
    watcher.join()
    assert capsys.readouterr().err == "hicache: interrupted\n"
    assert not service_thread_names(), service_thread_names()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
