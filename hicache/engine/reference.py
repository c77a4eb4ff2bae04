"""The baseline: every conversation run alone over a dense KV buffer that holds everything.

Nothing is evicted, nothing is paged, nothing is shared between conversations: each token's
KV rows are computed once and read from a contiguous buffer. Because the model computes
every token on its own (see :mod:`hicache.engine.model`), the engine must reproduce these
tokens exactly; any difference means some KV row the engine read was not the row it wrote.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .model import ModelSpec, TinyDecoder
from .workload import Conversation, Workload

TurnKey = tuple[int, int]  # (conversation, turn index)


class DenseKV:
    """One sequence's K and V rows per layer, ``[capacity, heads, D]`` each, in KV dtype.

    A forward appends its new tokens at positions ``length .. length + n - 1``.
    """

    def __init__(self, spec: ModelSpec, capacity: int, device: torch.device) -> None:
        shape = (spec.num_layers, capacity, spec.num_heads, spec.head_dim)
        self.spec = spec
        self.keys = torch.zeros(shape, dtype=spec.kv_dtype, device=device)
        self.values = torch.zeros(shape, dtype=spec.kv_dtype, device=device)
        self.length = 0
        self._num_new = 0

    def begin(self, num_new: int) -> None:
        """Start a forward of ``num_new`` tokens (after the previous one's :meth:`commit`)."""
        if self.length + num_new > self.keys.shape[1]:
            raise ValueError(f"dense KV of {self.keys.shape[1]} tokens is full")
        self._num_new = num_new

    def commit(self) -> None:
        self.length += self._num_new
        self._num_new = 0

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        end = self.length + k.shape[0]
        self.keys[layer, self.length:end] = k
        self.values[layer, self.length:end] = v

    def gather(self, layer: int, token: int) -> tuple[torch.Tensor, torch.Tensor]:
        position = self.length + token
        first = self.spec.first_key(layer, position)
        index = torch.arange(first, position + 1, device=self.keys.device)
        return self.keys[layer][index], self.values[layer][index]


def reference_tokens(
    model: TinyDecoder, workload: Workload,
    on_progress: Callable[[int, int], None] | None = None,
) -> dict[TurnKey, list[int]]:
    """Greedy tokens of every turn of every conversation, computed without any cache.

    ``on_progress(done, total)`` is called with the turns done after each conversation.
    """
    expected: dict[TurnKey, list[int]] = {}
    for conversation in workload.conversations:
        expected.update(_run_conversation(model, conversation))
        if on_progress is not None:
            on_progress(len(expected), workload.num_turns)
    return expected


def _run_conversation(model: TinyDecoder, conversation: Conversation) -> dict[TurnKey, list[int]]:
    kv = DenseKV(model.spec, conversation.max_tokens(), model.device)
    history = list(conversation.system_tokens)
    out: dict[TurnKey, list[int]] = {}
    for turn in conversation.turns:
        history += turn.user_tokens
        generated: list[int] = []
        pending = history[kv.length:]  # the previous turn's last token has no KV yet
        while len(generated) < turn.max_new_tokens:
            kv.begin(len(pending))
            positions = list(range(kv.length, kv.length + len(pending)))
            (token,) = model.forward(pending, positions, kv, [len(pending) - 1])
            kv.commit()
            generated.append(token)
            pending = [token]
        history += generated
        out[(turn.conversation, turn.index)] = generated
    return out
