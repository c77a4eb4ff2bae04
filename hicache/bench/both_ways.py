"""A write and a load of the whole transfer at once, against the both-ways ceiling.

Timed from a reference event recorded before either is issued to the later finish:

- issued together (``CacheController.start_transfers``: the load's first layer group, the
  write, the load's other groups), the figure the target is on;
- issued by two calls, write first and load first (``start_writing``, ``start_loading``),
  whose second op starts its copies only once the first is issued. Both orders count
  because an engine makes either: a load-back before the step that issues its backups, or
  the other way round. A write issued after a load used to start only once the load was
  done (its index upload queued behind the load's copies on the copy engine; see
  :mod:`hicache.pools.upload_kernel`), which write-first alone never showed.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from .timing import elapsed, recorded
from .workload import Issued, Session

ORDERS = ("together", "write first", "load first")


@dataclass(frozen=True)
class BothWays:
    """Medians of ``repeats`` (seconds): issued together, and the slower of the two orders
    issued by separate calls; ``ran``: the backends that ran the ops."""

    together_s: float
    separate_s: float
    ran: frozenset[str]


def both_ways(session: Session, repeats: int) -> BothWays:
    """Time a write and a load of ``session.tokens`` each, in the three ways of the module
    docstring, taking turns within each repeat."""
    times: dict[str, list[float]] = {order: [] for order in ORDERS}
    ran: set[str] = set()
    for _ in range(repeats):
        for order in ORDERS:
            torch.cuda.synchronize()
            ref = recorded()
            issued = _issue(session, order)
            session.finish(issued, keep=True)
            times[order].append(max(elapsed(ref, item.op.finish_event) for item in issued
                                    if item.op.finish_event is not None))
            ran.update(item.op.backend for item in issued)
            session.finish(issued)
    return BothWays(statistics.median(times["together"]),
                    max(statistics.median(times[order]) for order in ORDERS[1:]),
                    frozenset(ran))


def _issue(session: Session, order: str) -> list[Issued]:
    tokens = session.tokens
    if order == "together":
        return session.both_ops(tokens)
    if order == "load first":
        return session.load_ops(1, tokens) + session.write_ops(1, tokens)
    return session.write_ops(1, tokens) + session.load_ops(1, tokens)
