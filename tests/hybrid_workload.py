"""What the randomized hybrid run (``hybrid_driver``) feeds the cache and what rows it expects:
the service's configuration, the token sequences, and the value of every KV row.

Rows are derived from the token prefix, the position and the layer: the rolling code of
``radix_helpers.prefix_codes`` (one per position, a hash of the prefix ending there) times 64
plus an offset per component, layer and element. Full rows are that value, SWA rows its
negation minus one, so a row of another sequence, position, layer or pool never compares
equal (up to a collision of the 16-bit codes, which can only hide a corruption).
"""

from __future__ import annotations

import random

import torch
from radix_helpers import GEOMETRY

from hicache.config import HiCacheConfig, config_from_dict

PAGE = 4
VOCAB = 50_000


def make_config(write_policy: str, window_tokens: int, swa_history: str = "all") -> HiCacheConfig:
    """3 layers (layer 1 sliding-window), pages of 4 tokens, a 192-token device pool with
    96 SWA tokens, host pools of twice the device's full tokens, no load-back threshold."""
    return config_from_dict(
        {
            "page_size_tokens": PAGE,
            "model": {
                "num_layers": 3,
                "attention": "mha",
                "num_kv_heads": 1,
                "head_dim": 2,
                "dtype": "float32",
                "swa_layers": [1],
                "window_tokens": window_tokens,
            },
            "device_pool": {"num_tokens": 192, "swa_num_tokens": 96, "device": "cpu"},
            "host": {"ratio": 2.0, "ram_reserve_gib": 0.0, "swa_history": swa_history},
            "controller": {
                "io_backend": "torch",
                "write_policy": write_policy,
                "load_back_threshold_tokens": 0,
            },
            "service": {"metrics_enabled": False},
        }
    )


class Workload:
    """Token sequences that share prefixes as chat traffic does: a few system prompts,
    multi-turn continuations, cuts of earlier sequences (an edited turn, a regenerated
    answer) and unrelated prompts. Recent conversations come back more often.

    Args:
        rng: the run's random source.
        max_tokens: the longest sequence (prompt and generated tokens).
        num_system: system prompts.
        keep: finished sequences that later requests continue or cut.
    """

    def __init__(
        self, rng: random.Random, max_tokens: int, num_system: int = 6, keep: int = 48
    ) -> None:
        self.rng = rng
        self.max_tokens = max_tokens
        self.keep = keep
        self.system = [self._fresh(rng.randint(8, 40)) for _ in range(num_system)]
        self.history: list[list[int]] = []

    def next(self) -> tuple[list[int], int]:
        """(prompt followed by the tokens the request will generate, prompt length)."""
        rng, kind = self.rng, self.rng.random()
        if self.history and kind < 0.45:
            prompt = self._recent() + self._fresh(rng.randint(2, 16))
        elif self.history and kind < 0.7:
            earlier = self._recent()
            prompt = earlier[: rng.randint(1, len(earlier))] + self._fresh(rng.randint(0, 10))
        elif kind < 0.92:
            prompt = rng.choice(self.system) + self._fresh(rng.randint(4, 24))
        else:
            prompt = self._fresh(rng.randint(4, 40))
        generated = self._fresh(rng.randint(1, 12))
        if len(prompt) < 2 or len(prompt) + len(generated) > self.max_tokens:
            prompt = rng.choice(self.system) + self._fresh(rng.randint(2, 16))
        return prompt + generated, len(prompt)

    def finished(self, tokens: list[int]) -> None:
        """``tokens`` (prompt and generated) can be continued or cut by later requests."""
        self.history.append(tokens)
        del self.history[: -self.keep]

    def _recent(self) -> list[int]:
        back = min(int(self.rng.expovariate(1 / 8)), len(self.history) - 1)
        return self.history[-1 - back]

    def _fresh(self, num_tokens: int) -> list[int]:
        return [self.rng.randrange(1, VOCAB) for _ in range(num_tokens)]


class RowValues:
    """The expected rows of a hybrid pool's full and SWA sub-pools.

    Args:
        full_layers / swa_layers: layers of each sub-pool.
    """

    def __init__(self, full_layers: int, swa_layers: int) -> None:
        self._grids = {False: _grid(full_layers), True: _grid(swa_layers)}

    def rows(self, codes: torch.Tensor, swa: bool) -> torch.Tensor:
        """``[n, components, layers, row]`` float32 rows of the positions whose prefix codes
        are ``codes`` (``[n]`` float32), for the SWA or the full sub-pool."""
        rows = codes[:, None, None, None] * 64 + self._grids[swa][None]
        return -rows - 1 if swa else rows


def _grid(num_layers: int) -> torch.Tensor:
    """``[components, layers, row]`` offsets of each element (as ``radix_helpers``)."""
    c, r = GEOMETRY.num_components, GEOMETRY.row_elems
    return (
        torch.arange(c)[:, None, None] * 16
        + torch.arange(num_layers)[None, :, None] * 4
        + torch.arange(r)[None, None, :]
    ).to(torch.float32)
