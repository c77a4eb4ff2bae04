"""A stack of decoder layers with random weights: the model of ``hicache bench e2e``.

Llama-style blocks (the default shape is an 8B model's: hidden 4096, 32 query and 8 KV
heads of 128, SwiGLU MLP of 14336, bf16, 32 layers): RMS norm, fused QKV projection,
optional rotary positions, causal attention through
``torch.nn.functional.scaled_dot_product_attention`` (flash or memory-efficient kernel on a
GPU), output projection, SwiGLU MLP, residuals. There is no embedding or LM head: a forward
takes hidden states ``[T, hidden]`` and returns them, which is what the prefill of a prompt's
tokens costs up to the logits of its last token (an LM head is the same in every path timed).

Where each layer's K and V go and what it attends to is a :class:`KVAccess`: the chunk's own
rows (a prefill from scratch), or cached rows in a buffer or in hicache's device pool with
the chunk's rows appended after them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

ROPE_BASE = 500000.0
# enable_gqa (torch >= 2.5) lets the fused kernels read 8 KV heads for 32 query heads;
# older torch gets the KV heads repeated.
_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


@dataclass(frozen=True)
class DecoderSpec:
    """Shape of the stack; ``hidden == num_heads * head_dim``."""

    num_layers: int = 32
    hidden: int = 4096
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    mlp: int = 14336
    dtype: torch.dtype = torch.bfloat16
    rope: bool = False

    def __post_init__(self) -> None:
        if min(self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim,
               self.mlp) < 1:
            raise ValueError(f"every size of the decoder must be >= 1, got {self}")
        if self.hidden != self.num_heads * self.head_dim:
            raise ValueError(f"hidden {self.hidden} != num_heads {self.num_heads} x head_dim "
                             f"{self.head_dim}; pass sizes of a real model")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads "
                             f"{self.num_kv_heads}")

    @property
    def kv_size(self) -> int:
        """Elements of one token's K (or V) row in one layer."""
        return self.num_kv_heads * self.head_dim

    @property
    def kv_token_bytes(self) -> int:
        """Bytes of one token's K and V over every layer (what a load moves per token)."""
        return 2 * self.num_layers * self.kv_size * torch.finfo(self.dtype).bits // 8


TINY = DecoderSpec(num_layers=2, hidden=256, num_heads=4, num_kv_heads=2, head_dim=64, mlp=512)


