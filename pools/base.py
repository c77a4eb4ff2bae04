"""Index spaces, tagged index tensors and the checks every pool runs at its boundary.

Every slot index that crosses a module boundary travels as an :class:`Indices`: the tensor
plus the :class:`IndexSpace` it belongs to. A pool refuses indices of another space, of a
dtype other than int32/int64, of another device, or of another shape, with a ``ValueError``
that says what was expected. Translation from ``DEVICE_FULL`` to ``DEVICE_SWA`` happens only
in :class:`hicache.pools.swa.HybridSWAPool`; nothing else creates SWA indices.

Slot 0 (in fact the whole page 0) of every pool is reserved for padding: padded batch rows
point at it, the full-to-SWA map sends "no SWA slot" to it and transfers skip it.

Bounds checks always run (``hicache.pools.bounds``): a CPU tensor is checked at once, a CUDA
tensor on the GPU without a synchronisation, its error raised at the next ``poll()``/``step()``.
``HICACHE_DEBUG_CHECKS=1`` makes CUDA checks synchronous too, so the error is raised at the
offending call (slower; for debugging, not needed for safety).

Page tables travel as :class:`PageTable`, tagged like :class:`Indices` with the space of the
pages they hold; only full-space tables are translated to SWA space.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .bounds import BoundsGuard

DEBUG_CHECKS_ENV = "HICACHE_DEBUG_CHECKS"
PADDING_SLOT = 0
INDEX_DTYPES = (torch.int32, torch.int64)


class IndexSpace(enum.Enum):
    """Which pool a slot index belongs to."""

    DEVICE_FULL = "device_full"
    DEVICE_SWA = "device_swa"
    HOST_FULL = "host_full"
    HOST_SWA = "host_swa"

    # Members are singletons: hash by identity, in C (Enum's own hash is a Python call,
    # and the in-flight counts look a space up several times per op).
    __hash__ = object.__hash__

    @property
    def is_host(self) -> bool:
        """True for the host spaces (full and SWA host pools)."""
        return self in (IndexSpace.HOST_FULL, IndexSpace.HOST_SWA)


class HostLayout(enum.Enum):
    """Storage order of a host pool.

    ``layer_first``: ``[components, layers, slots, row]``; one layer of a run of slots is
    contiguous (good for layer-wise loads).
    ``page_first``: ``[slots, components, layers, row]``; every layer of a page is contiguous
    (good for write-back and for shared-store objects).
    ``page_first_direct``: ``[pages, components, layers, page_size, row]``; a page is one
    contiguous block (write-back, shared-store objects) and, inside it, one layer of one
    component is ``page_size`` consecutive rows, so one layer of a run of pages is a set of
    equally spaced blocks: one 2D copy-engine copy (layer-wise loads). With page size 1 it
    holds the same bytes as ``page_first``.
    """

    LAYER_FIRST = "layer_first"
    PAGE_FIRST = "page_first"
    PAGE_FIRST_DIRECT = "page_first_direct"


class AttentionKind(enum.Enum):
    """MHA stores K and V rows of ``heads * head_dim``; MLA stores one latent row."""

    MHA = "mha"
    MLA = "mla"


@dataclass(frozen=True, init=False)
class Indices:
    """A 1-D slot index tensor tagged with the space it indexes.

    Args:
        tensor: shape ``[n]``, int32 or int64, on any device.
        space: the pool family the values index.
    """

    tensor: torch.Tensor
    space: IndexSpace

    def __init__(self, tensor: torch.Tensor, space: IndexSpace) -> None:
        # Written by hand: the generated frozen __init__ stores through
        # object.__setattr__ and then runs __post_init__, about twice this cost, and
        # every allocation, tree slice and op makes one of these.
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"Indices.tensor must be a torch.Tensor, got {type(tensor).__name__}")
        if type(space) is not IndexSpace:  # an enum with members has no subclasses
            raise TypeError(f"Indices.space must be an IndexSpace, got {type(space).__name__}")
        fields = self.__dict__  # frozen: the instance dict, not the blocked __setattr__
        fields["tensor"] = tensor
        fields["space"] = space

    def __len__(self) -> int:
        return int(self.tensor.numel())

    @property
    def device(self) -> torch.device:
        """The device the index tensor is on (not the pool's: indices of any space may be on
        the CPU or a GPU)."""
        return self.tensor.device

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> Indices:
        """Same indices on another device/dtype (``non_blocking`` when the source is pinned)."""
        tensor = self.tensor.to(
            device=device, dtype=dtype or self.tensor.dtype, non_blocking=True
        )
        return Indices(tensor, self.space)


@dataclass(frozen=True)
class PageTable:
    """A page table tagged with the space of the pages it holds (a thin wrapper: kernels
    get ``tensor`` as is).

    Args:
        tensor: ``[rows, max_pages]`` int32/int64 page ids; 0 is the padding page.
        space: ``DEVICE_FULL`` (pages of the full pool) or ``DEVICE_SWA`` (made only by
            :meth:`hicache.pools.HybridSWAPool.translate_page_table`).
        page_size: slots per page.
        map_version: of an SWA table, the full-to-SWA map's version it was translated
            with (a hybrid pool refuses it once the map changed); ``None`` otherwise.
    """

    tensor: torch.Tensor
    space: IndexSpace
    page_size: int
    map_version: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.tensor, torch.Tensor):
            raise TypeError(
                f"PageTable.tensor must be a torch.Tensor, got {type(self.tensor).__name__}"
            )
        if not isinstance(self.space, IndexSpace):
            raise TypeError(f"PageTable.space must be an IndexSpace, got "
                            f"{type(self.space).__name__}")
        if self.space not in (IndexSpace.DEVICE_FULL, IndexSpace.DEVICE_SWA):
            raise ValueError(f"a page table holds device pages, not {self.space}")
        if self.tensor.dtype not in INDEX_DTYPES or self.tensor.dim() != 2:
            raise ValueError(
                f"a page table must be a 2-D int32/int64 tensor, got {self.tensor.dtype} "
                f"of shape {tuple(self.tensor.shape)}"
            )
        if isinstance(self.page_size, bool) or not isinstance(self.page_size, int) \
                or self.page_size < 1:
            raise ValueError(f"PageTable.page_size must be an int >= 1, got {self.page_size!r}")

    @property
    def num_rows(self) -> int:
        """Rows of the table (requests of the batch)."""
        return int(self.tensor.shape[0])


def debug_checks_enabled() -> bool:
    """True when ``HICACHE_DEBUG_CHECKS=1``: CUDA bounds checks also raise at the call."""
    return os.environ.get(DEBUG_CHECKS_ENV, "0") == "1"


def check_indices(
    indices: Indices,
    *,
    space: IndexSpace,
    pool_name: str,
    num_slots: int,
    device: torch.device | None,
    op: str,
    guard: BoundsGuard | None = None,
) -> torch.Tensor:
    """Validate ``indices`` for ``op`` on a pool and return the raw tensor to use.

    Checks the space, the dtype (int32/int64), that the tensor is 1-D, its device when
    ``device`` is given, and that every value lies in ``[0, num_slots)``: at once for a CPU
    tensor; through ``guard`` (required) for a CUDA tensor, which then returns a cleaned copy
    (see :class:`hicache.pools.bounds.BoundsGuard`).

    Raises:
        TypeError: ``indices`` is not an :class:`Indices` (a bare tensor has no space).
        ValueError: wrong space, dtype, shape or device; :class:`BoundsError` (a
            ``ValueError``) for a value out of range.
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
    check_index_tensor(tensor, pool_name=pool_name, device=device, op=op, what="indices")
    if tensor.dim() != 1:
        raise ValueError(
            f"{op}: indices for pool '{pool_name}' must be 1-D, got shape {tuple(tensor.shape)}"
        )
    if guard is not None:
        return guard.check(tensor, bound=num_slots, op=op)
    if tensor.device.type != "cpu":
        raise TypeError(f"{op}: indices on {tensor.device} need the pool's bounds guard")
    check_now(tensor, pool_name=pool_name, bound=num_slots, op=op)
    return tensor


