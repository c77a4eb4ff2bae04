"""A tiny decoder with seeded random weights: the model of the reference engine.

Pre-norm transformer blocks (RMS norm without weights, rotary positions, a GELU MLP), an
untied LM head and greedy decoding over a small vocabulary. Layers listed in
``swa_layers`` attend only to the last ``window_tokens`` positions (the token itself
included); the others attend to the whole prefix.

Batch invariance by construction: every token is computed on its own, with tensors whose
shapes depend only on its position (``[1, hidden]`` projections, ``[keys, heads, head_dim]``
attention over freshly gathered rows). So a token's result depends only on its prefix,
never on which other requests share the forward or on where its KV rows live; the engine
and the dense reference agree bit for bit when they read the same KV bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F

from hicache.config import HiCacheConfig
from hicache.pools import AttentionKind

VOCAB_SIZE = 256
MLP_RATIO = 4
ROPE_BASE = 10000.0
# Sharper attention than 1/sqrt(head_dim): random weights then make tokens depend on
# their context, so a wrong KV row changes the generated text instead of vanishing in an
# average.
ATTENTION_SHARPNESS = 4.0


@dataclass(frozen=True)
class ModelSpec:
    """Shape of the tiny decoder; its KV geometry matches the config's pools."""

    num_layers: int
    num_heads: int
    head_dim: int
    swa_layers: tuple[int, ...]
    window_tokens: int | None
    kv_dtype: torch.dtype
    vocab_size: int = VOCAB_SIZE

    @classmethod
    def from_config(cls, config: HiCacheConfig) -> ModelSpec:
        """The decoder whose KV rows fill ``config``'s pools (MHA only)."""
        model = config.model
        if model.attention is not AttentionKind.MHA:
            raise ValueError(
                f"model.attention = {model.attention.value!r}: the reference engine implements "
                f"mha only; use attention: mha for the demo"
            )
        assert model.num_kv_heads is not None and model.head_dim is not None, "mha config"
        return cls(
            num_layers=model.num_layers, num_heads=model.num_kv_heads, head_dim=model.head_dim,
            swa_layers=model.swa_layer_ids, window_tokens=model.window_tokens,
            kv_dtype=model.torch_dtype,
        )

    @property
    def hidden_size(self) -> int:
        return self.num_heads * self.head_dim

    def first_key(self, layer: int, position: int) -> int:
        """First position the token at ``position`` attends to in ``layer``."""
        if layer in self.swa_layers:
            assert self.window_tokens is not None, "SWA layers need a window"
            return max(0, position - self.window_tokens + 1)
        return 0


class KVAccess(Protocol):
    """Where a forward writes and reads KV rows (the pools, or a dense reference buffer).

    The forward's new tokens are numbered ``0..n-1`` in batch order.
    """

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K and V (``[n, heads, head_dim]``, KV dtype) of the new tokens of ``layer``."""

    def gather(self, layer: int, token: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows (``[keys, heads, head_dim]``, fresh tensors) that new token ``token``
        attends to in ``layer``, oldest first, its own row last."""


class LayerWeights(NamedTuple):
    """One block's fp32 weights, ``[in, out]``: the fused Q/K/V projection ``[H, 3H]``,
    the attention output ``[H, H]`` and the MLP ``[H, 4H]``, ``[4H, H]``."""

    qkv: torch.Tensor
    out: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


