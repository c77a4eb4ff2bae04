"""``insert``'s check of the engine's slots (:meth:`EngineSlots.insertable`): the fast path
for the slots a served request gives back (the tree's own prefix, then one run the engine
holds) must answer exactly as the page-by-page check does, for any slots an engine passes:
the same pages the engine holds, or the same error, with nothing changed either way."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.config import config_from_dict
from hicache.engine_slots import EngineSlots
from hicache.factory import build_service
from hicache.pools import IndexSpace, Indices
from hicache.service import HiCacheService

PAGE = 2
MUTATIONS = ("as_served", "engine_prefix", "pages_swapped", "slots_swapped", "foreign_page",
             "tree_page_moved", "int32", "longer", "page_repeated", "padding_page",
             "past_the_pool", "strided")


def make_service() -> HiCacheService:
    return build_service(config_from_dict({
        "page_size_tokens": PAGE,
        "model": {"num_layers": 1, "attention": "mha", "num_kv_heads": 1, "head_dim": 2,
                  "dtype": "float32"},
        "device_pool": {"num_tokens": 64, "device": "cpu"},
        "host": {"ratio": 2.0, "ram_reserve_gib": 0.0},
        "controller": {"io_backend": "torch", "write_policy": "write_through",
                       "load_back_threshold_tokens": 0},
        "service": {"metrics_enabled": False, "integrity_check_interval_s": 3600.0},
    }))


def engine_of(service: HiCacheService) -> EngineSlots:
    engine = service._engine
    assert isinstance(engine, EngineSlots)
    return engine


def answer(call: Callable[[], np.ndarray]) -> tuple[str, object]:
    """``("pages", list)`` or ``("error", message)`` of ``call()``."""
    try:
        pages = call()
    except ValueError as exc:
        return "error", str(exc)
    return "pages", np.asarray(pages).tolist()


def engine_held(engine: EngineSlots, pages: np.ndarray) -> np.ndarray:
    """Those of ``pages`` the engine holds (the page-by-page check returns every page)."""
    return np.array([page for page in pages.tolist() if engine._held[page]], dtype=np.int64)


def slots_for(service: HiCacheService, mutation: str, prefix_pages: int, new_pages: int,
              tokens: list[int]) -> torch.Tensor:
    """The slots an engine passes for ``tokens`` (the tree caches their first
    ``prefix_pages`` pages), made as ``mutation`` says."""
    match = service.match(tokens)
    assert match.device_hit_tokens == prefix_pages * PAGE
    own = match.device_indices.tensor
    fresh = service.alloc_device(new_pages * PAGE)
    assert fresh is not None
    new = fresh.tensor
    slots = torch.cat([own, new])
    if mutation == "engine_prefix" and prefix_pages:
        copy = service.alloc_device(prefix_pages * PAGE)
        assert copy is not None
        slots = torch.cat([copy.tensor, new])
    elif mutation == "pages_swapped" and new_pages >= 2:
        pages = slots.view(-1, PAGE)
        slots = torch.cat([pages[:-2], pages[-1:], pages[-2:-1]]).reshape(-1)
    elif mutation == "slots_swapped" and len(slots):
        slots = slots.clone()
        slots[[0, 1]] = slots[[1, 0]]
    elif mutation == "foreign_page" and len(slots):
        foreign = service.controller.device_allocator.try_alloc(PAGE)  # behind its back
        assert foreign is not None
        slots = torch.cat([slots[:-PAGE], foreign.tensor])
    elif mutation == "tree_page_moved" and prefix_pages and new_pages:
        slots = torch.cat([new[:PAGE], own[PAGE:], own[:PAGE], new[PAGE:]])
    elif mutation == "int32":
        slots = slots.to(torch.int32)
    elif mutation == "longer":
        extra = service.alloc_device(PAGE)
        assert extra is not None
        slots = torch.cat([slots, extra.tensor])
    elif mutation == "page_repeated" and len(slots) >= 2 * PAGE:
        slots = torch.cat([slots[:-PAGE], slots[:PAGE]])
    elif mutation == "padding_page" and len(slots):
        slots = torch.cat([slots[:-PAGE], torch.arange(PAGE)])
    elif mutation == "past_the_pool" and len(slots):
        top = service.controller.device_allocator.num_slots
        slots = torch.cat([slots[:-PAGE], torch.arange(top, top + PAGE)])
    elif mutation == "strided":
        slots = torch.stack([slots, slots]).t().reshape(-1)[::2]  # a view with stride 2
    return slots


@settings(max_examples=120, deadline=None)
@given(prefix_pages=st.integers(0, 4), new_pages=st.integers(0, 4),
       mutation=st.sampled_from(MUTATIONS), seed=st.integers(0, 2**16))
def test_the_fast_path_answers_as_the_page_by_page_check(
        prefix_pages: int, new_pages: int, mutation: str, seed: int) -> None:
    service = make_service()
    try:
        rng = np.random.default_rng(seed)
        cached = [int(t) for t in rng.integers(1, 1000, size=prefix_pages * PAGE)]
        if cached:
            other = service.alloc_device(len(cached))
            assert other is not None
            service.insert(cached, other)
        tokens = cached + [int(t) for t in rng.integers(1000, 2000, size=new_pages * PAGE)]
        slots = Indices(slots_for(service, mutation, prefix_pages, new_pages, tokens),
                        IndexSpace.DEVICE_FULL)
        engine, key = engine_of(service), service.key(tokens)
        held_before = engine.num_tokens
        fast = answer(lambda: engine.insertable(service.tree, key, slots, len(tokens)))
        general = answer(lambda: engine_held(engine, engine.insertable_by_page(
            service.tree, key, slots, len(tokens))))
        assert fast == general
        assert engine.num_tokens == held_before  # a check changes nothing
        if fast[0] == "pages":  # and the insert itself goes through
            service.insert(key, slots)
    finally:
        service.stop()


def test_slots_as_served_take_the_fast_path() -> None:
    """The request's own slots (its cached prefix, then one allocation) are answered by the
    fast path; an engine copy of a cached page is not (the page-by-page check takes it)."""
    service = make_service()
    try:
        cached = [5, 6, 7, 8]
        first = service.alloc_device(4)
        assert first is not None
        service.insert(cached, first)
        tokens = [*cached, 9, 10]
        match = service.match(tokens)
        new = service.alloc_device(2)
        assert new is not None
        slots = Indices(torch.cat([match.device_indices.tensor, new.tensor]),
                        IndexSpace.DEVICE_FULL)
        engine, key = engine_of(service), service.key(tokens)
        served = engine._insertable_as_served(service.tree, key, slots, 6)
        assert served is not None
        assert served.own_tokens == 4  # the match's slots: compared with the tree's own
        assert served.pages.tolist() == (new.tensor[::PAGE] // PAGE).tolist()  # the engine's
        copy = service.alloc_device(4)
        assert copy is not None
        mixed = Indices(torch.cat([copy.tensor, new.tensor]), IndexSpace.DEVICE_FULL)
        assert engine._insertable_as_served(service.tree, key, mixed, 6) is None
        assert service.insert(key, mixed) == 4  # the copy's pages are duplicates, freed
        service.check_integrity()
    finally:
        service.stop()


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_a_request_with_nothing_cached_inserts_its_run(dtype: torch.dtype) -> None:
    service = make_service()
    try:
        slots = service.alloc_device(6)
        assert slots is not None
        assert service.insert([1, 2, 3, 4, 5, 6], Indices(slots.tensor.to(dtype),
                                                          IndexSpace.DEVICE_FULL)) == 0
        assert service.engine_held_tokens == 0
        service.check_integrity()
    finally:
        service.stop()


def test_negative_slots_are_refused_even_where_they_would_wrap_to_held_pages() -> None:
    """A run of negative pages would index the held-page map from its end (numpy's
    negative indices), where the engine holds the pool's top pages: refused all the same."""
    service = make_service()
    try:
        every = service.alloc_device(service.controller.device_allocator.num_free_tokens)
        assert every is not None  # the engine holds every page, the top ones included
        tokens = [1, 2, 3, 4]
        wrapped = Indices(torch.arange(-3 * PAGE, -PAGE), IndexSpace.DEVICE_FULL)
        with pytest.raises(ValueError, match="insert"):
            service.insert(tokens, wrapped)
        assert service.engine_held_tokens == len(every)
        service.free_device(every)
        service.check_integrity()
    finally:
        service.stop()


