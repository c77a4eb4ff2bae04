"""The benchmark's printed report: header, main table, target check and auto table.

Pure formatting of a :class:`~hicache.bench.results.BenchResult`; runs without a GPU (for
``--from-json``). The targets are issue 14's goals for the transfer engine (H100).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .auto import CANDIDATES, worst_by_backend
from .results import BOTH, LOAD, WRITE, BenchResult, Measurement

TARGET_BACKENDS = ("staged", "auto")
BACKEND_ORDER = ("torch", "kernel", "staged", "direct", "auto")
# issue 14's goals: at pages of 16 and more, writes >= 97% and layer-wise loads >= 95% of
# the one-way ceiling (page_first_direct; layer_first reaches them too), the concurrent
# matmul slowed <= 3% on page_first_direct and every row auto picks; both directions at
# once >= 90% of the two-stream ceiling on every layout auto serves
WRITE_PCT_LARGE_PAGES = 97.0  # page size >= 16
LOAD_PCT_LARGE_PAGES = 95.0
ONE_WAY_PCT_SMALL_PAGES = 90.0
BOTH_PCT = 90.0
SLOWDOWN_PCT = 3.0
ALL_READY_RATIO = 1.15
LAYER0_RATIO = 3.0
LARGE_PAGE = 16


def _num(value: float | None, width: int, digits: int = 1) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def _get(m: Measurement | None, attr: str, scale: float = 1.0) -> float | None:
    """``m.attr * scale``, or ``None`` when ``m`` or the value is missing."""
    value = getattr(m, attr) if m is not None else None
    return None if value is None else float(value) * scale


def header_lines(result: BenchResult) -> list[str]:
    """What was moved, on what, and the references every percentage is taken against."""
    meta, ceiling = result.meta, result.ceiling
    gib = meta["transfer_bytes"] / 2**30
    slots = ("one run of consecutive pages per op" if meta.get("slots") == "runs"
             else "random whole pages")
    return [
        f"{meta['device']}, torch {meta['torch']}, {meta['date']}",
        f"{meta['tokens']} tokens x {meta['layers']} layers x K,V x "
        f"{meta['token_bytes'] // (2 * meta['layers'])} B rows = {gib:.2f} GiB per transfer "
        f"(bf16, {meta['heads']} KV heads x {meta['head_dim']}); device slots: {slots}; "
        f"host slots: as the host allocator hands them out; median of {meta['repeats']} "
        f"(torch {meta['torch_repeats']})",
        f"ceiling, contiguous pinned copy: d2h {ceiling.d2h_gb_per_s:.1f} GB/s, "
        f"h2d {ceiling.h2d_gb_per_s:.1f} GB/s, both ways at once {ceiling.bidir_gb_per_s:.1f} "
        f"GB/s total; matmul slowdown during the copy: d2h "
        f"{_num(ceiling.d2h_slowdown_pct, 0)}%, h2d {_num(ceiling.h2d_slowdown_pct, 0)}%",
        f"matmul loop: bf16 {meta['matmul_size']}^3, {result.matmul_alone_s * 1e3:.2f} ms "
        f"alone; staged backend staging memory: {result.staging_bytes['write'] / 2**20:.1f} MiB "
        f"(write stream) + {result.staging_bytes['load'] / 2**20:.1f} MiB (load stream), "
        f"{meta['staging_tokens']} tokens of every layer per chunk",
    ]


def layout_width(layouts: list[str], least: int = 12) -> int:
    """Width of a layout column: ``least``, or wider for a longer name (page_first_direct),
    so reports without one keep their columns."""
    return max([least, *(len(name) + 1 for name in layouts)])


def main_header(width: int = 12) -> str:
    """The main table's header line, with a layout column ``width`` wide."""
    return (f"{'backend':<8}{'page':>4} {'layout':<{width}}{'write':>7}{'%d2h':>6}{'mm%w':>6}"
            f"{'load':>8}{'%h2d':>6}{'L0 ms':>7}{'L0/1L':>6}{'all/B':>6}{'mm%l':>6}"
            f"{'both':>8}{'%bidir':>7}  ran")

