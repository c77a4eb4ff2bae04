"""One chunk of a staged move: device gather/scatter through a staging buffer, and one
copy-engine copy per contiguous host run (:mod:`.copy2d`), on the streams
:class:`~hicache.controller.staged.StagedBackend` gives it.

On a CPU device pool (no streams) the same code runs inline, so it is tested without a GPU.
"""

from __future__ import annotations

import numpy as np
import torch

from hicache.pools import HostLayout

from .base import Direction, MovedTransfer
from .copy2d import copy_block
from .direct_staging import DirectStaging, PagePlan
from .events import Event


def host_runs(host_slots: np.ndarray) -> list[tuple[int, int]]:
    """Split sorted host slots into ``(start position, length)`` runs of consecutive slots."""
    if host_slots.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(host_slots) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [host_slots.size]))
    return [(int(s), int(e - s)) for s, e in zip(starts, ends, strict=True)]


def move_chunk(chunk: StagedChunk, direction: Direction, side: torch.cuda.Stream | None,
               aux: torch.cuda.Stream | None, free: Event, staged: Event) -> None:
    """Move one chunk through its staging buffer, whose two events are reused chunk after
    chunk: ``free`` (recorded on ``side`` once the buffer may be overwritten; this chunk
    waits on its previous record, a no-op before the first) and ``staged`` (recorded on
    ``aux`` once the buffer is filled or drained there; ``side`` waits on it at once). A
    wait takes the record made before it, so recording an event again after the wait was
    issued is safe, and no event is created per chunk.

    Write: gather on ``aux``, copy-engine copy on ``side``. Load: copy-engine copy on ``aux``,
    scatter on ``side``, so the side stream (whose events say "layer ready") never holds
    back the next layer's copy, and the copies follow one another without a gap.
    """
    to_host = direction is Direction.DEVICE_TO_HOST
    with _stream(aux):
        free.wait()
        if to_host:
            chunk.gather()
        else:
            chunk.copy_runs(to_host=False)
        staged.record(aux)
    with _stream(side):
        staged.wait()
        if to_host:
            chunk.copy_runs(to_host=True)
        else:
            chunk.scatter()
        free.record(side)


class ChunkSlots:
    """Pairs ``[start, end)`` of ``moved``: their device index, host slots and what the copies
    derive from the host slots (runs of consecutive slots, or the pages of a
    ``page_first_direct`` host). None of it depends on the layers moved, so a layer-wise load
    makes it once per chunk of the op (:meth:`of`), not once per layer group."""

    def __init__(self, moved: MovedTransfer, start: int, end: int) -> None:
        self.device_index = moved.device_index[start:end]
        self.host_slots = moved.host_index.numpy()[start:end]
        host = moved.source.host_pool
        self.pages: PagePlan | None = None
        self.runs: list[tuple[int, int]] = []
        if host.layout is HostLayout.PAGE_FIRST_DIRECT:
            self.pages = PagePlan(self.host_slots, host.page_size)
        else:
            self.runs = host_runs(self.host_slots)

    @staticmethod
    def of(moved: MovedTransfer, start: int, end: int) -> ChunkSlots:
        """The slots of pairs ``[start, end)`` of ``moved``, made on first use and kept
        with it (``moved.chunk_slots``) until its op is acknowledged."""
        slots = moved.chunk_slots.get((start, end))
        if slots is None:
            slots = moved.chunk_slots[(start, end)] = ChunkSlots(moved, start, end)
        return slots


