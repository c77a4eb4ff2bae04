"""Triton transfer kernel: copy KV rows between a device pool and pinned host memory directly.

Pinned (``cudaHostRegister``-ed) host memory is addressable from the GPU under unified virtual
addressing, so one kernel can gather and scatter rows at token granularity across PCIe without
a staging buffer. :func:`transfer_rows` launches a *persistent* grid of at most
``num_programs`` programs: a transfer occupies only that many SMs, however many rows it moves,
which bounds how much it slows the model's compute running beside it.

Work decomposition: the pairs are cut into tiles of ``tokens_per_tile`` pairs; one work item
is (tile, layer, component) and the programs walk the items grid-stride. Consecutive items
differ in component, then layer, then tile, so the programs running at the same time touch
the same few slots (all of one token's layers are one contiguous run in a ``page_first`` host
pool, all of one page's in a ``page_first_direct`` one). Each item loads the two index tiles,
masks the padding slot and the tail, and moves a ``[tokens_per_tile, row]`` block: one load
and one store of ``tokens_per_tile * row_bytes`` (16 KiB for 8 tokens of 2 KiB rows) that
every program keeps in flight.

The kernel body and its compilation are in :mod:`hicache.controller.copy_rows_kernel`; this
module checks the arguments and plans the launch (grid, tile, warps, strides). What depends
only on the pool buffers (their checks and strides) is found once per buffer geometry, so a
launch, one per layer group of a load, costs little Python. Importing it never needs Triton.
"""

from __future__ import annotations

import torch

from hicache.pools import HostLayout

from .copy_rows_kernel import INTERPRET_ENV, kernel_available
from .row_copy import INDEX_DTYPES, MAX_TOKENS_PER_TILE, RowCopy, check_launch

__all__ = ["INDEX_DTYPES", "INTERPRET_ENV", "MAX_TOKENS_PER_TILE", "kernel_available",
           "transfer_rows"]



def transfer_rows(
    *,
    device_data: torch.Tensor,
    host_data: torch.Tensor,
    host_layout: HostLayout,
    host_indices: torch.Tensor,
    device_indices: torch.Tensor,
    layer_begin: int,
    layer_end: int,
    to_host: bool,
    num_programs: int = 16,
    tokens_per_tile: int = 8,
) -> None:
    """Copy rows of layers ``[layer_begin, layer_end)`` between a device and a host pool buffer.

    For every pair ``i`` and every component ``c`` and layer ``l`` in range, moves
    ``device_data[c, l, device_indices[i]]`` to (``to_host=True``) or from (``False``) the host
    row of slot ``host_indices[i]`` (``host_data[c, l, s]`` for ``layer_first``,
    ``host_data[s, c, l]`` for ``page_first``, ``host_data[s // P, c, l, s % P]`` for
    ``page_first_direct`` with pages of ``P`` slots). Pairs where either index is the padding slot 0
    are skipped; an index outside ``[1, slots)`` of its pool is never dereferenced either (the
    controller refuses such an index before it launches; a direct caller gets no error for
    one, the pair is just not copied). Nothing else is written.

    Args:
        device_data: ``[C, L, S_dev, R]`` contiguous device pool buffer (``DeviceKVPool.data``),
            bfloat16/float16/float32, on CUDA (or CPU under the Triton interpreter).
        host_data: contiguous host pool buffer (``HostKVPool.data``), same dtype: ``[C, L,
            S_host, R]`` (``layer_first``), ``[S_host, C, L, R]`` (``page_first``) or
            ``[S_host / P, C, L, P, R]`` (``page_first_direct``). With a CUDA ``device_data``
            it is a pinned CPU tensor (``cudaHostRegister``), read and written by the GPU
            through unified addressing.
        host_layout: storage order of ``host_data``.
        host_indices: ``[n]`` int32/int64 host slots, on ``device_data.device``.
        device_indices: ``[n]`` int32/int64 device slots (dtype may differ), same device.
        layer_begin, layer_end: local layer range, ``0 <= begin <= end <= L``.
        to_host: ``True`` writes device rows to the host, ``False`` loads host rows.
        num_programs: upper bound of the persistent grid (SMs the copy may occupy).
        tokens_per_tile: pairs per work item, a power of two.

    Launches on the current CUDA stream and returns at once; never synchronises. Empty input
    launches nothing. Stream contract: the index tensors are recorded on the current stream
    (``record_stream``), so the caller may drop them right after the call; ``device_data`` and
    ``host_data`` belong to their pools, which must stay open (host memory registered) and must
    not reuse the destination slots until the caller's completion event on this stream fires.

    Raises:
        ValueError: a malformed argument (the message says what was expected).
        RuntimeError: Triton is missing, or a CPU launch without ``TRITON_INTERPRET=1``.
    """
    copy = RowCopy(device_data=device_data, host_data=host_data, host_layout=host_layout,
                   host_indices=host_indices, device_indices=device_indices, to_host=to_host,
                   num_programs=num_programs, tokens_per_tile=tokens_per_tile)
    check_launch(copy.num_layers, layer_begin, layer_end, num_programs, tokens_per_tile)
    if copy.num_pairs == 0 or layer_end == layer_begin:
        return
    if device_data.is_cuda:
        stream = torch.cuda.current_stream(device_data.device)
        host_indices.record_stream(stream)
        device_indices.record_stream(stream)
    copy.launch(layer_begin, layer_end)
