"""One request of the reference engine: its tokens, its slots and where its prefix came from.

Positions ``0 .. num_computed - 1`` have KV rows. The first ``len(prefix)`` of them are the
tree's (matched on the device or loaded back from the host, locked through ``lock_node``);
the rest sit in ``own_pages``, pages the engine allocated with ``alloc_device``::

    tokens     [ prompt ..................... ][ generated ... ]
    slots      [ prefix (tree) ][ own pages (engine) ........... ]
               0            len(prefix)                num_computed
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from hicache.pools import IndexSpace, Indices
from hicache.radix import TreeNode

from .workload import Turn


@dataclass(eq=False)
class Request:
    """A turn being served (see the module docstring).

    ``device_tokens`` / ``host_tokens``: prompt tokens whose KV came from the device tier /
    from a load-back; the rest of the prompt was computed. ``matched_tokens``: prompt tokens
    the tree held on either tier at admission (used or not); ``store_tokens``: those of
    ``host_tokens`` the shared store brought for this admission. ``num_swa_released``:
    leading own pages whose SWA slots were given back (they left every future window).
    """

    turn: Turn
    prompt: list[int]
    page_size: int
    lock_node: TreeNode
    prefix: Indices
    device_tokens: int
    host_tokens: int
    matched_tokens: int
    store_tokens: int = 0
    generated: list[int] = field(default_factory=list)
    own_pages: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_swa_released: int = 0

    def __post_init__(self) -> None:
        self.num_computed = len(self.prefix)

    @property
    def name(self) -> str:
        return self.turn.name

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def is_done(self) -> bool:
        return len(self.generated) >= self.turn.max_new_tokens

    @property
    def recomputed_tokens(self) -> int:
        """Cached prompt tokens computed anyway (load-back refused, SWA rows missing, or
        the last page, which must be computed for the first token's logits)."""
        return self.matched_tokens - self.device_tokens - self.host_tokens

    @property
    def new_tokens(self) -> int:
        """Prompt tokens the cache did not hold at admission (new, or evicted from both
        tiers)."""
        return len(self.prompt) - self.matched_tokens

    def page_ids(self) -> list[int]:
        """Full-pool page id of every page of the sequence, prefix first."""
        prefix = self.prefix.tensor[::self.page_size] // self.page_size
        return [int(p) for p in prefix.tolist()] + self.own_pages

    def pending(self, chunk_tokens: int) -> list[int]:
        """Tokens of the next forward: a prefill chunk, or the last generated token."""
        tokens = self.tokens
        return tokens[self.num_computed:self.num_computed + chunk_tokens]

    def pages_needed(self, num_new: int) -> int:
        """Own pages still to allocate so that ``num_new`` more tokens have slots."""
        end = self.num_computed + num_new
        total = -(-end // self.page_size)
        return total - len(self.prefix) // self.page_size - len(self.own_pages)

    def slot_of(self, pages: list[int], position: int) -> int:
        return pages[position // self.page_size] * self.page_size + position % self.page_size

    def slots(self, num_tokens: int) -> Indices:
        """CPU int64 ``DEVICE_FULL`` slots of positions ``0 .. num_tokens - 1`` rounded up to
        whole pages (the form ``insert`` takes)."""
        num_pages = -(-num_tokens // self.page_size)
        pages = torch.tensor(self.page_ids()[:num_pages], dtype=torch.int64)
        offsets = torch.arange(self.page_size, dtype=torch.int64)
        return Indices((pages[:, None] * self.page_size + offsets).reshape(-1),
                       IndexSpace.DEVICE_FULL)

    def own_slots(self, pages: list[int]) -> Indices:
        """CPU int64 ``DEVICE_FULL`` slots of whole ``pages``."""
        tensor = torch.tensor(pages, dtype=torch.int64)[:, None] * self.page_size
        return Indices((tensor + torch.arange(self.page_size)).reshape(-1),
                       IndexSpace.DEVICE_FULL)


class ForwardPlan(NamedTuple):
    """The host-side description of one forward: new token ``i`` is ``tokens[i]`` at
    ``positions[i]`` of the request in page-table row ``rows[i]``, written at full slot
    ``locs[i]``. ``logit_rows``: new tokens whose next token is wanted (one per request
    that reaches its last token). ``page_rows``: every request's page ids."""

    tokens: list[int]
    positions: list[int]
    rows: list[int]
    locs: list[int]
    logit_rows: list[int]
    page_rows: list[list[int]]

    @property
    def is_decode(self) -> bool:
        """One new token per request: the shape a CUDA-graph decode buffer serves."""
        return len(self.tokens) == len(self.page_rows)


def plan_forward(work: list[tuple[Request, list[int]]]) -> ForwardPlan:
    """Lay out the pending tokens of ``work`` (requests in batch order) for one forward."""
    plan = ForwardPlan([], [], [], [], [], [request.page_ids() for request, _ in work])
    for row, (request, pending) in enumerate(work):
        for j, token in enumerate(pending):
            position = request.num_computed + j
            plan.tokens.append(token)
            plan.positions.append(position)
            plan.rows.append(row)
            plan.locs.append(request.slot_of(plan.page_rows[row], position))
        if request.num_computed + len(pending) == len(request.tokens):
            plan.logit_rows.append(len(plan.tokens) - 1)
    return plan
