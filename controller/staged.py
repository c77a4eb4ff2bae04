"""The ``staged`` backend: GPU gather/scatter through a device staging buffer plus copy-engine
copies of contiguous host runs.

The scattered part of a move runs at HBM speed on the GPU (a few percent of the transfer
time); the PCIe leg is one 2D copy per contiguous host run (:mod:`.copy2d`: all components
and layers of the run at once), carried by the copy engine, which uses no SMs, so the
model's compute is left alone.

Pairs are sorted by host slot in ``order_pairs`` (part of ``move_indices``), so runs of
consecutive host pages become single copies. Work is cut into chunks sized by the staging
budget (``staging_tokens`` tokens of every layer; a one-layer move takes that many bytes'
worth of tokens). Each side stream has a lane of two staging buffers and an auxiliary
stream: a write gathers chunk i+1 on the auxiliary stream while the side stream copies chunk
i to the host; a load copies on the auxiliary stream and scatters on the side stream, so the
copy of layer i+1 runs while layer i is scattered and its "layer ready" event recorded.
Buffers alternate across calls and each waits only for the event that freed it. Staging
memory is bounded: ``2 * staging_tokens * token_bytes`` per side stream (write and load:
twice that).

A ``page_first`` host moving one layer (a layer-wise load) copies rows of one layer a
token's bytes apart: correct, but the copy engine moves such short strided rows at about a
third of the link's rate (measured), so ``auto`` sends those loads to the kernel backend.

On a CPU device pool there is no copy engine; the same chunking and run logic runs with
plain ``copy_`` calls, so it is tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from hicache.pools import DeviceKVPool, HostKVPool, HostLayout

from .base import Direction, MovedTransfer, TransferBackend
from .copy2d import copy_block
from .events import Event

CPU = torch.device("cpu")


def host_runs(host_slots: np.ndarray) -> list[tuple[int, int]]:
    """Split sorted host slots into ``(start position, length)`` runs of consecutive slots."""
    if host_slots.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(host_slots) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [host_slots.size]))
    return [(int(s), int(e - s)) for s, e in zip(starts, ends, strict=True)]


class StagedBackend(TransferBackend):
    """Device staging buffer + copy engine, chunked and double buffered.

    Args:
        staging_tokens: pairs per chunk (the staging buffer holds two chunks).
    """

    name = "staged"

    def __init__(self, staging_tokens: int = 1024) -> None:
        if staging_tokens < 1:
            raise ValueError(f"staged backend: staging_tokens must be >= 1, got {staging_tokens}")
        self.staging_tokens = staging_tokens
        # Keyed by the side stream that issues the move (write and load streams each get their
        # own staging and auxiliary stream, so the two directions never share a buffer).
        self._lanes: dict[tuple[int, torch.dtype], _Lane] = {}

    def staging_bytes(self, token_bytes: int) -> int:
        """Device memory the staging buffers take for rows of ``token_bytes``."""
        return 2 * self.staging_tokens * token_bytes

    def allocated_bytes(self) -> int:
        """Device memory the staging buffers hold now (all side streams and dtypes)."""
        return sum(b.numel() * b.element_size() for lane in self._lanes.values()
                   for b in lane.buffers)

    def index_devices(
        self, host_pool: HostKVPool, device_pool: DeviceKVPool
    ) -> tuple[torch.device, torch.device]:
        return CPU, device_pool.device

    def order_pairs(
        self, host_index: torch.Tensor, device_index: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sort pairs by host slot (device slots permuted alike) so host runs are contiguous."""
        order = torch.argsort(host_index, stable=True)
        return host_index[order], device_index[order]

    def copy(
        self,
        moved: MovedTransfer,
        local_layers: Sequence[int],
        direction: Direction,
        keep_alive: list[torch.Tensor],
    ) -> None:
        if moved.host_index.numel() == 0 or not local_layers:
            return
        device_pool = moved.source.device_pool
        layers = list(local_layers)
        slots = moved.host_index.numpy()
        side = torch.cuda.current_stream(device_pool.device) if _on_cuda(device_pool) else None
        lane = self._lane(device_pool, side)
        if direction is Direction.DEVICE_TO_HOST and lane.aux is not None and side is not None:
            # Gathers read device rows: after the producers and the caller (the side stream
            # waited on them when the op began).
            lane.aux.wait_stream(side)
        chunk_tokens = self.chunk_tokens(device_pool.num_layers, len(layers))
        for start in range(0, slots.size, chunk_tokens):
            end = min(start + chunk_tokens, slots.size)
            number = lane.take()
            chunk = _Chunk(moved, layers, start, end, lane.buffers[number])
            lane.free[number] = _move_chunk(chunk, direction, side, lane.aux, lane.free[number])
        keep_alive.extend(lane.buffers)

    def chunk_tokens(self, pool_layers: int, moved_layers: int) -> int:
        """Pairs per chunk: the staging budget is ``staging_tokens`` tokens of every layer of
        the pool, so a move of fewer layers (a layer-wise load) takes proportionally more
        tokens per chunk at the same memory (fewer, longer copies)."""
        return self.staging_tokens * pool_layers // max(moved_layers, 1)

    def _lane(self, device_pool: DeviceKVPool, side: torch.cuda.Stream | None) -> _Lane:
        """The staging lane of ``side`` for the pool's dtype: two buffers of one chunk each
        and an auxiliary stream, allocated once.

        A buffer replaced by a larger one (a pool of wider rows) stays alive through the ops
        that hold views of it (``keep_alive``) until their side stream has passed them."""
        geometry = device_pool.geometry
        key = (side.cuda_stream if side is not None else 0, geometry.dtype)
        half = (self.staging_tokens * geometry.num_components * device_pool.num_layers
                * geometry.row_elems)
        lane = self._lanes.get(key)
        if lane is None or lane.buffers[0].numel() < half:
            flat = torch.empty(2 * half, dtype=geometry.dtype, device=device_pool.device)
            aux = lane.aux if lane is not None else (
                torch.cuda.Stream(side.device) if side is not None else None)
            lane = _Lane([flat[:half], flat[half:]], aux)
            self._lanes[key] = lane
        return lane


