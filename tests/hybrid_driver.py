"""A seeded engine that drives a hybrid :class:`HiCacheService` as a scheduler does and checks
every KV row it reads (``tests/test_hybrid_random_run.py``).

Each request goes match -> lock -> load_back (the host run, and the SWA rows of the device
prefix's window) -> alloc -> compute in chunks, then one token at a time, giving back the SWA
slots of pages that left the window (``release_window``) -> insert -> release. Around the
requests the driver applies acks (``step``), evicts from the device, the SWA pool and the
host, and checks integrity, at random. The service's thread is not started, so a seed gives
one run. Rows are those of :class:`hybrid_workload.RowValues`: after every load the driver
reads back every loaded full row and every SWA row of the prefix, and before every chunk
what its forward would read (the full rows so far and the SWA rows of the window).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from hybrid_workload import PAGE, RowValues, Workload
from radix_helpers import prefix_codes, read_rows, write_rows

from hicache.pools import HybridSWAPool, IndexSpace, Indices
from hicache.radix import TreeNode
from hicache.service import HiCacheService

SENTINEL = -7.0


class CountedService:
    """Forwards method calls to a service and counts them by name (the run's operations)."""

    def __init__(self, service: HiCacheService) -> None:
        self.service = service
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.service, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return method(*args, **kwargs)

        return call

    @property
    def num_ops(self) -> int:
        return sum(self.calls.values())


@dataclass(eq=False)
class Request:
    """A running request: its reused prefix (tree slots) and the pages it allocated."""

    tokens: list[int]  # the prompt, then the tokens it generates
    prompt_len: int
    codes: torch.Tensor  # float32 [len(tokens)]: the prefix code of every position
    lock_node: TreeNode
    prefix: torch.Tensor  # int64 DEVICE_FULL slots of the reused prefix (whole pages)
    num_computed: int
    own: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    num_swa_released: int = 0  # own pages whose SWA slots were given back

    @property
    def target(self) -> int:
        """Tokens to compute: all but the last generated token (never fed back)."""
        return len(self.tokens) - 1

    @property
    def num_own_pages(self) -> int:
        return len(self.own) // PAGE

    def slots(self) -> torch.Tensor:
        return torch.cat([self.prefix, self.own])

    def own_pages(self, begin: int, end: int) -> Indices:
        return full_indices(self.own[begin * PAGE : end * PAGE])


@dataclass
class Figures:
    """What a run did and found (tokens unless named otherwise)."""

    ops: int = 0
    calls: dict[str, int] = field(default_factory=dict)
    requests: int = 0
    finished: int = 0
    retracted: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    refused_load_backs: dict[str, int] = field(default_factory=dict)
    refused_backups: dict[str, int] = field(default_factory=dict)
    unusable_prefix_tokens: int = 0  # matched, but their window had no SWA rows
    windows_missing_after_load: int = 0  # load-backs that left the window without SWA rows
    loads: int = 0
    loaded_rows_checked: int = 0
    restored_swa_tokens: int = 0
    full_rows_checked: int = 0
    swa_rows_checked: int = 0
    corrupted_rows: int = 0
    first_corruption: str = ""
    leaked_tokens: dict[str, int] = field(default_factory=dict)
    integrity_checks: int = 0

    @property
    def refused_swa_tail_tokens(self) -> int:
        return self.refused_load_backs.get("swa_tail_missing", 0)

    def summary(self) -> str:
        """The figures in a few lines."""
        share = 100.0 * self.refused_swa_tail_tokens / max(1, self.host_hit_tokens)
        return "\n".join(
            [
                f"  ops {self.ops}; requests {self.requests} ({self.finished} finished, "
                f"{self.retracted} retracted); hit tokens: device {self.device_hit_tokens}, host "
                f"{self.host_hit_tokens}",
                f"  refused as swa_tail_missing: {self.refused_swa_tail_tokens} tokens "
                f"({share:.3f}% of host hits); unusable prefix tokens "
                f"{self.unusable_prefix_tokens}; windows missing after a load "
                f"{self.windows_missing_after_load}; refused load-backs {self.refused_load_backs},"
                f" refused backups {self.refused_backups}",
                f"  rows checked: loaded {self.loaded_rows_checked} ({self.loads} loads), full "
                f"{self.full_rows_checked}, SWA {self.swa_rows_checked} (restored SWA tokens "
                f"{self.restored_swa_tokens}); corrupted rows {self.corrupted_rows}",
                f"  leaked tokens {sum(self.leaked_tokens.values())} {self.leaked_tokens}; "
                f"integrity checks {self.integrity_checks}",
                f"  calls {self.calls}",
            ]
        )


class HybridDriver:
    """Drives ``service`` (its thread not started: ``step`` applies the acks).

    Args:
        service: a hybrid service on CPU pools.
        seed: seeds the workload and every choice of the driver.
        window_tokens: the model's sliding window (a prefix of ``P`` tokens needs the SWA
            rows of positions ``P - window_tokens + 1 .. P - 1``).
        max_running: requests in flight at once.
        max_tokens: the longest sequence (prompt and generated).
        chunk_tokens: most prompt tokens one forward of a request computes.
    """

    def __init__(
        self,
        service: HiCacheService,
        seed: int,
        window_tokens: int,
        *,
        max_running: int = 3,
        max_tokens: int = 96,
        chunk_tokens: int = 8,
    ) -> None:
        pool = service.device_pool
        assert isinstance(pool, HybridSWAPool), "the driver needs a hybrid pool"
        self.service = service
        self.svc = CountedService(service)
        self.tree = service.tree
        self.pool = pool
        self.rng = random.Random(seed)
        self.workload = Workload(self.rng, max_tokens)
        self.values = RowValues(pool.full.num_layers, pool.swa.num_layers)
        self.window = window_tokens
        self.max_running = max_running
        self.chunk_tokens = chunk_tokens
        self.running: list[Request] = []
        self.figures = Figures()
        pool.full.data.fill_(SENTINEL)
        pool.swa.data.fill_(SENTINEL)

    def run(self, num_ops: int) -> Figures:
        """Make at least ``num_ops`` service calls, then drain, empty the cache and count
        what is still allocated; returns the figures (the caller asserts on them)."""
        iteration = 0
        while self.svc.num_ops < num_ops:
            self._iteration()
            iteration += 1
            if iteration % 250 == 0:
                self.svc.check_integrity()
                self.figures.integrity_checks += 1
        self._drain()
        return self._final_figures()

    def _iteration(self) -> None:
        rng = self.rng
        if rng.random() < 0.6:
            self.svc.step()
        if (
            len(self.running) < self.max_running
            and (not self.running or rng.random() < 0.3)
            and self._has_swa_room()
        ):
            self._admit()
        elif self.running:
            self._advance(rng.choice(self.running))
        roll = rng.random()
        if roll < 0.08:
            self.svc.evict(rng.randint(1, 16) * PAGE)
        elif roll < 0.12:
            self.svc.evict_swa(rng.randint(1, 8) * PAGE)
        elif roll < 0.14:
            self.svc.evict_host(rng.randint(1, 4) * PAGE)

    # ---- admission ----------------------------------------------------------------------

    def _has_swa_room(self) -> bool:
        """Free SWA slots for one more request's window and chunk and for those the running
        requests may still take (as the reference engine checks), evicting if needed."""
        budget = -(-(self.window - 1) // PAGE) + 1 + self.chunk_tokens // PAGE
        pending = sum(max(0, budget - r.num_own_pages + r.num_swa_released) for r in self.running)
        want = (budget + pending) * PAGE
        allocator = self.pool.swa_allocator
        while allocator.num_free_tokens < want:
            short = want - allocator.num_free_tokens
            if self.svc.evict_swa(short) == 0 and self.svc.evict(short) == 0:
                return not self.running
        return True

    def _admit(self) -> None:
        """Match the prompt but its last token (whose logits must be computed), lock, load
        back, check the rows, keep the longest prefix whose window has SWA rows."""
        tokens, prompt_len = self.workload.next()
        codes = torch.tensor(prefix_codes(tokens), dtype=torch.float32)
        match = self.svc.match(tokens[: prompt_len - 1])
        node = match.last_host_node
        self.svc.lock(node)
        prefix = match.device_indices.tensor
        loaded = None
        quota = self.pool.full_allocator.capacity_tokens
        if match.device_hit_tokens or match.host_hit_tokens:
            result = self.svc.load_back(match, quota)
            loaded = result.device_indices if result.queued else None
        if loaded is None and match.device_hit_tokens:
            loaded = self._restore_window(match.last_device_node, quota)
        if loaded is not None:
            self.svc.start_loading()
            for layer in range(self.pool.num_layers):  # as the forward's attention does
                self.service.wait_until(layer)
            prefix = self._check_loaded(prefix, loaded, codes)
        usable = self._usable_prefix(prefix)
        if loaded is not None and usable < len(prefix):
            self.figures.windows_missing_after_load += 1
        self.figures.unusable_prefix_tokens += len(prefix) - usable
        request = Request(tokens, prompt_len, codes, node, prefix[:usable].clone(), usable)
        # the engine reuses the tensors the service handed it: nothing cached may share them
        match.device_indices.tensor.add_(PAGE)
        if loaded is not None:
            loaded.tensor.add_(PAGE)
        self.figures.requests += 1
        self.running.append(request)

    def _restore_window(self, node: TreeNode, quota: int) -> Indices | None:
        """The host run was refused: restore at least the SWA rows of the device prefix's
        window; once more after freeing SWA slots if that was refused too."""
        result = self.svc.load_back(node, quota)
        if not result.queued:
            self.svc.step()  # acknowledged window backups free their SWA slots
            self.svc.evict(2 * self.tree.io.tail_tokens)  # and so do device leaves
            self.svc.step()
            result = self.svc.load_back(node, quota)
        return result.device_indices if result.queued else None

    def _check_loaded(
        self, prefix: torch.Tensor, loaded: Indices, codes: torch.Tensor
    ) -> torch.Tensor:
        """Check the loaded full rows and every SWA row of the prefix (loaded, restored or
        resident); returns the prefix with the loaded slots."""
        self.figures.loads += bool(len(loaded))
        self.figures.loaded_rows_checked += len(loaded)
        start = len(prefix)
        prefix = torch.cat([prefix, loaded.tensor])
        self._check(full_indices(prefix[start:]), codes[start : len(prefix)], "loaded")
        swa = self.pool.swa_slots_of(full_indices(prefix)).tensor
        mapped = swa != 0
        self._check(
            Indices(swa[mapped], IndexSpace.DEVICE_SWA),
            codes[: len(prefix)][mapped],
            "loaded or restored",
        )
        return prefix

    def _usable_prefix(self, prefix: torch.Tensor) -> int:
        """Longest whole-page prefix whose last ``window - 1`` positions have SWA rows."""
        swa = self.pool.swa_slots_of(full_indices(prefix)).tensor
        for end in range(len(prefix), 0, -PAGE):
            if bool((swa[max(0, end - self.window + 1) : end] != 0).all()):
                return end
        return 0

    # ---- computing ----------------------------------------------------------------------

    def _advance(self, request: Request) -> None:
        """One forward of ``request``: a prompt chunk or one decoded token."""
        start = request.num_computed
        num = 1
        if start < request.prompt_len:
            num = min(request.prompt_len - start, self.rng.randint(1, self.chunk_tokens))
        end = min(start + num, request.target)
        need_pages = -(-end // PAGE) - len(request.prefix) // PAGE - request.num_own_pages
        if need_pages > 0:
            slots = self._alloc(need_pages * PAGE)
            if slots is None:
                self._retract(request)
                return
            request.own = torch.cat([request.own, slots.tensor])
            slots.tensor.add_(PAGE)  # reused by the engine (see _admit)
        self._check_reads(request, start)
        self._write(request, start, end)
        request.num_computed = end
        self._release_window(request)
        if end == request.target:
            self._finish(request)

    def _alloc(self, num_tokens: int) -> Indices | None:
        """Fresh pages; evicts SWA rows and device nodes and applies acks between tries."""
        for _ in range(3):
            slots = self.svc.alloc_device(num_tokens)
            if slots is not None:
                return slots
            self.svc.evict_swa(num_tokens)
            self.svc.evict(num_tokens)
            self.svc.step()
        return None

    def _check_reads(self, request: Request, start: int) -> None:
        """What the forward of the tokens from ``start`` reads: every full row before them
        and the SWA rows of the window (each must have an SWA slot)."""
        slots = request.slots()[:start]
        self._check(full_indices(slots), request.codes[:start], "full")
        first = max(0, start - self.window + 1)
        window = self.pool.swa_slots_of(full_indices(slots[first:])).tensor
        if bool((window == 0).any()):
            self._corrupt(int((window == 0).sum()), f"window of position {start} lost SWA rows")
        mapped = window != 0
        self._check(
            Indices(window[mapped], IndexSpace.DEVICE_SWA),
            request.codes[first:start][mapped],
            "window",
        )

    def _write(self, request: Request, start: int, end: int) -> None:
        """The forward's KV writes: full and SWA rows of positions ``[start, end)``."""
        full = full_indices(request.slots()[start:end])
        codes = request.codes[start:end]
        write_rows(self.pool.full, full.tensor, self.values.rows(codes, swa=False))
        swa = self.pool.swa_slots_of(full).tensor
        assert bool((swa != 0).all()), "a token being computed has no SWA slot"
        write_rows(self.pool.swa, swa, self.values.rows(codes, swa=True))

    def _release_window(self, request: Request) -> None:
        """Give back the SWA slots of own pages before the window of the current page
        boundary (where a later turn's prefix may end)."""
        keep_from = request.num_computed // PAGE * PAGE - self.window + 1
        first_own = len(request.prefix) // PAGE
        done = max(0, min(request.num_own_pages, keep_from // PAGE - first_own))
        if done > request.num_swa_released:
            released = request.own_pages(request.num_swa_released, done)
            buffer = full_indices(released.tensor.clone())  # the engine's own buffer
            self.svc.release_window(buffer)
            buffer.tensor.add_(PAGE)  # reused at once: the queued copy must own its slots
            request.num_swa_released = done

    # ---- completion ---------------------------------------------------------------------

    def _finish(self, request: Request) -> None:
        """Insert what was computed, free the partial last page, release the lock."""
        computed = request.num_computed
        buffer = full_indices(request.slots().clone())  # the engine's own buffer
        self.svc.insert(request.tokens[:computed], buffer)
        buffer.tensor.add_(PAGE)  # reused at once: the tree must keep copies
        whole = computed // PAGE - len(request.prefix) // PAGE
        if whole < request.num_own_pages:
            self.svc.free_device(request.own_pages(whole, request.num_own_pages))
        self.svc.release(request.lock_node)
        self.running.remove(request)
        self.workload.finished(request.tokens)
        self.figures.finished += 1

    def _retract(self, request: Request) -> None:
        """No room: give back what the request holds (it is not retried)."""
        if request.num_own_pages:
            self.svc.free_device(request.own_pages(0, request.num_own_pages))
        self.svc.release(request.lock_node)
        self.running.remove(request)
        self.figures.retracted += 1

    def _drain(self) -> None:
        """Finish every running request, apply every ack, prove conservation; then empty
        both tiers (write-back needs rounds: a device eviction writes first)."""
        for request in list(self.running):
            self._finish(request)
        self.svc.step()
        assert self.service.controller.num_in_flight == 0, "ops in flight after a CPU step"
        self.svc.check_integrity()
        assert self.service.engine_held_tokens == 0, "the engine still holds device pages"
        assert len(self.tree.window_backups) == 0, "window backups no node took"
        assert all(node.lock_count == 0 for node in self.tree.nodes()), "a lock was kept"
        for _ in range(100):
            if not list(self.tree.nodes()):
                break
            self.svc.evict(10**6)
            self.svc.step()
            self.svc.evict_host(10**6)
        self.svc.check_integrity()
        self.figures.integrity_checks += 2

    def _final_figures(self) -> Figures:
        stats, figures = self.tree.stats, self.figures
        figures.ops = self.svc.num_ops
        figures.calls = dict(self.svc.calls)
        figures.device_hit_tokens = stats.device_hit_tokens
        figures.host_hit_tokens = stats.host_hit_tokens
        figures.refused_load_backs = dict(stats.refused_load_backs)
        figures.refused_backups = dict(stats.refused_backups)
        figures.restored_swa_tokens = stats.restored_swa_tokens
        figures.leaked_tokens = {
            space.name: allocator.num_used_tokens
            for space, allocator in self.tree.io.allocators().items()
        }
        return figures

    # ---- rows ---------------------------------------------------------------------------

    def _check(self, slots: Indices, codes: torch.Tensor, what: str) -> None:
        """Compare the rows at ``slots`` (``DEVICE_FULL`` or ``DEVICE_SWA``) with those of
        the positions whose codes are ``codes``."""
        if not len(slots):
            return
        swa = slots.space is IndexSpace.DEVICE_SWA
        got = read_rows(self.pool.swa if swa else self.pool.full, slots.tensor)
        bad = (got != self.values.rows(codes, swa)).flatten(1).any(dim=1)
        if swa:
            self.figures.swa_rows_checked += len(slots)
        else:
            self.figures.full_rows_checked += len(slots)
        if bool(bad.any()):
            slot = int(slots.tensor[int(bad.nonzero()[0])])
            self._corrupt(int(bad.sum()), f"{what} {'SWA' if swa else 'full'} row at {slot}")

    def _corrupt(self, num_rows: int, what: str) -> None:
        self.figures.corrupted_rows += num_rows
        if not self.figures.first_corruption:
            self.figures.first_corruption = f"{what}, after {self.svc.num_ops} ops"


def full_indices(slots: torch.Tensor) -> Indices:
    return Indices(slots, IndexSpace.DEVICE_FULL)
