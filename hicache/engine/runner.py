"""The reference engine's scheduler: admits requests by prefix match and load-back, runs
batched forwards over the pools and inserts finished sequences, as a real engine embeds
:class:`~hicache.service.HiCacheService`.

One scheduler step::

    service.step()                      apply finished transfers (locks drop, backups land)
    admit: match -> lock -> load_back   prefix from the device tier, then from the host tier
    service.start_loading()             loads run layer by layer on the load stream
    audit.check_loads()                 loaded rows == the digests taken at backup
    reserve pages: alloc_device         evicting, or retracting the newest request if full
    forward                             attention waits per layer through the pool accessors
    finish: insert -> free tail -> release

SWA layers only need the last ``window`` positions, so pages that left every future window
give their SWA slots back at once (``service.release_window``: with ``host.swa_history:
all`` their SWA rows are copied to the host first, so any prefix of the request stays
reusable; a load-back restores the SWA rows of a reused prefix's last window).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from hicache.pools import HybridSWAPool, IndexSpace, Indices
from hicache.radix import Refusal
from hicache.service import HiCacheService

from .attention import DecodeBuffers, PagedKV, exact_batch
from .limits import EngineError, check_at_least_one, check_room_for_a_chunk
from .model import TinyDecoder
from .reference import TurnKey
from .request import Request, plan_forward
from .store_pages import match_with_store
from .verify import TransferAudit
from .window import SlidingWindow
from .workload import Turn, Workload

Progress = Callable[[int, int], None]


class DemoEngine:
    """Serves a :class:`Workload` through a started :class:`HiCacheService`.

    Args:
        service: the cache service (started; its pools hold the model's KV).
        model: the decoder; its KV geometry matches the pools.
        max_running: requests in flight at once (also the padded decode batch).
        prefill_chunk_tokens: most prompt tokens of one request per forward.
        max_tokens: the longest sequence of the workload (page-table width).
        audit: checks loaded pages against their backups after each forward.
        stream: the forward's CUDA stream (registered as a producer), ``None`` on a CPU.
    """

    def __init__(
        self, service: HiCacheService, model: TinyDecoder, *, max_running: int,
        prefill_chunk_tokens: int, max_tokens: int, audit: TransferAudit,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        self.service = service
        self.model = model
        self.pool = service.device_pool
        self.page_size = service.tree.page_size
        check_at_least_one("max_running", max_running)
        check_at_least_one("prefill_chunk_tokens", prefill_chunk_tokens)
        self.max_running = max_running
        self.chunk = max(self.page_size, prefill_chunk_tokens // self.page_size * self.page_size)
        check_room_for_a_chunk(service, self.chunk)
        self.window: SlidingWindow | None = None
        if isinstance(self.pool, HybridSWAPool):
            assert model.spec.window_tokens is not None, "a hybrid pool needs a window"
            self.window = SlidingWindow(self.pool, model.spec.window_tokens, self.page_size,
                                        self.chunk)
        self.max_pages = -(-max_tokens // self.page_size) + 1
        self.buffers = DecodeBuffers(max_running, self.max_pages, self.pool.device,
                                     self.page_size)
        self.audit = audit
        self.stream = stream
        self.running: list[Request] = []
        self._admit_paused = False
        self.waiting: deque[Turn] = deque()
        self.finished: list[Request] = []
        self.num_retracted = 0

    def serve(self, workload: Workload, on_progress: Progress | None = None) -> None:
        """Run every turn of every conversation; next turns queue behind the others."""
        history = {c.conversation: list(c.system_tokens) for c in workload.conversations}
        turns = {c.conversation: c.turns for c in workload.conversations}
        self.waiting.extend(c.turns[0] for c in workload.conversations)
        while self.waiting or self.running:
            self.service.step()
            self._admit(history)
            if self.service.start_loading() is not None:
                self._check_loads()
            self._step()
            for request in [r for r in self.running if r.is_done]:
                self._finish(request)
                turn = request.turn
                history[turn.conversation] = request.tokens
                if turn.index + 1 < len(turns[turn.conversation]):
                    self.waiting.append(turns[turn.conversation][turn.index + 1])
                if on_progress is not None:
                    on_progress(len(self.finished), workload.num_turns)
        self.service.step()
        self.service.check_integrity()

    # ---- admission ----------------------------------------------------------------------

    def _admit(self, history: dict[int, list[int]]) -> None:
        if self._admit_paused and self.running:
            return
        self._admit_paused = False
        while self.waiting and len(self.running) < self.max_running:
            # room made with nothing running too, before the request locks its SWA rows
            if not self._has_room_for_one_more() and self.running:
                return
            turn = self.waiting[0]
            request = self._try_admit(turn, history[turn.conversation] + list(turn.user_tokens))
            if request is None:
                return
            self.waiting.popleft()
            self.running.append(request)

    def _has_room_for_one_more(self) -> bool:
        """SWA room for the windows of the running requests and of one more, evicting cached
        prefixes if needed (else it would be admitted to be retracted: the default SWA pool
        holds four windows)."""
        if self.window is None:
            return True
        want = self.window.tokens_wanted(self.running)
        allocator = self.window.pool.swa_allocator
        self.service.step()  # window backups acknowledged free their SWA slots
        while allocator.num_free_tokens < want:
            short, before = want - allocator.num_free_tokens, allocator.num_free_tokens
            if self.service.evict_swa(short) == 0 and self.service.evict(short) == 0:
                self.service.step()  # write-back evictions free their pages on the ack
                if allocator.num_free_tokens == before:
                    return False
        return True

    def _try_admit(self, turn: Turn, prompt: list[int]) -> Request | None:
        """Match, lock and load back; ``None`` (nothing held) to retry once others finish,
        when the host run did not fit on the device now. Other refusals are final: those
        tokens are computed again."""
        # the last prompt token is always computed (its logits give the first new token),
        # so match without it: the window a load-back restores is then the window of what
        # is reused, not of a page the request recomputes anyway
        match, cached = match_with_store(self.service, prompt[:-1])
        node = match.last_host_node
        self.service.lock(node)  # the device prefix and the host run stay put until finish
        prefix = match.device_indices
        # a hybrid model also needs the SWA rows of the prefix's last window, which a
        # load-back restores from the host when they left the device
        if match.host_hit_tokens or (self.window is not None and match.device_hit_tokens):
            with self.audit.serving(turn.name):
                loaded = self.service.load_back(
                    match, self.service.controller.device_allocator.capacity_tokens)
            if loaded.refused is Refusal.DEVICE_FULL and self.running:
                self.service.release(node)
                return None
            if loaded.queued:
                prefix = Indices(torch.cat([prefix.tensor, loaded.device_indices.tensor]),
                                 IndexSpace.DEVICE_FULL)
        usable = self._usable_prefix(prefix, len(prompt))
        device = min(usable, match.device_hit_tokens)
        return Request(turn, prompt, self.page_size, node,
                       Indices(prefix.tensor[:usable], IndexSpace.DEVICE_FULL),
                       device_tokens=device, host_tokens=usable - device,
                       matched_tokens=match.device_hit_tokens + match.host_hit_tokens,
                       store_tokens=max(0, usable - cached))

    def _usable_prefix(self, prefix: Indices, prompt_tokens: int) -> int:
        """Longest whole-page prefix that leaves a token to compute (the first generated
        token needs its logits) and that SWA layers can read."""
        limit = min(len(prefix), (prompt_tokens - 1) // self.page_size * self.page_size)
        return limit if self.window is None else self.window.usable_prefix(prefix, limit)

    @property
    def generated(self) -> dict[TurnKey, list[int]]:
        """Tokens generated for every finished turn."""
        return {(r.turn.conversation, r.turn.index): r.generated for r in self.finished}

    # ---- one forward --------------------------------------------------------------------

    def _step(self) -> None:
        for request in list(self.running):
            if request in self.running:
                self._reserve(request, len(request.pending(self.chunk)))
        if not self.running:
            return
        work = [(r, r.pending(self.chunk)) for r in self.running]
        next_tokens = self._forward(work)
        for request, pending in work:
            request.num_computed += len(pending)
            if request.num_computed == len(request.tokens):
                request.generated.append(next_tokens.pop(0))
            self._release_window(request)

    def _forward(self, work: list[tuple[Request, list[int]]]) -> list[int]:
        """One batched forward; returns the next token of every request that reached the
        end of its tokens, in batch order."""
        plan = plan_forward(work)
        with self._on_stream():
            if plan.is_decode:
                batch = self.buffers.fill(self.pool, plan.locs, plan.positions, plan.page_rows)
            else:
                batch = exact_batch(self.pool, plan.locs, plan.rows, plan.positions,
                                    plan.page_rows, self.max_pages, self.page_size)
            kv = PagedKV(self.pool, batch, self.model.spec, self.page_size)
            return self.model.forward(plan.tokens, plan.positions, kv, plan.logit_rows)

    def _check_loads(self) -> None:
        """Compare the rows just loaded with their backups, once every layer is in place
        (a GPU-side wait per layer, then the audit's read synchronises)."""
        with self._on_stream():
            for layer in range(self.model.spec.num_layers):
                self.service.wait_until(layer)
            self.audit.check_loads()

    @contextmanager
    def _on_stream(self) -> Iterator[None]:
        """Run on the forward stream, ordered after the scheduler's stream (page-map
        updates) and before it again (digests and frees read what the forward wrote)."""
        if self.stream is None:
            yield
            return
        scheduler = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(scheduler)
        with torch.cuda.stream(self.stream):
            yield
        scheduler.wait_stream(self.stream)

    # ---- memory -------------------------------------------------------------------------

    def _reserve(self, request: Request, num_new: int) -> None:
        """Give ``request`` own pages for ``num_new`` more tokens: allocate (the service
        evicts once), evict more, and as a last resort retract the newest request (maybe
        ``request`` itself, which then leaves :attr:`running`)."""
        need = request.pages_needed(num_new) * self.page_size
        while need > 0 and request in self.running:
            slots = self.service.alloc_device(need)
            if slots is not None:
                pages = slots.tensor[::self.page_size] // self.page_size
                request.own_pages += [int(p) for p in pages.tolist()]
                return
            before = self._free_tokens()
            self.service.evict(need)
            self.service.step()  # write-back evictions free their pages on the ack
            if self._free_tokens() != before:
                continue
            if len(self.running) == 1:
                raise EngineError(
                    f"{request.name} needs {need} more device tokens and nothing else can be "
                    f"evicted; raise device_pool.num_tokens or device_pool.swa_num_tokens"
                )
            self._retract(self.running[-1])

    def _retract(self, request: Request) -> None:
        """Give back everything ``request`` holds and queue it again (it restarts later)."""
        if request.own_pages:
            self.service.free_device(request.own_slots(request.own_pages))
        self.service.release(request.lock_node)
        self.running.remove(request)
        self.waiting.appendleft(request.turn)
        self.num_retracted += 1
        self._admit_paused = True  # until a request finishes and frees its pages

    def _free_tokens(self) -> tuple[int, ...]:
        if isinstance(self.pool, HybridSWAPool):
            return (self.pool.full_allocator.num_free_tokens,
                    self.pool.swa_allocator.num_free_tokens)
        return (self.service.controller.device_allocator.num_free_tokens,)

    def _release_window(self, request: Request) -> None:
        """Free the SWA slots of own pages that left every future window."""
        if self.window is None:
            return
        pages = self.window.pages_to_release(request)
        if pages:
            self.service.release_window(request.own_slots(pages))

    # ---- completion ---------------------------------------------------------------------

    def _finish(self, request: Request) -> None:
        """Insert the sequence's KV (prompt and all but the last generated token), free the
        partial tail page, release the prefix lock and count where the prompt came from."""
        computed = request.num_computed
        self.service.insert(request.tokens[:computed], request.slots(computed))
        whole_pages = computed // self.page_size - len(request.prefix) // self.page_size
        leftover = request.own_pages[max(0, whole_pages):]
        if leftover:
            self.service.free_device(request.own_slots(leftover))
        self.service.release(request.lock_node)
        self.running.remove(request)
        self._admit_paused = False
        self.finished.append(request)
