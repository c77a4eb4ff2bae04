"""Triton kernels compiled on first use: :func:`jit_or_none` imports Triton when a kernel is
first wanted, binds ``tl`` in the kernel's module (where the kernel body resolves it), and
gives ``None`` without Triton, so callers take their torch path."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def jit_or_none(kernel: Callable[..., Any]) -> Any:
    """``triton.jit(kernel)`` with ``tl`` bound in ``kernel``'s module; ``None`` when Triton
    cannot be imported."""
    try:
        import triton
        import triton.language as language
    except ImportError:
        return None
    kernel.__globals__["tl"] = language
    return triton.jit(kernel)
