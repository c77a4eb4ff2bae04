"""The CUDA libraries this process has mapped (those torch loaded), found by file name: the
runtime for 2D copies (:mod:`.copy2d`) and hicache's own streams (:mod:`.stream_pool`),
NVRTC for the page copy kernel (:mod:`.page_kernel`). Opening the copy torch already uses
avoids loading a second one."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch


def mapped_libraries(prefix: str) -> list[str]:
    """Paths of the files mapped into this process whose name starts with ``prefix`` (the
    libraries torch loaded: ``libcudart``, ``libnvrtc``)."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return []
    found: list[str] = []
    for line in maps.read_text().splitlines():
        path = line.split()[-1] if line.split() else ""
        if Path(path).name.startswith(prefix) and path not in found:
            found.append(path)
    return found


@functools.cache
def cuda_runtime() -> ctypes.CDLL | None:
    """The CUDA runtime library torch uses (its callers type the functions they call);
    ``None`` when CUDA is unavailable or no runtime library can be opened."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    for name in [*mapped_libraries("libcudart"), "libcudart.so", "libcudart.so.13",
                 "libcudart.so.12"]:
        try:
            library = ctypes.CDLL(name)
            library.cudaStreamCreateWithFlags  # noqa: B018 (a runtime, not a namesake)
        except (OSError, AttributeError):
            continue
        return library
    return None