# ---- what the tree keeps: copies, never the engine's tensor ------------------------------


def cache_new(service: HiCacheService, tokens: list[int]) -> Indices:
    """Allocate slots for ``tokens`` (whole pages) and insert them; the slots."""
    slots = service.alloc_device(len(tokens))
    assert slots is not None
    service.insert(tokens, slots)
    return slots


def scribble(tensor: torch.Tensor) -> None:
    """The engine reuses its slot tensor after insert: every value overwritten in place."""
    tensor.copy_(torch.flip(tensor, [0]) + 2 * PAGE)


@pytest.mark.parametrize("path", ["service", "tree"])
def test_the_tree_keeps_copies_of_new_and_reattached_slots(path: str) -> None:
    """A new node's slots and a host-only node's new device slots are the tree's own
    copies: the engine overwriting its tensor after insert changes nothing cached. Both
    the service's insert and the tree's own (``take_slots``) are covered."""
    service = make_service()
    try:
        tokens = list(range(100, 108))  # 4 pages
        slots = service.alloc_device(len(tokens))
        assert slots is not None
        engine_tensor = slots.tensor.clone()
        if path == "service":
            service.insert(tokens, Indices(engine_tensor, IndexSpace.DEVICE_FULL))
        else:  # the tree's public insert, the engine's pages handed over by hand
            service.tree.insert(tokens, Indices(engine_tensor, IndexSpace.DEVICE_FULL))
            engine_of(service).forget(np.unique(slots.tensor.numpy() // PAGE))
        kept = slots.tensor.clone()
        scribble(engine_tensor)
        assert torch.equal(service.match(tokens).device_indices.tensor, kept)
        service.check_integrity()

        service.step()  # the write-through backup is acknowledged: evictable
        assert service.evict(len(tokens)) == len(tokens)
        assert service.match(tokens).device_hit_tokens == 0
        again = service.alloc_device(len(tokens))  # re-attach: new device slots
        assert again is not None
        engine_tensor = again.tensor.clone()
        service.insert(tokens, Indices(engine_tensor, IndexSpace.DEVICE_FULL))
        kept = again.tensor.clone()
        scribble(engine_tensor)
        assert torch.equal(service.match(tokens).device_indices.tensor, kept)
        service.check_integrity()
    finally:
        service.stop()


def test_duplicate_pages_are_freed_and_the_cached_ones_kept_after_a_scribble() -> None:
    """The engine's own copy of a cached prefix (duplicates, freed by insert) compared
    through a view: the tree keeps its pages, the duplicates go back to the pool, and the
    engine overwriting its tensor afterwards changes neither."""
    service = make_service()
    try:
        tokens = list(range(200, 208))
        first = cache_new(service, tokens)
        free_before = service.controller.device_allocator.num_free_tokens
        copy = service.alloc_device(len(tokens))
        assert copy is not None
        engine_tensor = copy.tensor.clone()
        assert service.insert(tokens, Indices(engine_tensor, IndexSpace.DEVICE_FULL)) == 8
        assert service.controller.device_allocator.num_free_tokens == free_before
        scribble(engine_tensor)
        assert torch.equal(service.match(tokens).device_indices.tensor, first.tensor)
        assert service.engine_held_tokens == 0
        service.check_integrity()
    finally:
        service.stop()


@pytest.mark.parametrize("nodes", [1, 2])
def test_a_match_hands_out_its_own_tensor(nodes: int) -> None:
    """The engine writing into a match's slots (reusing the tensor as its buffer) changes
    nothing cached, whether the prefix is one node (whose slots the match once handed out
    as they were) or several (a concatenation)."""
    service = make_service()
    try:
        tokens = list(range(300, 308))
        first = cache_new(service, tokens)
        if nodes == 2:  # a branch at token 4 splits the cached node in two
            branch = [*tokens[:4], 900, 901, 902, 903]
            slots = service.alloc_device(8)
            assert slots is not None
            prefix = service.match(branch).device_indices.tensor
            service.insert(branch, Indices(torch.cat([prefix, slots.tensor[4:]]),
                                           IndexSpace.DEVICE_FULL))
            service.free_device(Indices(slots.tensor[:4], IndexSpace.DEVICE_FULL))
        match = service.match(tokens)
        path, node = 0, match.last_device_node
        while node is not service.tree.root:
            path, node = path + 1, node.parent
        assert path == nodes
        scribble(match.device_indices.tensor)
        assert torch.equal(service.match(tokens).device_indices.tensor, first.tensor)
        service.check_integrity()
        service.step()
        service.check_integrity()
    finally:
        service.stop()
