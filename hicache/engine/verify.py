"""End-to-end checks of the demo: loaded pages hold what was backed up, tokens match.

:class:`TransferAudit` observes every call queued on a controller
(``CacheController.add_observer``). For a write it keeps a digest of every device row being
backed up, keyed by the host slot it goes to (SWA-only window backups included); for a load
it remembers which host slot goes to which device slot (SWA restores included).
:meth:`TransferAudit.check_loads`, called once the batch that waited on those loads has
run, hashes the device rows again and reports every page whose rows differ from their backup.

Device rows are read on the caller's current stream: on a GPU, call both from the stream
that wrote the rows (the engine's forward stream), which also waited on the loads.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from hicache.controller import Direction, HybridCacheController, PoolTransfer, TransferCore
from hicache.pools import DeviceKVPool, HostKVPool

from .reference import TurnKey

DIGEST_BYTES = 8


@dataclass(frozen=True)
class PendingLoad:
    """Host slots loaded into device slots of one pool, for the request named ``request``."""

    request: str
    pool: str
    host_slots: np.ndarray
    device_slots: np.ndarray


class TransferAudit:
    """Digests of backed-up rows and checks of loaded rows (module docstring).

    Args:
        controller: the service's controller (plain or hybrid); its methods are wrapped.
        corrupt_host_byte: testing aid: flip one byte of the host pool in the first page
            that is loaded back (after its backup, before its load), so that
            :meth:`check_loads` must report that page.
    """

    def __init__(self, controller: TransferCore, *, corrupt_host_byte: bool = False) -> None:
        self.controller = controller
        self.request = "-"
        self.mismatches: list[str] = []
        self.checked_pages = 0
        self.checked_from_store = 0  # of them, pages whose digests came with the store's page
        self.from_store: dict[str, set[int]] = {"full": set(), "swa": set()}  # such host slots
        self.corrupted_slot: int | None = None
        self._corrupt = corrupt_host_byte
        self._digests: dict[str, dict[int, bytes]] = {"full": {}, "swa": {}}
        self._pending: list[PendingLoad] = []
        controller.add_observer(self._observe)

    def close(self) -> None:
        """Stop observing the controller."""
        self.controller.remove_observer(self._observe)

    @contextmanager
    def serving(self, request: str) -> Iterator[None]:
        """Attribute the loads queued inside the block to ``request`` (for messages)."""
        self.request = request
        try:
            yield
        finally:
            self.request = "-"

    def digests(self, pool: str) -> dict[int, bytes]:
        """The expected row digest of every host slot of ``pool`` (``full``, ``swa``) whose
        rows were backed up; a caller that puts rows into host slots by other means (the
        shared store) records what they must be here."""
        return self._digests[pool]

    def check_loads(self) -> int:
        """Compare every pending load with its backup; returns the pages checked. A page
        that differs is appended to :attr:`mismatches` as one line."""
        pending, self._pending = self._pending, []
        return sum(self._check(load) for load in pending)

    def _check(self, load: PendingLoad) -> int:
        page = self.controller.device_allocator.page_size
        got = _row_digests(self._device_pool(load.pool), load.device_slots)
        known = self._digests[load.pool]
        for start in range(0, len(got), page):
            host = load.host_slots[start:start + page]
            want = [known.get(int(slot)) for slot in host]
            if want != got[start:start + page]:
                self.mismatches.append(
                    f"{load.request}: host page {int(host[0]) // page} of pool '{load.pool}' "
                    f"loaded into device page {int(load.device_slots[start]) // page} differs "
                    f"from its backup"
                )
        num_pages = -(-len(got) // page)
        self.checked_pages += num_pages
        stored = self.from_store[load.pool]
        self.checked_from_store += sum(int(slot) in stored for slot in load.host_slots[::page])
        return num_pages

    # ---- the controller's observer --------------------------------------------------

    def _observe(self, direction: Direction, transfers: Sequence[PoolTransfer],
                 tag: object) -> None:
        """Every queued call: digest the device rows a write backs up; remember which host
        slots a load brings to which device slots (checked by :meth:`check_loads`)."""
        for transfer in transfers:
            host = transfer.host_indices.tensor.numpy()
            device = transfer.device_indices.tensor.numpy()
            if direction is Direction.DEVICE_TO_HOST:
                self._remember(transfer.name, device, host)
                continue
            if self._corrupt and self.corrupted_slot is None and transfer.name == "full" \
                    and host.size:
                self._flip_byte(int(host[0]))
            if host.size:
                self._pending.append(PendingLoad(self.request, transfer.name, host.copy(),
                                                 device.copy()))

    # ---- helpers ------------------------------------------------------------------------

    def _remember(self, pool: str, device: np.ndarray, host: np.ndarray) -> None:
        """Digest device rows at ``device`` under host slots ``host`` (0 pairs skipped)."""
        keep = (device != 0) & (host != 0)
        digests = _row_digests(self._device_pool(pool), device[keep])
        slots = host[keep].tolist()
        self._digests[pool].update(zip(slots, digests, strict=True))
        self.from_store[pool].difference_update(slots)  # this instance's own rows now

    def _device_pool(self, pool: str) -> DeviceKVPool:
        controller = self.controller
        if isinstance(controller, HybridCacheController):
            return controller.hybrid_pool.swa if pool == "swa" else controller.hybrid_pool.full
        return controller.device_pool

    def _host_pool(self) -> HostKVPool:
        return self.controller.host_pool

    def _flip_byte(self, host_slot: int) -> None:
        """XOR the lowest byte of the first K element of ``host_slot``, layer 0."""
        pool = self._host_pool()
        row = pool.layer_pages(0, 0)[host_slot // pool.page_size, host_slot % pool.page_size]
        row.view(torch.uint8)[0:1].bitwise_xor_(1)
        self.corrupted_slot = host_slot


def _row_digests(pool: DeviceKVPool, slots: np.ndarray) -> list[bytes]:
    """Digest of every slot's rows (all components, all layers of ``pool``)."""
    if slots.size == 0:
        return []
    index = torch.from_numpy(slots.astype(np.int64)).to(pool.device)
    rows = pool.data[:, :, index].permute(2, 0, 1, 3).contiguous().cpu()
    raw = rows.view(torch.uint8).reshape(slots.size, -1).numpy()
    return [hashlib.blake2b(raw[i].tobytes(), digest_size=DIGEST_BYTES).digest()
            for i in range(slots.size)]


def first_token_mismatch(
    generated: dict[TurnKey, list[int]], expected: dict[TurnKey, list[int]],
) -> str | None:
    """The first turn (in conversation, turn order) whose tokens differ from the baseline,
    as one line naming the request and the token; ``None`` when every turn matches."""
    for key in sorted(expected):
        want, got = expected[key], generated.get(key)
        name = f"conversation {key[0]} turn {key[1] + 1}"
        if got is None:
            return f"{name}: never served"
        for i, (a, b) in enumerate(zip(got, want, strict=False)):
            if a != b:
                return f"{name}: token {i} is {a}, the baseline generated {b}"
        if len(got) != len(want):
            return f"{name}: {len(got)} tokens generated, the baseline generated {len(want)}"
    return None