LEGEND = [
    "write/load/both: GB/s (1e9 B/s), op start to finish event; %d2h/%h2d/%bidir: of the "
    "ceiling; mm%w/mm%l: slowdown of",
    "the concurrent matmul loop during the write/load; L0 ms: load start to layer 0 ready; "
    "L0/1L: that over one layer's",
    "bytes / h2d ceiling; all/B: all layers ready over all bytes / h2d ceiling; ran (auto): "
    "what ran write/load/both",
]


def main_table(result: BenchResult) -> list[str]:
    """One line per (backend, page size, layout) at the main size."""
    configs = {(m.backend, m.page_size, m.layout) for m in result.main_rows()}
    width = layout_width([c[2] for c in configs])
    header = main_header(width)
    lines = [header, "-" * len(header)]
    order = {name: i for i, name in enumerate(BACKEND_ORDER)}
    for backend, page, layout in sorted(configs, key=lambda c: (c[1], c[2],
                                                                order.get(c[0], 99), c[0])):
        w, ld, both = (result.find(backend, kind, page, layout) for kind in (WRITE, LOAD, BOTH))
        ran = "/".join(m.executed_by if m else "-" for m in (w, ld, both))
        ran = "" if {w and w.executed_by, ld and ld.executed_by} <= {backend} else ran
        lines.append(
            f"{backend:<8}{page:>4} {layout:<{width}}"
            f"{_num(_get(w, 'gb_per_s'), 7)}{_num(_get(w, 'pct_of_ceiling'), 6)}"
            f"{_num(_get(w, 'slowdown_pct'), 6)}"
            f"{_num(_get(ld, 'gb_per_s'), 8)}{_num(_get(ld, 'pct_of_ceiling'), 6)}"
            f"{_num(_get(ld, 'layer0_s', 1e3), 7, 2)}"
            f"{_num(_get(ld, 'layer0_ratio'), 6, 2)}{_num(_get(ld, 'all_ratio'), 6, 2)}"
            f"{_num(_get(ld, 'slowdown_pct'), 6)}"
            f"{_num(_get(both, 'gb_per_s'), 8)}{_num(_get(both, 'pct_of_ceiling'), 7)}  "
            f"{ran}".rstrip()
        )
    return lines


def load_sizes_table(result: BenchResult) -> list[str]:
    """One line per layer-wise load measured (every size), with the CPU time its issue took:
    an issue longer than the op means the CPU, not the link, sets the pace."""
    loads = [m for m in result.measurements if m.kind == LOAD]
    if not loads:
        return ["layer-wise loads by size: none measured"]
    width = layout_width([m.layout for m in loads])
    order = {name: i for i, name in enumerate(BACKEND_ORDER)}
    head = (f"{'backend':<8}{'page':>4} {'layout':<{width}}{'tokens':>7}{'load':>8}{'%h2d':>6}"
            f"{'op ms':>9}{'issue ms':>10}{'issue/op':>9}{'L0 ms':>7}")
    lines = ["layer-wise loads by size (issue ms: CPU time to issue one op; issue/op: that "
             "over the op's time on the GPU)", head, "-" * len(head)]
    for m in sorted(loads, key=lambda m: (m.page_size, m.layout, order.get(m.backend, 99),
                                          m.backend, m.tokens)):
        ratio = None if m.issue_s is None else m.issue_s / m.seconds
        lines.append(
            f"{m.backend:<8}{m.page_size:>4} {m.layout:<{width}}{m.tokens:>7}"
            f"{m.gb_per_s:>8.1f}{m.pct_of_ceiling:>6.1f}{m.seconds * 1e3:>9.3f}"
            f"{_num(_get(m, 'issue_s', 1e3), 10, 3)}{_num(ratio, 9, 2)}"
            f"{_num(_get(m, 'layer0_s', 1e3), 7, 2)}")
    return lines