class _Lane:
    """Double-buffered staging of one side stream: the buffers, the event after which each
    may be overwritten (``None``: free), which one the next chunk takes, and the auxiliary
    stream. Chunks alternate buffers across calls, so consecutive layers of a layer-wise load
    overlap (the copy of layer i+1 runs while layer i is scattered)."""

    def __init__(self, buffers: list[torch.Tensor], aux: torch.cuda.Stream | None) -> None:
        self.buffers, self.aux = buffers, aux
        self.free: list[Event | None] = [None, None]
        self.next = 0

    def take(self) -> int:
        number, self.next = self.next, 1 - self.next
        return number


def _move_chunk(chunk: _Chunk, direction: Direction, side: torch.cuda.Stream | None,
                aux: torch.cuda.Stream | None, buffer_free: Event | None) -> Event | None:
    """Move one chunk; returns the event (on ``side``) after which its buffer may be reused.

    Write: gather on ``aux``, copy-engine copy on ``side``. Load: copy-engine copy on ``aux``,
    scatter on ``side``, so the side stream (whose events say "layer ready") never holds
    back the next layer's copy, and the copies follow one another without a gap.
    """
    device = chunk.moved.source.device_pool.device
    to_host = direction is Direction.DEVICE_TO_HOST
    with _stream(aux):
        if buffer_free is not None:
            buffer_free.wait()
        if to_host:
            chunk.gather()
        else:
            chunk.copy_runs(to_host=False)
        staged = _record(device, aux)
    with _stream(side):
        if staged is not None:
            staged.wait()
        if to_host:
            chunk.copy_runs(to_host=True)
        else:
            chunk.scatter()
        return _record(device, side)


class _Chunk:
    """One chunk of a staged move: pairs ``[start, end)`` of ``moved``.

    Staging follows the host layout so that every host run is one block copy
    (:func:`copy_block`, a single 2D copy-engine operation): token-major
    ``[n, components, layers, row]`` for a ``page_first`` host, layer-major
    ``[components, layers, n, row]`` for a ``layer_first`` host. A ``page_first`` host
    moving a subset of its layers (a per-layer load) has rows of one layer a token's bytes
    apart; the 2D copy takes them in one operation, though short rows move slower.
    """

    def __init__(self, moved: MovedTransfer, layers: list[int], start: int, end: int,
                 flat: torch.Tensor) -> None:
        self.moved, self.layers = moved, layers
        self.blocks = _layer_blocks(layers)
        self.device_index = moved.device_index[start:end]
        self.host_slots = moved.host_index.numpy()[start:end]
        host = moved.source.host_pool
        geometry = moved.source.device_pool.geometry
        n, c, r = end - start, geometry.num_components, geometry.row_elems
        self.token_major = host.layout is HostLayout.PAGE_FIRST
        shape = (n, c, len(layers), r) if self.token_major else (c, len(layers), n, r)
        self.buf = flat[: n * c * len(layers) * r].view(shape)

    def gather(self) -> None:
        data, buf = _wide(self.moved.source.device_pool.data), _wide(self.buf)
        for offset, (begin, end) in self.blocks:
            if self.token_major:
                source = data[:, begin:end].permute(2, 0, 1, 3)
                if len(self.blocks) == 1:
                    torch.index_select(source, 0, self.device_index, out=buf)
                else:
                    buf[:, :, offset: offset + end - begin].copy_(
                        torch.index_select(source, 0, self.device_index))
                continue
            block = buf[:, offset: offset + end - begin]
            if len(self.blocks) == 1:
                torch.index_select(data[:, begin:end], 2, self.device_index, out=block)
            else:
                block.copy_(torch.index_select(data[:, begin:end], 2, self.device_index))

    def scatter(self) -> None:
        data, buf = _wide(self.moved.source.device_pool.data), _wide(self.buf)
        for offset, (begin, end) in self.blocks:
            if self.token_major:
                data[:, begin:end].permute(2, 0, 1, 3).index_copy_(
                    0, self.device_index, buf[:, :, offset: offset + end - begin])
            else:
                data[:, begin:end].index_copy_(
                    2, self.device_index, buf[:, offset: offset + end - begin])

    def copy_runs(self, to_host: bool) -> None:
        host = self.moved.source.host_pool.data
        for offset, length in host_runs(self.host_slots):
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


def _on_cuda(pool: DeviceKVPool) -> bool:
    return pool.device.type == "cuda"


def _record(device: torch.device, stream: torch.cuda.Stream | None) -> Event | None:
    if stream is None:
        return None
    event = Event(device)
    event.record(stream)
    return event


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
