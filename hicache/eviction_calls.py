"""The service's eviction calls: free device, device SWA or host tokens on the engine's
demand (an allocation that finds no room evicts by itself; these free ahead of it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import slot_handoff

if TYPE_CHECKING:
    from .call_gate import CallGate
    from .radix import HiRadixCache


class EvictionCalls:
    """Mixed into :class:`~hicache.service.HiCacheService` (its lock and gate, as every call)."""

    tree: HiRadixCache
    _gate: CallGate

    def evict_swa(self, num_tokens: int) -> int:
        """:meth:`HiRadixCache.evict_swa`: device SWA tokens freed (nodes keep full rows)."""
        with self._gate.call():
            self._gate.check_open()
            return self.tree.evict_swa(slot_handoff.check_count("evict_swa", num_tokens))

    def evict(self, num_tokens: int) -> int:
        """:meth:`HiRadixCache.evict`: device tokens freed now. Under ``write_back`` the
        tokens it writes back first are freed by a later :meth:`step`, once written."""
        with self._gate.call():
            self._gate.check_open()
            return self.tree.evict(slot_handoff.check_count("evict", num_tokens))

    def evict_host(self, num_tokens: int) -> int:
        """:meth:`HiRadixCache.evict_host`: host tokens freed."""
        with self._gate.call():
            self._gate.check_open()
            return self.tree.evict_host(slot_handoff.check_count("evict_host", num_tokens))
