"""What the staged backend derives once per pair of host and device pools and reuses for
every op between them (:class:`PoolViews`): the device rows as wide elements, the host
buffer's address and layer stride, and the device views of each group of layers an op
moves (:class:`LayerGroup`); and the views of a staging buffer, once per shape
(:class:`StagingBuffer`).

None of it depends on the op: a pool's buffers are made once, with the pool. Every op made
them anew before: a layer group's views (a slice, a permute, and for a ``page_first_direct``
host a paged view, per block of layers) cost a few microseconds each on a GPU host, and a
layer-wise load moves up to 16 groups, so a 32k-token load spent about 0.2-0.4 ms of its
issue on views that the previous op had already made. Likewise a staged write of 32k tokens
is 32 chunks of one length, each of which viewed the staging buffer anew (a slice and two
views, and for whole pages a view, a permute and a slice per block of layers): the chunks
of one length share those views now."""

from __future__ import annotations

from typing import Any

import torch

from hicache.pools import DeviceKVPool, HostKVPool, HostLayout

from .layer_blocks import layer_blocks

MAX_GROUPS = 1024  # layer lists kept per pool pair (the load groups of a few op sizes)
MAX_VIEWS = 4096  # views kept per staging buffer (a few per chunk length and layer shape)


class PoolViews:
    """Views of one host pool and one device pool for staged moves between them. Holds
    neither pool (a backend keeps it in weak mappings keyed by both) and not the host
    buffer either, only its address and strides: a closed host pool releases its memory,
    and an op on it is refused when it reads the buffer (``host_pool.data``). The device
    views share the device pool's buffer, which lives as long as the pool."""

    def __init__(self, host_pool: HostKVPool, device_pool: DeviceKVPool) -> None:
        host = host_pool.data
        self.geometry, self.num_layers = device_pool.geometry, device_pool.num_layers
        self.page_size = host_pool.page_size
        self.token_major = host_pool.layout is HostLayout.PAGE_FIRST
        layer_dim = 1 if host_pool.layout is HostLayout.LAYER_FIRST else 2
        self.host_layer_bytes = host.stride(layer_dim) * host.element_size()
        self.host_ptr = host.data_ptr()
        self.rows = wide(device_pool.data)  # [C, L, slots, row], 8-byte elements if it can
        # page-indexed views (device pools of whole host pages; see chunk_pages)
        self.by_pages = (host_pool.layout is not HostLayout.PAGE_FIRST
                         and self.rows.shape[2] % self.page_size == 0)
        self._groups: dict[tuple[int, ...], LayerGroup] = {}
        # the first chunk plan of each length and layer shape in one host run, of earlier
        # ops (staged_chunk.StagedMove.chunks): a later op shifts it rather than plan anew
        self.plan_fields: dict[tuple[object, ...], dict[str, Any]] = {}

    def group(self, layers: tuple[int, ...]) -> LayerGroup:
        """The :class:`LayerGroup` of local ``layers``, made on first use."""
        group = self._groups.get(layers)
        if group is None:
            if len(self._groups) >= MAX_GROUPS:
                self._groups.clear()
            group = self._groups[layers] = LayerGroup(self, layers)
        return group


class LayerGroup:
    """The layers of one copy call: their block shape, each block's host offset (bytes from
    the host buffer's start) and device rows (wide; ``[C, count, slots, row]``, token-major
    ``[slots, C, count, row]`` for a ``page_first`` host; for whole pages also ``[C, count,
    pages, page_size, row]``, ``paged_rows``, named by ``paged_key``: their addresses, shapes
    and strides, which a staging buffer's cache keys with, holding no reference to the pool's
    memory)."""

    def __init__(self, views: PoolViews, layers: tuple[int, ...]) -> None:
        self.shape, begins = layer_blocks(layers)
        self.views = views
        self.num_layers = len(layers)
        self.host_offsets = [begin * views.host_layer_bytes for begin in begins]
        self.host_ptrs = [views.host_ptr + offset for offset in self.host_offsets]
        self.begins = begins
        self.device_rows: list[torch.Tensor] = []
        self.paged_rows: list[torch.Tensor] = []
        for begin, (_, count) in zip(begins, self.shape, strict=True):
            rows = views.rows[:, begin: begin + count]
            self.device_rows.append(rows.permute(2, 0, 1, 3) if views.token_major else rows)
            if views.by_pages:
                c, _, slots, width = rows.shape
                self.paged_rows.append(rows.view(c, count, slots // views.page_size,
                                                 views.page_size, width))
        self.paged_key = tuple((rows.data_ptr(), tuple(rows.shape), rows.stride())
                               for rows in self.paged_rows)
        # the staged backend's chunk length and turns, by (pairs, staging budget)
        self.chunking: dict[tuple[int, int], tuple[int, bool]] = {}


class StagingBuffer:
    """One staging buffer of a lane (``data``, flat, in the pool's dtype) and the views of it
    that chunks asked for, by a key naming the view (:meth:`view`). The views die with the
    buffer: a lane that replaces its buffers makes new ones."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self._views: dict[tuple[object, ...], object] = {}

    def view(self, numel: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The first ``numel`` elements (the pool's dtype) as ``dtype`` in ``shape``."""
        key = (numel, dtype, shape)
        found = self._views.get(key)
        if found is None:
            found = self.keep(key, self.data[:numel].view(dtype).view(shape))
        assert isinstance(found, torch.Tensor)
        return found

    def get(self, key: tuple[object, ...]) -> object:
        """The object kept under ``key`` (:meth:`keep`), or ``None``."""
        return self._views.get(key)

    def keep(self, key: tuple[object, ...], value: object) -> object:
        """Keep ``value`` (views of this buffer) under ``key``; returns it."""
        if len(self._views) >= MAX_VIEWS:
            self._views.clear()
        self._views[key] = value
        return value


def wide(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` reinterpreted as 8-byte elements where the row allows it: the gather and
    scatter then move a quarter of the elements of bf16 rows, with wider loads, and hold the
    SMs (which the model's compute shares) for less time. Bits are moved, never converted."""
    if rows.element_size() < 8 and rows.shape[-1] * rows.element_size() % 8 == 0:
        return rows.view(torch.int64)
    return rows
