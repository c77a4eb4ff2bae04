"""The ``direct`` backend: copy-engine copies straight between the host pool's rows and the
device pool's rows, one 2D copy per run of pairs that are consecutive on both sides (per
component and block of layers), with no staging buffer, no index upload and no kernel.

Why: an engine's allocations are runs. A fresh allocation of ``n`` tokens is ``n``
consecutive slots on either tier (the allocators keep free runs for exactly this), so a host
hit's load-back or a new prefix's write-back is a few long runs. Each run of a
``layer_first`` host is then ``len * row`` contiguous bytes per component and layer on both
sides, which the copy engine moves at the link's rate, and a block of layers is one 2D copy
per component (an all-layer write of a run is one copy). What the other backends spend per
copy call is gone: the kernel backend's launch through Triton (about 100 us of CPU on an
H100 host) and the SMs it takes from the model; the staged backend's chunk (a copy, an index
kernel and four event operations, about 75 us) and its device-side scatter. The indices
never leave the CPU: the runs are found there once per op (:class:`DirectMove`).

When it is wrong: scattered pairs (a fragmented pool, a bench's random pages) make every run
a page or less, one copy call (a few microseconds of CPU) per page and component; ``staged``
and ``kernel`` move those faster. ``auto`` sends an op here only on a ``layer_first`` host
and only when its runs average at least :data:`DIRECT_MIN_RUN_TOKENS` tokens
(:func:`worth_direct`). ``page_first`` and ``page_first_direct`` hosts are served correctly
(each run's views are planned as 2D copies like any other block) but ``auto`` never picks
it for them: one layer of a ``page_first`` run is rows a token apart, which the copy engine
moves at about a third of the link's rate. A run of whole ``page_first_direct`` pages is one
2D copy per component and layer (each of its rows a page's ``page_size`` rows of that layer,
a host page apart), which alone reaches the link's rate, but the layer-wise host hits of
``hicache bench e2e`` came out slower through it than through the table's choice at 2k and
32k tokens (see ``docs/performance-log.md``), so that layout follows the table.

Copies of a block of layers of at least ``copy_turns.TURN_BYTES`` go in batches on two copy
streams that take turns (:mod:`.copy_turns`), so a big op never holds the copy engine
against an engine's own copies; smaller blocks are copied on the side stream itself.

Plans: a run's copies depend on its length and the layers moved, not on where it starts, so
each run shape is planned once per pool pair (:class:`RunPlans`) as byte offsets from host
layer 0 and device layer 0 and shifted to each run; an op gathers its runs' copies once per
block size, and a block of layers starting at ``begin`` issues them shifted by ``begin``
layers on each side (every layer of both pools is laid out alike). On a CPU device pool
(tests) the same plans run as strided CPU copies; ``make_backend`` refuses ``direct`` for
CPU pools in a config.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from hicache.pools import DeviceKVPool, HostKVPool, HostLayout
from hicache.pools.nonzero_count import count_nonzero

from . import copy2d
from .base import Direction, MovedTransfer, TransferBackend
from .copy_turns import CopyTurns, copy_batches, takes_turns
from .layer_blocks import layer_blocks
from .pool_pairs import PoolPairCache
from .run_views import run_views

__all__ = ["DIRECT_MIN_RUN_TOKENS", "DirectBackend", "DirectMove", "RunPlans", "pair_runs",
           "worth_direct"]

CPU = torch.device("cpu")

# Tokens a run must average for ``auto`` to send an op to ``direct``. One copy call costs a
# few microseconds of CPU (ctypes into the runtime; measured with the bench's run-slot
# rows); a layer of 128 tokens of K and V at 2 KiB rows is 512 KiB, about 10 us on a 55 GB/s
# link, so from this length on a layer-wise load's copies are issued faster than the link
# drains them even one layer per call.
DIRECT_MIN_RUN_TOKENS = 128


def pair_runs(host: np.ndarray, device: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split aligned slot arrays into runs consecutive on both sides: ``(host first, device
    first, length)`` per run, in the pairs' order (int64 arrays)."""
    size = host.size
    if size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    breaks = np.flatnonzero((np.diff(host) != 1) | (np.diff(device) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [size])))
    return (host[starts].astype(np.int64), device[starts].astype(np.int64),
            lengths.astype(np.int64))


def count_runs(host: np.ndarray, device: np.ndarray) -> int:
    """How many runs :func:`pair_runs` finds, without building them."""
    if host.size == 0:
        return 0
    return 1 + int(count_nonzero((np.diff(host) != 1) | (np.diff(device) != 1)))


def worth_direct(host: np.ndarray, device: np.ndarray) -> bool:
    """Whether the pairs' runs average at least :data:`DIRECT_MIN_RUN_TOKENS` tokens."""
    runs = count_runs(host, device)
    return runs > 0 and host.size >= runs * DIRECT_MIN_RUN_TOKENS


