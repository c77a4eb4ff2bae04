"""Transfer backends: ``torch`` (index ops, the reference), ``kernel`` (Triton over unified
addressing), the builder of every backend (``staged`` and ``direct`` have their own modules)
and of the ``auto`` choice between them.

Every backend is called with the op's side stream current and with indices that
``move_indices`` already placed where :meth:`TransferBackend.index_devices` asked.
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Sequence

import numpy as np
import torch

from hicache.pools import DeviceKVPool, HostKVPool, HostLayout
from hicache.pools.page_ids import is_run

from .auto import AutoBackend, load_table
from .base import BLOCK_MIN_ROWS, Direction, MovedTransfer, TransferBackend
from .direct import DirectBackend
from .row_copy import RowCopy
from .staged import StagedBackend

logger = logging.getLogger(__name__)
CPU = torch.device("cpu")


class BackendName(enum.Enum):
    TORCH = "torch"
    KERNEL = "kernel"
    STAGED = "staged"
    DIRECT = "direct"
    AUTO = "auto"


class TorchBackend(TransferBackend):
    """Index ops in plain torch. Runs anywhere; every other backend is tested against it.

    On a CPU device pool both sides are indexed directly. On a GPU, writes gather rows on
    the GPU, copy them to pinned memory and scatter them on the CPU, which needs the side
    stream synchronised: this backend blocks the caller on GPU writes (a reference, not a
    fast path). Loads gather on the CPU into pinned memory and copy asynchronously.
    """

    name = "torch"

    def index_devices(
        self, host_pool: HostKVPool, device_pool: DeviceKVPool
    ) -> tuple[torch.device, torch.device]:
        return CPU, device_pool.device

    def copy(
        self,
        moved: MovedTransfer,
        local_layers: Sequence[int],
        direction: Direction,
        keep_alive: list[torch.Tensor],
    ) -> None:
        device = moved.source.device_pool
        if moved.host_index.numel() == 0 or not local_layers:
            return
        components = range(device.geometry.num_components)
        pairs = [(c, layer) for layer in local_layers for c in components]
        if device.device == CPU:  # (comparing devices is cheaper than reading .type)
            self._copy_cpu(moved, pairs, direction)
        elif direction is Direction.DEVICE_TO_HOST:
            self._write_gpu(moved, pairs)
        else:
            self._load_gpu(moved, pairs, keep_alive)

    @staticmethod
    def _copy_cpu(
        moved: MovedTransfer, pairs: list[tuple[int, int]], direction: Direction
    ) -> None:
        """Rows by index through the pools' numpy record views: a torch index op costs
        microseconds of dispatch per call, a record copy is a memcpy per row."""
        host, device = moved.source.host_pool, moved.source.device_pool
        if moved.row_selectors is None:  # once per op, not per layer group of a load
            moved.row_selectors = _row_selectors(moved)
        host_index, device_index = moved.row_selectors
        to_host = direction is Direction.DEVICE_TO_HOST
        for c, layer in pairs:
            if host.layout is HostLayout.PAGE_FIRST_DIRECT:  # no flat [slots] view of a layer
                device_layer = device.layer_rows(c, layer)
                if to_host:
                    host.write_layer_rows(c, layer, moved.host_index,
                                          device_layer.index_select(0, moved.device_index))
                else:
                    device_layer.index_copy_(0, moved.device_index,
                                             host.read_layer_rows(c, layer, moved.host_index))
                continue
            host_rows, device_rows = host.layer_records(c, layer), device.layer_records(c, layer)
            if to_host:
                host_rows[host_index] = device_rows[device_index]
            else:
                device_rows[device_index] = host_rows[host_index]

    @staticmethod
    def _write_gpu(moved: MovedTransfer, pairs: list[tuple[int, int]]) -> None:
        host, device = moved.source.host_pool, moved.source.device_pool
        gathered = torch.stack(
            [device.layer_rows(c, layer).index_select(0, moved.device_index) for c, layer in pairs]
        )
        staging = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
        staging.copy_(gathered, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        for i, (c, layer) in enumerate(pairs):
            host.write_layer_rows(c, layer, moved.host_index, staging[i])

    @staticmethod
    def _load_gpu(
        moved: MovedTransfer, pairs: list[tuple[int, int]], keep_alive: list[torch.Tensor]
    ) -> None:
        host, device = moved.source.host_pool, moved.source.device_pool
        staging = torch.stack(
            [host.read_layer_rows(c, layer, moved.host_index) for c, layer in pairs]
        ).pin_memory()
        on_device = staging.to(device.device, non_blocking=True)
        keep_alive.extend((staging, on_device))
        for i, (c, layer) in enumerate(pairs):
            device.layer_rows(c, layer).index_copy_(0, moved.device_index, on_device[i])


class KernelBackend(TransferBackend):
    """Triton kernel that reads and writes pinned host rows directly (unified addressing),
    with a bounded persistent grid of ``num_programs`` programs. Layers move as one launch
    per contiguous range of local layers."""

    name = "kernel"
    counts_layers = True
    copy_s = 25e-6  # one launch through the cached launcher: 15-26 us

    def __init__(self, num_programs: int = 16) -> None:
        if num_programs < 1:
            raise ValueError(f"kernel backend: num_programs must be >= 1, got {num_programs}")
        self.num_programs = num_programs

    def check_device(self, device: torch.device) -> None:
        """CUDA pools with Triton, or CPU pools under the Triton interpreter
        (``TRITON_INTERPRET=1``, the tests' setting); anything else raises ``ValueError``."""
        from .copy_rows_kernel import INTERPRET_ENV, kernel_available

        interpreting = os.environ.get(INTERPRET_ENV, "0") == "1"
        if device.type != "cuda" and not (device.type == "cpu" and interpreting):
            raise ValueError(
                f"io_backend 'kernel' cannot serve pools on device {device}: the kernel "
                f"addresses pinned host memory from a CUDA device (a CPU runs it only in the "
                f"Triton interpreter, {INTERPRET_ENV}=1); choose io_backend: torch or auto for "
                f"CPU pools"
            )
        if not kernel_available():
            raise ValueError(
                "io_backend 'kernel' needs Triton with a CUDA device (or TRITON_INTERPRET=1 on "
                "a CPU); install triton or choose io_backend: torch"
            )

    def index_devices(
        self, host_pool: HostKVPool, device_pool: DeviceKVPool
    ) -> tuple[torch.device, torch.device]:
        return device_pool.device, device_pool.device

    def copy(
        self,
        moved: MovedTransfer,
        local_layers: Sequence[int],
        direction: Direction,
        keep_alive: list[torch.Tensor],
    ) -> None:
        if moved.host_index.numel() == 0:
            return
        row_copy = self._row_copy(moved, direction is Direction.DEVICE_TO_HOST)
        # the op records moved.host_index / device_index on its side stream and holds them
        for begin, end in _contiguous_ranges(local_layers):
            row_copy.launch(begin, end)

    def copy_counted(self, moved: MovedTransfer, layers: range, counters: torch.Tensor
                     ) -> int:
        row_copy = self._row_copy(moved, False)
        if not moved.host_index.numel():  # nothing launched: nothing will count
            return 0
        row_copy.launch(layers.start, layers.stop, counters)
        return row_copy.items_per_layer

    def _row_copy(self, moved: MovedTransfer, to_host: bool) -> RowCopy:
        """The op's prepared launch, made once per op (every layer group launches the same
        copy); a transfer moved both ways (tests) gets one per direction."""
        row_copy = moved.row_copy
        if row_copy is None or row_copy.to_host is not to_host:
            source = moved.source
            row_copy = moved.row_copy = RowCopy(
                device_data=source.device_pool.data, host_data=source.host_pool.data,
                host_layout=source.host_pool.layout, host_indices=moved.host_index,
                device_indices=moved.device_index, to_host=to_host,
                num_programs=self.num_programs)
        return row_copy


def _row_selectors(moved: MovedTransfer) -> tuple[slice | np.ndarray, slice | np.ndarray]:
    """The numpy row selectors of ``moved``'s host and device slots: a slice for one long
    run of slots (found from its pages when the op has them, else
    :func:`_block_or_index`)."""
    if moved.pages is None or moved.host_index.numel() < BLOCK_MIN_ROWS:
        return (_block_or_index(moved.host_index.numpy()),
                _block_or_index(moved.device_index.numpy()))
    host_run, device_run = moved.pages.runs()
    return (moved.host_index.numpy() if host_run is None else host_run,
            moved.device_index.numpy() if device_run is None else device_run)


def _block_or_index(index: np.ndarray) -> slice | np.ndarray:
    """``index`` as a slice when it is one ascending run of consecutive slots (what the
    allocators hand out; one block copy instead of a copy per row), else as it is. Short
    indices are left alone: their per-row copy costs less than the test."""
    size = index.size
    if size < BLOCK_MIN_ROWS:
        return index
    if not is_run(index):
        return index
    first = int(index[0])
    return slice(first, first + size)


def _contiguous_ranges(layers: Sequence[int]) -> list[tuple[int, int]]:
    ranges: list[tuple[int, int]] = []
    for layer in layers:
        if ranges and ranges[-1][1] == layer:
            ranges[-1] = (ranges[-1][0], layer + 1)
        else:
            ranges.append((layer, layer + 1))
    return ranges


def make_backend(name: BackendName | str, device: torch.device, num_programs: int = 16,
                 staging_tokens: int = 1024) -> TransferBackend:
    """Build the backend called ``name`` for pools on ``device``.

    ``auto`` is ``torch`` on a CPU; on a GPU it sends ops in long runs on a ``layer_first``
    host to ``direct`` and chooses the others per op from the measured table
    (``controller/auto_table.json``), falling back to ``kernel`` (or ``staged`` without
    Triton). ``kernel``, ``staged`` and ``direct`` need CUDA pools (``kernel`` also runs on
    CPU pools in the Triton interpreter, for tests).

    Raises:
        ValueError: an unknown name, or a backend that cannot serve pools on ``device``.
    """
    from .copy_rows_kernel import kernel_available

    choice = BackendName(name) if isinstance(name, str) else name
    if choice is BackendName.AUTO:
        if device.type != "cuda":
            return TorchBackend()
        found: dict[str, TransferBackend] = {
            "torch": TorchBackend(), "staged": StagedBackend(staging_tokens),
            "direct": DirectBackend()}
        if kernel_available():
            found["kernel"] = KernelBackend(num_programs)
        fallback = "kernel" if "kernel" in found else "staged"
        return AutoBackend(found, load_table(), fallback)
    if choice is BackendName.TORCH:
        return TorchBackend()
    if choice is BackendName.KERNEL:
        kernel = KernelBackend(num_programs)
        kernel.check_device(device)
        return kernel
    if device.type != "cuda":
        # StagedBackend and DirectBackend run on CPU pools as tests of their plans, but a
        # configured 'staged' or 'direct' there would only be a slow torch: refuse it.
        how = ("gathers rows into a CUDA staging buffer and copies them"
               if choice is BackendName.STAGED else "copies runs of rows")
        raise ValueError(
            f"io_backend '{choice.value}' cannot serve pools on device {device}: it {how} "
            f"with the GPU's copy engine; choose io_backend: torch or auto for CPU pools"
        )
    if choice is BackendName.DIRECT:
        return DirectBackend()
    return StagedBackend(staging_tokens)
