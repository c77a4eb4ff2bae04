"""Device KV pool: per-layer K and V rows (MHA) or one latent row (MLA), allocated once.

Storage is one tensor ``data`` of shape ``[components, layers, slots, row_elems]``
(components = 2 for MHA: K then V; 1 for MLA), so a layer's rows are one contiguous
``[slots, row_elems]`` block and every accessor is a view.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .base import PADDING_SLOT, AttentionKind, IndexSpace, Indices, check_indices

LayerWaiter = Callable[[int], None]


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

    @property
    def num_components(self) -> int:
        return 2 if self.kind is AttentionKind.MHA else 1

    @property
    def row_elems(self) -> int:
        if self.kind is AttentionKind.MHA:
            return self.num_kv_heads * self.head_dim
        return self.latent_dim

    @property
    def row_bytes(self) -> int:
        """Bytes of one component of one token in one layer."""
        return self.row_elems * torch.empty((), dtype=self.dtype).element_size()

    def token_bytes(self, num_layers: int) -> int:
        """Bytes of one token over all components of ``num_layers`` layers."""
        return self.row_bytes * self.num_components * num_layers


class DeviceKVPool:
    """KV rows of ``num_layers`` layers for ``num_slots`` slots on one device.

    Args:
        name: used in error messages and metrics (``full``, ``swa``).
        space: ``DEVICE_FULL`` or ``DEVICE_SWA``: the only index space it accepts.
        num_layers: layers stored here (local layer ids ``0..num_layers-1``).
        num_slots: slots including the reserved padding page.
        geometry: row shape and dtype.
        device: where the rows live.
    """

    def __init__(
        self,
        *,
        name: str,
        space: IndexSpace,
        num_layers: int,
        num_slots: int,
        geometry: RowGeometry,
        device: torch.device | str,
    ) -> None:
        if space.is_host:
            raise ValueError(f"device pool '{name}' cannot use host space {space.name}")
        self.name = name
        self.space = space
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.geometry = geometry
        self.data = torch.zeros(
            (geometry.num_components, num_layers, num_slots, geometry.row_elems),
            dtype=geometry.dtype,
            device=torch.device(device),
        )
        # The tensor's device carries the index ("cuda" -> "cuda:0"), as every tensor's does;
        # comparing against a bare "cuda" would reject every index on the GPU.
        self.device = self.data.device
        self._layer_waiter: LayerWaiter | None = None

    @property
    def size_bytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def register_layer_waiter(self, waiter: LayerWaiter | None) -> None:
        """Every attention accessor calls ``waiter(layer)`` before touching a layer, so a
        layer-wise load is waited on by construction (``CacheController.wait_until``)."""
        self._layer_waiter = waiter

    def check(self, indices: Indices, op: str) -> torch.Tensor:
        """Validate indices of this pool (space, dtype, device, debug bounds)."""
        return check_indices(
            indices, space=self.space, pool_name=self.name, num_slots=self.num_slots,
            device=self.device, op=op,
        )

    def layer_rows(self, component: int, layer: int) -> torch.Tensor:
        """Raw ``[num_slots, row_elems]`` view for the transfer engine (no layer wait)."""
        return self.data[component, layer]

    def key_buffer(self, layer: int) -> torch.Tensor:
        """``[num_slots, num_kv_heads, head_dim]`` K of ``layer`` (MHA); waits on loads."""
        self._require(AttentionKind.MHA, "key_buffer")
        self._wait(layer)
        return self._heads_view(self.data[0, layer])

    def value_buffer(self, layer: int) -> torch.Tensor:
        """``[num_slots, num_kv_heads, head_dim]`` V of ``layer`` (MHA); waits on loads."""
        self._require(AttentionKind.MHA, "value_buffer")
        self._wait(layer)
        return self._heads_view(self.data[1, layer])

    def latent_buffer(self, layer: int) -> torch.Tensor:
        """``[num_slots, latent_dim]`` latent rows of ``layer`` (MLA); waits on loads."""
        self._require(AttentionKind.MLA, "latent_buffer")
        self._wait(layer)
        return self.data[0, layer]

    def set_kv(
        self, layer: int, locs: Indices, k: torch.Tensor, v: torch.Tensor | None = None
    ) -> None:
        """Write new tokens' rows of ``layer``.

        Args:
            layer: local layer id.
            locs: ``[n]`` slots in this pool's space, on this pool's device.
            k: ``[n, num_kv_heads, head_dim]`` (MHA) or ``[n, latent_dim]`` (MLA), pool dtype.
            v: ``[n, num_kv_heads, head_dim]`` for MHA; must be ``None`` for MLA.

        Rows aimed at the padding slot are written there and then cleared, so padding never
        holds garbage that a masked attention tile could read as NaN.
        """
        index = self.check(locs, f"set_kv(layer={layer})")
        self._check_layer(layer)
        if self.geometry.kind is AttentionKind.MLA and v is not None:
            raise ValueError(f"set_kv on MLA pool '{self.name}': pass only k (the latent row)")
        if self.geometry.kind is AttentionKind.MHA and v is None:
            raise ValueError(f"set_kv on MHA pool '{self.name}': v is required")
        rows = [k] if v is None else [k, v]
        # Check every component before writing any, so a bad v leaves K untouched.
        flats = [self._check_rows(value, index.numel(), c) for c, value in enumerate(rows)]
        self._wait(layer)
        if index.numel() == 0:
            return
        for component, flat in enumerate(flats):
            self.data[component, layer].index_copy_(0, index.to(torch.int64), flat)
            self.data[component, layer, PADDING_SLOT].zero_()

    def _check_rows(self, value: torch.Tensor, num_rows: int, component: int) -> torch.Tensor:
        expected = self.geometry.row_elems
        # flatten, not reshape(n, -1): the latter fails on an empty batch
        flat = value.flatten(1) if value.dim() > 1 else value
        if flat.shape != (num_rows, expected):
            raise ValueError(
                f"set_kv on pool '{self.name}': component {component} must hold {num_rows} "
                f"rows of {expected} elements, got shape {tuple(value.shape)}"
            )
        if value.dtype != self.geometry.dtype or value.device != self.device:
            raise ValueError(
                f"set_kv on pool '{self.name}': rows must be {self.geometry.dtype} on "
                f"{self.device}, got {value.dtype} on {value.device}"
            )
        return flat

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise ValueError(
                f"pool '{self.name}': layer {layer} out of range (0..{self.num_layers - 1})"
            )

    def _require(self, kind: AttentionKind, accessor: str) -> None:
        if self.geometry.kind is not kind:
            raise ValueError(
                f"{accessor} needs a {kind.value} pool; pool '{self.name}' is "
                f"{self.geometry.kind.value}"
            )

    def _wait(self, layer: int) -> None:
        self._check_layer(layer)  # a negative layer would silently alias the last one
        if self._layer_waiter is not None:
            self._layer_waiter(layer)

    def _heads_view(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.view(self.num_slots, self.geometry.num_kv_heads, self.geometry.head_dim)