class RunPlans:
    """The 2D copies of each run shape of one pool pair, shared by every op: a run of ``n``
    pairs and ``count`` layers is planned once at host slot ``phase`` (its offset in a
    ``page_first_direct`` page; 0 otherwise) and device slot 0, and any other run of that
    shape moves by the same copies shifted by its host and device slot. Views and plans
    cost tens of microseconds per shape; a shift is one addition per copy. Holds numbers
    only (the pools are passed at each call), so a backend kept by a long-lived owner keeps
    no pool alive."""

    MAX_SHAPES = 4096  # forgotten all at once past this (a workload has a few shapes)

    def __init__(self, host_pool: HostKVPool, device_pool: DeviceKVPool) -> None:
        host, device = host_pool.data, device_pool.data
        self.page_size = (host_pool.page_size
                          if host_pool.layout is HostLayout.PAGE_FIRST_DIRECT else 1)
        # bytes from one host slot (or page, page_first_direct) and one device slot to the next
        slot_dim = {HostLayout.LAYER_FIRST: 2, HostLayout.PAGE_FIRST: 0,
                    HostLayout.PAGE_FIRST_DIRECT: 0}[host_pool.layout]
        self.host_step = host.stride(slot_dim) * host.element_size()
        self.device_step = device.stride(2) * device.element_size()
        self._known: dict[tuple[int, int, int], list[copy2d.Copy2D]] = {}

    def copies(self, host_pool: HostKVPool, device_pool: DeviceKVPool, h: int, d: int, n: int,
               count: int) -> list[copy2d.Copy2D]:
        """The copies moving layers ``[0, count)`` of the run of ``n`` pairs from host slot
        ``h`` and device slot ``d`` (offsets from layer 0 of either pool)."""
        phase = h % self.page_size
        key = (n, count, phase)
        base = self._known.get(key)
        if base is None:
            if len(self._known) >= self.MAX_SHAPES:
                self._known.clear()
            planner = copy2d.CopyPlanner(host_pool.data.data_ptr(), device_pool.data.data_ptr())
            base = self._known[key] = [
                copy for host_view, device_view in run_views(host_pool, device_pool, phase, 0,
                                                               n, 0, count)
                for copy in planner.plan(host_view, device_view)]
        host_shift = (h - phase) // self.page_size * self.host_step
        device_shift = d * self.device_step
        return [(host + host_shift, host_pitch, device + device_shift, device_pitch, width,
                 height) for host, host_pitch, device, device_pitch, width, height in base]


