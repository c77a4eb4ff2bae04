"""Integrity check of the tiered radix tree: shape, tier invariants and slot conservation.

For every index space of the model (``DEVICE_FULL``, ``HOST_FULL`` and, for hybrid models,
``DEVICE_SWA`` and ``HOST_SWA``) every allocated page must be owned by exactly one node or
held by the engine (slots it allocated and has not inserted yet), and every page in flight
in the controller must be node-owned (a host page by a node whose op is in flight, which
host eviction relies on instead of asking the controller); so free + owned + engine-held ==
capacity. Failures
raise ``RuntimeError`` naming the space, the page and the nodes involved; nothing is
repaired. Cost: one walk of the tree and a few sorts of page ids; :class:`TreeCheck` does the
walk in steps with a deadline each, and the sorts without the tree.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from hicache.pools import IndexSpace, Indices, PageAllocator
from hicache.pools.allocator import used_pages_of

from .key import TOKEN_BYTES
from .node import SLOT_FIELDS, TreeNode

if TYPE_CHECKING:
    from .tiers import TieredRadixTree

_Owned = list[tuple[int, np.ndarray]]  # (node id, pages)


def check_tree(tree: TieredRadixTree, engine_device: Indices | None, sync_device: bool) -> None:
    """Raise ``RuntimeError`` unless ``tree`` and its pools are consistent (module docstring).

    Args:
        tree: the tree to check; only read.
        engine_device: ``[n]`` CPU ``DEVICE_FULL`` slots the engine holds (whole pages), or
            ``None`` when it holds none.
        sync_device: also compare device-side state with its host mirror (the hybrid map),
            which waits for the GPU; without it the check reads CPU state only.
    """
    tree.io.check_pools(sync_device)
    check = TreeCheck(tree)
    check.walk(deadline=None)
    check.conclude(check.snapshot(engine_device))


@dataclass(frozen=True)
class PoolSnapshot:
    """What the conservation half of a check reads besides the nodes, copied at one moment:
    per index space, the free map, the slots in flight and the engine-held pages."""

    used: dict[IndexSpace, np.ndarray]
    busy: dict[IndexSpace, np.ndarray]
    engine: dict[IndexSpace, np.ndarray]


class TreeCheck:
    """One integrity check in steps, so that a caller can spread it over short holds of the
    lock that guards the tree (see :class:`hicache.integrity_slices.SlicedIntegrityCheck`).

    :meth:`walk` checks nodes and gathers the pages they own, until a deadline;
    :meth:`snapshot` copies the pools' side (allocated, in flight, engine-held); both read
    the tree and must run with nothing changing it between the first walk and the snapshot.
    :meth:`conclude` compares the two and needs no lock. Each step raises ``RuntimeError``
    on the first inconsistency it finds.
    """

    def __init__(self, tree: TieredRadixTree) -> None:
        self.tree = tree
        self.allocators = tree.io.allocators()
        self.owned: dict[IndexSpace, _Owned] = defaultdict(list)
        self.in_flight: dict[IndexSpace, list[np.ndarray]] = defaultdict(list)
        self._nodes = tree.nodes()

    def walk(self, deadline: float | None) -> bool:
        """Check nodes until every node is done (``True``) or ``time.perf_counter()`` passes
        ``deadline`` (``False``; call again to go on); ``None``: no deadline."""
        allocators = self.allocators
        for node in self._nodes:
            for name in SLOT_FIELDS:  # first: the node checks below read the pool's map at them
                value: Indices | None = getattr(node, name)
                if value is not None:
                    pages = _pages(allocators, value, f"{node!r}.{name}", name.endswith("_swa"))
                    self.owned[value.space].append((node.node_id, pages))
                    if node.is_in_flight:
                        self.in_flight[value.space].append(pages)
            _check_node(self.tree, node)
            if deadline is not None and time.perf_counter() > deadline:
                return False
        return True

    def snapshot(self, engine_device: Indices | None) -> PoolSnapshot:
        """Copies of the pools' side of the check (a few array copies, no walk)."""
        engine = _engine_pages(self.tree, engine_device)
        used, busy = {}, {}
        for space, allocator in self.allocators.items():
            used[space] = allocator.free_map()  # pages in use computed by conclude()
            busy[space] = np.array(self.tree.controller.busy_slots(space), dtype=np.int64)
        return PoolSnapshot(used, busy, engine)

    def conclude(self, snapshot: PoolSnapshot) -> None:
        """Conservation of every index space, from the walk and ``snapshot``; no lock."""
        for space, allocator in self.allocators.items():
            busy = np.unique(snapshot.busy[space] // allocator.page_size)
            _check_space(space, used_pages_of(snapshot.used[space]), self.owned[space],
                         snapshot.engine.get(space), busy)
            if space in (IndexSpace.HOST_FULL, IndexSpace.HOST_SWA):
                engine = snapshot.engine.get(space)
                allowed = self.in_flight[space] + ([] if engine is None else [engine])
                _check_host_in_flight(space, allowed, busy)


def _check_host_in_flight(space: IndexSpace, in_flight: list[np.ndarray],
                          busy: np.ndarray) -> None:
    """Every host page in flight belongs to a node whose op is in flight: host eviction
    trusts the node's flags and never asks the controller."""
    pages = np.concatenate(in_flight or [np.empty(0, np.int64)])
    unflagged = np.setdiff1d(busy, pages)
    if unflagged.size:
        raise RuntimeError(f"{space.name} page {int(unflagged[0])} is in flight but its node "
                           f"has no op in flight (host eviction would free it)")


def _check_node(tree: TieredRadixTree, node: TreeNode) -> None:
    """Shape, locks and tier invariants of one node."""
    page = tree.page_size
    parent = node.parent
    first_page = node.key[:page * TOKEN_BYTES]
    if parent is None or node.is_detached or parent.children.get(first_page) is not node:
        raise RuntimeError(f"{node!r} is not linked to its parent under its first page")
    if node.num_tokens == 0 or node.num_tokens % page:
        raise RuntimeError(f"{node!r}: key of {node.num_tokens} tokens is not whole pages")
    for name in SLOT_FIELDS:
        value: Indices | None = getattr(node, name)
        if value is not None and len(value) != node.num_tokens:
            raise RuntimeError(f"{node!r}: {len(value)} {name} slots for its tokens")
    below = sum(child.lock_count for child in node.children.values())
    if node.lock_count < below or node.lock_count < 0:
        raise RuntimeError(f"{node!r}: lock count {node.lock_count} < children's {below}")
    if node.caller_locks < 0 or node.lock_count < below + node.caller_locks:
        raise RuntimeError(f"{node!r}: lock count {node.lock_count} < children's {below} "
                           f"+ the engine's {node.caller_locks}")
    if node.on_device and parent is not tree.root and not parent.on_device:
        raise RuntimeError(f"{node!r} is on the device but its parent {parent!r} is not")
    if not node.on_device and not node.is_backed_up:
        raise RuntimeError(f"{node!r} is on neither tier (no device slots, no host copy)")
    if node.write_op is not None and node.write_op.queued:
        if node.host is not None or not node.on_device or node.lock_count < 1:
            raise RuntimeError(f"{node!r}: a queued backup needs a locked device node with "
                               f"no host slots yet")
    elif node.write_op is not None and node.host is None:
        raise RuntimeError(f"{node!r} has a backup in flight but no host slots")
    if node.evict_on_ack and node.write_op is None:
        raise RuntimeError(f"{node!r} waits to be evicted after a write that is not in flight")
    for op in (node.write_op, node.load_op, node.store_op):
        if op is not None and node not in op.nodes:
            raise RuntimeError(f"{node!r} is in flight but missing from its op")
    if node.store_op is not None and not node.is_backed_up:
        raise RuntimeError(f"{node!r} is being stored but has no complete host copy")
    _check_swa(tree, node)


def _check_swa(tree: TieredRadixTree, node: TreeNode) -> None:
    """SWA fields: device SWA slots match the pool's map. (SWA slots in a model without SWA
    pools were refused when the walk read their pages, "no pool of space"; a node with SWA
    host slots and no full rows anywhere is on neither tier, refused before this.)"""
    if not tree.io.is_hybrid:
        return
    if node.host is not None and node.host_swa is None:
        raise RuntimeError(f"{node!r}: a host copy of the full rows without SWA host slots")
    if node.device is None:
        if node.device_swa is not None:
            raise RuntimeError(f"{node!r} holds device SWA slots but no device slots")
        return
    mapped = tree.io.swa_of(node.device)
    if node.device_swa is None or mapped is None or \
            not torch.equal(node.device_swa.tensor, mapped.tensor):
        raise RuntimeError(f"{node!r}: recorded device SWA slots differ from the pool's map")


def _pages(
    allocators: dict[IndexSpace, PageAllocator], indices: Indices, what: str, aligned: bool
) -> np.ndarray:
    """Page ids of ``indices`` (0 entries skipped when ``aligned``); RuntimeError if bad."""
    if indices.space not in allocators:
        raise RuntimeError(f"{what}: no pool of space {indices.space.name} in this model")
    if aligned:
        indices = Indices(indices.tensor[indices.tensor != 0], indices.space)
    try:
        return allocators[indices.space].pages_of(indices, op=what)
    except ValueError as exc:
        raise RuntimeError(f"integrity: {exc}") from exc


def _engine_pages(
    tree: TieredRadixTree, engine_device: Indices | None
) -> dict[IndexSpace, np.ndarray]:
    """Pages the engine holds: its device pages, their SWA pages, and the host SWA copies
    of the rows that left a running request's window (``window_backups``)."""
    allocators = tree.io.allocators()
    pages: dict[IndexSpace, np.ndarray] = {}
    backups = getattr(tree, "window_backups", None)
    if backups is not None and len(backups):
        pages[IndexSpace.HOST_SWA] = _pages(allocators, backups.host_slots(),
                                            "engine window backups", False)
        _check_backed_up_pages(allocators, backups.device_pages(), engine_device)
    if tree.storage is not None:
        for space, held in ((IndexSpace.HOST_FULL, tree.storage.held_host_slots()),
                            (IndexSpace.HOST_SWA, tree.storage.held_host_swa_slots())):
            if held is not None and len(held):
                mine = _pages(allocators, held, "shared-store tier slots", False)
                pages[space] = np.concatenate([pages[space], mine]) if space in pages else mine
    if engine_device is None or not len(engine_device):
        return pages
    pages |= {IndexSpace.DEVICE_FULL: _pages(allocators, engine_device, "engine slots", False)}
    swa = tree.io.engine_swa_slots(engine_device)
    if swa is not None:
        pages[IndexSpace.DEVICE_SWA] = _pages(allocators, swa, "engine SWA slots", False)
    return pages


def _check_backed_up_pages(allocators: dict[IndexSpace, PageAllocator], pages: np.ndarray,
                           engine_device: Indices | None) -> None:
    """A window backup is of a page the engine still holds (the page's going takes it):
    one of ``engine_device`` when the engine's pages are known, else an allocated page."""
    allocator = allocators[IndexSpace.DEVICE_FULL]
    if engine_device is None:
        gone = allocator.first_unallocated_page(pages)
        if gone is not None:
            raise RuntimeError(f"a window backup is of DEVICE_FULL page {gone}, which is free")
        return
    held = np.isin(pages, _pages(allocators, engine_device, "engine slots", False))
    if not held.all():
        raise RuntimeError(f"a window backup is of DEVICE_FULL page {int(pages[~held][0])}, "
                           f"which the engine no longer holds")


def _check_space(
    space: IndexSpace, used: np.ndarray, owned: _Owned, engine: np.ndarray | None,
    busy: np.ndarray,
) -> None:
    """Conservation of one index space (module docstring)."""
    name = space.name
    ids = np.concatenate([np.full(p.size, i) for i, p in owned] or [np.empty(0, np.int64)])
    pages = np.concatenate([p for _, p in owned] or [np.empty(0, np.int64)])
    order = np.argsort(pages, kind="stable")
    pages, ids = pages[order], ids[order]
    twice = np.flatnonzero(pages[1:] == pages[:-1])
    if twice.size:
        i = int(twice[0])
        raise RuntimeError(f"{name} page {int(pages[i])} is owned by nodes {int(ids[i])} and "
                           f"{int(ids[i + 1])}")
    engine = np.empty(0, np.int64) if engine is None else engine
    shared = np.intersect1d(pages, engine)
    if shared.size:
        raise RuntimeError(f"{name} page {int(shared[0])} is owned by a node and also held "
                           f"by the engine")
    held = np.concatenate([pages, engine])
    free_but_held = np.setdiff1d(held, used)
    if free_but_held.size:
        raise RuntimeError(f"{name} page {int(free_but_held[0])} is free in its allocator but "
                           f"owned by a node or held by the engine")
    leaked = np.setdiff1d(used, held)
    if leaked.size:
        raise RuntimeError(f"{name}: {leaked.size} allocated pages are owned by no node and not "
                           f"held by the engine (leak), first page {int(leaked[0])}")
    # engine-held SWA pages are in flight while their window backup is written
    swa = space in (IndexSpace.DEVICE_SWA, IndexSpace.HOST_SWA)
    stray = np.setdiff1d(busy, held if swa else pages)
    if stray.size:
        owner = "owned by no node and not held by the engine" if swa else (
            "owned by no node (only the tree's nodes move these pages)")
        raise RuntimeError(f"{name} page {int(stray[0])} is in flight but {owner}")
