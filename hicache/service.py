"""HiCacheService: the radix tree, its controller and a background poller for one engine.

Thread ownership (the rules every caller relies on):

- The engine's scheduler thread owns the tree, the allocators and the record of the slots
  ``alloc_device`` handed it (so the integrity check accounts for every device slot). Every
  API call (``match``, ``load_back``, ``start_loading``, ``insert``, ``lock``/``release``,
  ``alloc_device``, ``free_device``, ``evict``, ``evict_host``, ``step``) runs there, and
  only those calls mutate bookkeeping.
- One service lock (``service_lock``) serialises access to the controller. Every API call
  holds it; the background thread only while it polls finished ops (event ``query()``;
  first it issues backups queued with no ``step`` since) or runs an idle integrity check;
  a metrics scrape while it reads the counters. It is never held across a GPU wait
  (``wait_until`` takes no lock; ``stop`` drains only after the thread was joined).
- The background thread applies no ack: it puts acks on a queue that ``step`` applies on
  the scheduler thread. It issues backups a quiet scheduler left queued (host slots only;
  host leaves it evicts for them only after a second with no scheduler call). Ranks of a
  tensor-parallel engine apply acks where they agree (:mod:`hicache.rank_agreement`).
- An exception in the background thread is never swallowed: it is logged, counted in
  ``stats.background_errors`` and raised, as :class:`ServiceError` with the original as
  ``__cause__``, by every later scheduler call until ``stop``; ``stop`` raises it if no call
  did. The service is unusable after that: stop it.

Parts: :mod:`hicache.slot_handoff` moves slots between the engine and the tree;
:class:`~hicache.call_gate.CallGate` admits every call; the thread and its ack queue are
:mod:`hicache.background_poller`, started and stopped by :mod:`.lifecycle`;
:mod:`hicache.prefetch_calls` holds the shared store's calls, :mod:`hicache.eviction_calls`
the engine's evictions.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from types import TracebackType

from hicache.metrics import MetricsExporter, controller_pool_usage
from hicache.pools import DeviceKVPool, HostKVPool, HybridSWAPool, Indices

from . import lifecycle, slot_handoff
from .background_poller import BackgroundPoller
from .call_gate import CallGate
from .engine_slots import EngineSlots
from .eviction_calls import EvictionCalls
from .integrity_slices import SlicedIntegrityCheck
from .l3 import StorageTier
from .prefetch_calls import PrefetchCalls
from .radix import HiRadixCache, LoadBack, MatchResult, TokenIds, TokenKey, TreeNode
from .rank_agreement import RankAgreement, agreed_step
from .service_stats import ServiceStats


class ServiceError(RuntimeError):
    """The background thread failed; ``__cause__`` is its exception."""


class HiCacheService(PrefetchCalls, EvictionCalls):
    """Scheduler-facing cache service (see the module docstring for the threading rules).

    Args:
        tree: the radix tree, with its controller; :meth:`step` allocates and issues the
            backups its ``insert`` and ``match`` queue, as one write (``issue_backups`` off).
        device_pool: the pool the engine writes KV into (plain or hybrid).
        host_pools: host pools to close (unpin) at :meth:`stop`.
        integrity_check_interval_s: seconds between integrity checks of the thread, which
            starts one only after that long with neither a finished transfer nor a scheduler
            call; it holds the lock well under a millisecond at a time and gives up if the
            scheduler calls in between (see :mod:`hicache.integrity_slices`).
        poll_interval_s: the background thread's sleep while transfers are in flight
            (longer while the scheduler is busy: :mod:`hicache.background_poller`).
        metrics_address: ``(host, port)`` to serve Prometheus metrics on from :meth:`start`,
            or ``None`` for no endpoint.
        storage: the shared store's tier (L3), or ``None``; the service closes it at
            :meth:`stop`. Its calls are in :class:`~hicache.prefetch_calls.PrefetchCalls`.
        agreement: the tensor-parallel ranks this service's acks are agreed with
            (:class:`~hicache.rank_agreement.RankAgreement`; no store then), or ``None``.
    """

    def __init__(
        self,
        *,
        tree: HiRadixCache,
        device_pool: DeviceKVPool | HybridSWAPool,
        host_pools: Sequence[HostKVPool],
        integrity_check_interval_s: float = 1.0,
        poll_interval_s: float = 0.001,
        metrics_address: tuple[str, int] | None = None,
        storage: StorageTier | None = None,
        agreement: RankAgreement | None = None,
    ) -> None:
        self.tree = tree
        tree.issue_backups = False  # issued by step() (see above)
        self.storage = storage
        self.controller = tree.controller
        self.device_pool = device_pool
        self.service_lock = threading.Lock()
        self.stats = ServiceStats()
        self._host_pools = list(host_pools)
        self._engine = EngineSlots(self.controller.device_allocator)
        self._gate = CallGate(self.service_lock, ServiceError)
        self.background_check = SlicedIntegrityCheck(
            self.service_lock, tree, self._engine.as_indices, lambda: self._gate.num_calls)
        self._metrics_address = metrics_address
        self.exporter = None if metrics_address is None else MetricsExporter(
            self.controller.stats, cache=tree.stats,
            pool_usage=controller_pool_usage(self.controller), service=self.stats,
            source_lock=self.service_lock, storage=lambda: self.storage,
        )
        self.controller.stats.keep_durations = self.exporter is not None  # the one consumer
        self._poller = BackgroundPoller(
            gate=self._gate, tree=tree, stats=self.stats,
            exporter=self.exporter, check=self.background_check,
            check_interval_s=integrity_check_interval_s, poll_interval_s=poll_interval_s,
        )
        self._poller.agreement = agreement
        self.controller.layer_events.wait_when_busy = agreement is not None  # see its doc

    # ---- scheduler API ------------------------------------------------------------------

    def key(self, tokens: TokenIds) -> TokenKey:
        """``tokens`` checked once for a request: pass the key to :meth:`match` and
        :meth:`insert`, which then skip the check (see :class:`~hicache.radix.TokenKey`).
        Needs no lock and changes nothing. Raises ``TypeError`` for what is not token ids (as
        :meth:`match` does), ``ValueError`` for a negative token id."""
        return self.tree.key(tokens, "key")

    def match(self, tokens: TokenIds | TokenKey) -> MatchResult:
        """:meth:`HiRadixCache.match_prefix`; lock ``last_device_node`` to keep the result.

        ``tokens``: a :class:`~hicache.radix.TokenKey` from :meth:`key`, or ``[n]`` token
        ids, a list or tuple of ints or a 1-D integer tensor or numpy array; anything else
        raises ``TypeError``, a negative id ``ValueError``, with nothing changed.
        """
        with self._gate.call():
            self._gate.check_open()
            return self.tree.match_prefix(tokens)

    def lock(self, node: TreeNode) -> None:
        """Protect ``node`` and its ancestors from eviction until :meth:`release`.

        Raises:
            TypeError: ``node`` is not a :class:`TreeNode` (pass ``last_device_node`` or
                ``last_host_node`` of a :meth:`match` of this service).
            ValueError: ``node`` belongs to another service's cache, or was removed from
                this one (evicted or dropped): match again. Nothing is changed.
        """
        with self._gate.call():
            self._gate.check_open()
            self.tree.lock(node, caller=True)

    def release(self, node: TreeNode) -> None:
        """Undo one :meth:`lock` of ``node``; refuses nodes as :meth:`lock` does, and raises
        ``RuntimeError`` for a node this service's :meth:`lock` did not lock."""
        with self._gate.call():
            self._gate.check_open()
            self.tree.unlock(node, op="release", caller=True)

    def load_back(self, target: MatchResult | TreeNode, device_quota_tokens: int) -> LoadBack:
        """Queue the load of a match's host-only run (or of a node's host-only ancestors);
        see :meth:`HiRadixCache.load_back`. Issue it with :meth:`start_loading`.

        Returns:
            a :class:`~hicache.radix.LoadBack`: ``queued`` with the loaded run's device
            slots, or ``refused`` with the reason (``device_full``: retry after other
            requests finished; the others are final: compute those tokens).
        """
        node = target.last_host_node if isinstance(target, MatchResult) else target
        with self._gate.call():
            self._gate.check_open()
            return self.tree.load_back(node, slot_handoff.check_count(
                "load_back", device_quota_tokens, "device_quota_tokens"))

    def start_loading(self) -> int | None:
        """Issue queued load-backs (when the batch that reads them starts); the event set id."""
        with self._gate.call():
            self._gate.check_open()
            return self.tree.start_loading()

    def insert(self, tokens: TokenIds | TokenKey, device_indices: Indices) -> int:
        """Give ``device_indices[:n]`` (``n``: whole pages of ``tokens``) to the tree; see
        :meth:`HiRadixCache.insert`. Each of those pages must come from :meth:`alloc_device`
        or be the tree's own page at that position (from a match or a load-back).

        Returns:
            tokens already cached.
        Raises:
            TypeError: ``device_indices`` is not :class:`Indices`; ``tokens`` are not token
                ids (as for :meth:`match`).
            ValueError: a negative token id; too few slots; a page the engine does not
                hold, at a position the tree does not own. Nothing is changed.
        """
        if not isinstance(device_indices, Indices):
            raise TypeError(f"insert: expected DEVICE_FULL Indices, got {type(device_indices)}")
        with self._gate.call():
            self._gate.check_open()
            return slot_handoff.insert(self, tokens, device_indices)

    def alloc_device(self, num_tokens: int) -> Indices | None:
        """``num_tokens`` rounded up to whole pages of fresh device slots (with SWA slots for
        a hybrid pool), evicting once if needed; ``None`` when there is still no room (under
        ``write_back`` retry after :meth:`step`: evicted pages free up when written).
        ``alloc_device(0)`` returns empty indices.

        Raises:
            TypeError: ``num_tokens`` is not an int (a bool, float or string).
            ValueError: ``num_tokens`` is negative, or more than the pool can ever hold (its
                capacity; for a hybrid pool the smaller of the full and SWA pools). Checked
                before anything is evicted.
        """
        rounded = slot_handoff.check_alloc(self, num_tokens)
        with self._gate.call():
            self._gate.check_open()
            return slot_handoff.alloc(self, rounded)

    def free_device(self, device_indices: Indices) -> None:
        """Give back whole pages from :meth:`alloc_device` that were never inserted."""
        with self._gate.call():
            self._gate.check_open()
            slot_handoff.free(self, device_indices)

    def release_window(self, device_indices: Indices) -> None:
        """Give back the SWA slots of engine-held pages (from :meth:`alloc_device`, not
        inserted yet) that no later token of their request can attend to: the pages left
        every future sliding window. Under ``host.swa_history: all`` their SWA rows are
        copied to the host first (``insert`` hands the copies to the tree, so a prefix that
        ends anywhere in this request stays reusable; copied with the step's write) and the
        device SWA slots are free once that is acknowledged; otherwise they are free at once.
        A page without SWA slots (already given back) is skipped. No-op for a model
        without SWA layers.

        Raises:
            ValueError: a page the engine does not hold (never handed out, inserted or
                freed), or not whole pages. Nothing is changed.
        """
        with self._gate.call():
            self._gate.check_open()
            slot_handoff.release_window(self, device_indices)

    def step(self) -> int:
        """Issue the backups queued since the last step (one op for all of them; the thread
        does when no step comes), then apply finished ops; returns how many.

        Raises:
            BoundsError: a CUDA bounds check of a device pool (``set_kv``, a translation, a
                page table) that the GPU has run since the last step found an index out of
                range; nothing live was written (see :mod:`hicache.pools.bounds`). Raised
                before anything is applied; the next step goes on normally.
        """
        if self._poller.agreement is not None:  # a tensor-parallel rank (its own gate)
            return agreed_step(self)
        with self._gate.call():
            self._gate.check_open()
            self.controller.raise_if_tripped()
            self.tree.issue_queued_backups()  # those queued since the last step, as one op
            acks = self._poller.collect()
            self._poller.apply(acks)
            if self.storage is not None:
                self.storage.poll()
            return len(acks)

    def wait_until(self, layer: int) -> None:
        """GPU-side wait of the current stream for ``layer`` of the latest load; no lock."""
        self._gate.check_lock_free("wait_until")
        self.controller.wait_until(layer)

    def check_integrity(self) -> None:
        """Conservation of every slot (tree, engine-held, free); ``RuntimeError`` if broken;
        also after :meth:`stop`. The hybrid map's device copy is compared outside the lock."""
        with self.service_lock:  # CPU state only: no wait for the GPU while the lock is held
            self.tree.check_integrity(engine_device=self._engine.as_indices(), sync_device=False)
            self.stats.integrity_checks += 1
            compare = self.tree.io.device_state_check()  # copies taken here, compared below
        if compare is not None:
            compare()

    @property
    def engine_held_tokens(self) -> int:
        """Device slots handed out by :meth:`alloc_device` and not inserted or freed yet."""
        return self._engine.num_tokens

    # ---- life cycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Start the background thread and metrics endpoint (:func:`.lifecycle.start`); no-op
        when running; ``OSError`` when the metrics address cannot be bound (nothing starts)."""
        lifecycle.start(self)

    def stop(self) -> None:
        """Join the thread, drain every op in flight and apply its ack, close the host pools.
        Idempotent; raises the background thread's error if no scheduler call did."""
        lifecycle.stop(self)

    def __enter__(self) -> HiCacheService:
        lifecycle.enter(self)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        lifecycle.leave(self, exc)