class DirectMove:
    """What the direct backend derives once per op and pool transfer (``moved.direct_move``,
    held until the op is acknowledged): the runs, both pools' layer strides in bytes and the
    op's copies per block size (from the pool pair's :class:`RunPlans`)."""

    def __init__(self, moved: MovedTransfer, plans: RunPlans) -> None:
        source = moved.source
        self.host_pool, self.device_pool = source.host_pool, source.device_pool
        host, device = self.host_pool.data, self.device_pool.data
        self.host_ptr, self.device_ptr = host.data_ptr(), device.data_ptr()
        layer_dim = {HostLayout.LAYER_FIRST: 1, HostLayout.PAGE_FIRST: 2,
                     HostLayout.PAGE_FIRST_DIRECT: 2}[self.host_pool.layout]
        self.host_layer_bytes = host.stride(layer_dim) * host.element_size()
        self.device_layer_bytes = device.stride(1) * device.element_size()
        self.runs = pair_runs(moved.host_index.numpy(), moved.device_index.numpy())
        self._run_plans = plans
        self._plans: dict[int, list[copy2d.Copy2D]] = {}
        self._batches: dict[int, list[tuple[list[copy2d.Copy2D], int]]] = {}
        # per direction, the copy streams of the op's side stream, found at its first copy
        # (a lookup of the side stream costs about 10 us of CPU on an H100 host)
        self.turns: dict[bool, CopyTurns] = {}
        # per direction, whether the copy streams were ordered after the op's start
        self.started: set[bool] = set()
        self.layer_bytes = len(moved.host_index) * self.device_pool.geometry.token_bytes(1)

    def copies(self, count: int) -> list[copy2d.Copy2D]:
        """The 2D copies moving layers ``[0, count)`` of every run (offsets from layer 0 of
        either pool), gathered on first use."""
        plans = self._plans.get(count)
        if plans is None:
            plans = self._plans[count] = [
                copy for h, d, n in zip(*(r.tolist() for r in self.runs), strict=True)
                for copy in self._run_plans.copies(self.host_pool, self.device_pool, h, d, n,
                                                   count)]
        return plans

    def batches(self, count: int) -> list[tuple[list[copy2d.Copy2D], int]]:
        """:meth:`copies` of ``count`` layers in turns' batches (:func:`.copy_batches`)."""
        batches = self._batches.get(count)
        if batches is None:
            batches = self._batches[count] = copy_batches(self.copies(count))
        return batches

    def views(self, begin: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(host view, device view)`` of every run for layers ``[begin, begin + count)``
        (for the row-by-row path without a runtime library)."""
        return [view for h, d, n in zip(*(r.tolist() for r in self.runs), strict=True)
                for view in run_views(self.host_pool, self.device_pool, h, d, n, begin,
                                      count)]


class DirectBackend(TransferBackend):
    """Copy-engine copies between host and device rows, one per run (see the module
    docstring). Correct for any pairs and host layout; fast for runs."""

    name = "direct"
    cheap_copies = True  # a copy call is a runtime call of a few microseconds
    copy_s = 10e-6

    def __init__(self) -> None:
        # per pool pair, weakly: a backend shared by many controllers (or tests) keeps no
        # pool (and no pinned memory) alive
        self._plans = PoolPairCache(RunPlans)
        self._turns: dict[int, CopyTurns] = {}  # by side stream

    def index_devices(
        self, host_pool: HostKVPool, device_pool: DeviceKVPool
    ) -> tuple[torch.device, torch.device]:
        return CPU, CPU  # the runs are found on the CPU; no kernel reads an index

    def _run_plans(self, moved: MovedTransfer) -> RunPlans:
        return self._plans.get(moved.source.host_pool, moved.source.device_pool)

    def copy(
        self,
        moved: MovedTransfer,
        local_layers: Sequence[int],
        direction: Direction,
        keep_alive: list[torch.Tensor],
    ) -> None:
        if moved.host_index.numel() == 0 or not local_layers:
            return
        move = moved.direct_move
        if move is None:  # once per op: every layer group reuses the runs and plans
            move = moved.direct_move = DirectMove(moved, self._run_plans(moved))
        to_host = direction is Direction.DEVICE_TO_HOST
        shape, begins = layer_blocks(tuple(local_layers))
        device = move.device_pool.data
        if not device.is_cuda:
            _emulate(move, shape, begins, to_host)
            return
        if not copy2d.have_2d_copies():  # no runtime library found: row by row, same bytes
            for (_, count), begin in zip(shape, begins, strict=True):
                for host_view, device_view in move.views(begin, count):
                    if to_host:
                        copy2d.copy_block(host_view, device_view)
                    else:
                        copy2d.copy_block(device_view, host_view)
            return
        turns = move.turns.get(to_host)
        if turns is None:  # an op is issued on one side stream, current now
            turns = move.turns[to_host] = self._turns_of(torch.cuda.current_stream(device.device))
        layer_bytes = move.layer_bytes
        for (_, count), begin in zip(shape, begins, strict=True):
            if not takes_turns(count * layer_bytes):  # a small block: on the side stream itself
                copy2d.issue_copies(move.copies(count),
                                    move.host_ptr + begin * move.host_layer_bytes,
                                    move.device_ptr + begin * move.device_layer_bytes,
                                    to_host, turns.side.cuda_stream)
                continue
            if to_host not in move.started:
                # the copy streams after the side stream's start of the op (its waits on
                # the producers and the caller), once: what the side stream does later
                # (a small block's copy, joins, layer events) no copy here has to follow
                turns.start()  # batches taking turns on the copy streams (``copy_turns``)
                move.started.add(to_host)
            host_ptr = move.host_ptr + begin * move.host_layer_bytes
            device_ptr = move.device_ptr + begin * move.device_layer_bytes
            for batch, num_bytes in move.batches(count):
                handle = turns.next(num_bytes)
                copy2d.issue_copies(batch, host_ptr, device_ptr, to_host, handle)
                turns.end()
        turns.join()

    def _turns_of(self, side: torch.cuda.Stream) -> CopyTurns:
        """The copy streams of ``side`` (made on its first op)."""
        turns = self._turns.get(side.cuda_stream)
        if turns is None:
            turns = self._turns[side.cuda_stream] = CopyTurns(side)
        return turns


def _emulate(move: DirectMove, shape: tuple[tuple[int, int], ...], begins: tuple[int, ...],
             to_host: bool) -> None:
    """The planned copies on CPU pools (strided CPU copies of the same bytes)."""
    host_bytes = copy2d.as_bytes(move.host_pool.data)
    device_bytes = copy2d.as_bytes(move.device_pool.data)
    for (_, count), begin in zip(shape, begins, strict=True):
        offset = begin * move.device_layer_bytes
        copy2d.emulate_copies(move.copies(count), host_bytes, begin * move.host_layer_bytes,
                              device_bytes[offset:], to_host)
