"""Paged attention in torch: the reference engine's KV access through the device pools.

Each request of a forward has a row in the batch page table (full-pool page ids; 0 is the
padding page). A new token at position ``p`` of the request in row ``r`` reads::

    full layer   keys 0 .. p         slot = page_table[r, pos // P] * P + pos % P
    SWA layer    keys p-W+1 .. p     slot = swa_page_table[r, pos // P] * P + pos % P

``swa_page_table`` is ``HybridSWAPool.translate_page_table(page_table)``, a typed
:class:`~hicache.pools.PageTable` in SWA space: SWA layers never see a full-space index, and
the pool's ``page_slots`` refuses a table of the wrong space for a layer. New rows are
written with ``set_kv`` through the forward's :class:`~hicache.pools.ForwardLocs` (checked
and translated once per forward, owned by the handle: the buffer it was made from may be
refilled for the next forward). The pool's ``key_buffer(layer)`` / ``value_buffer(layer)``
run the layer waiter first, so a layer-wise load into this batch's slots is waited on before
the layer reads or writes anything.

Decode steps use :class:`DecodeBuffers`: preallocated int32 buffers, as a CUDA graph needs,
filled for the live rows and zeroed past them, so padded rows point at slot 0 (page 0).
Every fill is checked whole before any buffer is written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hicache.pools import DeviceKVPool, ForwardLocs, HybridSWAPool, IndexSpace, Indices, PageTable
from hicache.pools.base import bounds_message

from .model import ModelSpec

KVPool = HybridSWAPool | DeviceKVPool


@dataclass(frozen=True)
class ForwardBatch:
    """Where one forward's new tokens go and which pages their requests read.

    ``rows[i]`` / ``positions[i]``: page-table row and position of new token ``i``.
    ``locs``: the checked ``[n]`` (or ``[max_batch]`` padded) new-token locations, full and
    (hybrid pools) SWA. ``page_table`` / ``swa_page_table``: ``[rows, max_pages]`` typed page
    tables on the device (``swa_page_table`` for hybrid pools only).
    """

    rows: list[int]
    positions: list[int]
    locs: ForwardLocs
    page_table: PageTable
    swa_page_table: PageTable | None


def page_table_cpu(page_rows: list[list[int]], num_rows: int, max_pages: int) -> torch.Tensor:
    """``[num_rows, max_pages]`` int32 CPU table; rows and entries past the data are 0."""
    check_page_rows(page_rows, num_rows, max_pages)
    table = torch.zeros(num_rows, max_pages, dtype=torch.int32)
    for r, pages in enumerate(page_rows):
        table[r, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
    return table


def check_page_rows(page_rows: list[list[int]], num_rows: int, max_pages: int) -> None:
    """Raise ``ValueError`` unless ``page_rows`` fits a ``[num_rows, max_pages]`` table."""
    if len(page_rows) > num_rows:
        raise ValueError(
            f"{len(page_rows)} page-table rows do not fit a table of {num_rows} rows "
            f"(max_batch); split the batch"
        )
    for r, pages in enumerate(page_rows):
        if len(pages) > max_pages:
            raise ValueError(f"page table row {r}: {len(pages)} pages > max_pages {max_pages}")


def exact_batch(
    pool: KVPool, locs: list[int], rows: list[int], positions: list[int],
    page_rows: list[list[int]], max_pages: int, page_size: int,
) -> ForwardBatch:
    """A forward of any shape (prefill chunks and decodes); unpadded tensors."""
    _check_tokens(locs, rows, positions, len(page_rows))
    device = pool.device
    table = page_table_cpu(page_rows, len(page_rows), max_pages).to(device)
    full = Indices(torch.tensor(locs, dtype=torch.int32).to(device), IndexSpace.DEVICE_FULL)
    return _batch(pool, full, rows, positions, PageTable(table, IndexSpace.DEVICE_FULL, page_size))


class DecodeBuffers:
    """Preallocated decode-step buffers (fixed addresses, as CUDA-graph replay needs).

    Args:
        max_batch: rows of every buffer.
        max_pages: page-table columns (the longest sequence in pages).
        device: the pool's device.
        page_size: tokens per page.
    """

    def __init__(self, max_batch: int, max_pages: int, device: torch.device, page_size: int
                 ) -> None:
        self.max_batch = max_batch
        self.max_pages = max_pages
        self.page_size = page_size
        self.out_cache_loc = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.page_table = torch.zeros(max_batch, max_pages, dtype=torch.int32, device=device)

    def fill(
        self, pool: KVPool, locs: list[int], positions: list[int], page_rows: list[list[int]]
    ) -> ForwardBatch:
        """One new token per live row; rows ``len(locs):`` become padding (slot 0, page 0).

        Stale values from a larger earlier batch are overwritten, never left behind. The
        whole batch is checked before any buffer is written.
        """
        n = len(locs)
        if n > self.max_batch:
            raise ValueError(f"decode batch of {n} rows > max_batch {self.max_batch}")
        _check_tokens(locs, list(range(n)), positions, len(page_rows))
        table = page_table_cpu(page_rows, self.max_batch, self.max_pages)
        _check_bounds(pool, locs, table, self.page_size)  # before the graph's buffers change
        self.out_cache_loc[:n].copy_(torch.tensor(locs, dtype=torch.int32))
        self.out_cache_loc[n:].zero_()
        self.page_table.copy_(table)
        full = Indices(self.out_cache_loc, IndexSpace.DEVICE_FULL)
        return _batch(pool, full, list(range(n)), positions,
                      PageTable(self.page_table, IndexSpace.DEVICE_FULL, self.page_size))


def _check_bounds(pool: KVPool, locs: list[int], table: torch.Tensor, page_size: int) -> None:
    """Every slot and page of a decode batch within the full pool (the pool checks them
    again, after the buffers are filled: a refusal there would leave them changed)."""
    full = pool.full if isinstance(pool, HybridSWAPool) else pool
    for unit, values, bound in (("slot", locs, full.num_slots),
                                ("page", table.flatten().tolist(), full.num_slots // page_size)):
        bad = next((v for v in values if not 0 <= v < bound), None)
        if bad is not None:
            raise ValueError(bounds_message("decode batch", full.name, unit, bad, bound))


def _check_tokens(locs: list[int], rows: list[int], positions: list[int], num_rows: int
                  ) -> None:
    if not len(locs) == len(rows) == len(positions):
        raise ValueError(
            f"{len(locs)} locations, {len(rows)} rows and {len(positions)} positions: one "
            f"of each per new token"
        )
    if rows and not 0 <= min(rows) <= max(rows) < num_rows:
        raise ValueError(f"a token's page-table row is outside the {num_rows} rows given")


def _batch(pool: KVPool, full: Indices, rows: list[int], positions: list[int],
           page_table: PageTable) -> ForwardBatch:
    locs = pool.forward_locs(full)
    if not isinstance(pool, HybridSWAPool):
        return ForwardBatch(rows, positions, locs, page_table, None)
    return ForwardBatch(rows, positions, locs, page_table, pool.translate_page_table(page_table))


class PagedKV:
    """:class:`~hicache.engine.model.KVAccess` over the pools for one :class:`ForwardBatch`.

    Args:
        pool: the engine's device pool (hybrid SWA or full attention only).
        batch: this forward's locations and page tables.
        spec: the model (which layers slide, the window).
        page_size: tokens per page.
    """

    def __init__(self, pool: KVPool, batch: ForwardBatch, spec: ModelSpec, page_size: int) -> None:
        self.pool = pool
        self.batch = batch
        self.spec = spec
        self.page_size = page_size
        self._offsets = torch.arange(page_size, dtype=torch.int64, device=pool.device)
        self._slots: dict[tuple[bool, int], torch.Tensor] = {}
        self._buffers: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``[n, heads, D]`` rows at the forward's locations (padded rows: zeros,
        slot 0)."""
        pool, batch = self.pool, self.batch
        # The accessors wait on this layer's load before anything touches the layer.
        keys, values = pool.key_buffer(layer), pool.value_buffer(layer)
        pad = len(batch.locs) - k.shape[0]
        if pad:
            k = torch.cat([k, k.new_zeros(pad, *k.shape[1:])])
            v = torch.cat([v, v.new_zeros(pad, *v.shape[1:])])
        pool.set_kv(layer, batch.locs, k, v)
        self._buffers = (layer, keys, values)

    def gather(self, layer: int, token: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows new token ``token`` attends to in ``layer`` (after :meth:`write` of it).

        Raises:
            ValueError: the token's position lies past its page-table row (the row is
                too short for the sequence; attending to fewer keys would be silent).
        """
        assert self._buffers is not None and self._buffers[0] == layer, "write the layer first"
        _, keys, values = self._buffers
        position = self.batch.positions[token]
        is_swa = layer in self.spec.swa_layers
        slots = self._row_slots(layer, is_swa, self.batch.rows[token])
        if not 0 <= position < slots.numel():
            raise ValueError(
                f"token {token} at position {position} lies past its page-table row "
                f"({slots.numel() // self.page_size} pages of {self.page_size} tokens); give "
                f"the row every page of the sequence"
            )
        wanted = slots[self.spec.first_key(layer, position):position + 1]
        return keys[wanted], values[wanted]

    def _row_slots(self, layer: int, is_swa: bool, row: int) -> torch.Tensor:
        """int64 slot of every position of a page-table row, in the layer's space."""
        key = (is_swa, row)
        if key not in self._slots:
            pool = self.pool
            if isinstance(pool, HybridSWAPool):
                table = self.batch.swa_page_table if is_swa else self.batch.page_table
                assert table is not None, "SWA layer without an SWA page table"
                self._slots[key] = pool.page_slots(layer, table, row).tensor
            else:
                self._slots[key] = pool.page_slots(self.batch.page_table, row).tensor
        return self._slots[key]
