"""Index tensors of queued transfer ops: the controller's own copies of a call's slots, the
merge of several calls, and the move to where a backend reads them.

``move_checked`` is the one place that casts and moves index tensors on the way to a side
stream; ``record_on_stream`` then records every tensor that stream reads.
"""

from __future__ import annotations

import numpy as np
import torch

from hicache.pools import DeviceKVPool, HostKVPool, Indices
from hicache.pools.nonzero_count import count_nonzero
from hicache.pools.pinned_uploads import UPLOADS
from hicache.pools.serial_copies import int64_copy, joined

from .base import MovedTransfer, PoolTransfer, SlotPages, TransferBackend, TransferOp

_CPU = torch.device("cpu")
_AS_GIVEN = TransferBackend.order_pairs  # a backend that does not override it keeps the order


def owned_copy(transfer: PoolTransfer) -> PoolTransfer:
    """``transfer`` with int64 copies of its index tensors (the caller keeps its own; the
    op moves these as they are, see :func:`move_checked`)."""
    return PoolTransfer(
        name=transfer.name, host_pool=transfer.host_pool, device_pool=transfer.device_pool,
        host_indices=owned_indices(transfer.host_indices),
        device_indices=owned_indices(transfer.device_indices), layers=transfer.layers,
    )


def owned_indices(indices: Indices) -> Indices:
    """An int64 copy of CPU ``indices`` (on the calling thread: :mod:`~hicache.pools.
    serial_copies`)."""
    return Indices(int64_copy(indices.tensor), indices.space)


def owned_pages_copy(indices: Indices, pages: np.ndarray, page_size: int,
                     ascending: bool | None = None) -> Indices:
    """:func:`owned_indices` of ``indices``, whole pages in slot order whose distinct page
    ids are ``pages`` (checked). Pages that are one ascending run (an allocation's) give
    the copy from the run's bounds, without reading the slots: in an op, after the caches
    have moved the last op's rows, reading 32k slots cost more than three times making
    them (measured). ``ascending``: whether ``pages`` ascend, when the caller knows."""
    size = pages.size
    if size and pages.item(-1) - pages.item(0) == size - 1:
        if ascending is None:
            ascending = size < 2 or not count_nonzero(pages[1:] <= pages[:-1])
        if ascending:  # distinct, ascending, spanning ``size`` ids: consecutive
            first = pages.item(0) * page_size
            slots = np.arange(first, first + size * page_size, dtype=np.int64)
            return Indices(torch.from_numpy(slots), indices.space)
    return owned_indices(indices)


def cat_parts(parts: list[Indices]) -> Indices:
    """One :class:`Indices` of the parts (all of one space); a single part as it is."""
    if len(parts) == 1:
        return parts[0]
    return Indices(joined([p.tensor for p in parts]), parts[0].space)


def move_checked(
    host: torch.Tensor, device: torch.Tensor, host_pool: HostKVPool, device_pool: DeviceKVPool,
    backend: TransferBackend, owned: bool = False, may_pad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`TransferCore.move_indices` past its checks: aligned, checked CPU index
    tensors of equal length. Pairs touching the padding slot are dropped (numpy on the
    CPU: a few torch calls on small tensors would cost more than the whole op's
    bookkeeping). The results are the op's own: copies, or with ``owned`` (int64 tensors
    the op already owns: its queued copies) the tensors themselves when no pair drops.
    ``may_pad=False``: the caller's checks found no padding slot (nothing to look for)."""
    if may_pad or not owned:
        host_np, device_np = host.numpy(), device.numpy()
        size = host_np.size
        if count_nonzero(host_np) != size or count_nonzero(device_np) != size:
            keep = (host_np != 0) & (device_np != 0)
            host = torch.from_numpy(host_np[keep].astype(np.int64))  # copies
            device = torch.from_numpy(device_np[keep].astype(np.int64))
        elif not owned:
            host = torch.from_numpy(host_np.astype(np.int64))  # the op owns what it moves
            device = torch.from_numpy(device_np.astype(np.int64))
    if type(backend).order_pairs is not _AS_GIVEN:
        host, device = backend.order_pairs(host, device)
    host_target, device_target = backend.index_devices(host_pool, device_pool)
    if host_target == device_target:
        if host_target == _CPU:  # a CPU pool's op: nothing to move
            return host, device
        # one pinned staging and one copy for both (each costs tens of microseconds of CPU);
        # the two results are views of one tensor, recorded and held like any other
        both = UPLOADS.upload((host.numpy(), device.numpy()), host_target)
        return both[:host.numel()], both[host.numel():]
    return to_device(host, host_target), to_device(device, device_target)


