"""The service's calls for the shared store (L3): prefetch a request's uncached tail into
host slots, and let the engine decide when to use what arrived.

An engine with a store configured calls, per request::

    match = service.match(key)
    prefetch = service.prefetch(key, match)       # None: nothing worth asking the store
    ...                                           # later scheduler rounds
    if prefetch is not None:
        if not service.prefetch_ready(prefetch):  # the policy says keep waiting
            continue                              # schedule the request in a later round
        service.finish_prefetch(prefetch)         # arrived pages join the tree (host)
        match = service.match(key)                # now a longer host hit
    service.load_back(match, quota)

``prefetch_ready`` follows ``storage.prefetch_policy``: ``best_effort`` is ready at once,
``wait_complete`` when every page found arrived, ``timeout`` then or at the prefetch's
deadline. ``wait_prefetch`` blocks until ready without holding the service lock (for a
synchronous engine). Without a store, ``prefetch`` returns ``None``.

On a tensor-parallel rank (``build_service(..., tp_group=...)``) what a prefetch found and
read, and whether it is ready, change only at a ``step()``, to what every rank agreed
(:mod:`hicache.l3.held_jobs`); ``wait_prefetch`` steps until ready.
"""

from __future__ import annotations

import numbers
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .l3 import Prefetch, StorageTier
from .radix import MatchResult, TokenIds, TokenKey

if TYPE_CHECKING:
    from .call_gate import CallGate
    from .radix import HiRadixCache, TreeNode

_WAIT_SLICE_S = 0.05  # the longest a wait sleeps before it looks at the deadline again


class PrefetchCalls:
    """Mixed into :class:`~hicache.service.HiCacheService` (module docstring)."""

    storage: StorageTier | None
    tree: HiRadixCache
    _gate: CallGate
    step: Callable[[], int]

    def prefetch(self, tokens: TokenIds | TokenKey, match: MatchResult) -> Prefetch | None:
        """Ask the store for the whole pages of ``tokens`` after ``match`` (this request's
        match); does not wait. The matched node stays locked until :meth:`finish_prefetch`.

        Returns:
            the prefetch, or ``None``: no store, a tail shorter than
            ``storage.prefetch_threshold_tokens``, or the prefetch queue is full (counted).
        Raises:
            TypeError, ValueError: bad tokens (as for ``match``); ``match`` is not a
                :class:`MatchResult` of this service.
        """
        if not isinstance(match, MatchResult):
            raise TypeError(f"prefetch: expected this request's MatchResult, got "
                            f"{type(match).__name__}")
        with self._gate.call():
            self._gate.check_open()
            key = self.tree.key_data(tokens, "prefetch")  # bad tokens raise, store or not
            if self.storage is None:
                return None
            node = match.last_host_node
            if node is not self.tree.root:
                self.tree._check_node(node, "prefetch")
                _check_same_prefix(key, node)
            return self.storage.start_prefetch(key, match)

    def prefetch_ready(self, prefetch: Prefetch) -> bool:
        """Whether ``storage.prefetch_policy`` says to finish ``prefetch`` now."""
        with self._gate.call():
            self._gate.check_open()
            return self._tier("prefetch_ready", prefetch).ready(prefetch)

    def wait_prefetch(self, prefetch: Prefetch, timeout_s: float | None = None) -> bool:
        """Block until :meth:`prefetch_ready` (or ``timeout_s`` passed); the service lock is
        not held while waiting. Returns whether it is ready.

        On a tensor-parallel rank it calls ``step()`` until the ranks agree the prefetch is
        ready (every rank makes the same steps), and takes no ``timeout_s``: each rank's
        clock would end the wait at a different step (the ``timeout`` policy's deadline is
        agreed instead)."""
        if timeout_s is not None:
            _check_timeout(timeout_s)
        until = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            with self._gate.call():
                self._gate.check_open()
                tier = self._tier("wait_prefetch", prefetch)
                if tier.held is not None and timeout_s is not None:
                    raise ValueError(
                        "wait_prefetch: timeout_s on a tensor-parallel rank: the ranks would "
                        "stop waiting at different steps; leave it out (storage."
                        "prefetch_policy timeout bounds the wait, agreed by every rank)")
                if tier.ready(prefetch):
                    return True
            if tier.held is not None:
                tier.wait_for_change(prefetch, _WAIT_SLICE_S)
                self.step()
                continue
            left = _WAIT_SLICE_S if until is None else until - time.monotonic()
            if left <= 0:
                return False
            tier.wait_for_change(prefetch, min(left, _WAIT_SLICE_S))

    def finish_prefetch(self, prefetch: Prefetch) -> int:
        """Give the tree the pages that arrived (host-only nodes; match again to see them)
        and unlock the matched node; pages still on their way are dropped. Call once per
        prefetch, also for a request that is dropped. Returns the tokens added."""
        with self._gate.call():
            self._gate.check_open()
            return self._tier("finish_prefetch", prefetch).finish(prefetch)

    def _tier(self, op: str, prefetch: Prefetch) -> StorageTier:
        if not isinstance(prefetch, Prefetch):
            raise TypeError(f"{op}: expected a Prefetch from prefetch(), got "
                            f"{type(prefetch).__name__}")
        if self.storage is None:
            raise ValueError(f"{op}: this service has no store (the service stopped, or "
                             f"storage.backend is none)")
        if prefetch.finished:
            raise ValueError(f"{op}: this prefetch was finished already")
        if not self.storage.owns(prefetch):
            raise ValueError(f"{op}: this prefetch belongs to another service: pass it to "
                             f"the service whose prefetch() made it")
        return self.storage


def _check_timeout(timeout_s: object) -> None:
    """``wait_prefetch``'s ``timeout_s``: a number of seconds, 0 up to the longest wait
    Python can make (a NaN would be no timeout, a string fails later naming nothing)."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real):
        raise TypeError(f"wait_prefetch: timeout_s must be a number of seconds or None, got "
                        f"{type(timeout_s).__name__} {timeout_s!r:.20}")
    if not 0 <= float(timeout_s) <= threading.TIMEOUT_MAX:
        raise ValueError(f"wait_prefetch: timeout_s must be 0..{threading.TIMEOUT_MAX:g} "
                         f"seconds or None, got {timeout_s!r}")


def _check_same_prefix(key: bytes, node: TreeNode) -> None:
    """``ValueError`` unless ``key`` starts with the tokens of the path to ``node`` (a match
    of ``key``'s own tokens): a match of other tokens would hang their pages under it."""
    parts = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    path = b"".join(reversed(parts))
    if key[:len(path)] != path:
        raise ValueError("prefetch: the match is not of these tokens; pass the MatchResult "
                         "that match() returned for the same tokens")
