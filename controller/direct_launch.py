"""Launching a compiled Triton kernel again without the JIT front end.

Triton's JIT binds and specialises every argument of every launch and looks the kernel up
by that specialisation: measured on an H100 host, about 30 us of Python per launch of the
row kernel in a loop, 50-100 us between a load's other calls. A layer-wise load launches
the same row copy once per layer group with only the layer range changed, which the kernel
leaves unspecialised: the kernel the first launch found serves the others, called through
the launcher Triton built for it (:class:`DirectLaunch`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)


class DirectLaunch:
    """A compiled kernel launched without Triton's JIT front end: the launcher Triton built
    for it, called with every argument in signature order (the constexprs included, as the
    JIT passes them) on the current stream of the kernel's device.

    Only a copy's launches after its first use it: same buffers, index tensors, dtypes and
    strides, so the same specialisation, except the layer range, which the kernel does not
    specialise. Should this Triton's compiled kernels not take such a call (an API that
    changed: the call raises before anything is launched), direct launches are turned off
    for the process and every launch goes through the JIT as before."""

    enabled = True

    def __init__(self, compiled: Any, device: torch.device) -> None:
        self._compiled = compiled
        self._index = device.index if device.index is not None else torch.cuda.current_device()

    @classmethod
    def of(cls, compiled: Any, device: torch.device) -> DirectLaunch | None:
        """A direct launcher for what a JIT launch returned, if it is a compiled kernel that
        can be launched again (not under the interpreter)."""
        if not cls.enabled or not hasattr(compiled, "__getitem__") or not hasattr(
                compiled, "function"):
            return None
        return cls(compiled, device)

    def launch(self, grid: int, args: tuple[Any, ...]) -> bool:
        """Launch on ``grid`` programs; ``False`` (nothing launched) where another device
        is current or this Triton refuses the call (direct launches off from then on)."""
        if not DirectLaunch.enabled or torch.cuda.current_device() != self._index:
            return False  # another current device: the JIT launch switches to the copy's
        try:
            self._compiled[(grid, 1, 1)](*args, stream=_raw_stream(self._index))
        except (TypeError, IndexError, AttributeError) as exc:
            DirectLaunch.enabled = False
            logger.warning("direct kernel launches are off (this Triton refused one: %s); "
                           "every launch goes through the JIT", exc)
            return False
        return True


def _raw_stream(index: int | None) -> int:
    """The handle of the current CUDA stream of device ``index`` (what Triton's JIT passes
    its launcher), without building a ``torch.cuda.Stream``."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return int(raw(index))
    return int(torch.cuda.current_stream(index).cuda_stream)
