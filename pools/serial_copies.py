"""Copies and joins of CPU index tensors that stay on the calling thread.

torch runs a CPU copy (``clone``, ``to``, ``cat``) of more than ``GRAIN`` elements on its
intra-op threads, and waking them is not free where other threads keep the cores busy: in
the end-to-end bench's process on an H200 host (an engine's forward, the service's thread,
the CUDA driver's), ``torch.arange`` and ``torch.equal`` of 32,784 slots took 3.1-6.0 ms
each, against 21-27 us in a loop on their own. The cache copies and joins slots of a whole
request on the scheduler thread (a match's result, a load-back's slots, a node split), so
beyond the grain numpy, which never leaves the thread, fills a tensor of torch's own memory
(as a clone's: every slot tensor of the cache keeps one kind of storage). Below the grain
torch is serial already, and its call costs less than the numpy round trip.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

GRAIN = 32768  # torch's internal::GRAIN_SIZE: larger CPU copies may run on its threads


def int64_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A new int64 tensor with the values of 1-D integer ``tensor`` (on its device; only a
    CPU one beyond the grain goes through numpy)."""
    if tensor.numel() <= GRAIN or not tensor.is_cpu:
        return tensor.clone() if tensor.dtype is torch.int64 else tensor.to(torch.int64)
    out = torch.empty(tensor.numel(), dtype=torch.int64)  # torch's memory, as a clone's
    out.numpy()[:] = tensor.numpy()
    return out


def joined(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A new tensor holding 1-D ``tensors`` (one dtype and device, at least one) in order."""
    total = sum(t.numel() for t in tensors)
    if total <= GRAIN or not tensors[0].is_cpu:
        return torch.cat(list(tensors))
    out = torch.empty(total, dtype=tensors[0].dtype)
    np.concatenate([t.numpy() for t in tensors], out=out.numpy())
    return out
