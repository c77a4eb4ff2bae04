"""The ``staged`` backend: GPU gather/scatter through a device staging buffer plus copy-engine
copies of contiguous host runs.

The scattered part of a move runs at HBM speed on the GPU (a few percent of the transfer
time); the PCIe leg is one 2D copy per contiguous host run (:mod:`.copy2d`: all components
and layers of the run at once), carried by the copy engine, which uses no SMs, so the
model's compute is left alone.

Pairs are sorted by host slot in ``order_pairs`` (part of ``move_indices``), so runs of
consecutive host pages become single copies. Work is cut into chunks sized by the staging
budget (``staging_tokens`` tokens of every layer; a move of fewer layers takes
proportionally more tokens), balanced and in whole host pages (:meth:`chunk_tokens`): a
3-layer group of a 32k-token load of 32 layers is three chunks, not three and a 2-token
fourth, and no chunk of a ``page_first_direct`` host splits a page. A buffer holds the
budget plus one host page of every layer, which balancing in whole pages may use. Each
side stream has a lane of two staging buffers, an auxiliary stream and a copy stream per
buffer: a write gathers chunk i+1 on the auxiliary stream while chunk i is copied to the
host; a load copies on the buffer's copy stream and scatters on the side stream, so the
copy of the next layer group runs while one is scattered and its "layer ready" events
recorded. The two copy streams take turns (:mod:`.copy_turns`): after a big chunk the next
chunk's copy waits until it has finished, so the op never holds the copy engine against an
engine's own copies. Buffers alternate across calls and each waits only for the event that
freed it. Staging memory is bounded: ``2 * (staging_tokens + page_size) * token_bytes`` per
side stream (write and load: twice that).

A ``page_first`` host moving one layer (a layer-wise load) copies rows of one layer a
token's bytes apart: correct, but the copy engine moves such short strided rows at about a
third of the link's rate (measured), so ``auto`` sends those loads to the kernel backend.
A ``page_first_direct`` host keeps one layer of a page as ``page_size`` consecutive rows, so
one layer of a run of whole pages is a single 2D copy of ``page_size``-row blocks (32 KiB
for 16 tokens of 2 KiB rows) and a write of all layers one contiguous copy per run
(:mod:`.direct_staging`).

On a CPU device pool there is no copy engine; the same chunking and run logic runs with
plain ``copy_`` calls, so it is tested without a GPU.

Issue cost: an op finds its host runs (or pages) once, plans each chunk once per layer shape
(its host runs as 2D copies, byte offsets from the host buffer and a staging buffer, shifted
from templates the backend keeps per run shape across ops), and every layer group of a
layer-wise load issues those copies at its layers' offset; copies and events name their streams (the
side stream is looked up once per op), so a chunk issues its copies, one index kernel and
a few event operations with no stream lookup. Where the op's device slots are whole device
pages (``layer_first`` and ``page_first_direct`` hosts) that kernel indexes pages and is
launched through the driver (:mod:`.chunk_pages`, :mod:`.page_kernel`); a load scatters
such a chunk on the buffer's own copy stream, after its copy
(:func:`~.chunk_moves.move_paged_chunk`): the stream's order keeps the buffer's uses apart,
so the chunk makes two event calls (its copy's end and the turn before it) where one
scattered on the side stream makes five; the copy streams wait on the side stream once an
op, and the side stream on them once a layer group. The plans are in
:mod:`hicache.controller.staged_chunk`, a chunk's data movement in
:mod:`hicache.controller.chunk_moves`; this module holds the backend and its staging lanes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from hicache.pools import DeviceKVPool, HostKVPool, HostLayout

from .base import Direction, MovedTransfer, TransferBackend
from .chunk_copies import CopyTemplates
from .chunk_moves import move_chunk, move_paged_chunk
from .chunk_pages import kernel_launches
from .chunk_slots import host_runs
from .copy_turns import copy_streams, takes_turns
from .events import Event
from .pool_pairs import PoolPairCache
from .staged_chunk import StagedMove
from .staged_views import PoolViews, StagingBuffer
from .stream_pool import stream_beside

__all__ = ["StagedBackend", "host_runs"]

CPU = torch.device("cpu")


class StagedBackend(TransferBackend):
    """Device staging buffer + copy engine, chunked and double buffered.

    Args:
        staging_tokens: pairs per chunk (the staging buffer holds two chunks).
    """

    name = "staged"
    # a chunk: its scatter launch (22-28 us), 2D copies (6 us each), two to five event
    # operations and a few views
    copy_s = 70e-6

    def __init__(self, staging_tokens: int = 1024) -> None:
        if staging_tokens < 1:
            raise ValueError(f"staged backend: staging_tokens must be >= 1, got {staging_tokens}")
        self.staging_tokens = staging_tokens
        # Keyed by the side stream that issues the move (write and load streams each get their
        # own staging and auxiliary stream, so the two directions never share a buffer).
        self._lanes: dict[tuple[int, torch.dtype], _Lane] = {}
        self.templates = CopyTemplates()  # every op's chunk copies, by run shape
        # views of each pool pair, for every op between them (weak: a pool's going drops
        # its entries)
        self._views = PoolPairCache(PoolViews)

    def staging_bytes(self, token_bytes: int, page_size: int) -> int:
        """Device memory the staging buffers of one side stream take for rows of
        ``token_bytes`` and host pages of ``page_size`` tokens."""
        return 2 * (self.staging_tokens + page_size) * token_bytes

    def allocated_bytes(self) -> int:
        """Device memory the staging buffers hold now (all side streams and dtypes)."""
        return sum(b.numel() * b.element_size() for lane in self._lanes.values()
                   for b in lane.buffers)

    def index_devices(
        self, host_pool: HostKVPool, device_pool: DeviceKVPool
    ) -> tuple[torch.device, torch.device]:
        return CPU, device_pool.device

    def reads_device_pages(self, host_pool: HostKVPool, device_pool: DeviceKVPool) -> bool:
        """Moves of a ``page_first_direct`` or ``layer_first`` host gather and scatter whole
        device pages (:func:`~.chunk_slots.device_page_index`, :mod:`.chunk_pages`)."""
        return host_pool.layout is not HostLayout.PAGE_FIRST

    def order_pairs(
        self, host_index: torch.Tensor, device_index: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sort pairs by host slot (device slots permuted alike) so host runs are contiguous.
        Pairs already in order (the host allocator's runs) are returned as they are. numpy,
        not torch: torch's stable argsort took 0.8 ms of the issue for 32768 pairs."""
        slots = host_index.numpy()
        if bool((slots[1:] >= slots[:-1]).all()):
            return host_index, device_index
        order = np.argsort(slots, kind="stable")
        return torch.from_numpy(slots[order]), torch.from_numpy(device_index.numpy()[order])

    def copy(
        self,
        moved: MovedTransfer,
        local_layers: Sequence[int],
        direction: Direction,
        keep_alive: list[torch.Tensor],
    ) -> None:
        if moved.host_index.numel() == 0 or not local_layers:
            return
        move = moved.staged_move
        page_size = moved.source.host_pool.page_size
        if move is None:  # the op's first copy: on its side stream, current now
            device = moved.source.device_pool.device
            side = torch.cuda.current_stream(device) if device.type == "cuda" else None
            move = moved.staged_move = StagedMove(moved, side, self._pool_views(moved))
            if move.page_index is not None:  # made on the side stream, read there
                keep_alive.append(move.page_index)
        # the lane its first copy found while it is still this backend's (one replaced by a
        # larger lane since is looked up again)
        lane = move.lane
        if lane is None or self._lanes.get(lane.key) is not lane:
            lane = move.lane = self._lane(moved.source.device_pool, move.side, page_size)
        to_host = direction is Direction.DEVICE_TO_HOST
        group = move.views.group(tuple(local_layers))
        # the group's chunk length and turns for moves of this many pairs and this budget
        # (a group is one pool pair's: its page size is fixed), made once
        chunking = group.chunking.get((move.num_pairs, self.staging_tokens))
        if chunking is None:
            chunking = group.chunking[(move.num_pairs, self.staging_tokens)] = (
                self._chunking(move, group.num_layers, page_size))
        chunk_tokens, turns = chunking
        staging, free, staged, aux = lane.staging, lane.free, lane.staged, lane.aux
        side, copiers = move.side, lane.copiers
        plans = move.chunks(moved, chunk_tokens, group.shape, staging[0], self.templates)
        done = free if to_host else staged  # recorded on a copier after its copy
        on_aux = False  # a write's gathers by torch: on aux, made current once for them all
        scattered = [False, False]  # a load's copy streams that scattered chunks
        try:
            for plan in plans:
                number = lane.next
                lane.next = 1 - number
                previous = done[1 - number] if lane.turns else None
                lane.turns = turns
                copier = copiers[number]
                # a load's chunk of whole device pages: scattered on its copy stream (a
                # write's gathers there slowed writes by 1-2%, measured: they stay on aux)
                launches = (kernel_launches(plan, group, staging[number], True)
                            if copier is not None and not to_host else None)
                if launches is not None and copier is not None and side is not None:
                    if not move.copiers_follow:  # the scatters write the op's device rows
                        move.copiers_follow = True
                        lane.fence.record(side)
                        lane.fence.wait(copiers[0])
                        lane.fence.wait(copiers[1])
                    scattered[number], drained = True, None
                    if lane.drained_on_side[number]:
                        drained, lane.drained_on_side[number] = free[number], False
                    move_paged_chunk(plan, group, launches, staging[number], copier,
                                     done[number], previous, drained)
                    continue
                if to_host and aux is not None and side is not None and not on_aux:
                    # Gathers read device rows: after the producers and the caller (the side
                    # stream waited on them when the op began).
                    aux.wait_stream(side)
                    torch.cuda.set_stream(aux)
                    on_aux = True
                move_chunk(plan, group, to_host, staging[number], side, aux, copier,
                           free[number], staged[number], previous)
                if not to_host and side is not None:  # ``free`` on the side stream says it
                    lane.drained_on_side[number], scattered[number] = True, False
        finally:
            if on_aux and side is not None:
                torch.cuda.set_stream(side)
        if side is not None:  # the op's end (a write) or the group's layers (a load)
            if to_host:
                free[0].wait(side)
                free[1].wait(side)
            for number in (0, 1):  # ``free`` says when a buffer the copy stream drained last
                if scattered[number]:
                    free[number].record(copiers[number])
                    free[number].wait(side)
        buffers = lane.buffers
        held = keep_alive[-2:]  # once per op and lane, not once per layer group
        if len(held) < 2 or held[0] is not buffers[0] or held[1] is not buffers[1]:
            keep_alive.extend(buffers)

    def chunk_tokens(self, pool_layers: int, moved_layers: int, num_pairs: int,
                     page_size: int = 1) -> int:
        """Pairs per chunk of a move of ``num_pairs`` pairs of ``moved_layers`` layers.

        The budget is ``staging_tokens`` tokens of every layer of the pool, so a move of
        fewer layers (a layer-wise load's group) takes proportionally more tokens per chunk
        (fewer, longer copies). The move takes as few chunks as the budget allows, of equal
        length rounded up to whole ``page_size`` pages: what rounding adds (less than a page
        of every moved layer) fits the page of every layer a buffer holds beyond the budget.
        """
        budget = self.staging_tokens * pool_layers  # token-layers
        moved = max(moved_layers, 1)
        count = max(1, -(-num_pairs * moved // budget))
        per_chunk = -(-num_pairs // count)
        return max(1, -(-per_chunk // page_size) * page_size)

    def _chunking(self, move: StagedMove, moved_layers: int, page_size: int
                  ) -> tuple[int, bool]:
        """``(chunk_tokens, turns)`` of ``move``'s copies of ``moved_layers`` layers: the
        chunk length (:meth:`chunk_tokens`) and whether the chunk after one of them waits
        for its copy (a big chunk: ``copy_turns``)."""
        chunk_tokens = self.chunk_tokens(move.views.num_layers, moved_layers, move.num_pairs,
                                         page_size)
        return chunk_tokens, takes_turns(chunk_tokens * moved_layers
                                         * move.geometry.token_bytes(1))

    def _pool_views(self, moved: MovedTransfer) -> PoolViews:
        """The :class:`PoolViews` of ``moved``'s host and device pools, made on first use."""
        return self._views.get(moved.source.host_pool, moved.source.device_pool)

    def _lane(self, device_pool: DeviceKVPool, side: torch.cuda.Stream | None,
              page_size: int) -> _Lane:
        """The staging lane of ``side`` for the pool's dtype: two buffers of one chunk each
        (the budget and one page of every layer) and an auxiliary stream, allocated once.

        A buffer replaced by a larger one (a pool of wider rows, or host pages of more
        tokens) stays alive through the ops that hold views of it (``keep_alive``) until
        their side stream has passed them."""
        geometry = device_pool.geometry
        key = (side.cuda_stream if side is not None else 0, geometry.dtype)
        half = ((self.staging_tokens + page_size) * geometry.num_components
                * device_pool.num_layers * geometry.row_elems)
        lane = self._lanes.get(key)
        if lane is None or lane.buffers[0].numel() < half:
            flat = torch.empty(2 * half, dtype=geometry.dtype, device=device_pool.device)
            aux, copiers = ((lane.aux, lane.copiers) if lane is not None else
                            (stream_beside(side), copy_streams(side)))
            lane = _Lane([flat[:half], flat[half:]], aux, copiers, device_pool.device, key)
            self._lanes[key] = lane
        return lane


class _Lane:
    """Double-buffered staging of one side stream: the buffers, each buffer's two events
    (``free``: after which it may be overwritten; ``staged``: after which it has been
    filled or drained; see :func:`move_chunk`), which one the next chunk takes, the
    auxiliary stream (a write's gathers) and each buffer's copy stream (the two take turns:
    :mod:`.copy_turns`). Chunks alternate buffers across calls, so consecutive layer groups
    of a load overlap (the next group's copy runs while one is scattered)."""

    def __init__(self, buffers: list[torch.Tensor], aux: torch.cuda.Stream | None,
                 copiers: tuple[torch.cuda.Stream | None, torch.cuda.Stream | None],
                 device: torch.device, key: tuple[int, torch.dtype]) -> None:
        self.buffers, self.aux, self.copiers = buffers, aux, copiers
        self.key = key  # among the backend's lanes (``_lane``)
        self.staging = [StagingBuffer(buffer) for buffer in buffers]  # with their views
        self.free = [Event(device), Event(device)]
        self.staged = [Event(device), Event(device)]
        self.next = 0
        self.turns = False  # the last chunk was big enough for the next to wait on its copy
        # loads scattered by the page kernel on the copy streams (:func:`move_paged_chunk`):
        # the copy streams wait on ``fence`` (recorded on the side stream) once an op; the
        # side stream on ``free`` recorded on them after a copy call's last scatters (so a
        # later call, of either direction, finds it valid); ``drained_on_side``: the
        # buffer's last chunk was a load scattered on the side stream (``free`` says when)
        self.fence = Event(device)
        self.drained_on_side = [False, False]
