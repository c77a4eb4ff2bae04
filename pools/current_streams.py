"""The calling thread's current CUDA stream, found by its raw handle: the ``torch.cuda.Stream``
of each handle is made once, where ``torch.cuda.current_stream()`` costs 8-10 us of CPU per
call (measured on an H200 host). Shared by the controller's stream waits and side streams
and by the index uploads."""

from __future__ import annotations

from collections.abc import Callable

import torch


class CurrentStreams:
    """The calling thread's current CUDA stream on one device, found by its raw handle, its
    ``torch.cuda.Stream`` made once per handle: ``torch.cuda.current_stream()`` costs
    microseconds per call."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self.index = device.index if device.index is not None else (
            torch.cuda.current_device() if device.type == "cuda" else -1)
        self._streams: dict[int, torch.cuda.Stream] = {}
        # the raw handle of a device's current stream (not in a CPU-only build of torch)
        self.raw_of: Callable[[int], int] = getattr(torch._C, "_cuda_getCurrentRawStream",
                                                    _no_cuda)

    def raw(self) -> int:
        """The current stream's raw handle."""
        return self.raw_of(self.index)

    def current(self) -> torch.cuda.Stream:
        """The current stream (:meth:`raw`, then :meth:`stream`)."""
        return self.stream(self.raw_of(self.index))

    def stream(self, raw: int) -> torch.cuda.Stream:
        """The current stream, whose handle :meth:`raw` just gave."""
        stream = self._streams.get(raw)
        if stream is None:
            stream = self._streams[raw] = torch.cuda.current_stream(self._device)
        return stream


def _no_cuda(index: int) -> int:
    raise RuntimeError(f"no current CUDA stream of device {index}: this torch has no CUDA")