def check_index_tensor(
    tensor: torch.Tensor, *, pool_name: str, device: torch.device | None, op: str, what: str
) -> None:
    """Raise ``ValueError`` unless ``tensor`` is int32/int64 (and on ``device`` if given)."""
    if tensor.dtype not in INDEX_DTYPES:
        raise ValueError(
            f"{op}: {what} for pool '{pool_name}' must be int32 or int64, got {tensor.dtype}"
        )
    if device is not None and tensor.device != device:
        raise ValueError(
            f"{op}: {what} for pool '{pool_name}' must be on {device}, got {tensor.device}; "
            f"move them with {'Indices' if what == 'indices' else 'PageTable.tensor'}"
            f".to({str(device)!r}) (the controller's move_indices does this for transfers)"
        )


def check_now(tensor: torch.Tensor, *, pool_name: str, bound: int, op: str,
              unit: str = "slot") -> None:
    """Raise :class:`BoundsError` naming the op, the pool, the value and the bound if any
    value is outside ``[0, bound)``. Empty tensors pass. On a GPU tensor this synchronises
    (only ``HICACHE_DEBUG_CHECKS`` asks for that)."""
    if tensor.numel() == 0:
        return
    low, high = torch.aminmax(tensor)
    low_v, high_v = int(low), int(high)
    if low_v < 0 or high_v >= bound:
        raise BoundsError(bounds_message(op, pool_name, unit, low_v if low_v < 0 else high_v,
                                         bound))


class BoundsError(ValueError):
    """An index outside its pool: the op, the pool, the value and the valid range."""


def bounds_message(op: str, pool_name: str, unit: str, value: int, bound: int) -> str:
    what = "negative" if value < 0 else "out of range"
    return (
        f"{op}: {unit} {value} is {what} for pool '{pool_name}' (valid {unit}s are "
        f"0..{bound - 1}); pass only {unit}s this pool handed out"
    )


def check_page_multiple(num_tokens: int, page_size: int, what: str) -> None:
    """Raise ``ValueError`` unless ``num_tokens`` is a non-negative multiple of ``page_size``."""
    if num_tokens < 0:
        raise ValueError(f"{what}: num_tokens must be >= 0, got {num_tokens}")
    if num_tokens % page_size != 0:
        raise ValueError(
            f"{what}: {num_tokens} tokens is not a whole number of pages of {page_size} tokens; "
            f"round to a multiple of page_size_tokens"
        )
