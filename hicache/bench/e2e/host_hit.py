"""The host hit of ``hicache bench e2e`` through the service, as an engine serves it."""

from __future__ import annotations

import torch

from hicache.pools import IndexSpace, Indices
from hicache.radix import TreeNode
from hicache.service import HiCacheService

from ..workload import BenchmarkError
from .kv import PoolKV
from .model import Decoder
from .setup import Buffers, device_pool, settle


class HostHit:
    """The host hit through the service, as an engine serves it: match, lock, load-back,
    pages for the new tokens, ``start_loading``, the forward (each layer waits for its load
    in the pool's accessors). :meth:`reset` (untimed) gives back what a run held and evicts
    the prefix's device copy again, so that every run starts from a host-only prefix.
    :meth:`run_device` is the same request as a device hit (after :meth:`make_resident`)."""

    def __init__(self, service: HiCacheService, model: Decoder, tokens: list[int],
                 new: torch.Tensor, capacity_tokens: int) -> None:
        self.service = service
        self.model = model
        self.key = service.key(tokens)
        self.new = new
        self.num_cached = len(tokens) - new.shape[0]
        self.capacity_tokens = capacity_tokens
        # the last run's locked node, new-token slots and prefix slots (CPU int64)
        self.held: tuple[TreeNode, torch.Tensor, torch.Tensor] | None = None
        self.gathered = 0

    def run(self) -> torch.Tensor:
        service, num_new = self.service, self.new.shape[0]
        match = service.match(self.key)
        service.lock(match.last_host_node)
        loaded = service.load_back(match, self.capacity_tokens)
        slots = service.alloc_device(num_new)
        if not loaded.queued or slots is None:
            raise BenchmarkError(f"the host hit of {self.num_cached} tokens was not loaded "
                                 f"(refused: {loaded.refused}; new-token pages: "
                                 f"{slots is not None})")
        service.start_loading()
        cached = torch.cat([match.device_indices.tensor, loaded.device_indices.tensor])
        kv = PoolKV(device_pool(service), cached, slots.tensor[:num_new])
        self.held = (match.last_host_node, slots.tensor, cached)
        out = self.model.forward(self.new, self.num_cached, kv)
        self.gathered = kv.gathered
        return out

    def run_device(self) -> torch.Tensor:
        """The same request when the prefix is on the device (:meth:`make_resident` before):
        a device hit through the same pool (match, lock, pages for the new tokens, the
        forward through the pool's accessors), no load. A host hit that costs what this does
        hides its load entirely."""
        service, num_new = self.service, self.new.shape[0]
        match = service.match(self.key)
        if match.device_hit_tokens != self.num_cached:
            raise BenchmarkError(f"the device hit found {match.device_hit_tokens} of "
                                 f"{self.num_cached} cached tokens on the device")
        service.lock(match.last_device_node)
        slots = service.alloc_device(num_new)
        if slots is None:
            raise BenchmarkError(f"no device pages for the device hit's {num_new} new tokens")
        cached = match.device_indices.tensor
        kv = PoolKV(device_pool(service), cached, slots.tensor[:num_new])
        self.held = (match.last_device_node, slots.tensor, cached)
        return self.model.forward(self.new, self.num_cached, kv)

    def make_resident(self) -> None:
        """:meth:`reset`, then the prefix loaded back to the device and settled (untimed),
        for :meth:`run_device`."""
        self.reset()
        service = self.service
        match = service.match(self.key)
        service.lock(match.last_host_node)
        loaded = service.load_back(match, self.capacity_tokens)
        if not loaded.queued:
            raise BenchmarkError(f"the prefix of {self.num_cached} tokens was not loaded back "
                                 f"for the device hit (refused: {loaded.refused})")
        service.start_loading()
        settle(service)
        service.release(match.last_host_node)

    def reset(self) -> None:
        settle(self.service)
        if self.held is not None:
            node, slots, _ = self.held
            self.service.free_device(Indices(slots, IndexSpace.DEVICE_FULL))
            self.service.release(node)
            self.held = None
        self.service.evict(self.num_cached)
        # an eviction frees slots without clearing them, and a load-back gets the same
        # slots again: NaN in every free row, so a load that moves nothing fails the checks
        device_pool(self.service).data.fill_(float("nan"))

    def rows_match(self, buffers: Buffers, num_cached: int) -> bool:
        """The pool's rows of the last run's prefix equal the rows the prefix was made of."""
        assert self.held is not None, "rows_match after a run, before reset"
        settle(self.service)
        pool = device_pool(self.service)
        index = self.held[2][:num_cached].to(pool.device)
        return all(
            torch.equal(pool.layer_rows(c, layer).index_select(0, index),
                        rows[layer][:num_cached].flatten(1))
            for layer in range(pool.num_layers)
            for c, rows in enumerate((buffers.keys, buffers.values)))