def engine_copy_table(result: BenchResult) -> list[str]:
    """One line per configuration measured with an engine's copy beside its main-size ops:
    how long that copy took, next to the same copy alone (the ceiling's figures)."""
    rows = [m for m in result.main_rows() if m.engine_copy_s is not None]
    ceiling = result.ceiling
    if not rows or ceiling.engine_copy_d2h_s is None or ceiling.engine_copy_h2d_s is None:
        return ["an engine's copy during an op: not measured"]
    configs = sorted({(m.backend, m.page_size, m.layout) for m in rows},
                     key=lambda c: (c[1], c[2], BACKEND_ORDER.index(c[0])
                                    if c[0] in BACKEND_ORDER else 99, c[0]))
    width = layout_width([c[2] for c in configs])
    head = f"{'backend':<8}{'page':>4} {'layout':<{width}}{'write':>9}{'load':>9}"
    lines = [f"an engine's 64 KiB copy on its own stream, issued right after a "
             f"{result.tokens}-token op, in the op's direction: ms from its issue until "
             f"done, host clock (alone: "
             f"{ceiling.engine_copy_d2h_s * 1e3:.3f} to the host, "
             f"{ceiling.engine_copy_h2d_s * 1e3:.3f} to the device)", head, "-" * len(head)]
    for backend, page, layout in configs:
        w, ld = (result.find(backend, kind, page, layout) for kind in (WRITE, LOAD))
        lines.append(f"{backend:<8}{page:>4} {layout:<{width}}"
                     f"{_num(_get(w, 'engine_copy_s', 1e3), 9, 3)}"
                     f"{_num(_get(ld, 'engine_copy_s', 1e3), 9, 3)}")
    return lines


@dataclass(frozen=True)
class Target:
    """One goal checked against one measured value."""

    backend: str
    page_size: int
    layout: str
    name: str
    value: float | None
    bound: float
    at_least: bool  # True: value >= bound is met; False: value <= bound is met

    @property
    def met(self) -> bool:
        if self.value is None:
            return False
        return self.value >= self.bound if self.at_least else self.value <= self.bound

    def describe(self) -> str:
        sign = ">=" if self.at_least else "<="
        value = "not measured" if self.value is None else f"{self.value:.2f}"
        gap = "" if self.value is None else f" (by {abs(self.value - self.bound):.2f})"
        return (f"{self.backend} page {self.page_size} {self.layout} {self.name}: {value}, "
                f"target {sign} {self.bound:g}{gap}")


TARGET_COLUMNS: list[tuple[str, str, Callable[[Measurement], float | None]]] = [
    ("write", WRITE, lambda m: m.pct_of_ceiling),
    ("load", LOAD, lambda m: m.pct_of_ceiling),
    ("both", BOTH, lambda m: m.pct_of_ceiling),
    ("mm%w", WRITE, lambda m: m.slowdown_pct),
    ("mm%l", LOAD, lambda m: m.slowdown_pct),
    ("all/B", LOAD, lambda m: m.all_ratio),
    ("L0/1L", LOAD, lambda m: m.layer0_ratio),
]


def targets(result: BenchResult) -> list[Target]:
    """Every goal for ``staged`` and ``auto`` at the main size, in table order."""
    found = []
    configs = sorted({(m.backend, m.page_size, m.layout) for m in result.main_rows()
                      if m.backend in TARGET_BACKENDS},
                     key=lambda c: (TARGET_BACKENDS.index(c[0]), -c[1], c[2]))
    for backend, page, layout in configs:
        large = page >= LARGE_PAGE
        write = WRITE_PCT_LARGE_PAGES if large else ONE_WAY_PCT_SMALL_PAGES
        load = LOAD_PCT_LARGE_PAGES if large else ONE_WAY_PCT_SMALL_PAGES
        bounds = [(write, True), (load, True), (BOTH_PCT, True), (SLOWDOWN_PCT, False),
                  (SLOWDOWN_PCT, False), (ALL_READY_RATIO, False), (LAYER0_RATIO, False)]
        for (name, kind, value_of), (bound, at_least) in zip(TARGET_COLUMNS, bounds,
                                                             strict=True):
            m = result.find(backend, kind, page, layout)
            found.append(Target(backend, page, layout, name, value_of(m) if m else None,
                                bound, at_least))
    return found