class KVAccess(Protocol):
    """Where a forward's K and V rows go and what its queries attend to."""

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the chunk's ``[T, kv_heads, head_dim]`` K and V of ``layer``; return the
        ``[S, kv_heads, head_dim]`` K and V the chunk attends to (``S = cached + T``, the
        chunk's rows last)."""


class OwnKV:
    """A prefill from scratch: each layer attends to the chunk's own rows only. With
    ``keep``, each layer's ``[T, kv_heads, head_dim]`` K and V are also copied into
    ``keep[0][layer][:T]`` and ``keep[1][layer][:T]``."""

    def __init__(self, keep: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
                 ) -> None:
        self.keep = keep

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keep is not None:
            self.keep[0][layer][:k.shape[0]].copy_(k)
            self.keep[1][layer][:v.shape[0]].copy_(v)
        return k, v


class LayerWeights(NamedTuple):
    """One block's weights, ``[out, in]`` as ``F.linear`` takes them."""

    qkv: torch.Tensor  # [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
    out: torch.Tensor  # [hidden, hidden]
    gate_up: torch.Tensor  # [2 * mlp, hidden]
    down: torch.Tensor  # [hidden, mlp]


class Decoder:
    """The stack with weights drawn on ``device`` from ``seed`` (std ``1/sqrt(in)``, so the
    residual stream stays O(1) over the layers).

    Args:
        spec: the shape.
        device: where weights and activations live.
        seed: the weights' seed.
    """

    def __init__(self, spec: DecoderSpec, device: torch.device, seed: int = 0) -> None:
        self.spec = spec
        self.device = device
        gen = torch.Generator(device=device).manual_seed(seed)

        def draw(out: int, inp: int) -> torch.Tensor:
            weight = torch.empty(out, inp, dtype=spec.dtype, device=device)
            return weight.normal_(0.0, inp ** -0.5, generator=gen)

        qkv = spec.hidden + 2 * spec.kv_size
        self.layers = [LayerWeights(draw(qkv, spec.hidden), draw(spec.hidden, spec.hidden),
                                    draw(2 * spec.mlp, spec.hidden), draw(spec.hidden, spec.mlp))
                       for _ in range(spec.num_layers)]

    @property
    def size_bytes(self) -> int:
        return sum(w.numel() * w.element_size() for layer in self.layers for w in layer)

    def forward(self, x: torch.Tensor, first_position: int, kv: KVAccess) -> torch.Tensor:
        """Run ``x`` (``[T, hidden]``, the tokens at positions ``first_position ..``) through
        every layer; returns ``[T, hidden]``."""
        rope = _rope_tables(self.spec, first_position, x.shape[0], x.device) \
            if self.spec.rope else None
        for layer, weights in enumerate(self.layers):
            x = self._block(layer, weights, x, rope, kv)
        return x

    def _block(self, layer: int, w: LayerWeights, x: torch.Tensor,
               rope: tuple[torch.Tensor, torch.Tensor] | None, kv: KVAccess) -> torch.Tensor:
        spec, tokens = self.spec, x.shape[0]
        qkv = F.linear(F.rms_norm(x, (spec.hidden,)), w.qkv)
        q, k, v = qkv.split([spec.hidden, spec.kv_size, spec.kv_size], dim=1)
        q = q.view(tokens, spec.num_heads, spec.head_dim)
        k = k.view(tokens, spec.num_kv_heads, spec.head_dim)
        v = v.view(tokens, spec.num_kv_heads, spec.head_dim)
        if rope is not None:
            q, k = _apply_rope(q, *rope), _apply_rope(k, *rope)
        keys, values = kv.extend(layer, k, v)
        x = x + F.linear(attend(q, keys, values), w.out)
        gate, up = F.linear(F.rms_norm(x, (spec.hidden,)), w.gate_up).chunk(2, dim=1)
        return x + F.linear(F.silu(gate) * up, w.down)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Causal attention of ``T`` new tokens after ``S - T`` cached ones.

    Args:
        q: ``[T, heads, D]``; keys, values: ``[S, kv_heads, D]``, the new tokens' rows last.
    Returns:
        ``[T, heads * D]``: token ``i`` attends to every cached row and to new rows ``0..i``
        (the lower-right causal mask; upper-left and lower-right agree when ``S == T``).
    """
    tokens, length = q.shape[0], keys.shape[0]
    qh = q.transpose(0, 1).unsqueeze(0)
    kh, vh = keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)
    group = q.shape[1] // keys.shape[1]
    if group > 1 and not _HAS_GQA:
        kh, vh = kh.repeat_interleave(group, dim=1), vh.repeat_interleave(group, dim=1)
    gqa = group > 1 and _HAS_GQA
    if tokens == length:
        out = _sdpa(qh, kh, vh, None, is_causal=True, gqa=gqa)
    elif tokens == 1:
        out = _sdpa(qh, kh, vh, None, is_causal=False, gqa=gqa)
    else:
        out = _sdpa(qh, kh, vh, causal_lower_right(tokens, length), is_causal=False, gqa=gqa)
    return out.squeeze(0).transpose(0, 1).reshape(tokens, -1)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *,
          is_causal: bool, gqa: bool) -> torch.Tensor:
    if gqa:  # torch < 2.5 knows no enable_gqa, not even False
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                              enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)


def _rope_tables(spec: DecoderSpec, first: int, tokens: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, 1, D/2]`` cos and sin of positions ``first .. first + T - 1``, fp32."""
    inv = ROPE_BASE ** (-torch.arange(0, spec.head_dim, 2, device=device) / spec.head_dim)
    angles = torch.arange(first, first + tokens, device=device)[:, None] * inv[None, :]
    return angles.cos()[:, None, :], angles.sin()[:, None, :]


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the halves of each head of ``x`` (``[T, heads, D]``), in fp32."""
    first, second = x.float().chunk(2, dim=-1)
    rotated = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
    return rotated.to(x.dtype)
