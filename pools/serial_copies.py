"""Copies and joins of CPU index tensors that stay on the calling thread.

torch runs a CPU copy (``clone``, ``to``, ``cat``) of more than ``GRAIN`` elements on its
intra-op threads, and waking them is not free where other threads keep the cores busy: in
the end-to-end bench's process on an H200 host (an engine's forward, the service's thread,
the CUDA driver's), ``torch.arange`` and ``torch.equal`` of 32,784 slots took 3.1-6.0 ms
each, against 21-27 us in a loop on their own. The cache copies and joins slots of a whole
request on the scheduler thread (a match's result, a load-back's slots, a node split), so
beyond the grain it copies with numpy, which never leaves the thread. Below it torch is
serial already, and its call costs less than the numpy round trip.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

GRAIN = 32768  # torch's internal::GRAIN_SIZE: larger CPU copies may run on its threads


def int64_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A new int64 CPU tensor with the values of 1-D integer CPU ``tensor``."""
    if tensor.numel() <= GRAIN:
        return tensor.clone() if tensor.dtype is torch.int64 else tensor.to(torch.int64)
    return torch.from_numpy(tensor.numpy().astype(np.int64, copy=True))


def joined(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A new CPU tensor holding 1-D CPU ``tensors`` (one dtype, at least one) in order."""
    if sum(t.numel() for t in tensors) <= GRAIN:
        return torch.cat(list(tensors))
    return torch.from_numpy(np.concatenate([t.numpy() for t in tensors]))
