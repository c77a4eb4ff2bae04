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
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .base import PADDING_SLOT, ForwardLocs, Indices, check_indices
from .page_ids import is_run
from .pinned_uploads import UPLOADS

if TYPE_CHECKING:
    from .device import DeviceKVPool


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
        if values.size and int(values[0]) > PADDING_SLOT and is_run(values):
            span = (int(values[0]), int(values[0]) + int(values.size))
        if pool.device.type == "cuda":
            owned = UPLOADS.upload([values], pool.device)
        else:
            owned = checked.to(torch.int64, copy=checked is tensor)
        return ForwardLocs(Indices(owned, pool.space), None, pool, 0, span)
    index = pool.check(locs, "forward_locs")
    owned = index.to(torch.int64, copy=index is tensor)
    return ForwardLocs(Indices(owned, pool.space), None, pool, 0)
