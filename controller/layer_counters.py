"""Per-layer completion counters: a layer-wise load in one kernel launch, each layer ready on
its own.

A layer-wise load through the ``kernel`` backend was one launch per layer group
(:mod:`.load_groups`), each with its event: 7 launches for a 256-token load of 32 layers,
13 for a big one, at 15-26 us of CPU each on an H200 host, so a small load's issue took
longer than its transfer. A counted load is two launches: layer 0 alone (its event recorded
after it, as before), then every other layer in one launch whose programs go layer by layer
and add 1 to their layer's counter (an int32 in device memory) for every block they store.
A layer is in place when its counter has grown by the launch's items per layer, so its event
becomes "this counter reaches this value", and a stream waits on it with the driver's
stream wait on a 32-bit value (``cuStreamWaitValue32``, greater-or-equal, a comparison that
ignores wraparound): one call of about 3 us, no record per layer on the load stream.

Counters only grow: :class:`LayerCounters` keeps, on the CPU, what every launch issued so far
on its stream adds, so a layer's target is known when its launch is issued (launches on one
stream run in issue order). Each event's ``query`` and ``synchronize`` use the load's last
event (recorded after the launch), which fires once every layer is in place: a CPU never
sees a layer ready too early, only, between the two, a little late.

Without the driver's call (a driver that lacks it, a CPU, ``HICACHE_LAYER_COUNTERS=0`` in
the environment), loads keep their layer groups and events, as before. A wait whose driver
call fails waits on the load's last event instead (correct, later) and turns counted loads
off for the process.
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Any

import torch

logger = logging.getLogger(__name__)

ENV = "HICACHE_LAYER_COUNTERS"
_GEQ = 0  # CU_STREAM_WAIT_VALUE_GEQ: (int32_t)(*addr - value) >= 0
_INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT: the calling thread has none current
_MASK = 0xFFFFFFFF

# the driver's call once found; False once known to be missing or turned off
_wait_value: Any = None


def counters_enabled() -> bool:
    """True when counted loads can run here: the driver has the stream wait on a 32-bit value
    and ``HICACHE_LAYER_COUNTERS`` is not ``0``."""
    global _wait_value
    if _wait_value is None:
        _wait_value = _find_wait_value()
    return _wait_value is not False


def wait_value(raw_stream: int, address: int, value: int) -> bool:
    """Make the stream of raw handle ``raw_stream`` wait until the int32 at device
    ``address`` reaches ``value`` (modulo 2**32, ignoring wraparound); False, with counted
    loads turned off, when the driver refuses (the caller then waits some other way)."""
    global _wait_value
    call = _wait_value
    if call is None or call is False:
        return False
    result = call(raw_stream, address, value & _MASK, _GEQ)
    if result == _INVALID_CONTEXT:  # a thread with no CUDA context current yet: bind, retry
        _bind_context()
        result = call(raw_stream, address, value & _MASK, _GEQ)
    if result != 0:
        _wait_value = False
        logger.warning("layer counters: the driver refused a stream wait on a value "
                       "(CUresult %d); layer-wise loads use one event per layer group from "
                       "now on", result)
        return False
    return True


def _bind_context() -> None:
    """Make the current device's primary context current on this thread (the runtime's
    device call does; a driver call does not)."""
    torch.cuda.set_device(torch.cuda.current_device())


def _find_wait_value() -> Any:
    if os.environ.get(ENV, "1") == "0" or not torch.cuda.is_available():
        return False
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    for name in ("cuStreamWaitValue32_v2", "cuStreamWaitValue32"):
        call = getattr(driver, name, None)
        if call is not None:
            call.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            call.restype = ctypes.c_int
            return call
    return False


def check_counters(counters: torch.Tensor, like: torch.Tensor, layer_end: int) -> bool:
    """True for counters a launch of layers below ``layer_end`` may count into: a contiguous
    int32 tensor on ``like``'s device with a counter per layer; ``ValueError`` otherwise
    (the kernel would add to memory past them)."""
    if not (isinstance(counters, torch.Tensor) and counters.dtype == torch.int32
            and counters.device == like.device and counters.dim() == 1
            and counters.is_contiguous() and counters.numel() >= layer_end):
        got = (f"{counters.dtype} {tuple(counters.shape)} on {counters.device}"
               if isinstance(counters, torch.Tensor) else type(counters).__name__)
        raise ValueError(f"transfer_rows: counters must be a contiguous 1-D int32 tensor of "
                         f">= {layer_end} layers on {like.device}, got {got}")
    return True


class LayerCounters:
    """One int32 counter per model layer for the counted loads of one load stream, and what
    the launches issued on it so far add to each (the targets of their waits).

    Args:
        num_layers: model layers of the loads.
        device: the CUDA device of the load stream.
    """

    def __init__(self, num_layers: int, device: torch.device) -> None:
        self.tensor = torch.zeros(num_layers, dtype=torch.int32, device=device)
        self._base = self.tensor.data_ptr()
        self._issued = [0] * num_layers  # modulo 2**32, as the counters wrap

    def __len__(self) -> int:
        return len(self._issued)

    def resync(self, stream: torch.cuda.Stream | None) -> None:
        """After a counted issue that raised: wait for ``stream`` (the load stream, where
        every counted launch runs) and take what the counters hold as what was issued, so
        a launch that went before the error does not make later waits fire early."""
        if stream is not None:
            stream.synchronize()
        self._issued = [value & _MASK for value in self.tensor.tolist()]

    def issued(self, layers: range, per_layer: int) -> list[tuple[int, int]]:
        """Count a launch just issued that adds ``per_layer`` to each of ``layers``: per
        layer, the counter's address and the value it holds once that launch's rows are in
        place."""
        issued, base, out = self._issued, self._base, []
        for layer in layers:
            target = issued[layer] = (issued[layer] + per_layer) & _MASK
            out.append((base + 4 * layer, target))
        return out
