"""Host KV pool: the same rows as a device pool, in pinned host memory, in one of three layouts.

``layer_first`` stores ``[components, layers, slots, row_elems]``; ``page_first`` stores
``[slots, components, layers, row_elems]``; ``page_first_direct`` stores ``[pages, components,
layers, page_size, row_elems]`` (a page is one block; inside it, one layer of one component is
``page_size`` consecutive rows). Each is allocated once. ``layer_pages`` gives the ``[pages,
page_size, row_elems]`` view of one component of one layer in every layout; ``layer_rows``
gives the ``[slots, row_elems]`` view where one exists (``layer_first``: contiguous,
``page_first``: strided; a ``page_first_direct`` layer is no single strided 2-D view).
``read_layer_rows`` / ``write_layer_rows`` index one layer's rows in any layout.

When CUDA is available the buffer is page-locked with ``cudaHostRegister`` (no power-of-two
rounding as with PyTorch's pinned allocator) and unregistered by :meth:`close`.
"""

from __future__ import annotations

import logging
import math
import mmap
import weakref

import numpy as np
import torch

from .allocator import PageAllocator
from .base import HostLayout, IndexSpace, Indices, check_indices
from .device import RowGeometry
from .row_records import layer_records

logger = logging.getLogger(__name__)
CPU = torch.device("cpu")


