"""hicache's own CUDA streams, apart from torch's stream pool.

``torch.cuda.Stream()`` does not make a stream: it hands out one of 32 per device and
priority, round robin. An engine that makes torch streams of its own (a forward stream, a
copy stream) would, once 32 were handed out between its and hicache's, hold one of the
cache's side or copy streams, and its work would queue behind a whole load or write-back:
the transfer bench's 64 KiB engine copy after a 32k-token load waited 78-84 ms, the load's
whole length, in the cases where the counts lined up so. The cache's streams come from a
pool of its own instead: non-blocking streams (they never wait for the legacy default
stream) made through the CUDA runtime torch loaded, up to :data:`POOL_SIZE` per device,
handed out round robin, never destroyed (as torch never destroys its own: the caching
allocator may hold uses of blocks recorded on them for as long as the process runs).
"""

from __future__ import annotations

import ctypes
import logging
import threading

import torch

from .cuda_libraries import cuda_runtime

logger = logging.getLogger(__name__)

POOL_SIZE = 32
CUDA_STREAM_NON_BLOCKING = 1  # cudaStreamNonBlocking


class StreamPool:
    """Up to :data:`POOL_SIZE` streams per device, each made the first time its turn comes,
    handed out round robin (a controller's streams, made one after another, are distinct).
    Thread-safe."""

    def __init__(self) -> None:
        self._streams: dict[int, list[torch.cuda.Stream]] = {}
        self._turns: dict[int, int] = {}
        self._lock = threading.Lock()

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        """The next stream of ``device`` (a CUDA device)."""
        if device.type != "cuda":
            raise ValueError(f"a stream needs a CUDA device, got {device}; on a CPU pool "
                             f"copies run at once and need none")
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            streams = self._streams.setdefault(index, [])
            turn = self._turns.get(index, 0)
            if turn == len(streams):  # a refused creation leaves the turn where it was
                streams.append(_new_stream(index))
            self._turns[index] = (turn + 1) % POOL_SIZE
            return streams[turn]


def _new_stream(index: int) -> torch.cuda.Stream:
    device = torch.device("cuda", index)
    runtime = cuda_runtime()
    if runtime is None:
        logger.warning("no CUDA runtime library found to make hicache's own streams; using "
                       "torch's stream pool, which may hand the engine's streams to the cache")
        return torch.cuda.Stream(device)
    create = runtime.cudaStreamCreateWithFlags
    create.restype = ctypes.c_int
    create.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
    handle = ctypes.c_void_p()
    with torch.cuda.device(index):  # the runtime makes a stream on the current device
        status = create(ctypes.byref(handle), CUDA_STREAM_NON_BLOCKING)
    if status != 0 or not handle.value:
        raise RuntimeError(f"cudaStreamCreateWithFlags failed with error {status} on {device}; "
                           f"the device may be out of resources or in an error state")
    return torch.cuda.ExternalStream(handle.value, device=device)


_POOL = StreamPool()


def cache_stream(device: torch.device) -> torch.cuda.Stream:
    """A stream of hicache's own on ``device`` (a CUDA device), never one that
    ``torch.cuda.Stream()`` hands out."""
    return _POOL.stream(device)


def stream_beside(side: torch.cuda.Stream | None) -> torch.cuda.Stream | None:
    """A stream of hicache's own on ``side``'s device (``None`` for no side stream: a CPU)."""
    return None if side is None else cache_stream(side.device)
