"""Result types of the transfer benchmark and their JSON form (no GPU needed).

A run produces one :class:`BenchResult`: the copy-engine ceilings, the matmul reference, the
staged backend's staging memory, one :class:`Measurement` per (backend, kind, page size,
layout, size) and the auto table derived from them. ``save_json``/``load_json`` round-trip it
exactly, so a result saved on the GPU machine can be re-rendered anywhere.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WRITE, LOAD, BOTH = "write", "load", "both"
KINDS = (WRITE, LOAD, BOTH)
FORMAT_VERSION = 1


@dataclass
class Measurement:
    """One timed configuration.

    ``kind``: ``write`` (device to host, all layers in one op), ``load`` (host to device,
    issued in layer groups as the controller does) or ``both`` (a write and a load issued
    together). ``seconds``: median op time from its start event to its finish event (for
    ``both``: from a common reference event to the later finish, the two issued together
    by ``start_transfers``). ``pct_of_ceiling``: of the one-way ceiling of the direction,
    or of the both-ways ceiling for ``both``.
    ``slowdown_pct``: how much a concurrent bf16 matmul loop slowed while the op ran
    (``None`` when not measured). Loads also carry ``layer0_s`` (start to layer 0 ready) and
    the ratios ``layer0_ratio`` (to one layer's bytes / ceiling) and ``all_ratio`` (all
    layers ready, to all bytes / ceiling). ``executed_by``: the backends that ran the ops
    (differs from ``backend`` for ``auto``). ``ops``: how many ops the median is over.
    ``issue_s`` / ``wall_s``: median host-clock seconds per op to issue it / to issue and
    wait for it. ``engine_copy_s`` (writes and loads of the main size): seconds an
    engine's small copy in the op's direction took when issued right after the op
    (:mod:`hicache.bench.engine_copy`; ``Ceiling.engine_copy_*_s`` is the copy alone).
    ``separate_s`` (``both``): the same pair issued by two calls, the slower order's median.
    """

    backend: str
    kind: str
    page_size: int
    layout: str
    tokens: int
    bytes: int
    seconds: float
    gb_per_s: float
    pct_of_ceiling: float
    slowdown_pct: float | None = None
    layer0_s: float | None = None
    layer0_ratio: float | None = None
    all_ratio: float | None = None
    issue_s: float | None = None
    wall_s: float | None = None
    executed_by: str = ""
    ops: int = 1
    engine_copy_s: float | None = None
    separate_s: float | None = None


@dataclass
class Ceiling:
    """Contiguous pinned copies of ``bytes`` by the copy engine, in GB/s (1e9 B/s).

    ``bidir_gb_per_s``: a device-to-host and a host-to-device copy on two streams at once,
    both copies' bytes over the wall time. ``*_slowdown_pct``: matmul slowdown during a copy.
    ``engine_copy_*_s``: seconds of an engine's small copy with nothing else in flight
    (:mod:`hicache.bench.engine_copy`), the reference for ``Measurement.engine_copy_s``.
    """

    bytes: int
    d2h_gb_per_s: float
    h2d_gb_per_s: float
    bidir_gb_per_s: float
    d2h_slowdown_pct: float | None = None
    h2d_slowdown_pct: float | None = None
    engine_copy_d2h_s: float | None = None
    engine_copy_h2d_s: float | None = None

    def one_way(self, kind: str) -> float:
        """The ceiling a ``write`` (d2h) or ``load`` (h2d) is compared with."""
        if kind == BOTH:
            return self.bidir_gb_per_s
        return self.d2h_gb_per_s if kind == WRITE else self.h2d_gb_per_s


@dataclass
class BenchResult:
    """Everything one benchmark run measured.

    ``meta``: device name, software versions, date, geometry and options. ``staging_bytes``:
    the staged backend's staging memory, ``{"write": ..., "load": ...}`` (the write and the
    load stream's lanes, each two chunks of every layer). ``matmul_alone_s``: one bf16
    matmul of the reference loop on its own.
    ``auto_table``: the table written by ``--auto-table`` (rows, measured_on, measurements).
    """

    meta: dict[str, Any]
    ceiling: Ceiling
    matmul_alone_s: float
    staging_bytes: dict[str, int]
    measurements: list[Measurement] = field(default_factory=list)
    auto_table: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        """The main transfer size (tokens) of this run."""
        return int(self.meta["tokens"])

    def main_rows(self) -> list[Measurement]:
        """Measurements at the main transfer size, in run order."""
        return [m for m in self.measurements if m.tokens == self.tokens]

    def find(self, backend: str, kind: str, page_size: int, layout: str,
             tokens: int | None = None) -> Measurement | None:
        """The measurement of one configuration (main size by default), or ``None``."""
        size = self.tokens if tokens is None else tokens
        for m in self.measurements:
            if (m.backend, m.kind, m.page_size, m.layout, m.tokens) == (
                    backend, kind, page_size, layout, size):
                return m
        return None


def to_json(result: BenchResult) -> dict[str, Any]:
    """Plain JSON-ready dict of ``result``."""
    return {"format": FORMAT_VERSION, **dataclasses.asdict(result)}


def from_json(data: dict[str, Any]) -> BenchResult:
    """Inverse of :func:`to_json`. Raises ``ValueError`` on a file of another format or a
    malformed one."""
    if data.get("format") != FORMAT_VERSION:
        raise ValueError(
            f"not a hicache bench result of format {FORMAT_VERSION} "
            f"(format {data.get('format')!r}); re-run `hicache bench --json PATH`"
        )
    try:
        return BenchResult(
            meta=dict(data["meta"]),
            ceiling=Ceiling(**data["ceiling"]),
            matmul_alone_s=float(data["matmul_alone_s"]),
            staging_bytes={k: int(v) for k, v in data["staging_bytes"].items()},
            measurements=[Measurement(**m) for m in data["measurements"]],
            auto_table=dict(data.get("auto_table", {})),
        )
    except KeyError as exc:
        raise ValueError(f"malformed hicache bench result: no field {exc}; re-run "
                         f"`hicache bench --json PATH`") from exc
    except (TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"malformed hicache bench result ({exc}); re-run "
                         f"`hicache bench --json PATH`") from exc


def save_json(result: BenchResult, path: Path) -> None:
    """Write ``result`` to ``path`` (indented JSON)."""
    path.write_text(json.dumps(to_json(result), indent=2) + "\n", encoding="utf-8")


def load_json(path: Path) -> BenchResult:
    """Read a result written by :func:`save_json`. Raises ``ValueError`` whose message
    starts with ``path``: a file that cannot be read (missing, a directory), is not UTF-8
    JSON, or is no saved result."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror or exc}); name a file "
                         f"written by `hicache bench --json PATH`") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); "
                         f"not a hicache bench result") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a hicache bench result (not a JSON object)")
    try:
        return from_json(data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
