"""``hicache bench ranks``: what the tensor-parallel agreement costs a scheduler step (CPU).

``num_ranks`` spawned processes join a gloo group (a file rendezvous in a temporary
directory) and each builds its own services, one after the other, all ranks alike:

- ``step()`` of a service of its own and of a rank of the group
  (``build_service(..., tp_group=group)``), each without and with a file store (L3, in the
  temporary directory), ``idle`` (nothing in flight: the agreement's own cost) and ``busy``
  (one chat request served before each step, whose backup the step issues and whose acks,
  and with a store its put and the prefetch of its tail, a later step applies; a rank's
  step then also waits for the slowest rank's request, as its model's collectives would,
  so the busy cases also time the request's calls and its step together);
- busy ranks of an MLA model, whose ranks name their pages alike, each with a file store of
  its own (every rank writes every page) and with one file store they all see (each rank
  writes its share of the pages: :mod:`hicache.l3.shared_copy`);
- the reference, in the same processes: the group's bare collectives of 8 int64 (an
  all-gather, which the agreement makes, and a minimum's all-reduce), the floor of any
  agreement on this machine.

Every figure is the median and the 99th percentile over ``steps`` calls, per rank.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

COLLECTIVE_VALUES = 8  # about what a step's first collective carries


@dataclass
class RankRow:
    """One case: its median and 99th percentile in microseconds, one entry per rank."""

    case: str
    median_us: list[float]
    p99_us: list[float]


def measure_ranks(num_ranks: int, steps: int, workdir: Path) -> list[RankRow]:
    """Every case on ``num_ranks`` spawned ranks (module docstring); ``workdir`` holds the
    rendezvous, the stores and each rank's figures."""
    import torch.multiprocessing

    torch.multiprocessing.spawn(_rank_main, args=(num_ranks, str(workdir), steps),
                                nprocs=num_ranks, join=True)
    by_rank = [json.loads((workdir / f"rank{rank}.json").read_text())
               for rank in range(num_ranks)]
    return [RankRow(case, [figures[case][0] for figures in by_rank],
                    [figures[case][1] for figures in by_rank]) for case in by_rank[0]]


def render(rows: list[RankRow]) -> str:
    ranks = len(rows[0].median_us)
    header = f"{'case (us)':<58}" + "".join(f"{f'rank {r} median':>15}{'p99':>9}"
                                             for r in range(ranks))
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(f"{row.case:<58}" + "".join(
            f"{median:15.1f}{p99:9.1f}" for median, p99 in zip(row.median_us, row.p99_us,
                                                                strict=True)))
    return "\n".join(lines)


def _rank_main(rank: int, size: int, workdir: str, steps: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous", rank=rank,
                            world_size=size)
    try:
        group = dist.new_group(backend="gloo")
        figures = _collectives(group, steps)
        for busy in (False, True):
            for agreed in (False, True):
                for store in (False, True):
                    case = (f"{'busy' if busy else 'idle'}, "
                            f"{'rank of a group' if agreed else 'alone'}"
                            f"{', store' if store else ''}")
                    path = Path(workdir, f"store-{rank}-{len(figures)}") if store else None
                    step, cycle = _steps(group if agreed else None, rank, size, path, busy,
                                         steps)
                    figures[f"step {case}"] = step
                    if busy:
                        figures[f"request + step {case}"] = cycle
        # an MLA model's ranks name their pages alike: stores of their own (every rank
        # writes every page), or one store they all see (each writes its share)
        for where in ("own", "shared"):
            path = Path(workdir, f"store-mla-{rank if where == 'own' else 'shared'}")
            step, cycle = _steps(group, rank, size, path, True, steps, mla=True)
            figures[f"step busy, rank of a group, MLA, {where} store"] = step
            figures[f"request + step busy, rank of a group, MLA, {where} store"] = cycle
        Path(workdir, f"rank{rank}.json").write_text(json.dumps(figures))
    finally:
        dist.destroy_process_group()


def _collectives(group: object, steps: int) -> dict[str, tuple[float, float]]:
    import torch
    import torch.distributed as dist

    size = dist.get_world_size(group)  # type: ignore[arg-type]
    mine = torch.zeros(COLLECTIVE_VALUES, dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(size)]
    return {
        f"reference: all-gather of {COLLECTIVE_VALUES} int64": _timed(
            lambda: dist.all_gather(everyone, mine, group=group), steps),  # type: ignore[arg-type]
        f"reference: all-reduce min, {COLLECTIVE_VALUES}": _timed(
            lambda: dist.all_reduce(mine, op=dist.ReduceOp.MIN, group=group),  # type: ignore[arg-type]
            steps),
    }


def _steps(group: object, rank: int, size: int, store: Path | None, busy: bool,
           steps: int, *, mla: bool = False) -> tuple[tuple[float, float], tuple[float, float]]:
    """The percentiles of ``step()`` and of a request's calls and its step together
    (``mla``: a model of one latent row a token instead of K and V)."""
    import torch.distributed as dist

    from hicache.factory import build_service
    from hicache.l3 import Prefetch

    from .scheduler import ChatWorkload, admit, free_tail

    # a service of its own names its pages by the arguments, a rank's by its group
    alone = group is None and store is not None
    service = build_service(_config(store, mla), tp_group=group, model_id="bench/ranks",
                            model_revision="r1", tp_rank=rank if alone else 0,
                            tp_size=size if alone else 1)
    workload = ChatWorkload(seed=1, num_systems=8)
    prefetches: list[Prefetch] = []
    times: list[float] = []
    cycles: list[float] = []
    try:
        dist.barrier()
        for _ in range(steps):
            cycle_start = time.perf_counter_ns()
            if busy:
                tokens = workload.request(workload.systems)
                key, match, slots = admit(service, tokens)
                prefetch = service.prefetch(key, match)  # None without a store
                service.insert(key, slots)
                free_tail(service, len(tokens), slots)
                service.release(match.last_device_node)
                prefetches += [prefetch] if prefetch is not None else []
            start = time.perf_counter_ns()
            service.step()
            end = time.perf_counter_ns()
            times.append(end - start)
            cycles.append(end - cycle_start)
            for prefetch in [p for p in prefetches if service.prefetch_ready(p)]:
                service.finish_prefetch(prefetch)
                prefetches.remove(prefetch)
        for prefetch in prefetches:
            service.finish_prefetch(prefetch)
    finally:
        service.stop()
    return _percentiles(times), _percentiles(cycles)


def _config(store: Path | None, mla: bool = False) -> Any:
    from hicache.config import config_from_dict

    from .scheduler import service_config

    mapping = service_config(16384, host_ratio=2.0)
    if mla:
        mapping["model"] = {"num_layers": 1, "attention": "mla", "latent_dim": 4,
                            "dtype": "float32"}
    if store is not None:
        mapping["storage"] = {"backend": "file", "path": str(store)}
    return config_from_dict(mapping)


def _timed(call: Callable[[], object], repeats: int) -> tuple[float, float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        call()
        times.append(time.perf_counter_ns() - start)
    return _percentiles(times)


def _percentiles(times_ns: list[int] | list[float]) -> tuple[float, float]:
    ordered = sorted(times_ns)
    return ordered[len(ordered) // 2] / 1e3, ordered[min(len(ordered) - 1,
                                                         int(len(ordered) * 0.99))] / 1e3
