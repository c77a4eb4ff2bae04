"""Device KV pool: per-layer K and V rows (MHA) or one latent row (MLA), allocated once.

Storage is one tensor ``data`` of shape ``[components, layers, slots, row_elems]``
(components = 2 for MHA: K then V; 1 for MLA), so a layer's rows are one contiguous
``[slots, row_elems]`` block and every accessor is a view.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from .arg_checks import check_int
from .base import (
    PADDING_SLOT,
    AttentionKind,
    IndexSpace,
    Indices,
    PageTable,
    check_indices,
)
from .bounds import BoundsGuard
from .forward_locs import ForwardLocs, make_forward_locs
from .kv_rows import checked_kv_rows
from .row_geometry import RowGeometry
from .row_records import layer_records

__all__ = ["DeviceKVPool", "LayerWaiter", "RowGeometry"]

LayerWaiter = Callable[[int], None]


class DeviceKVPool:
    """KV rows of ``num_layers`` layers for ``num_slots`` slots on one device.

    Args:
        name: used in error messages and metrics (``full``, ``swa``).
        space: ``DEVICE_FULL`` or ``DEVICE_SWA``: the only index space it accepts.
        num_layers: layers stored here (local layer ids ``0..num_layers-1``).
        num_slots: slots including the reserved padding page.
        geometry: row shape and dtype.
        device: where the rows live.
        page_size: slots per page of the allocator that hands out its slots; ``page_slots``
            then refuses a page table of another page size (``None``: not checked).
    """

    def __init__(
        self,
        *,
        name: str,
        space: IndexSpace,
        num_layers: int,
        num_slots: int,
        geometry: RowGeometry,
        device: torch.device | str,
        page_size: int | None = None,
    ) -> None:
        if space.is_host:
            raise ValueError(f"device pool '{name}' cannot use host space {space.name}")
        self.name = name
        self.space = space
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.geometry = geometry
        self.page_size = page_size  # of its allocator; None: a page table's is taken on trust
        self.data = torch.zeros(
            (geometry.num_components, num_layers, num_slots, geometry.row_elems),
            dtype=geometry.dtype,
            device=torch.device(device),
        )
        # The tensor's device carries the index ("cuda" -> "cuda:0"), as every tensor's does;
        # comparing against a bare "cuda" would reject every index on the GPU.
        self.device = self.data.device
        self.device_index = self.data.get_device()  # -1 on a CPU: a per-layer check compares it
        # one slot's rows in the views key_buffer / value_buffer / latent_buffer return
        self.slot_shape = ((geometry.num_kv_heads, geometry.head_dim)
                           if geometry.kind is AttentionKind.MHA else (geometry.row_elems,))
        # Views made once: set_kv runs per layer per forward, and each view costs a few us.
        self._rows = [[self.data[c, layer] for layer in range(num_layers)]
                      for c in range(geometry.num_components)]
        # the padding page (page 0, reserved) of every component of a layer: one strided view,
        # one zero_ after each indexed set_kv (a row aimed at any of its slots is not kept)
        padding = slice(PADDING_SLOT, self.page_size or 1)
        self._padding = [self.data[:, layer, padding] for layer in range(num_layers)]
        # what key_buffer / value_buffer / latent_buffer return, per component and layer
        self._buffers = [[self._heads_view(rows) if geometry.kind is AttentionKind.MHA
                          else rows for rows in component] for component in self._rows]
        self.guard = BoundsGuard(name, self.device)
        self._layer_waiter: LayerWaiter | None = None
        self._records: list[list[np.ndarray]] | None = None

    @property
    def size_bytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def register_layer_waiter(self, waiter: LayerWaiter | None) -> None:
        """Every attention accessor calls ``waiter(layer)`` before touching a layer, so a
        layer-wise load is waited on by construction (``CacheController.wait_until``)."""
        self._layer_waiter = waiter

    def check(self, indices: Indices, op: str) -> torch.Tensor:
        """Validate indices of this pool (space, dtype, device, bounds) and return the raw
        tensor to use: itself on a CPU, a copy with offenders sent to slot 0 on CUDA (their
        error is raised by :meth:`raise_if_tripped`)."""
        return check_indices(
            indices, space=self.space, pool_name=self.name, num_slots=self.num_slots,
            device=self.device, op=op, guard=self.guard,
        )

    def raise_if_tripped(self) -> None:
        """Raise the error of a finished CUDA bounds check that found a bad index (the
        controller's ``poll()`` calls this); no GPU synchronisation."""
        self.guard.raise_if_tripped()

    def forward_locs(self, out_cache_loc: Indices) -> ForwardLocs:
        """Check a forward's new-token slots once, for every layer's :meth:`set_kv`.

        Args:
            out_cache_loc: ``[n]`` int32/int64 slots in this pool's space (the hybrid pool's
                argument has this name too), on its device or on the CPU (checked at once
                there and uploaded without blocking; one ascending run of them makes each
                layer's write a slice copy: :mod:`.forward_locs`).
        Returns:
            a :class:`ForwardLocs` owning an int64 copy of them on this pool's device (for
            a run of CPU slots, made there when its ``full`` is first read).
        """
        return make_forward_locs(self, out_cache_loc)

    def page_slots(self, table: PageTable, row: int) -> Indices:
        """Slots of every position of row ``row`` of ``table``, which must hold this pool's
        pages (an SWA pool takes only SWA-space tables).

        Returns:
            ``[max_pages * page_size]`` int64 slots in this pool's space (padding pages give
            slots of page 0); bounds-checked like every index of this pool.
        """
        if not isinstance(table, PageTable):
            raise TypeError(
                f"page_slots on pool '{self.name}': expected a PageTable, got "
                f"{type(table).__name__}"
            )
        if table.space is not self.space:
            raise ValueError(
                f"page_slots: pool '{self.name}' reads pages of space {self.space.name}, got a "
                f"{table.space.name} page table"
                + ("; translate it with HybridSWAPool.translate_page_table"
                   if self.space is IndexSpace.DEVICE_SWA else "")
            )
        if self.page_size is not None and table.page_size != self.page_size:
            raise ValueError(f"page_slots: a table of pages of {table.page_size} tokens, pool "
                             f"'{self.name}' has pages of {self.page_size}")
        if type(row) is not int:
            check_int(row, "row", "page_slots")
        if not 0 <= row < table.num_rows:
            raise ValueError(f"page_slots: row {row} of a table of {table.num_rows} rows")
        if table.tensor.device != self.device:
            raise ValueError(
                f"page_slots: the table is on {table.tensor.device}, pool '{self.name}' on "
                f"{self.device}"
            )
        pages = self.guard.check(table.tensor[row], bound=self.num_slots // table.page_size,
                                 op="page_slots", unit="page")
        offsets = torch.arange(table.page_size, dtype=torch.int64, device=self.device)
        slots = pages.to(torch.int64)[:, None] * table.page_size + offsets
        return Indices(slots.reshape(-1), self.space)

    def layer_rows(self, component: int, layer: int) -> torch.Tensor:
        """Raw ``[num_slots, row_elems]`` view for the transfer engine (no layer wait)."""
        return self.data[component, layer]

    def layer_records(self, component: int, layer: int) -> np.ndarray:
        """:meth:`layer_rows` as ``[num_slots]`` numpy records (CPU pools only; see
        :mod:`hicache.pools.row_records`), made once."""
        if self._records is None:
            self._records = layer_records(self._rows)
        return self._records[component][layer]

    # The accessors and set_kv run per layer of every forward: checks inline, the rest in
    # helpers called only for what they refuse.

    def key_buffer(self, layer: int) -> torch.Tensor:
        """``[num_slots, num_kv_heads, head_dim]`` K of ``layer`` (MHA); waits on loads."""
        if self.geometry.kind is not AttentionKind.MHA:
            self._refuse_kind(AttentionKind.MHA, "key_buffer")
        self._wait(layer)
        return self._buffers[0][layer]

    def value_buffer(self, layer: int) -> torch.Tensor:
        """``[num_slots, num_kv_heads, head_dim]`` V of ``layer`` (MHA); waits on loads."""
        if self.geometry.kind is not AttentionKind.MHA:
            self._refuse_kind(AttentionKind.MHA, "value_buffer")
        self._wait(layer)
        return self._buffers[1][layer]

    def latent_buffer(self, layer: int) -> torch.Tensor:
        """``[num_slots, latent_dim]`` latent rows of ``layer`` (MLA); waits on loads."""
        if self.geometry.kind is not AttentionKind.MLA:
            self._refuse_kind(AttentionKind.MLA, "latent_buffer")
        self._wait(layer)
        return self._buffers[0][layer]

    def set_kv(
        self, layer: int, locs: Indices | ForwardLocs, k: torch.Tensor,
        v: torch.Tensor | None = None,
    ) -> None:
        """Write new tokens' rows of ``layer``.

        Args:
            layer: local layer id.
            locs: ``[n]`` slots in this pool's space, on this pool's device; or the
                :class:`ForwardLocs` of this pool (already checked, no check per layer).
            k: ``[n, num_kv_heads, head_dim]`` (MHA) or ``[n, latent_dim]`` (MLA), pool dtype.
            v: ``[n, num_kv_heads, head_dim]`` for MHA; must be ``None`` for MLA.

        Everything is checked before anything is written. Rows aimed at the padding slot
        (padded batch rows, and on CUDA indices the bounds check redirected) are written
        there and then cleared, so padding never holds garbage.
        """
        if isinstance(locs, ForwardLocs):
            if locs.owner is not self:
                raise ValueError(
                    f"set_kv(layer={layer}): these ForwardLocs were made by another pool; make "
                    f"them with forward_locs() of pool '{self.name}'"
                )
            if locs.span is not None:
                self._write_span(layer, locs.span, k, v)
                return
            index = locs.full.tensor
        else:
            index = self.check(locs, f"set_kv(layer={layer})")
        self.write_rows(layer, index, k, v)

    def write_rows(
        self, layer: int, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None
    ) -> None:
        """:meth:`set_kv` with a raw index this pool already checked (for the hybrid pool)."""
        rows = self._checked_rows(layer, index.numel(), k, v)
        if index.numel() == 0:
            return
        if index.dtype is not torch.int64:
            index = index.to(torch.int64)
        for component, value in enumerate(rows):
            self._buffers[component][layer].index_copy_(0, index, value)
        self._padding[layer].zero_()

    def _write_span(self, layer: int, span: tuple[int, int], k: torch.Tensor,
                    v: torch.Tensor | None) -> None:
        """:meth:`write_rows` to the slots ``span[0] .. span[1] - 1`` (checked, none of them
        the padding slot): a slice copy per component, and no padding to clear."""
        start, end = span
        for component, value in enumerate(self._checked_rows(layer, end - start, k, v)):
            self._buffers[component][layer][start:end].copy_(value)

    def _checked_rows(self, layer: int, num_rows: int, k: torch.Tensor,
                      v: torch.Tensor | None) -> list[torch.Tensor]:
        """The rows of every component of a write to ``layer`` in the shape of the buffer
        views (:func:`~hicache.pools.kv_rows.checked_kv_rows`), each checked before any is
        written, once the layer's load was waited on."""
        if type(layer) is not int or not 0 <= layer < self.num_layers:
            self._check_layer(layer)
        rows = checked_kv_rows(self, num_rows, k, v)
        if self._layer_waiter is not None:
            self._layer_waiter(layer)
        return rows

    def _check_layer(self, layer: int) -> None:
        if type(layer) is not int:
            check_int(layer, "layer", f"pool '{self.name}'")
        if not 0 <= layer < self.num_layers:
            raise ValueError(
                f"pool '{self.name}': layer {layer} out of range (0..{self.num_layers - 1})"
            )

    def _refuse_kind(self, kind: AttentionKind, accessor: str) -> None:
        raise ValueError(f"{accessor} needs a {kind.value} pool; pool '{self.name}' is "
                         f"{self.geometry.kind.value}")

    def _wait(self, layer: int) -> None:
        # a negative layer would silently alias the last one
        if type(layer) is not int or not 0 <= layer < self.num_layers:
            self._check_layer(layer)
        waiter = self._layer_waiter
        if waiter is not None:
            waiter(layer)

    def _heads_view(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.view(self.num_slots, self.geometry.num_kv_heads, self.geometry.head_dim)
