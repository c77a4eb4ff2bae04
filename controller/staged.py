"""The ``staged`` backend: GPU gather/scatter through a device staging buffer plus copy-engine
copies of contiguous host runs.

The scattered part of a move runs at HBM speed on the GPU (a few percent of the transfer
time); the PCIe leg is one ``cudaMemcpyAsync`` per contiguous host run (per component and
layer for ``layer_first``, whole token rows for ``page_first``), carried by the copy engine,
which uses no SMs, so the model's compute is left alone.

Pairs are sorted by host slot in ``order_pairs`` (part of ``move_indices``), so runs of
consecutive host pages become single copies. Work is cut into chunks of
``staging_tokens`` pairs with two staging buffers: the gather (or scatter) of one chunk runs
on an auxiliary stream while the copy engine moves the neighbouring chunk. Staging memory is
bounded: ``2 * staging_tokens * token_bytes`` per side stream (write and load: twice that).

On a CPU device pool there is no copy engine; the same chunking and run logic runs with
plain ``copy_`` calls, so it is tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from hicache.pools import DeviceKVPool, HostKVPool, HostLayout

from .base import Direction, MovedTransfer, TransferBackend
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
        self._buffers: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._aux_streams: dict[int, torch.cuda.Stream] = {}

    def staging_bytes(self, token_bytes: int) -> int:
        """Device memory the staging buffers take for rows of ``token_bytes``."""
        return 2 * self.staging_tokens * token_bytes

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
        aux = self._aux_stream(side) if side is not None else None
        if aux is not None and side is not None:
            aux.wait_stream(side)  # earlier moves on this side stream are done with the buffers
        buffers = self._staging(device_pool, side)
        chunk_tokens = self.chunk_tokens(device_pool.num_layers, len(layers))
        done: list[Event | None] = [None, None]
        for number, start in enumerate(range(0, slots.size, chunk_tokens)):
            end = min(start + chunk_tokens, slots.size)
            chunk = _Chunk(moved, layers, start, end, buffers[number % 2])
            done[number % 2] = self._move_chunk(chunk, direction, side, aux, done[number % 2])
        if aux is not None and side is not None:
            side.wait_stream(aux)  # the op's finish event covers the last scatter/gather
            keep_alive.extend(buffers)

    def _move_chunk(
        self,
        chunk: _Chunk,
        direction: Direction,
        side: torch.cuda.Stream | None,
        aux: torch.cuda.Stream | None,
        buffer_free: Event | None,
    ) -> Event | None:
        """Gather+copy (write) or copy+scatter (load) one chunk; returns the event after which
        its staging buffer may be reused."""
        device = chunk.moved.source.device_pool.device
        if direction is Direction.DEVICE_TO_HOST:
            with _stream(aux):
                if buffer_free is not None:
                    buffer_free.wait()
                chunk.gather()
                gathered = _record(device, aux)
            with _stream(side):
                if gathered is not None:
                    gathered.wait()
                chunk.copy_runs(to_host=True)
                return _record(device, side)
        with _stream(side):
            if buffer_free is not None:
                buffer_free.wait()
            chunk.copy_runs(to_host=False)
            arrived = _record(device, side)
        with _stream(aux):
            if arrived is not None:
                arrived.wait()
            chunk.scatter()
            return _record(device, aux)

    def chunk_tokens(self, pool_layers: int, moved_layers: int) -> int:
        """Pairs per chunk: the staging budget is ``staging_tokens`` tokens of every layer of
        the pool, so a move of fewer layers (a layer-wise load) takes proportionally more
        tokens per chunk at the same memory (fewer, longer copies)."""
        return self.staging_tokens * pool_layers // max(moved_layers, 1)

    def _staging(self, device_pool: DeviceKVPool,
                 side: torch.cuda.Stream | None) -> list[torch.Tensor]:
        """Two flat staging buffers of one chunk each, allocated once per side stream.

        A buffer replaced by a larger one (a pool of wider rows) stays alive through the ops
        that hold views of it (``keep_alive``) until their side stream has passed them."""
        geometry = device_pool.geometry
        key = (side.cuda_stream if side is not None else 0, geometry.dtype)
        num_layers = device_pool.num_layers
        half = self.staging_tokens * geometry.num_components * num_layers * geometry.row_elems
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < 2 * half:
            buffer = torch.empty(2 * half, dtype=geometry.dtype, device=device_pool.device)
            self._buffers[key] = buffer
        return [buffer[:half], buffer[half: 2 * half]]

    def _aux_stream(self, side: torch.cuda.Stream) -> torch.cuda.Stream:
        key = side.cuda_stream
        if key not in self._aux_streams:
            self._aux_streams[key] = torch.cuda.Stream(side.device)
        return self._aux_streams[key]


class _Chunk:
    """One chunk of a staged move: pairs ``[start, end)`` of ``moved``.

    Staging layout follows the host layout so that every host run is one copy per block:
    token-major ``[n, components, layers, row]`` when a ``page_first`` host moves all its
    layers (one copy per run), layer-major ``[components, layers, n, row]`` otherwise (one copy
    per run, component and layer). A ``page_first`` host moving a subset of its layers (a
    per-layer load) has strided host rows: correct, but the copy engine is slow there, so
    ``auto`` sends such loads to the kernel backend.
    """

    def __init__(self, moved: MovedTransfer, layers: list[int], start: int, end: int,
                 flat: torch.Tensor) -> None:
        self.moved, self.layers = moved, layers
        self.device_index = moved.device_index[start:end]
        self.host_slots = moved.host_index.numpy()[start:end]
        host = moved.source.host_pool
        geometry = moved.source.device_pool.geometry
        n, c, r = end - start, geometry.num_components, geometry.row_elems
        self.token_major = (host.layout is HostLayout.PAGE_FIRST
                            and layers == list(range(host.num_layers)))
        shape = (n, c, len(layers), r) if self.token_major else (c, len(layers), n, r)
        self.buf = flat[: n * c * len(layers) * r].view(shape)

    def gather(self) -> None:
        data = self.moved.source.device_pool.data
        if self.token_major:
            torch.index_select(data.permute(2, 0, 1, 3), 0, self.device_index, out=self.buf)
            return
        for offset, (begin, end) in _layer_blocks(self.layers):
            block = self.buf[:, offset: offset + end - begin]
            block.copy_(torch.index_select(data[:, begin:end], 2, self.device_index))

    def scatter(self) -> None:
        data = self.moved.source.device_pool.data
        if self.token_major:
            data.permute(2, 0, 1, 3).index_copy_(0, self.device_index, self.buf)
            return
        for offset, (begin, end) in _layer_blocks(self.layers):
            block = self.buf[:, offset: offset + end - begin]
            data[:, begin:end].index_copy_(2, self.device_index, block)

    def copy_runs(self, to_host: bool) -> None:
        host = self.moved.source.host_pool
        for offset, length in host_runs(self.host_slots):
            first = int(self.host_slots[offset])
            if self.token_major:
                _copy(host.data[first: first + length], self.buf[offset: offset + length],
                      to_host)
                continue
            for i, layer in enumerate(self.layers):
                for c in range(self.buf.shape[0]):
                    rows = host.layer_rows(c, layer)[first: first + length]
                    _copy(rows, self.buf[c, i, offset: offset + length], to_host)


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


def _copy(host_rows: torch.Tensor, staged_rows: torch.Tensor, to_host: bool) -> None:
    if to_host:
        host_rows.copy_(staged_rows, non_blocking=True)
    else:
        staged_rows.copy_(host_rows, non_blocking=True)


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
