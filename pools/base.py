"""Index spaces, tagged index tensors and the checks every pool runs at its boundary.

Every slot index that crosses a module boundary travels as an :class:`Indices`: the tensor
plus the :class:`IndexSpace` it belongs to. A pool refuses indices of another space, of a
dtype other than int32/int64, of another device, or of another shape, with a ``ValueError``
that says what was expected. Translation from ``DEVICE_FULL`` to ``DEVICE_SWA`` happens only
in :class:`hicache.pools.swa.HybridSWAPool`; nothing else creates SWA indices.

Slot 0 (in fact the whole page 0) of every pool is reserved for padding: padded batch rows
point at it, the full-to-SWA map sends "no SWA slot" to it and transfers skip it.

Full bounds checks (one min/max over the tensor, which synchronises a GPU stream) run when
the environment variable ``HICACHE_DEBUG_CHECKS=1`` is set; the cheap checks always run.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

import torch

DEBUG_CHECKS_ENV = "HICACHE_DEBUG_CHECKS"
PADDING_SLOT = 0
INDEX_DTYPES = (torch.int32, torch.int64)


class IndexSpace(enum.Enum):
    """Which pool a slot index belongs to."""

    DEVICE_FULL = "device_full"
    DEVICE_SWA = "device_swa"
    HOST_FULL = "host_full"
    HOST_SWA = "host_swa"

    @property
    def is_host(self) -> bool:
        return self in (IndexSpace.HOST_FULL, IndexSpace.HOST_SWA)


class HostLayout(enum.Enum):
    """Storage order of a host pool.

    ``layer_first``: ``[components, layers, slots, row]``; one layer of a run of slots is
    contiguous (good for layer-wise loads).
    ``page_first``: ``[slots, components, layers, row]``; every layer of a page is contiguous
    (good for write-back and for shared-store objects).
    """

    LAYER_FIRST = "layer_first"
    PAGE_FIRST = "page_first"


class AttentionKind(enum.Enum):
    """MHA stores K and V rows of ``heads * head_dim``; MLA stores one latent row."""

    MHA = "mha"
    MLA = "mla"


@dataclass(frozen=True)
class Indices:
    """A 1-D slot index tensor tagged with the space it indexes.

    Args:
        tensor: shape ``[n]``, int32 or int64, on any device.
        space: the pool family the values index.
    """

    tensor: torch.Tensor
    space: IndexSpace

    def __post_init__(self) -> None:
        if not isinstance(self.tensor, torch.Tensor):
            raise TypeError(
                f"Indices.tensor must be a torch.Tensor, got {type(self.tensor).__name__}"
            )
        if not isinstance(self.space, IndexSpace):
            raise TypeError(
                f"Indices.space must be an IndexSpace, got {type(self.space).__name__}"
            )

    def __len__(self) -> int:
        return int(self.tensor.numel())

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> Indices:
        """Same indices on another device/dtype (``non_blocking`` when the source is pinned)."""
        tensor = self.tensor.to(
            device=device, dtype=dtype or self.tensor.dtype, non_blocking=True
        )
        return Indices(tensor, self.space)


def debug_checks_enabled() -> bool:
    """True when ``HICACHE_DEBUG_CHECKS=1``: every index is bounds-checked."""
    return os.environ.get(DEBUG_CHECKS_ENV, "0") == "1"


def check_indices(
    indices: Indices,
    *,
    space: IndexSpace,
    pool_name: str,
    num_slots: int,
    device: torch.device | None,
    op: str,
) -> torch.Tensor:
    """Validate ``indices`` for ``op`` on a pool and return the raw tensor.

    Always checks the space, the dtype (int32/int64), that the tensor is 1-D and, when
    ``device`` is given, its device. With ``HICACHE_DEBUG_CHECKS=1`` also checks every value
    lies in ``[0, num_slots)``.

    Raises:
        TypeError: ``indices`` is not an :class:`Indices` (a bare tensor has no space).
        ValueError: wrong space, dtype, shape, device or (debug) an out-of-range value.
    """
    if not isinstance(indices, Indices):
        raise TypeError(
            f"{op}: expected hicache.pools.Indices in space {space.name} for pool "
            f"'{pool_name}', got {type(indices).__name__}; wrap the tensor as "
            f"Indices(tensor, IndexSpace.{space.name}) only if it really indexes that pool"
        )
    if indices.space is not space:
        hint = (
            "; translate full slots with HybridSWAPool.translate_full_to_swa first"
            if space is IndexSpace.DEVICE_SWA and indices.space is IndexSpace.DEVICE_FULL
            else ""
        )
        raise ValueError(
            f"{op}: pool '{pool_name}' takes indices in space {space.name}, "
            f"got {indices.space.name}{hint}"
        )
    tensor = indices.tensor
    if tensor.dtype not in INDEX_DTYPES:
        raise ValueError(
            f"{op}: indices for pool '{pool_name}' must be int32 or int64, got {tensor.dtype}"
        )
    if tensor.dim() != 1:
        raise ValueError(
            f"{op}: indices for pool '{pool_name}' must be 1-D, got shape {tuple(tensor.shape)}"
        )
    if device is not None and tensor.device != device:
        raise ValueError(
            f"{op}: indices for pool '{pool_name}' must be on {device}, got {tensor.device}; "
            f"move them with Indices.to({str(device)!r}) (the controller's move_indices does "
            f"this for transfers)"
        )
    if debug_checks_enabled():
        check_bounds(tensor, pool_name=pool_name, num_slots=num_slots, op=op)
    return tensor


def check_bounds(tensor: torch.Tensor, *, pool_name: str, num_slots: int, op: str) -> None:
    """Raise ``ValueError`` naming the pool, the value and the bound if any index is outside
    ``[0, num_slots)``. Empty tensors pass. Synchronises the tensor's stream (debug only)."""
    if tensor.numel() == 0:
        return
    low = int(tensor.min().item())
    high = int(tensor.max().item())
    if low < 0:
        raise ValueError(
            f"{op}: index {low} is negative for pool '{pool_name}' "
            f"(valid slots are 0..{num_slots - 1})"
        )
    if high >= num_slots:
        raise ValueError(
            f"{op}: index {high} is out of range for pool '{pool_name}' "
            f"(valid slots are 0..{num_slots - 1})"
        )


def check_page_multiple(num_tokens: int, page_size: int, what: str) -> None:
    """Raise ``ValueError`` unless ``num_tokens`` is a non-negative multiple of ``page_size``."""
    if num_tokens < 0 or num_tokens % page_size != 0:
        raise ValueError(
            f"{what}: {num_tokens} tokens is not a whole number of pages of {page_size} tokens; "
            f"round to a multiple of page_size_tokens"
        )
