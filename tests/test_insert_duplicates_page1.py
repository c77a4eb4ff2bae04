"""``HiCacheService.insert`` at pages of one token, over a tree whose first node is one token
long: an insert of cached tokens whose first slot is fresh and whose second is the tree's
own gives the fresh slots back, the first one included (CPU)."""

from __future__ import annotations

import dataclasses

import torch
from test_service_refusals import make_config

from hicache import HiCacheService
from hicache.factory import build_service
from hicache.pools import IndexSpace, Indices


def check_fresh_first_slot_is_given_back(service: HiCacheService,
                                          window_backup: bool = False) -> None:
    """The scenario of the module docstring on ``service`` (pages of one token);
    ``window_backup``: the fresh first slot leaves the window just before the insert, so
    the insert first waits for its window backup (hybrid, SWA history kept)."""
    device = service.tree.io.allocators()[IndexSpace.DEVICE_FULL]
    short = service.alloc_device(1)
    assert short is not None
    service.insert([5], short)  # the first node: one token
    longer = service.alloc_device(3)
    assert longer is not None
    service.insert([5, 6, 7], Indices(torch.cat([short.tensor, longer.tensor[1:]]),
                                      IndexSpace.DEVICE_FULL))
    service.free_device(Indices(longer.tensor[:1], IndexSpace.DEVICE_FULL))
    service.step()
    assert sorted(n.num_tokens for n in service.tree.nodes()) == [1, 2]
    free = device.num_free_tokens
    fresh = service.alloc_device(3)
    assert fresh is not None
    if window_backup:
        service.release_window(Indices(fresh.tensor[:1], IndexSpace.DEVICE_FULL))
        assert service.tree.window_backups.in_flight(fresh)
    own = service.tree.device_prefix([5, 6, 7]).tensor
    mixed = torch.stack([fresh.tensor[0], own[1], fresh.tensor[2]])
    service.insert([5, 6, 7], Indices(mixed, IndexSpace.DEVICE_FULL))
    service.free_device(Indices(fresh.tensor[1:2], IndexSpace.DEVICE_FULL))
    service.step()
    assert device.num_free_tokens == free, "every fresh slot given back"
    assert service.engine_held_tokens == 0
    service.check_integrity()


def test_a_fresh_first_slot_over_a_one_token_node_is_given_back() -> None:
    service = build_service(dataclasses.replace(make_config(), page_size_tokens=1))
    try:
        check_fresh_first_slot_is_given_back(service)
    finally:
        service.stop()


def test_the_same_after_a_window_backup_of_the_fresh_slot() -> None:
    """Hybrid, every SWA row kept on the host: the fresh first slot left the window just
    before the insert, so the insert first waits for its window backup and applies the
    acks; the first node's slot is still compared and the fresh one given back."""
    service = build_service(dataclasses.replace(make_config(hybrid=True), page_size_tokens=1))
    try:
        assert service.tree.io.keeps_swa_history
        check_fresh_first_slot_is_given_back(service, window_backup=True)
    finally:
        service.stop()