def target_table(result: BenchResult) -> list[str]:
    """The goals as a table (value and ok/MISS per cell) and a one-line summary."""
    checks = targets(result)
    width = layout_width([t.layout for t in checks])
    lines = [
        f"targets (staged, auto): write >= {WRITE_PCT_LARGE_PAGES:g}% and load >= "
        f"{LOAD_PCT_LARGE_PAGES:g}% of the one-way ceiling at page >= {LARGE_PAGE}, >= "
        f"{ONE_WAY_PCT_SMALL_PAGES:g}% at page 1; both >= "
        f"{BOTH_PCT:g}% of bidir; mm% <= {SLOWDOWN_PCT:g}; all/B <= {ALL_READY_RATIO:g}; "
        f"L0/1L <= {LAYER0_RATIO:g}",
        f"{'backend':<8}{'page':>4} {'layout':<{width}}"
        + "".join(f"{name:>11}" for name, _, _ in TARGET_COLUMNS),
    ]
    per_row = len(TARGET_COLUMNS)
    for start in range(0, len(checks), per_row):
        row = checks[start: start + per_row]
        cells = "".join(
            f"{_num(t.value, 6, 2 if '/' in t.name else 1)} {'ok' if t.met else 'MISS':<4}"
            for t in row)
        lines.append(f"{row[0].backend:<8}{row[0].page_size:>4} {row[0].layout:<{width}}"
                     f"{cells}".rstrip())
    missed = [t for t in checks if not t.met]
    lines.append(f"targets met: {len(checks) - len(missed)} of {len(checks)}")
    lines.extend(f"  MISSED {t.describe()}" for t in missed)
    return lines


def auto_lines(table: dict[str, Any]) -> list[str]:
    """The auto table's rows with the figures each choice was made from."""
    if not table.get("rows"):
        return ["auto table: no measurements of torch, kernel or staged"]
    figures = worst_by_backend(table.get("measurements", []))
    width = layout_width([row["layout"] for row in table["rows"]], least=13)
    head = (f"{'direction':<16}{'layout':<{width}}{'layer_wise':<11}{'tokens':>7}{'min_tok':>8}"
            + "".join(f"{name:>21}" for name in CANDIDATES) + "  -> backend")
    lines = [f"auto table ({table.get('rule', '')}); cells: GB/s (matmul slowdown %) and "
             f"what one op costs the engine in ms (CPU issue plus matmul time lost)",
             head, "-" * len(head)]
    for row in table["rows"]:
        key = (row["direction"], row["layout"], bool(row["layer_wise"]),
               int(row["min_tokens"] if row.get("measured_tokens") is None
                   else row["measured_tokens"]))
        options = figures.get(key, {})
        cells = ""
        for name in CANDIDATES:
            if name not in options:
                cells += f"{'-':>21}"
                continue
            gbps, slowdown, cost = options[name]
            cells += f"{gbps:>8.1f} ({_num(slowdown, 0)}) {_num(cost, 0, 2)}".rjust(21)
        lines.append(f"{row['direction']:<16}{row['layout']:<{width}}"
                     f"{row['layer_wise']!s:<11}{key[3]:>7}{row['min_tokens']:>8}{cells}  -> "
                     f"{row['backend']}")
    return lines


def render(result: BenchResult) -> str:
    """The whole printed report."""
    parts = [header_lines(result), main_table(result), LEGEND, load_sizes_table(result),
             engine_copy_table(result), target_table(result), auto_lines(result.auto_table)]
    return "\n\n".join("\n".join(part) for part in parts)
