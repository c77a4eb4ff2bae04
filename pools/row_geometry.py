"""What one token's row looks like in one layer of a pool: shared by the device and host
pools, the transfer backends and the config's sizing."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .base import AttentionKind


@dataclass(frozen=True)
class RowGeometry:
    """What one token's row looks like in one layer of a pool.

    Args:
        kind: MHA (K and V of ``num_kv_heads * head_dim``) or MLA (one ``latent_dim`` row).
        num_kv_heads, head_dim: MHA shape (ignored for MLA).
        latent_dim: MLA row width (ignored for MHA).
        dtype: element dtype of the KV rows.
    """

    kind: AttentionKind
    num_kv_heads: int
    head_dim: int
    latent_dim: int
    dtype: torch.dtype

    # cached: the transfer path reads them per op, and the fields never change
    @functools.cached_property
    def num_components(self) -> int:
        return 2 if self.kind is AttentionKind.MHA else 1

    @functools.cached_property
    def row_elems(self) -> int:
        if self.kind is AttentionKind.MHA:
            return self.num_kv_heads * self.head_dim
        return self.latent_dim

    @functools.cached_property
    def row_bytes(self) -> int:
        """Bytes of one component of one token in one layer."""
        return self.row_elems * self.dtype.itemsize

    def token_bytes(self, num_layers: int) -> int:
        """Bytes of one token over all components of ``num_layers`` layers."""
        return self.row_bytes * self.num_components * num_layers
