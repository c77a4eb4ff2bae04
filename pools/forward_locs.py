"""How a device pool checks a forward's new-token slots once (:class:`~hicache.pools.
ForwardLocs`), and the cheaper write the check can allow.

A forward calls ``set_kv`` once per layer, on the engine's scheduler thread, so what each
call launches counts: an indexed write (``index_copy_``) costs more CPU to launch than a
plain copy, and its rows may aim at the padding slot (padded batch rows, or on a GPU the
slots the deferred bounds check redirected), which must be cleared after every write.

Slots given on the CPU are checked there, at once (a bad slot raises at ``forward_locs``,
whatever the pool's device), and reach a GPU pool through a reused pinned buffer (no
blocking copy). When they are one ascending run that leaves the padding slot alone, as an
allocator hands a request its pages, :class:`ForwardLocs` carries that run as its
``span``: every layer's write is then a slice copy per component, and nothing aims at the
padding slot, so nothing is cleared. Slots given on the GPU keep the deferred check and the
indexed write.

A span's slots are not uploaded when the handle is made: ``set_kv`` never reads them, and
an upload (a pinned copy or the upload kernel, its buffer and event) was most of the
handle's CPU time on a GPU host. ``full`` makes them on the device the first time it is read
(one ``arange`` on the stream current then).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .base import IndexSpace, Indices, check_indices
from .page_ids import is_run
from .pinned_uploads import UPLOADS

if TYPE_CHECKING:
    from .device import DeviceKVPool


class ForwardLocs:
    """One forward's new-token locations, checked once when made, for every layer's write.

    Made by ``DeviceKVPool.forward_locs`` / ``HybridSWAPool.forward_locs``; read-only. It
    owns its slots (never a view of the caller's buffer, so refilling that buffer in place
    cannot change it) and remembers the full-to-SWA map it was translated with: a write
    after the map changed is refused.

    Args:
        full: ``[n]`` int64 ``DEVICE_FULL`` slots on the pool's device (padding rows: 0);
            ``None`` with a ``span``, whose slots :attr:`full` then makes when first read.
        swa: ``[n]`` int32 ``DEVICE_SWA`` slots aligned with ``full`` (hybrid pools only).
        owner: the pool that made it.
        map_version: that pool's map version at the time.
        span: ``(start, end)`` when the slots, checked on the CPU, are the ascending run
            ``start .. end - 1`` and skip the padding slot: each layer's write is then a
            slice copy; ``None`` otherwise.
        device, space: where :attr:`full` makes a span's slots (with ``full=None``).
    """

    __slots__ = ("_device", "_full", "_space", "map_version", "owner", "span", "swa")

    def __init__(self, full: Indices | None, swa: Indices | None, owner: object,
                 map_version: int, span: tuple[int, int] | None = None,
                 device: torch.device | None = None,
                 space: IndexSpace = IndexSpace.DEVICE_FULL) -> None:
        if full is None and (span is None or device is None):
            raise ValueError("ForwardLocs: give the slots, or their span and device")
        for name, value in (("_full", full), ("swa", swa), ("owner", owner),
                            ("map_version", map_version), ("span", span),
                            ("_device", device), ("_space", space)):
            object.__setattr__(self, name, value)

    _full: Indices | None
    _device: torch.device | None
    _space: IndexSpace
    swa: Indices | None
    owner: object
    map_version: int
    span: tuple[int, int] | None

    @property
    def full(self) -> Indices:
        """``[n]`` int64 ``DEVICE_FULL`` slots on the pool's device (a span's: made on the
        first read, on the stream current then, and kept)."""
        full = self._full
        if full is None:
            assert self.span is not None and self._device is not None
            start, end = self.span
            full = Indices(torch.arange(start, end, dtype=torch.int64, device=self._device),
                           self._space)
            object.__setattr__(self, "_full", full)
        return full

    def __len__(self) -> int:
        if self.span is not None:
            return self.span[1] - self.span[0]
        assert self._full is not None
        return len(self._full)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"ForwardLocs is read-only (tried to set {name}): make new ones "
                             f"with forward_locs()")


def make_forward_locs(pool: DeviceKVPool, locs: Indices) -> ForwardLocs:
    """:meth:`DeviceKVPool.forward_locs`: ``locs`` checked for ``pool`` and owned as int64
    on its device, with their span when they are a run checked on the CPU."""
    if not isinstance(locs, Indices):
        raise TypeError(f"forward_locs: expected the forward's slots as Indices(tensor, "
                        f"IndexSpace.{pool.space.name}), got {type(locs).__name__}; wrap the "
                        f"tensor as Indices(...)")
    tensor = locs.tensor
    if tensor.device.type == "cpu":
        # checked now on the CPU, for a pool on any device (no guard: nothing deferred)
        checked = check_indices(locs, space=pool.space, pool_name=pool.name,
                                num_slots=pool.num_slots, device=None, op="forward_locs")
        values = checked.numpy()
        span = None
        # a run past the whole padding page: slice copies, nothing to clear after them
        if values.size and int(values[0]) >= (pool.page_size or 1) and is_run(values):
            span = (int(values[0]), int(values[0]) + int(values.size))
        if span is not None and pool.device.type == "cuda":  # made on the first read
            return ForwardLocs(None, None, pool, 0, span, pool.device, pool.space)
        if pool.device.type == "cuda":
            owned = UPLOADS.upload([values], pool.device)
        else:
            owned = checked.to(torch.int64, copy=checked is tensor)
        return ForwardLocs(Indices(owned, pool.space), None, pool, 0, span)
    index = pool.check(locs, "forward_locs")
    owned = index.to(torch.int64, copy=index is tensor)
    return ForwardLocs(Indices(owned, pool.space), None, pool, 0)