class StagedChunk:
    """One chunk of a staged move: the pairs of ``slots`` of ``moved``, for ``layers``.

    Staging follows the host layout so that every host run is one block copy
    (:func:`copy_block`, a single 2D copy-engine operation): token-major
    ``[n, components, layers, row]`` for a ``page_first`` host, layer-major
    ``[components, layers, n, row]`` for a ``layer_first`` host. A ``page_first`` host
    moving a subset of its layers (a per-layer load) has rows of one layer a token's bytes
    apart; the 2D copy takes them in one operation, though short rows move slower. A
    ``page_first_direct`` host is staged page by page as it stores them
    (:class:`~hicache.controller.direct_staging.DirectStaging`): one 2D copy per run of whole
    pages and block of layers, with rows of ``page_size`` tokens.
    """

    def __init__(self, moved: MovedTransfer, layers: list[int], slots: ChunkSlots,
                 flat: torch.Tensor) -> None:
        self.moved, self.layers, self.slots = moved, layers, slots
        self.blocks = _layer_blocks(layers)
        self.device_index = slots.device_index
        self.host_slots = slots.host_slots
        host = moved.source.host_pool
        geometry = moved.source.device_pool.geometry
        n, c, r = len(self.host_slots), geometry.num_components, geometry.row_elems
        self.token_major = host.layout is HostLayout.PAGE_FIRST
        self.direct: DirectStaging | None = None
        if slots.pages is not None:
            self.direct = DirectStaging(slots.pages, c, len(layers), r)
            shape: tuple[int, ...] = (n * c * len(layers), r)
        else:
            shape = (n, c, len(layers), r) if self.token_major else (c, len(layers), n, r)
        self.buf = flat[: n * c * len(layers) * r].view(shape)

    def gather(self) -> None:
        data, buf = _wide(self.moved.source.device_pool.data), _wide(self.buf)
        if self.direct is not None:
            shape = (*self.direct.shape, self.device_index.numel(), buf.shape[-1])
            gathered = torch.empty(shape, dtype=buf.dtype, device=buf.device)
            self._gather_layer_major(data, gathered)
            self.direct.stage(gathered, buf)
            return
        if not self.token_major:
            self._gather_layer_major(data, buf)
            return
        for offset, (begin, end) in self.blocks:
            source = data[:, begin:end].permute(2, 0, 1, 3)
            if len(self.blocks) == 1:
                torch.index_select(source, 0, self.device_index, out=buf)
            else:
                buf[:, :, offset: offset + end - begin].copy_(
                    torch.index_select(source, 0, self.device_index))

    def _gather_layer_major(self, data: torch.Tensor, buf: torch.Tensor) -> None:
        """Device rows into ``buf`` ``[components, moved layers, n, row]``."""
        for offset, (begin, end) in self.blocks:
            block = buf[:, offset: offset + end - begin]
            if len(self.blocks) == 1:
                torch.index_select(data[:, begin:end], 2, self.device_index, out=block)
            else:
                block.copy_(torch.index_select(data[:, begin:end], 2, self.device_index))

    def scatter(self) -> None:
        data, buf = _wide(self.moved.source.device_pool.data), _wide(self.buf)
        if self.direct is not None:
            buf = self.direct.unstage(buf)  # layer-major, as for a layer_first host
        for offset, (begin, end) in self.blocks:
            if self.token_major:
                data[:, begin:end].permute(2, 0, 1, 3).index_copy_(
                    0, self.device_index, buf[:, :, offset: offset + end - begin])
            else:
                data[:, begin:end].index_copy_(
                    2, self.device_index, buf[:, offset: offset + end - begin])

    def copy_runs(self, to_host: bool) -> None:
        host = self.moved.source.host_pool.data
        if self.direct is not None:
            self.direct.copy_segments(host, self.buf, self.blocks, to_host)
            return
        for offset, length in self.slots.runs:
            first = int(self.host_slots[offset])
            for block_offset, (begin, end) in self.blocks:
                count = end - begin
                if self.token_major:
                    host_view = host[first: first + length, :, begin:end]
                    staged = self.buf[offset: offset + length, :, block_offset:
                                      block_offset + count]
                else:
                    host_view = host[:, begin:end, first: first + length]
                    staged = self.buf[:, block_offset: block_offset + count,
                                      offset: offset + length]
                if to_host:
                    copy_block(host_view, staged)
                else:
                    copy_block(staged, host_view)


def _wide(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` reinterpreted as 8-byte elements where the row allows it: the gather and
    scatter then move a quarter of the elements of bf16 rows, with wider loads, and hold the
    SMs (which the model's compute shares) for less time. Bits are moved, never converted."""
    if rows.element_size() < 8 and rows.shape[-1] * rows.element_size() % 8 == 0:
        return rows.view(torch.int64)
    return rows


def _layer_blocks(layers: list[int]) -> list[tuple[int, tuple[int, int]]]:
    """``(offset in layers, (begin, end))`` for each run of consecutive layer ids."""
    blocks: list[tuple[int, tuple[int, int]]] = []
    for offset, layer in enumerate(layers):
        if blocks and blocks[-1][1][1] == layer:
            start, (begin, _) = blocks[-1]
            blocks[-1] = (start, (begin, layer + 1))
        else:
            blocks.append((offset, (layer, layer + 1)))
    return blocks


class _stream:
    """``torch.cuda.stream`` that accepts ``None`` (CPU: run inline)."""

    def __init__(self, stream: torch.cuda.Stream | None) -> None:
        self._ctx = torch.cuda.stream(stream) if stream is not None else None

    def __enter__(self) -> None:
        if self._ctx is not None:
            self._ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
