"""What the sliding window means for the engine's memory: which cached prefixes SWA layers
can reuse, how many SWA pages a request holds, and which it can give back early.

A token at position ``t`` of an SWA layer attends to ``t - window + 1 .. t``. So a prefix
of ``P`` cached tokens is reusable only if positions ``P - window + 1 .. P - 1`` still have
SWA rows (the tree keeps them for the window tail of what was inserted, not for a prefix
cut out of a longer sequence, such as a shared system prompt). And while a request runs,
an own page is needed only while a later token's window, counted from the current page
boundary (the next turn restarts there), can reach it::

    pages      ... | p-5 | p-4 | p-3 | p-2 | p-1 | p (current) | next chunk
    SWA rows       freed |<------ window - 1 ------>|   kept     |  allocated
"""

from __future__ import annotations

from hicache.pools import HybridSWAPool, IndexSpace, Indices

from .request import Request


class SlidingWindow:
    """SWA policy of the engine over a hybrid pool.

    Args:
        pool: the hybrid device pool.
        window_tokens: the model's sliding window.
        page_size: tokens per page.
        chunk_tokens: most tokens one request adds per forward (a page multiple).
    """

    def __init__(
        self, pool: HybridSWAPool, window_tokens: int, page_size: int, chunk_tokens: int
    ) -> None:
        self.pool = pool
        self.window_tokens = window_tokens
        self.page_size = page_size
        # own pages with SWA rows one request can hold: the window before its current page,
        # the current page and the pages of the next chunk
        self.budget_pages = -(-(window_tokens - 1) // page_size) + 1 + chunk_tokens // page_size

    def usable_prefix(self, prefix: Indices, limit: int) -> int:
        """Longest whole-page prefix of ``prefix`` (at most ``limit`` tokens) whose last
        ``window - 1`` positions have SWA rows; 0 if none."""
        for end in range(limit, 0, -self.page_size):
            first = max(0, end - self.window_tokens + 1)
            tail = Indices(prefix.tensor[first:end], IndexSpace.DEVICE_FULL)
            if bool((self.pool.swa_slots_of(tail).tensor != 0).all()):
                return end
        return 0

    def tokens_wanted(self, running: list[Request]) -> int:
        """Free SWA tokens needed before admitting one more request: its budget plus what
        the running requests may still allocate."""
        pending = sum(max(0, self.budget_pages - held_swa_pages(r)) for r in running)
        return (self.budget_pages + pending) * self.page_size

    def pages_to_release(self, request: Request) -> list[int]:
        """Own pages of ``request`` whose SWA rows no later token can read; marks them."""
        page = self.page_size
        keep_from = request.num_computed // page * page - self.window_tokens + 1
        first_own = len(request.prefix) // page
        done = max(0, min(len(request.own_pages), keep_from // page - first_own))
        if done <= request.num_swa_released:
            return []
        pages = request.own_pages[request.num_swa_released:done]
        request.num_swa_released = done
        return pages


def held_swa_pages(request: Request) -> int:
    """Own pages of ``request`` that still hold SWA rows."""
    return len(request.own_pages) - request.num_swa_released
