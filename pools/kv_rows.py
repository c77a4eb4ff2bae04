"""The rows a device pool's ``set_kv`` writes, checked before any of them is written.

A forward calls ``set_kv`` once per layer on the engine's scheduler thread, so the check runs
per layer of every forward, and on a launch-bound step (a decode, a short prefill) its CPU
time is the step's time. The rows an attention layer produces, ``[n, num_kv_heads,
head_dim]`` (MHA) or ``[n, latent_dim]`` (MLA), already have the shape of the pool's buffer
views (``key_buffer``, ``latent_buffer``), so they are written into those views as they are:
comparisons of the shape, dtype and device, and no ``flatten`` (a tensor op, about a
microsecond and a half of CPU on a fast host, twice a layer). Rows of any other shape that
hold the same elements per token (``[n, num_kv_heads * head_dim]``) are reshaped first;
anything else is refused with the shape, dtype or device it should have.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .base import AttentionKind

if TYPE_CHECKING:
    from .device import DeviceKVPool


def checked_kv_rows(pool: DeviceKVPool, num_rows: int, k: torch.Tensor,
                    v: torch.Tensor | None) -> list[torch.Tensor]:
    """``k`` (and ``v`` for MHA) as ``[num_rows, *pool.slot_shape]`` tensors of the pool's
    dtype on its device, every one checked before the caller writes any (a bad ``v`` leaves
    K untouched).

    Raises:
        TypeError: ``k`` or ``v`` is not a tensor.
        ValueError: ``v`` given to an MLA pool or missing for an MHA pool; rows of another
            count or width, dtype or device.
    """
    kind = pool.geometry.kind
    if v is None:
        if kind is AttentionKind.MHA:
            raise ValueError(f"set_kv on MHA pool '{pool.name}': v is required")
        return [_slot_rows(pool, k, num_rows, 0)]
    if kind is AttentionKind.MLA:
        raise ValueError(f"set_kv on MLA pool '{pool.name}': pass only k (the latent row)")
    return [_slot_rows(pool, k, num_rows, 0), _slot_rows(pool, v, num_rows, 1)]


def _slot_rows(pool: DeviceKVPool, value: torch.Tensor, num_rows: int, component: int
               ) -> torch.Tensor:
    """One component's rows as ``[num_rows, *pool.slot_shape]``, checked."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"set_kv on pool '{pool.name}': {'kv'[component]} must be a "
                        f"torch.Tensor, got {type(value).__name__}")
    shape = value.shape
    if shape[1:] != pool.slot_shape or shape[0] != num_rows:  # a 0-d tensor fails the first
        value = _reshaped(pool, value, num_rows, component)
    on_device = (value.get_device() == pool.device_index if pool.device_index >= 0
                 else value.is_cpu)
    if value.dtype is not pool.geometry.dtype or not on_device:
        raise ValueError(
            f"set_kv on pool '{pool.name}': rows must be {pool.geometry.dtype} on "
            f"{pool.device}, got {value.dtype} on {value.device}"
        )
    return value


def _reshaped(pool: DeviceKVPool, value: torch.Tensor, num_rows: int, component: int
              ) -> torch.Tensor:
    """Rows of another shape with ``row_elems`` elements per token, as the slot shape."""
    expected = pool.geometry.row_elems
    # flatten, not reshape(n, -1): the latter fails on an empty batch
    flat = value.flatten(1) if value.dim() > 1 else value
    if flat.shape != (num_rows, expected):
        raise ValueError(
            f"set_kv on pool '{pool.name}': component {component} must hold {num_rows} "
            f"rows of {expected} elements, got shape {tuple(value.shape)}"
        )
    return flat.reshape(num_rows, *pool.slot_shape)
