"""Whether a device (``--device``, ``device_pool.device``) names one and exists here.

:func:`device_form_problem` is the check of the form (``cpu``, ``cuda`` or ``cuda:N``, as the
config accepts); :func:`missing_device` asks this machine whether a well-formed device is
on it. Neither allocates anything on a GPU.
"""

from __future__ import annotations

import re

import torch

_DEVICE = re.compile(r"cpu|cuda(:[0-9]+)?")


def device_form_problem(text: str) -> str | None:
    """Why ``text`` is not a device name (with the fix), or ``None``."""
    if _DEVICE.fullmatch(text):
        return None
    if _DEVICE.fullmatch(text.lower()):
        return f"not a device; write it in lower case, {text.lower()}"
    return "not a device; use cpu, cuda or cuda:N"


def missing_device(text: str) -> str | None:
    """Why the well-formed device ``text`` is not on this machine, or ``None`` (``cpu``, or
    a CUDA device that exists)."""
    if not text.startswith("cuda"):
        return None
    if not torch.cuda.is_available():
        return "CUDA is not available on this machine"
    count = torch.cuda.device_count()
    _, _, index = text.partition(":")
    if index and int(index) >= count:
        return (f"this machine has {count} CUDA device{'s' if count != 1 else ''} "
                f"(cuda:0 to cuda:{count - 1})")
    return None


__all__ = ["device_form_problem", "missing_device"]