class TinyDecoder:
    """Seeded random weights on ``device``; identical on every device for one seed.

    Args:
        spec: the shape.
        seed: weight seed (weights are drawn on the CPU, then moved).
        device: where the weights and activations live.
    """

    def __init__(self, spec: ModelSpec, seed: int, device: torch.device | str) -> None:
        self.spec = spec
        self.device = torch.device(device)
        gen = torch.Generator().manual_seed(seed)
        hidden, vocab = spec.hidden_size, spec.vocab_size

        def draw(*shape: int, std: float) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) * std).to(self.device)

        self.embedding = draw(vocab, hidden, std=1.0)
        self.layers = [
            LayerWeights(
                qkv=draw(hidden, 3 * hidden, std=hidden**-0.5),
                out=draw(hidden, hidden, std=hidden**-0.5),
                up=draw(hidden, MLP_RATIO * hidden, std=hidden**-0.5),
                down=draw(MLP_RATIO * hidden, hidden, std=(MLP_RATIO * hidden) ** -0.5),
            )
            for _ in range(spec.num_layers)
        ]
        self.lm_head = draw(hidden, vocab, std=hidden**-0.5)
        self._scale = ATTENTION_SHARPNESS / spec.head_dim**0.5
        self._rope = torch.empty(0, 2, spec.head_dim // 2, device=self.device)

    def forward(
        self, tokens: list[int], positions: list[int], kv: KVAccess, logit_rows: list[int]
    ) -> list[int]:
        """Run the new tokens of one forward through every layer; greedy next tokens.

        Args:
            tokens: ``n`` new token ids, batch order.
            positions: their positions in their own sequences.
            kv: KV storage of this forward (writes all ``n`` rows per layer, then reads).
            logit_rows: new-token numbers whose next token is wanted (last of a request).
        Returns:
            the argmax token after each of ``logit_rows``.
        """
        ids = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        hidden = [self.embedding[ids[i:i + 1]] for i in range(len(tokens))]  # n x [1, H]
        rope = self._rope_table(max(positions, default=0) + 1)
        rotations = [(rope[p, 0], rope[p, 1]) for p in positions]
        for layer, weights in enumerate(self.layers):
            qkv = [self._qkv(h, weights.qkv, rot)
                   for h, rot in zip(hidden, rotations, strict=True)]
            kv.write(layer, torch.cat([k for _, k, _ in qkv]), torch.cat([v for _, _, v in qkv]))
            for i, (q, _, _) in enumerate(qkv):
                keys, values = kv.gather(layer, i)
                hidden[i] = self._block(hidden[i], self._attend(q, keys, values), weights)
        return [int(torch.argmax(_rms_norm(hidden[i]) @ self.lm_head)) for i in logit_rows]

    def _qkv(
        self, h: torch.Tensor, w_qkv: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[1, H]`` -> q ``[heads, D]`` (fp32), k and v ``[1, heads, D]`` (KV dtype)."""
        spec = self.spec
        q, k, v = (_rms_norm(h) @ w_qkv).view(3, spec.num_heads, spec.head_dim)
        k = _rotate(k, rotation).to(spec.kv_dtype)
        return _rotate(q, rotation), k.unsqueeze(0), v.to(spec.kv_dtype).unsqueeze(0)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """q ``[heads, D]`` over ``[keys, heads, D]`` rows -> ``[1, H]``."""
        scores = torch.einsum("hd,nhd->hn", q, keys.float()) * self._scale
        out = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), values.float())
        return out.reshape(1, -1)

    @staticmethod
    def _block(h: torch.Tensor, attn: torch.Tensor, w: LayerWeights) -> torch.Tensor:
        """Residual adds of the attention output and the MLP; ``[1, H]`` in and out."""
        h = h + attn @ w.out
        return h + F.gelu(_rms_norm(h) @ w.up) @ w.down

    def _rope_table(self, num_positions: int) -> torch.Tensor:
        """``[positions, 2, D/2]`` cos and sin, computed once in fp64 on the CPU and grown
        by doubling, so a position's rotation never depends on the table's size."""
        if num_positions > self._rope.shape[0]:
            size = max(num_positions, 2 * self._rope.shape[0], 256)
            half = self.spec.head_dim // 2
            inv_freq = ROPE_BASE ** (-torch.arange(half, dtype=torch.float64) / half)
            angles = torch.arange(size, dtype=torch.float64)[:, None] * inv_freq[None, :]
            table = torch.stack([angles.cos(), angles.sin()], dim=1)
            self._rope = table.to(torch.float32).to(self.device)
        return self._rope


def _rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + 1e-6)


def _rotate(x: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotary embedding of ``[heads, D]`` (halves rotated as pairs)."""
    cos, sin = rotation
    first, second = x.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)
