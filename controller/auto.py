"""The ``auto`` backend: picks ``torch``, ``kernel``, ``staged`` or ``direct`` per operation:
``direct`` for an op on a ``layer_first`` host whose slots are long runs on both tiers
(:func:`~hicache.controller.direct.worth_direct`), the others from a table that ``hicache
bench --auto-table`` measured (over scattered pages), never from guesses.

A table row says: for moves in ``direction`` with host ``layout``, issued layer by layer or
all layers at once (``layer_wise``), of at least ``min_tokens`` tokens, use ``backend``. The
row with the largest ``min_tokens`` not above the op's size wins. Without CUDA, or without a
matching row, ``torch`` (CPU) or ``kernel`` (GPU) is used. The choice is logged at DEBUG and
counted per backend in ``TransferStats.backend_ops`` (a metric label).

The shipped table's ``layer_first`` and ``page_first_direct`` rows were re-derived later
(``rederived``: ``kernel`` and ``staged`` on an H200, op sizes 256, 2048 and 32768 tokens,
page sizes 16 and 64, each figure the median of three full runs, kernel loads counted); the
``page_first`` rows are from the first run (``measured_on``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from hicache.pools import DeviceKVPool, HostKVPool, HostLayout

from .base import Direction, MovedTransfer, PoolTransfer, TransferBackend
from .direct import worth_direct

logger = logging.getLogger(__name__)
TABLE_RESOURCE = "auto_table.json"


@dataclass(frozen=True)
class AutoRow:
    """One measured choice (see the module docstring)."""

    direction: Direction
    layout: HostLayout
    layer_wise: bool
    min_tokens: int
    backend: str


def load_table(path: Path | None = None) -> list[AutoRow]:
    """Rows from ``path``, or the table shipped with the package (empty if none)."""
    if path is not None:
        text = path.read_text()
    else:
        shipped = resources.files("hicache.controller").joinpath(TABLE_RESOURCE)
        if not shipped.is_file():
            return []
        text = shipped.read_text()
    rows = json.loads(text).get("rows", [])
    return [
        AutoRow(Direction(r["direction"]), HostLayout(r["layout"]), bool(r["layer_wise"]),
                int(r["min_tokens"]), str(r["backend"]))
        for r in rows
    ]


class AutoBackend(TransferBackend):
    """Delegates each op to one of ``backends`` chosen by :meth:`select`.

    Args:
        backends: the concrete backends by name (``torch``, ``kernel``, ``staged``).
        rows: the measured table.
        fallback: backend name used when no row matches.
    """

    name = "auto"

    def __init__(self, backends: dict[str, TransferBackend], rows: Sequence[AutoRow],
                 fallback: str) -> None:
        if fallback not in backends:
            raise ValueError(f"auto backend: fallback '{fallback}' is not among {sorted(backends)}")
        self.backends = backends
        self.rows = [r for r in rows if r.backend in backends]
        self.fallback = fallback

    def select(self, direction: Direction, layout: HostLayout, num_tokens: int,
               layer_wise: bool, pairs: PoolTransfer | None = None) -> TransferBackend:
        direct = self.backends.get("direct")
        if (direct is not None and pairs is not None and layout is HostLayout.LAYER_FIRST
                and worth_direct(pairs.host_indices.tensor.numpy(),
                                 pairs.device_indices.tensor.numpy())):
            logger.debug("auto: %s %d tokens in runs -> direct", direction.value, num_tokens)
            return direct
        best: AutoRow | None = None
        for row in self.rows:
            fits = (row.direction is direction and row.layout is layout
                    and row.layer_wise == layer_wise and row.min_tokens <= num_tokens)
            if fits and (best is None or row.min_tokens > best.min_tokens):
                best = row
        chosen = self.backends[best.backend if best is not None else self.fallback]
        logger.debug("auto: %s %s %d tokens layer_wise=%s -> %s", direction.value,
                     layout.value, num_tokens, layer_wise, chosen.name)
        return chosen

    def index_devices(
        self, host_pool: HostKVPool, device_pool: DeviceKVPool
    ) -> tuple[torch.device, torch.device]:
        raise AssertionError("auto delegates: the controller asks the selected backend")

    def copy(self, moved: MovedTransfer, local_layers: Sequence[int], direction: Direction,
             keep_alive: list[torch.Tensor]) -> None:
        raise AssertionError("auto delegates: the controller calls the selected backend")
