"""The service and buffers of ``hicache bench e2e``, and how a prefix becomes a host hit.

One service serves every prefix length of a run: its device pool holds the longest prefix
and the new tokens, its pinned host pool as many tokens. A prefix becomes a host hit the way
it does in production: its rows are computed into the device pool, inserted, backed up by
write-through (acknowledged), and its device copy is evicted.
"""

from __future__ import annotations

import time

import torch

from hicache.config import HiCacheConfig, config_from_dict
from hicache.pools import DeviceKVPool
from hicache.service import HiCacheService

from ..workload import BenchmarkError
from .model import Decoder, DecoderSpec, OwnKV

SETTLE_TIMEOUT_S = 60.0


def service_config(spec: DecoderSpec, device: torch.device, capacity_tokens: int,
                   page_size: int, backend: str, layout: str) -> HiCacheConfig:
    """An MHA model of ``spec``'s KV geometry; device and host pools of ``capacity_tokens``
    (whole pages); write-through, every host hit loaded (no threshold); no metrics."""
    return config_from_dict({
        "page_size_tokens": page_size,
        "model": {"num_layers": spec.num_layers, "attention": "mha",
                  "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
                  "dtype": str(spec.dtype).removeprefix("torch.")},
        "device_pool": {"num_tokens": capacity_tokens, "device": str(device)},
        "host": {"ratio": 1.0, "layout": layout, "ram_reserve_gib": 0.0},
        "controller": {"io_backend": backend, "write_policy": "write_through",
                       "load_back_threshold_tokens": 0},
        "service": {"metrics_enabled": False, "integrity_check_interval_s": 3600.0},
    })


class Buffers:
    """The references' memory, for prefixes of up to ``max_cached`` tokens.

    ``keys`` / ``values``: per layer ``[max_cached + max_new, kv_heads, head_dim]`` on the
    device (the prefix's rows, then a chunk's). ``host``: ``[layers, 2, max_cached,
    kv_heads * head_dim]`` in pinned memory (on a GPU), the prefix's rows for the contiguous
    copy (the ceiling). ``scratch``: as many device bytes as ``host``, the destination of
    the contiguous copy and of the bare pipeline's copies (which read the host pool's pages,
    :mod:`.bare`).
    """

    def __init__(self, spec: DecoderSpec, device: torch.device, max_cached: int,
                 max_new: int) -> None:
        layers, dtype = spec.num_layers, spec.dtype
        dense = torch.empty(2, layers, max_cached + max_new, spec.num_kv_heads, spec.head_dim,
                            dtype=dtype, device=device)
        self.keys, self.values = list(dense[0]), list(dense[1])
        pin = device.type == "cuda"
        self.host = torch.empty(layers, 2, max_cached, spec.kv_size, dtype=dtype,
                                pin_memory=pin)
        self.scratch = torch.empty(self.host.numel(), dtype=dtype, device=device)
        self.copy_stream = torch.cuda.Stream(device) if pin else None

    def keep_prefix(self, num_cached: int) -> None:
        """Copy the prefix's rows from the device buffers to ``host``."""
        for layer, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            self.host[layer, 0, :num_cached].copy_(k[:num_cached].flatten(1))
            self.host[layer, 1, :num_cached].copy_(v[:num_cached].flatten(1))


def put_prefix(service: HiCacheService, model: Decoder, buffers: Buffers, tokens: list[int],
               x: torch.Tensor) -> None:
    """Make ``tokens`` (whole pages; their hidden states ``x``, ``[N, hidden]``) a host hit:
    their rows go into the buffers, the host copy and the device pool, which the tree inserts,
    backs up and evicts.

    Raises:
        BenchmarkError: the prefix did not end up host-only (the pools are too small).
    """
    num_cached = len(tokens)
    model.forward(x, 0, OwnKV(keep=(buffers.keys, buffers.values)))
    buffers.keep_prefix(num_cached)
    pool = device_pool(service)
    slots = service.alloc_device(num_cached)
    if slots is None:
        raise BenchmarkError(f"no device room for a prefix of {num_cached} tokens")
    locs = pool.forward_locs(slots)
    for layer in range(model.spec.num_layers):
        pool.set_kv(layer, locs, buffers.keys[layer][:num_cached],
                    buffers.values[layer][:num_cached])
    service.insert(tokens, slots)
    settle(service)
    service.evict(num_cached)
    match = service.match(tokens)
    if match.host_hit_tokens != num_cached or match.device_hit_tokens:
        raise BenchmarkError(f"the {num_cached}-token prefix is not a host-only hit after "
                             f"backup and eviction: {match.device_hit_tokens} device and "
                             f"{match.host_hit_tokens} host tokens")


def device_pool(service: HiCacheService) -> DeviceKVPool:
    pool = service.device_pool
    assert isinstance(pool, DeviceKVPool), "the e2e bench builds a full-attention pool"
    return pool


def settle(service: HiCacheService) -> None:
    """Wait for the GPU, then apply acks until no transfer is in flight.

    Raises:
        BenchmarkError: transfers still in flight after ``SETTLE_TIMEOUT_S``.
    """
    if device_pool(service).device.type == "cuda":
        torch.cuda.synchronize()
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    service.step()
    while service.controller.num_in_flight:
        if time.monotonic() > deadline:
            raise BenchmarkError(f"{service.controller.num_in_flight} transfers still in "
                                 f"flight after {SETTLE_TIMEOUT_S:.0f} s")
        time.sleep(0.0005)
        service.step()


def clear(service: HiCacheService, capacity_tokens: int) -> None:
    """Drop every cached token from both tiers (nothing may be locked or held)."""
    settle(service)
    service.evict(capacity_tokens)
    service.evict_host(capacity_tokens)
    service.check_integrity()