def move_whole_pages(transfer: PoolTransfer, backend: TransferBackend, pages: SlotPages
                     ) -> MovedTransfer | None:
    """``transfer``'s own index tensors moved where ``backend`` reads them, with the device
    page of every host page of pairs uploaded in the same copy (``device_page_index``), for a
    backend that :meth:`~.base.TransferBackend.reads_device_pages`; ``pages`` are what the
    op's checks and allocations found (whole pages, in slot order) and no slot of the op is
    the padding slot. ``None`` when the backend does not read them, a device page is not a
    host page's pairs (pages of other sizes, a pool that is not whole pages), or the
    backend would reorder the pairs: then :func:`move_checked`.
    The device pages cost one more copy's worth of CPU otherwise (a check of the slots and
    a kernel over them: 70-90 us of a 256-token load's issue on an H200 host, measured).

    Only the page ids are uploaded (one id a page: 16 KiB for a 32k-token op of 16-token
    pages, small enough for the driver to carry inline); the device slots stay on the CPU
    until a chunk that cannot move whole pages reads them: then they are uploaded, once for
    the move (:meth:`~.chunk_slots.OpSlots.device_index`). Uploading the slots with the
    pages cost a copy of 16 times the bytes into the pinned buffer and, beyond 16 KiB (an
    op of more than 2032 tokens), a kernel launch through Triton: 150-440 us of a staged
    load's issue on an H200 host at 2048 and 32k tokens, for slots the page kernel never
    reads."""
    host_pool, device_pool = transfer.host_pool, transfer.device_pool
    if (pages.device_page_size != host_pool.page_size
            or device_pool.num_slots % host_pool.page_size
            or not backend.reads_device_pages(host_pool, device_pool)):
        return None
    host, device = transfer.host_indices.tensor, transfer.device_indices.tensor
    if (not pages.host_ascending and type(backend).order_pairs is not _AS_GIVEN
            and backend.order_pairs(host, device)[0] is not host):
        return None  # sorted: the pages are not the moved pairs' any more
    host_target, device_target = backend.index_devices(host_pool, device_pool)
    if host_target != _CPU:
        return None
    ids = pages.device_pages
    if device_target == _CPU:
        page_index = torch.from_numpy(ids.astype(np.int64, copy=False))
    else:  # the pages alone: the slots stay on the CPU until a chunk reads them (OpSlots)
        page_index = UPLOADS.upload((ids,), device_target)
    return MovedTransfer(transfer, host, device, pages=pages, device_page_index=page_index)


def reads_in_place(backend: TransferBackend, transfer: PoolTransfer) -> bool:
    """True when ``backend`` keeps index pairs in their order and reads both of
    ``transfer``'s index tensors on the CPU: :func:`move_checked` of checked, owned indices
    without padding returns them as they are (a fixed answer per backend and pool pair)."""
    if type(backend).order_pairs is not _AS_GIVEN:
        return False
    host_target, device_target = backend.index_devices(transfer.host_pool, transfer.device_pool)
    return host_target == _CPU and device_target == _CPU


def to_device(index: torch.Tensor, target: torch.device) -> torch.Tensor:
    """CPU int64 ``index`` on ``target``: staged through a reused pinned buffer
    (:mod:`hicache.pools.pinned_uploads`), copied without blocking."""
    if target == _CPU:
        return index
    return UPLOADS.upload((index.numpy(),), target)


def record_on_stream(op: TransferOp, stream: torch.cuda.Stream) -> None:
    """``record_stream`` every CUDA tensor the op's side stream reads: each pool transfer's
    moved indices (iterating the op's own list) and every temporary."""
    tensors = [t for moved in op.moved for t in (moved.host_index, moved.device_index)]
    for tensor in tensors + op.keep_alive:
        if tensor.is_cuda:
            tensor.record_stream(stream)


def move_op_indices(op: TransferOp, may_pad: bool = True,
                    pages: list[SlotPages] | None = None) -> list[MovedTransfer]:
    """Move the indices of every pool transfer of ``op`` (its own list, so a pool kind added
    later is covered without touching call sites) where ``op.executor`` reads them. The
    op's indices are the queue's own copies, checked when their call was queued; without
    ``may_pad`` those checks found no padding slot among them, and ``pages`` (each
    transfer's, from those checks) go with the slots to a backend that reads device pages
    (:func:`~.index_moves.move_whole_pages`)."""
    assert op.executor is not None, f"op {op.op_id} has no backend"
    executor = op.executor
    moved = []
    for i, t in enumerate(op.transfers):
        found = None if pages is None else move_whole_pages(t, executor, pages[i])
        if found is None:
            found = MovedTransfer(t, *move_checked(t.host_indices.tensor,
                                                   t.device_indices.tensor, t.host_pool,
                                                   t.device_pool, executor, owned=True,
                                                   may_pad=may_pad))
        moved.append(found)
    return moved
