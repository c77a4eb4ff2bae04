"""The CUDA libraries this process has mapped (those torch loaded), found by file name: the
runtime for 2D copies (:mod:`.copy2d`), NVRTC for the page copy kernel
(:mod:`.page_kernel`). Opening the copy torch already uses avoids loading a second one."""

from __future__ import annotations

from pathlib import Path


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
