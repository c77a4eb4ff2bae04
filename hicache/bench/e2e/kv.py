"""Where the new tokens' forward finds the cached rows: a dense buffer, or hicache's pool.

:class:`DenseKV` is the reference: the cached rows sit in per-layer buffers (already there,
or arriving by a bare layer-wise copy whose per-layer events the forward waits on).
:class:`PoolKV` is the engine's path: the cached rows are the slots a load-back filled, the
new rows go in with ``set_kv`` and the layer is read through ``key_buffer`` /
``value_buffer``, which wait for that layer of the load (``wait_until(layer)``) by
construction. Both hand attention ``[S, kv_heads, head_dim]`` rows with the same strides,
so the same kernels see the same bytes and the outputs agree bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch

from hicache.pools import DeviceKVPool, IndexSpace, Indices
from hicache.pools.page_ids import is_run


class DenseKV:
    """Cached rows at ``[0, num_cached)`` of per-layer buffers; a chunk's rows go after them.

    Args:
        keys, values: per layer, ``[capacity, kv_heads, head_dim]`` on the forward's device.
        num_cached: rows already cached (or arriving) in every layer.
        ready: per layer, an event the forward's stream waits on before it touches the
            layer (a bare copy's), or ``None`` when the rows are resident.
    """

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], num_cached: int,
                 ready: list[torch.cuda.Event] | None = None) -> None:
        self.keys = keys
        self.values = values
        self.num_cached = num_cached
        self.ready = ready

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ready is not None:
            torch.cuda.current_stream().wait_event(self.ready[layer])
        end = self.num_cached + k.shape[0]
        self.keys[layer][self.num_cached:end].copy_(k)
        self.values[layer][self.num_cached:end].copy_(v)
        return self.keys[layer][:end], self.values[layer][:end]


class PoolKV:
    """Cached rows at ``cached_slots`` of hicache's device pool; the chunk's rows are written
    at ``new_slots`` with ``set_kv``.

    Attention needs the rows of a sequence side by side. When the slots (cached, then new)
    are one increasing run, as a fresh pool hands them out, each layer is read as a view of
    the pool; otherwise the rows are gathered (one copy per layer, counted in
    :attr:`gathered`).

    Args:
        pool: the service's device pool (MHA).
        cached_slots: ``[N]`` CPU int64 ``DEVICE_FULL`` slots of the cached prefix (from the
            match and the load-back), in token order.
        new_slots: ``[T]`` CPU int64 ``DEVICE_FULL`` slots of the chunk (engine-held).
    """

    def __init__(self, pool: DeviceKVPool, cached_slots: torch.Tensor, new_slots: torch.Tensor
                 ) -> None:
        self.pool = pool
        # given on the CPU, as the service allocated them: checked there once, and one run of
        # slots is written by slice copies (hicache.pools.forward_locs)
        self.locs = pool.forward_locs(Indices(new_slots, IndexSpace.DEVICE_FULL))
        # numpy, not torch: a torch CPU op on 32k slots or more runs on torch's intra-op
        # threads, and waking them took 3-6 ms an op on an H200 host in this process (a
        # 32k-token device hit's forward, measured), against microseconds single-threaded
        slots = np.concatenate([cached_slots.numpy(), new_slots.numpy()])
        self.span: tuple[int, int] | None = None
        self.gather: torch.Tensor | None = None
        if is_run(slots):
            first = int(slots[0]) if slots.size else 0
            self.span = (first, first + int(slots.size))
        else:
            self.gather = torch.from_numpy(slots).to(pool.device)
        self.gathered = 0

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        self.pool.set_kv(layer, self.locs, k, v)  # waits for the layer's load first
        keys, values = self.pool.key_buffer(layer), self.pool.value_buffer(layer)
        if self.span is not None:
            start, end = self.span
            return keys[start:end], values[start:end]
        assert self.gather is not None, "PoolKV has neither a span nor a gather index"
        self.gathered += 1
        return keys.index_select(0, self.gather), values.index_select(0, self.gather)
