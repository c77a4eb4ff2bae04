"""Checks of the benchmarks' option values, made before any work starts.

Each raises :class:`~hicache.cli.parser.UsageError` (exit code 2, one line) whose message
names the option, the value as given and what to give instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from hicache.cli.parser import UsageError
from hicache.storage.probe import probe_store
from hicache.storage.store_url import StoreLocation, parse_location

from .trace_file import BLOCK, TraceError, TraceRequest, read_trace

PROBE_TIMEOUT_S = 2.0


def at_least(option: str, values: int | Sequence[int], minimum: int) -> None:
    """Every value of ``option`` (one or several) is a whole number ``>= minimum``."""
    for value in [values] if isinstance(values, int) else values:
        if value < minimum:
            raise UsageError(f"{option} {value}: must be >= {minimum}; give a whole number "
                             f">= {minimum}")


def in_range(option: str, value: float, low: float, high: float = math.inf, *,
             low_open: bool = False) -> None:
    """``value`` is finite and within ``[low, high]`` (``(low, high]`` when ``low_open``)."""
    below = value <= low if low_open else value < low
    if not math.isfinite(value) or below or value > high:
        bound = f"> {low:g}" if low_open else f">= {low:g}"
        rule = f"a finite number {bound}" + ("" if math.isinf(high) else f" and <= {high:g}")
        raise UsageError(f"{option} {value:g}: must be {rule}; give {rule}")


def capacities(option: str, values: Sequence[str], *, host_at_least_device: bool
               ) -> list[tuple[int, int]]:
    """``DEVICE:HOST`` block counts: two whole numbers each, both >= 1 (and host >= device
    when ``host_at_least_device``)."""
    rule = "host >= device" if host_at_least_device else "host >= 1 block"
    result = []
    for text in values:
        try:
            device, host = (int(part) for part in text.split(":"))
        except ValueError:
            raise UsageError(f"{option} {text}: not DEVICE:HOST; give two whole numbers of "
                             f"512-token blocks, e.g. 2000:8000") from None
        if device < 1 or host < (device if host_at_least_device else 1):
            raise UsageError(f"{option} {text}: need device >= 1 block and {rule}, "
                             f"e.g. 2000:8000")
        result.append((device, host))
    return result


def fits(option: str, capacities: Sequence[tuple[int, int]],
         requests: Sequence[TraceRequest]) -> None:
    """The device of every capacity holds the longest request of the trace."""
    if not requests:
        return
    longest = max(request.input_length for request in requests)
    need = -(-longest // BLOCK)
    for device, host in capacities:
        if device < need:
            raise UsageError(f"{option} {device}:{host}: the trace's longest request of "
                             f"{longest} tokens needs a device of >= {need} blocks; give "
                             f"device >= {need}")


def trace(option: str, path: Path, limit: int) -> list[TraceRequest]:
    """The first ``limit`` requests of the trace ``path``, read and validated."""
    try:
        return read_trace(path, limit)
    except TraceError as exc:
        raise UsageError(f"{option} {exc}") from None


def directory(option: str, path: Path) -> None:
    """``path`` is a directory, or does not exist yet under an existing directory."""
    if path.exists() and not path.is_dir():
        raise UsageError(f"{option} {path}: exists and is not a directory; name a directory "
                         f"(or a path where one can be made)")
    parent = next((p for p in path.absolute().parents if p.exists()), None)
    if not path.exists() and parent is not None and not parent.is_dir():
        raise UsageError(f"{option} {path}: {parent} is not a directory; name a directory")


def store(option: str, value: str, *, schemes: Sequence[str]) -> StoreLocation:
    """``value`` parsed as a store location of one of ``schemes`` (``file``, ``redis``,
    ``redis+cluster``); a ``file`` location must be a directory or a path where one can be
    made."""
    forms = " or ".join("a directory" if s == "file" else f"{s}://host:port" for s in schemes)
    if "file" not in schemes and not value.startswith(tuple(f"{s}://" for s in schemes)):
        raise UsageError(f"{option} {value}: not a {forms} URL; give e.g. "
                         f"{schemes[0]}://127.0.0.1:6379")
    try:
        location = parse_location(value)
    except ValueError as exc:
        raise UsageError(f"{option} {value}: {exc}") from None
    if location.scheme not in schemes:
        raise UsageError(f"{option} {value}: a {location.scheme} location; give {forms}")
    if location.path is not None:
        directory(option, Path(location.path))
    return location


def reachable(option: str, url: str) -> str | None:
    """Why the Redis server (or cluster) at ``url`` cannot be used now, naming ``option``;
    ``None`` when it answers."""
    probe = probe_store(url, timeout_s=PROBE_TIMEOUT_S)
    # the probe speaks of the config's key; here the deadline is this module's
    report = probe.report.replace(" (storage.timeout_s)", "")
    return None if probe.ok else f"{option} {url}: {report}; start it or name one that runs"
