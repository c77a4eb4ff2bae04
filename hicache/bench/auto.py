"""The auto table: which backend ``auto`` runs, chosen from the benchmark's measurements.

For every (direction, layout, layer mode, size) measured, the backend with the highest GB/s
among those whose concurrent matmul slowdown is at most ``max_slowdown_pct`` (3%) wins; if
none qualifies, the one among those reaching the share below that costs the engine least
per op: its CPU issue (the scheduler thread launches nothing else meanwhile) plus the
matmul time it takes (its slowdown times the op's GPU time). A small op shows why: a
256-token layer-wise load on ``kernel`` takes 0.3-0.6 ms to issue and slows the matmul by
8.6% over its 0.67 ms (about 0.06 ms of matmul), the same load on ``staged`` 0.5-1.2 ms to
issue and 3.4% (0.03 ms): ``staged`` spares the GPU 0.03 ms and costs the scheduler thread
0.2-0.6 ms more. Runs saved before the issue time was recorded fall back to the one that
slows the matmul least.
A backend slower than ``min_share_of_best`` (0.6) of the fastest does not qualify: a
backend that barely touches the GPU because it is bound by the CPU (the staged backend's
strided ``page_first`` per-layer copies run at a tenth of the link) would otherwise win by
slowing the matmul least while moving bytes several times slower. A backend measured at
several page sizes counts with its worst figures (lowest GB/s, highest slowdown), so one
table serves every page size. Writes move all layers in one op (``layer_wise`` false),
loads go layer by layer (true), as the controller issues them.

A layer-wise load is ranked by its bytes over its CPU issue time plus its GPU time, not its
GPU time alone: the forward that waits on the load is launched only once the scheduler
thread has issued it, so a backend that moves the bytes a little faster but takes longer to
issue (the staged backend's per-chunk copies, 12 ms for an 8192-token load of 32 layers
against the kernel's 3 ms) delays the request more (measured end to end by ``bench e2e``).

Single runs of the benchmark move by several points on a busy host (a small op's figure
follows the CPU's speed during that run), and the worst page size decides a choice, so one
noisy cell can flip a row: :func:`auto_table_of_runs` derives the table from the median of
each figure over several saved runs (``--from-json RUN1.json RUN2.json ...``).

Rows follow ``controller/auto_table.json``'s format (``hicache.controller.auto``): the row
with the largest ``min_tokens`` not above an op's size applies. The smallest size measured
covers everything below it; a larger size takes over at the geometric mean of it and the
next smaller size (the crossover is assumed halfway on a log scale).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from .results import LOAD, WRITE, BenchResult, Measurement

# The issue's bound on every row auto picks; a backend within it is preferred while it moves
# at least 60% of the fastest one's bytes (small staged writes, bound by their CPU issue,
# reach 60-75% of the kernel's rate while leaving the matmul alone; the kernel slows it by
# 15-18% there).
DEFAULT_MAX_SLOWDOWN_PCT = 3.0
DEFAULT_MIN_SHARE_OF_BEST = 0.6
CANDIDATES = ("torch", "kernel", "staged")
_DIRECTION = {WRITE: ("device_to_host", False), LOAD: ("host_to_device", True)}

Key = tuple[str, str, bool, int]  # direction, layout, layer_wise, tokens
# backend -> (GB/s, slowdown % or None, milliseconds the engine loses per op or None)
Figures = dict[str, tuple[float, float | None, float | None]]


def candidate_measurements(measurements: Iterable[Measurement]) -> list[dict[str, Any]]:
    """The measurements the table is chosen from, as JSON-ready dicts (one per backend,
    direction, layout, size and page size)."""
    found = []
    for m in measurements:
        if m.backend not in CANDIDATES or m.kind not in _DIRECTION:
            continue
        direction, layer_wise = _DIRECTION[m.kind]
        gbps = m.gb_per_s
        if layer_wise and m.issue_s is not None:  # what a request waiting on it sees
            gbps = m.bytes / (m.seconds + m.issue_s) / 1e9
        found.append({
            "direction": direction, "layout": m.layout, "layer_wise": layer_wise,
            "tokens": m.tokens, "page_size": m.page_size, "backend": m.backend,
            "gb_per_s": round(gbps, 3),
            "slowdown_pct": None if m.slowdown_pct is None else round(m.slowdown_pct, 2),
            "issue_ms": None if m.issue_s is None else round(m.issue_s * 1e3, 4),
            "op_ms": round(m.seconds * 1e3, 4),
        })
    return found


def worst_by_backend(records: Sequence[dict[str, Any]]) -> dict[Key, Figures]:
    """``{key: {backend: (lowest GB/s, highest slowdown or None, highest cost per op or
    None)}}`` over page sizes (:func:`engine_cost_ms`)."""
    table: dict[Key, Figures] = {}
    for r in records:
        key = (r["direction"], r["layout"], bool(r["layer_wise"]), int(r["tokens"]))
        per_backend = table.setdefault(key, {})
        gbps, slowdown, cost = float(r["gb_per_s"]), r["slowdown_pct"], engine_cost_ms(r)
        if r["backend"] in per_backend:
            old_gbps, old_slowdown, old_cost = per_backend[r["backend"]]
            gbps = min(gbps, old_gbps)
            slowdown = None if slowdown is None or old_slowdown is None else max(
                slowdown, old_slowdown)
            cost = None if cost is None or old_cost is None else max(cost, old_cost)
        per_backend[r["backend"]] = (gbps, slowdown, cost)
    return table


def engine_cost_ms(record: dict[str, Any]) -> float | None:
    """What one op of ``record`` costs the engine, in milliseconds: its CPU issue plus the
    matmul time it takes (slowdown times the op's GPU time); ``None`` when the record lacks
    one of them (a run saved before the issue time was recorded)."""
    issue, op, slowdown = record.get("issue_ms"), record.get("op_ms"), record["slowdown_pct"]
    if issue is None or op is None or slowdown is None:
        return None
    return float(issue) + max(0.0, float(slowdown)) / 100.0 * float(op)


def pick_backend(options: Figures, max_slowdown_pct: float,
                 min_share_of_best: float = DEFAULT_MIN_SHARE_OF_BEST) -> str:
    """The fastest backend whose slowdown is known and within the bound and whose GB/s is
    at least ``min_share_of_best`` of the fastest one's. If none is, the one of those
    reaching that share (the fastest always does) that costs the engine least per op
    (``(GB/s, slowdown, cost)``, :func:`engine_cost_ms`), when every one of them has a
    cost; otherwise the one that slows the matmul least (an unknown slowdown counts as the
    worst): a backend 10% slower that slows it by 4.5% beats one that slows it by 32%. Ties
    go to the name first in alphabetical order (deterministic)."""
    best = max(figures[0] for figures in options.values())
    fast_enough = {name: v for name, v in options.items() if v[0] >= min_share_of_best * best}
    eligible = {name: v for name, v in fast_enough.items()
                if v[1] is not None and v[1] <= max_slowdown_pct}
    if eligible:
        return min(eligible, key=lambda name: (-eligible[name][0], name))
    costs = {name: v[2] for name, v in fast_enough.items()}
    if all(cost is not None for cost in costs.values()):
        return min(costs, key=lambda name: (costs[name], name))
    return min(fast_enough, key=lambda name: (
        math.inf if fast_enough[name][1] is None else fast_enough[name][1],
        -fast_enough[name][0], name))


def choose_rows(records: Sequence[dict[str, Any]],
                max_slowdown_pct: float = DEFAULT_MAX_SLOWDOWN_PCT,
                min_share_of_best: float = DEFAULT_MIN_SHARE_OF_BEST) -> list[dict[str, Any]]:
    """Auto table rows from :func:`candidate_measurements` records (see the module
    docstring), sorted by direction, layout, layer mode and ``min_tokens``."""
    table = worst_by_backend(records)
    sizes: dict[tuple[str, str, bool], list[int]] = {}
    for direction, layout, layer_wise, tokens in table:
        sizes.setdefault((direction, layout, layer_wise), []).append(tokens)
    rows = []
    for group, group_sizes in sorted(sizes.items()):
        ordered = sorted(group_sizes)
        for i, tokens in enumerate(ordered):
            min_tokens = 0 if i == 0 else math.isqrt(ordered[i - 1] * tokens)
            rows.append({
                "direction": group[0], "layout": group[1], "layer_wise": group[2],
                "min_tokens": min_tokens, "measured_tokens": tokens,
                "backend": pick_backend(table[(group[0], group[1], group[2], tokens)],
                                        max_slowdown_pct, min_share_of_best),
            })
    return rows


def median_records(runs: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One record per configuration (direction, layout, layer mode, size, page size,
    backend) that any of ``runs`` measured (:func:`candidate_measurements` records): the
    median of its GB/s, slowdown, issue and op times over the runs that measured each (one
    none of them measured stays ``None``), in first-seen order."""
    found: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for records in runs:
        for r in records:
            key = (r["direction"], r["layout"], bool(r["layer_wise"]), int(r["tokens"]),
                   int(r["page_size"]), r["backend"])
            found.setdefault(key, []).append(r)
    merged = []
    for same in found.values():
        record = {**same[0], "gb_per_s": round(statistics.median(r["gb_per_s"] for r in same), 3)}
        for name, digits in (("slowdown_pct", 2), ("issue_ms", 4), ("op_ms", 4)):
            known = [r[name] for r in same if r.get(name) is not None]
            record[name] = round(statistics.median(known), digits) if known else None
        record["runs"] = len(same)
        merged.append(record)
    return merged


def auto_table_of_runs(results: Sequence[BenchResult],
                       max_slowdown_pct: float = DEFAULT_MAX_SLOWDOWN_PCT,
                       min_share_of_best: float = DEFAULT_MIN_SHARE_OF_BEST) -> dict[str, Any]:
    """The auto table of several saved runs: each figure the median over the runs (see
    :func:`median_records`), then the usual rule. ``measured_on`` is the first run's, with
    the number of runs and their dates.

    Raises:
        ValueError: no runs, or runs on different devices (one table is for one device).
    """
    if not results:
        raise ValueError("no runs to derive an auto table from")
    devices = {str(r.meta.get("device")) for r in results}
    if len(devices) > 1:
        raise ValueError(f"the runs were measured on different devices ({sorted(devices)}); "
                         f"derive one table per device")
    first = results[0]
    measured_on = dict(first.auto_table.get("measured_on") or {"device": devices.pop()})
    measured_on["runs"] = len(results)
    measured_on["dates"] = sorted({str(r.meta.get("date")) for r in results})
    records = median_records([candidate_measurements(r.measurements) for r in results])
    return _table(records, measured_on, max_slowdown_pct, min_share_of_best,
                  f"median of each figure over {len(results)} runs; ")


def auto_table(measurements: Iterable[Measurement], measured_on: dict[str, Any],
               max_slowdown_pct: float = DEFAULT_MAX_SLOWDOWN_PCT,
               min_share_of_best: float = DEFAULT_MIN_SHARE_OF_BEST) -> dict[str, Any]:
    """The JSON document ``--auto-table`` writes: ``rows`` (what ``auto`` reads),
    ``measured_on`` (device, versions, date and the backends' settings), the ``rule`` in
    words and the raw ``measurements``."""
    return _table(candidate_measurements(measurements), measured_on, max_slowdown_pct,
                  min_share_of_best, "")


def _table(records: list[dict[str, Any]], measured_on: dict[str, Any],
           max_slowdown_pct: float, min_share_of_best: float, source: str) -> dict[str, Any]:
    return {
        "measured_on": measured_on,
        "rule": (f"{source}per (direction, layout, layer_wise, size): the highest GB/s (layer-wise "
                 f"loads: over CPU issue plus GPU time) among backends "
                 f"whose concurrent bf16 matmul slows by <= {max_slowdown_pct:g}% and that "
                 f"reach >= {min_share_of_best:g} of the best GB/s (worst page size counts), "
                 f"else the one of those reaching that share that costs the engine least per "
                 f"op (CPU issue plus slowdown times the op's GPU time; the one that slows "
                 f"the matmul least where a run lacks the issue time); a row applies from "
                 f"min_tokens up"),
        "rows": choose_rows(records, max_slowdown_pct, min_share_of_best),
        "measurements": records,
    }