class HostKVPool:
    """Pinned host copy of a device pool's rows, with its own page allocator.

    Args:
        name: pool name (``full``, ``swa``) for errors and metrics.
        space: ``HOST_FULL`` or ``HOST_SWA``.
        num_layers: layers stored (same as the device pool it mirrors).
        num_pages: usable pages (page 0 is reserved on top).
        page_size: slots per page.
        geometry: row shape and dtype (same as the device pool).
        layout: storage order.
        pin: page-lock the buffer (defaults to ``torch.cuda.is_available()``).
    """

    def __init__(
        self,
        *,
        name: str,
        space: IndexSpace,
        num_layers: int,
        num_pages: int,
        page_size: int,
        geometry: RowGeometry,
        layout: HostLayout,
        pin: bool | None = None,
    ) -> None:
        if not space.is_host:
            raise ValueError(f"host pool '{name}' cannot use device space {space.name}")
        self.name = name
        self.space = space
        self.num_layers = num_layers
        self.page_size = page_size
        self.geometry = geometry
        self.layout = layout
        self.allocator = PageAllocator(num_pages, page_size, space, name)
        self.num_slots = self.allocator.num_slots
        shape = storage_shape(layout, geometry.num_components, num_layers, self.num_slots,
                              page_size, geometry.row_elems)
        self.is_pinned = False
        self._unpin: weakref.finalize | None = None
        self._records: list[list[np.ndarray]] | None = None
        if pin if pin is not None else torch.cuda.is_available():
            self._data: torch.Tensor | None = _page_aligned_zeros(shape, geometry.dtype)
            self._pin()
        else:
            self._data = torch.zeros(shape, dtype=geometry.dtype)
        logger.info(
            "host pool '%s': %d tokens, %.3f GiB, layout %s, pinned=%s",
            name, self.allocator.capacity_tokens, self.size_bytes / 2**30, layout.value,
            self.is_pinned,
        )

    @property
    def data(self) -> torch.Tensor:
        """The whole buffer in storage order (see the module docstring)."""
        if self._data is None:
            raise RuntimeError(f"host pool '{self.name}' is closed")
        return self._data

    @property
    def size_bytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def layer_rows(self, component: int, layer: int) -> torch.Tensor:
        """``[num_slots, row_elems]`` view of one component of one layer (``layer_first``:
        contiguous; ``page_first``: strided).

        Raises:
            ValueError: a ``page_first_direct`` pool (its layer is ``page_size``-row blocks a
                page apart, no single strided 2-D view): use :meth:`layer_pages` or
                :meth:`read_layer_rows` / :meth:`write_layer_rows`.
        """
        if self.layout is HostLayout.LAYER_FIRST:
            return self.data[component, layer]
        if self.layout is HostLayout.PAGE_FIRST:
            return self.data[:, component, layer]
        raise ValueError(
            f"layer_rows: host pool '{self.name}' has layout {self.layout.value}, whose layer is "
            f"no single [slots, row] view; use layer_pages (a [pages, page_size, row] view) or "
            f"read_layer_rows / write_layer_rows"
        )

    def layer_pages(self, component: int, layer: int) -> torch.Tensor:
        """``[num_slots // page_size, page_size, row_elems]`` view of one component of one
        layer, in every layout (slot ``s`` is ``[s // page_size, s % page_size]``)."""
        if self.layout is HostLayout.PAGE_FIRST_DIRECT:
            return self.data[:, component, layer]
        return self.layer_rows(component, layer).unflatten(0, (-1, self.page_size))

    def read_layer_rows(self, component: int, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """``[n, row_elems]`` copy of one component of one layer at ``slots``.

        ``slots``: ``[n]`` int64 CPU slot numbers already checked against this pool (the
        transfer path; no check here)."""
        if self.layout is HostLayout.PAGE_FIRST_DIRECT:
            return self.data[:, component, layer][slots // self.page_size, slots % self.page_size]
        return self.layer_rows(component, layer).index_select(0, slots)

    def write_layer_rows(self, component: int, layer: int, slots: torch.Tensor,
                         rows: torch.Tensor) -> None:
        """Write ``[n, row_elems]`` ``rows`` into one component of one layer at ``slots``
        (int64 CPU, already checked, no duplicates)."""
        if self.layout is HostLayout.PAGE_FIRST_DIRECT:
            self.data[:, component, layer].index_put_(
                (slots // self.page_size, slots % self.page_size), rows)
        else:
            self.layer_rows(component, layer).index_copy_(0, slots, rows)

    def layer_records(self, component: int, layer: int) -> np.ndarray:
        """:meth:`layer_rows` as ``[num_slots]`` numpy records (see
        :mod:`hicache.pools.row_records`), made once; dropped by :meth:`close`. Not for
        ``page_first_direct``, whose layer is no flat view of slots (use
        :meth:`read_layer_rows` / :meth:`write_layer_rows`)."""
        if self.layout is HostLayout.PAGE_FIRST_DIRECT:
            raise ValueError(f"layer_records: host pool '{self.name}' is page_first_direct, "
                             f"whose layers have no [slots] view; use read_layer_rows / "
                             f"write_layer_rows")
        if self._records is None:
            rows = [[self.layer_rows(c, layer) for layer in range(self.num_layers)]
                    for c in range(self.geometry.num_components)]
            self._records = layer_records(rows)
        return self._records[component][layer]

    def check(self, indices: Indices, op: str, device: torch.device | None = CPU) -> torch.Tensor:
        """Validate host indices (space, dtype, device, bounds: always checked)."""
        return check_indices(
            indices, space=self.space, pool_name=self.name, num_slots=self.num_slots,
            device=device, op=op,
        )

    def read_rows(self, indices: Indices) -> torch.Tensor:
        """Copy of the rows at ``indices`` as ``[n, components, layers, row_elems]``."""
        index = self.check(indices, "read_rows").to(torch.int64)
        if self.layout is HostLayout.LAYER_FIRST:
            return self.data[:, :, index].permute(2, 0, 1, 3).contiguous()
        if self.layout is HostLayout.PAGE_FIRST_DIRECT:
            # Advanced indices on dims 0 and 3 around slices: the indexed dim comes first.
            return self.data[index // self.page_size, :, :, index % self.page_size]
        return self.data[index].clone()

    def write_rows(self, indices: Indices, rows: torch.Tensor) -> None:
        """Write ``[n, components, layers, row_elems]`` rows at ``indices`` (shared-store reads
        and tests)."""
        index = self.check(indices, "write_rows").to(torch.int64)
        expected = (index.numel(), self.geometry.num_components, self.num_layers,
                    self.geometry.row_elems)
        if tuple(rows.shape) != expected or rows.dtype != self.geometry.dtype:
            raise ValueError(
                f"write_rows on host pool '{self.name}': expected {self.geometry.dtype} rows of "
                f"shape {expected}, got {rows.dtype} {tuple(rows.shape)}"
            )
        if self.layout is HostLayout.LAYER_FIRST:
            self.data[:, :, index] = rows.permute(1, 2, 0, 3)
        elif self.layout is HostLayout.PAGE_FIRST_DIRECT:
            self.data[index // self.page_size, :, :, index % self.page_size] = rows
        else:
            self.data[index] = rows

    def close(self) -> None:
        """Unpin and release the buffer; any later access raises. Idempotent. A pool that is
        garbage collected without ``close()`` is unpinned then, before its memory goes back."""
        if self._data is None:
            return
        if self._unpin is not None:
            self._unpin()
            self._unpin = None
        self.is_pinned = False
        self._data = None
        self._records = None

    def _pin(self) -> None:
        data = self.data
        cudart = torch.cuda.cudart()
        result = cudart.cudaHostRegister(data.data_ptr(), data.numel() * data.element_size(), 0)
        if int(result) != 0:
            raise RuntimeError(
                f"cudaHostRegister failed for host pool '{self.name}' ({self.size_bytes} bytes): "
                f"{result}; transfers from unpinned memory would be synchronous or stale"
            )
        self.is_pinned = True
        # Holds the tensor (not the pool): the memory stays mapped until it is unregistered.
        # Not at interpreter exit: the CUDA context may be gone, and the OS reclaims it all.
        self._unpin = weakref.finalize(self, _unregister, data, self.name)
        self._unpin.atexit = False


def storage_shape(layout: HostLayout, num_components: int, num_layers: int, num_slots: int,
                  page_size: int, row_elems: int) -> tuple[int, ...]:
    """Shape of a host buffer of ``num_slots`` slots (whole pages) in ``layout``."""
    c, n, s, r = num_components, num_layers, num_slots, row_elems
    if layout is HostLayout.LAYER_FIRST:
        return (c, n, s, r)
    if layout is HostLayout.PAGE_FIRST:
        return (s, c, n, r)
    return (s // page_size, c, n, page_size, r)


def as_layer_first(data: torch.Tensor, layout: HostLayout) -> torch.Tensor:
    """``[components, layers, slots, row]`` rows of a host buffer in ``layout`` (a pool's
    ``data`` or a copy of it on any device): a view for ``layer_first`` and ``page_first``,
    a copy for ``page_first_direct`` (for checks and tests, not for the transfer path)."""
    if layout is HostLayout.LAYER_FIRST:
        return data
    if layout is HostLayout.PAGE_FIRST:
        return data.permute(1, 2, 0, 3)
    pages, c, n, page_size, r = data.shape
    return data.permute(1, 2, 0, 3, 4).reshape(c, n, pages * page_size, r)


def _unregister(data: torch.Tensor, name: str) -> None:
    result = torch.cuda.cudart().cudaHostUnregister(data.data_ptr())
    if int(result) != 0:
        logger.warning("cudaHostUnregister of host pool '%s' returned %s", name, result)


def _page_aligned_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeroed host tensor in its own anonymous mapping: page aligned and sharing no page with
    any other allocation, as ``cudaHostRegister`` needs (a small tensor from the general
    allocator may share a page with another pool's registered range and fail to register)."""
    numel = math.prod(shape)
    size_bytes = numel * torch.empty((), dtype=dtype).element_size()
    mapping = mmap.mmap(-1, max(size_bytes, 1))
    return torch.frombuffer(mapping, dtype=dtype, count=numel).view(shape)
