"""Audit of bad input at the API an engine imports (``hicache/__init__.py``): the service's
scheduler calls, the device pool it writes through, ``TokenKey``, ``PageTable``,
``load_config`` and ``build_service``.

The project's rule: every bad input gets a clear error that names what is wrong and what to
do, and leaves every counter, lock and slot as it was. Some tests pin inputs that were
handled that way but not tested at the service's level; the others are the gaps the audit
found, each fixed: a release of a lock the engine never took, another service's prefetch,
unchecked token counts and quotas, hand-made keys, layer and row ids that are not ints, bare
tensors where ``Indices`` belong, a second window release in one step, a bad slot in the
partial page given to ``insert``, page tables of another page size, a CUDA device the
process lacks, arguments that are not a config or a path, and a RAM check that left out a
device pool on the CPU.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_service_refusals import put, refused, snapshot

from hicache import (
    BoundsError,
    ConfigError,
    HiCacheConfig,
    HiCacheService,
    IndexSpace,
    Indices,
    PageTable,
    TokenKey,
    build_service,
    config_from_dict,
    load_config,
)
from hicache.config import GIB, loading
from hicache.pools import HybridSWAPool

PAGE = 2
A = [1, 1, 2, 2, 3, 3]
B = [4, 4, 5, 5]
NEW = [7, 7, 8, 8]  # tokens no fixture caches
FULL = IndexSpace.DEVICE_FULL
MODEL = {"model_id": "test/model", "model_revision": "r1"}


def raw_config(*, hybrid: bool = False, device: str = "cpu", num_tokens: int = 32,
               ratio: float = 2.0, storage: dict[str, Any] | None = None) -> dict[str, Any]:
    """A 2-layer model (32 bytes a token), pages of 2, write-through, no metrics."""
    model: dict[str, Any] = {"num_layers": 2, "attention": "mha", "num_kv_heads": 1,
                             "head_dim": 2, "dtype": "float32"}
    pool: dict[str, Any] = {"num_tokens": num_tokens, "device": device}
    if hybrid:
        model.update(swa_layers=[1], window_tokens=3)
        pool["swa_num_tokens"] = 16
    data: dict[str, Any] = {
        "page_size_tokens": PAGE, "model": model, "device_pool": pool,
        "host": {"ratio": ratio, "ram_reserve_gib": 0.0},
        "controller": {"io_backend": "torch", "write_policy": "write_through",
                       "load_back_threshold_tokens": 0},
        "service": {"metrics_enabled": False, "integrity_check_interval_s": 60.0},
    }
    if storage is not None:
        data["storage"] = storage
    return data


def make_config(**kwargs: Any) -> HiCacheConfig:
    return config_from_dict(raw_config(**kwargs), check_ram=False)


@pytest.fixture
def service() -> Iterator[HiCacheService]:
    """A plain service caching A and B on both tiers."""
    built = build_service(make_config())
    put(built, A)
    put(built, B)
    yield built
    built.stop()


@pytest.fixture
def hybrid() -> Iterator[HiCacheService]:
    """A hybrid (sliding-window) service caching A and B."""
    built = build_service(make_config(hybrid=True))
    put(built, A)
    put(built, B)
    yield built
    built.stop()


# ---- slots the engine passes in: handled (tested here at the service's level) -------------


def _bad_slots(held: Indices) -> dict[str, tuple[object, type[Exception], str]]:
    """Four-slot stand-ins for the engine's ``held`` slots (two pages), each with the error
    every slot-taking call raises for it; ``{op}`` is the call's name."""
    tensor = held.tensor
    first = int(tensor[0])
    return {
        "bare-tensor": (tensor, TypeError, r"^{op}: expected .*Indices"),
        "list": (tensor.tolist(), TypeError, r"^{op}: expected .*Indices"),
        "none": (None, TypeError, r"^{op}: expected .*Indices"),
        "host-space": (Indices(tensor, IndexSpace.HOST_FULL), ValueError,
                       r"^{op}: pool 'full' takes indices in space DEVICE_FULL, got HOST_FULL$"),
        "swa-space": (Indices(tensor, IndexSpace.DEVICE_SWA), ValueError,
                      r"^{op}: pool 'full' takes indices in space DEVICE_FULL, got DEVICE_SWA"),
        "float": (Indices(tensor.float(), FULL), ValueError,
                  r"^{op}: indices for pool 'full' must be int32 or int64, got torch\.float32$"),
        "int16": (Indices(tensor.to(torch.int16), FULL), ValueError,
                  r"^{op}: indices for pool 'full' must be int32 or int64, got torch\.int16$"),
        "2-d": (Indices(tensor.view(2, 2), FULL), ValueError,
                r"^{op}: indices for pool 'full' must be 1-D, got shape \(2, 2\)$"),
        "meta-device": (Indices(tensor.to("meta"), FULL), ValueError,
                        r"^{op}: indices for pool 'full' must be on cpu, got meta"),
        "negative": (Indices(torch.tensor([-2, -1, -4, -3]), FULL), BoundsError,
                     r"^{op}: slot -4 is negative for pool 'full' \(valid slots are 0\.\.33\)"),
        "out-of-range": (Indices(torch.tensor([100, 101, 102, 103]), FULL), BoundsError,
                         r"^{op}: slot 103 is out of range for pool 'full' \(valid slots are "
                         r"0\.\.33\); pass only slots this pool handed out$"),
        "far-out-of-range": (Indices(torch.tensor([2**40 + i for i in range(4)]), FULL),
                                 BoundsError, r"^{op}: slot 1099511627779 is out of range"),
        "padding-page": (Indices(torch.tensor([0, 1, first, first + 1]), FULL), ValueError,
                         r"^{op}: page 0 of pool 'full' is reserved for padding$"),
        "same-page-twice": (Indices(torch.cat([tensor[:2], tensor[:2]]), FULL), ValueError,
                            r"^{op}: the same page appears twice$"),
        "page-out-of-order": (Indices(tensor[[1, 0, 2, 3]], FULL), ValueError,
                              r"^{op}: slots must come in whole, ordered pages of 2$"),
    }


BAD_SLOT_CASES = list(_bad_slots(Indices(torch.arange(4, 8), FULL)))


@pytest.mark.parametrize("case", BAD_SLOT_CASES)
@pytest.mark.parametrize("op", ["insert", "free_device", "release_window"])
def test_bad_slots_are_refused_by_name_before_anything_changes(
        service: HiCacheService, op: str, case: str) -> None:
    """Every call that takes the engine's slots refuses a bad one, naming itself, and the
    engine still holds its pages afterwards."""
    held = service.alloc_device(4)
    assert held is not None
    bad, error, pattern = _bad_slots(held)[case]
    call = getattr(service, op)
    args = (NEW, bad) if op == "insert" else (bad,)
    refused(service, error, pattern.format(op=op), call, *args)
    assert service.engine_held_tokens == 4
    service.free_device(held)
    service.check_integrity()


@pytest.mark.parametrize("op", ["insert", "free_device", "release_window"])
def test_a_partial_page_is_refused(service: HiCacheService, op: str) -> None:
    held = service.alloc_device(4)
    assert held is not None
    if op == "insert":  # too few slots for the tokens' whole pages
        refused(service, ValueError, r"^insert: 1 slots for 4 tokens$", service.insert, NEW,
                Indices(held.tensor[:1], FULL))
    else:
        refused(service, ValueError, rf"^{op}: 1 slots is not a whole number of pages of 2$",
                getattr(service, op), Indices(held.tensor[:1], FULL))
    service.free_device(held)


@pytest.mark.parametrize("op", ["free_device", "release_window"])
def test_pages_the_engine_does_not_hold_are_refused(service: HiCacheService, op: str) -> None:
    """A page of the tree (from a match), and one freed already."""
    message = rf"^{op}: page \d+ was not handed out by alloc_device, or was already inserted " \
              r"or freed$"
    refused(service, ValueError, message, getattr(service, op), service.match(A).device_indices)
    held = service.alloc_device(2)
    assert held is not None
    service.free_device(held)
    refused(service, ValueError, message, getattr(service, op), held)


def test_insert_of_slots_inserted_already_is_refused(service: HiCacheService) -> None:
    held = service.alloc_device(4)
    assert held is not None
    service.insert(NEW, held)
    refused(service, ValueError, r"^insert: page \d+ at token 0 is neither held by the engine "
            r"\(alloc_device\) nor the tree's page there$", service.insert, [6, 6, 6, 6], held)


def test_int32_and_strided_slots_are_accepted(service: HiCacheService) -> None:
    """What an engine's own buffers hold: int32, or a strided view."""
    held = service.alloc_device(4)
    assert held is not None
    strided = torch.stack([held.tensor, held.tensor], 1).reshape(-1)[::2]
    assert not strided.is_contiguous()
    assert service.insert(NEW, Indices(strided.to(torch.int32), FULL)) == 0
    assert service.engine_held_tokens == 0
    service.check_integrity()


# ---- token ids: handled --------------------------------------------------------------------


@pytest.mark.parametrize("tokens,name", [
    pytest.param({1, 2}, "set", id="set"),
    pytest.param({1: 2}, "dict", id="dict"),
    pytest.param((t for t in A), "generator", id="generator"),
    pytest.param(b"\x01\x01", "bytes", id="bytes"),
    pytest.param(7, "int", id="a-single-int"),
])
def test_match_refuses_what_is_not_a_sequence_of_ids(service: HiCacheService, tokens: object,
                                                     name: str) -> None:
    refused(service, TypeError, rf"^match: tokens must be a list or tuple of ints, or a 1-D "
            rf"integer torch tensor or numpy array, got {name}$", service.match, tokens)


# ---- after stop(): handled -----------------------------------------------------------------


AFTER_STOP = ["match", "lock", "release", "load_back", "start_loading", "insert",
              "alloc_device", "free_device", "release_window", "evict", "evict_host",
              "evict_swa", "step", "prefetch"]


@pytest.mark.parametrize("op", AFTER_STOP)
def test_every_scheduler_call_after_stop_is_refused(op: str) -> None:
    built = build_service(make_config())
    put(built, A)
    match = built.match(A)
    held = built.alloc_device(2)
    assert held is not None
    built.stop()
    args: dict[str, tuple[object, ...]] = {
        "match": (A,), "lock": (match.last_device_node,), "release": (match.last_device_node,),
        "load_back": (match, 64), "start_loading": (), "insert": (NEW, held),
        "alloc_device": (2,), "free_device": (held,), "release_window": (held,),
        "evict": (2,), "evict_host": (2,), "evict_swa": (2,), "step": (),
        "prefetch": (A, match),
    }
    refused(built, RuntimeError, r"^the service was stopped$", getattr(built, op), *args[op])
    with pytest.raises(RuntimeError, match=r"^the service was stopped; build a new one$"):
        built.start()
    built.stop()  # idempotent
    built.check_integrity()  # documented to work after stop


def test_wait_until_after_stop_is_refused() -> None:
    built = build_service(make_config())
    built.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        built.wait_until(0)


# ---- release(): a lock the caller never took -----------------------------------------------


def _give_back_lock(service: HiCacheService, node: Any, wanted: int) -> None:
    """Undo a release that took a lock the caller did not hold (so that the test's teardown,
    which applies the acks that drop the cache's own locks, does not fail as well)."""
    while node.lock_count < wanted and not node.is_detached:
        service.tree.lock(node)


def test_release_of_a_node_locked_only_by_its_load_back_is_refused(
        service: HiCacheService) -> None:
    service.evict(10**6)
    match = service.match(A)
    assert match.host_hit_tokens == len(A)
    assert service.load_back(match, device_quota_tokens=64).queued
    node = match.last_host_node
    assert node.lock_count == 1  # the load-back's, not the engine's
    try:
        refused(service, RuntimeError, r"^release: .* is not locked", service.release, node)
        service.start_loading()
        service.step()
        service.check_integrity()
    finally:
        _give_back_lock(service, node, 1)


def test_release_of_a_node_locked_only_by_its_queued_backup_is_refused(
        service: HiCacheService) -> None:
    held = service.alloc_device(4)
    assert held is not None
    service.insert(NEW, held)  # write-through: the backup is queued, the node locked for it
    node = service.match(NEW).last_device_node
    assert node.lock_count == 1
    try:
        refused(service, RuntimeError, r"^release: .* is not locked", service.release, node)
        service.step()
        service.check_integrity()
    finally:
        _give_back_lock(service, node, 1)


def test_release_of_a_parent_locked_only_through_its_child_is_refused(
        service: HiCacheService) -> None:
    service.match(A[:4])  # splits A's node: parent A[:4], child A[4:]
    child = service.match(A).last_device_node
    parent = service.match(A[:4]).last_device_node
    assert child.parent is parent
    service.lock(child)
    try:
        refused(service, RuntimeError, r"^release: .* is not locked", service.release, parent)
    finally:
        _give_back_lock(service, parent, child.lock_count)
        service.release(child)
    service.check_integrity()


# ---- evict / evict_host / evict_swa: the token count --------------------------------------


@pytest.mark.parametrize("count", ["4", None, 2.5, True, -1, math.nan],
                         ids=["str", "none", "float", "bool", "negative", "nan"])
@pytest.mark.parametrize("op", ["evict", "evict_host", "evict_swa"])
def test_eviction_counts_are_checked_like_alloc_device(service: HiCacheService, op: str,
                                                       count: object) -> None:
    refused(service, (TypeError, ValueError), rf"^{op}: num_tokens", getattr(service, op),
            count)


def test_evict_swa_count_of_a_hybrid_service_is_checked(hybrid: HiCacheService) -> None:
    refused(hybrid, (TypeError, ValueError), r"^evict_swa: num_tokens", hybrid.evict_swa, "4")


# ---- load_back: the quota ------------------------------------------------------------------


@pytest.mark.parametrize("quota", ["64", None, math.nan, -1, 2.5, True],
                         ids=["str", "none", "nan", "negative", "float", "bool"])
def test_load_back_quota_is_checked(service: HiCacheService, quota: object) -> None:
    service.evict(10**6)
    match = service.match(A)
    assert match.host_hit_tokens == len(A)
    refused(service, (TypeError, ValueError), r"^load_back: device_quota_tokens",
            service.load_back, match, quota)


# ---- wait_until: the layer -----------------------------------------------------------------


def _with_a_load(service: HiCacheService) -> None:
    service.evict(10**6)
    assert service.load_back(service.match(A), device_quota_tokens=64).queued
    service.start_loading()
    service.step()


@pytest.mark.parametrize("layer", [-1, 2])
def test_wait_until_refuses_a_layer_the_model_lacks_once_a_load_exists(
        service: HiCacheService, layer: int) -> None:
    _with_a_load(service)
    refused(service, ValueError, rf"^wait_until: layer {layer} out of range \(0\.\.1\)$",
            service.wait_until, layer)


@pytest.mark.parametrize("layer", ["0", 1.0], ids=["str", "float"])
def test_wait_until_refuses_a_layer_that_is_not_an_int(service: HiCacheService,
                                                       layer: object) -> None:
    _with_a_load(service)
    refused(service, (TypeError, ValueError), r"^wait_until: layer", service.wait_until, layer)


@pytest.mark.parametrize("layer", [-1, 2, "0"], ids=["negative", "past-the-end", "str"])
def test_wait_until_refuses_a_bad_layer_before_any_load(service: HiCacheService,
                                                        layer: object) -> None:
    refused(service, (TypeError, ValueError), r"^wait_until: layer", service.wait_until, layer)


# ---- prefetch (shared store) ---------------------------------------------------------------


def _store_config(path: Path) -> HiCacheConfig:
    return make_config(storage={"backend": "file", "path": str(path),
                                "prefetch_threshold_tokens": 0})


@pytest.fixture
def two_stores(tmp_path: Path) -> Iterator[tuple[HiCacheService, HiCacheService]]:
    first = build_service(_store_config(tmp_path / "a"), **MODEL)
    second = build_service(_store_config(tmp_path / "b"), **MODEL)
    yield first, second
    first.stop()
    second.stop()


def test_finish_prefetch_of_another_services_prefetch_is_refused(
        two_stores: tuple[HiCacheService, HiCacheService]) -> None:
    first, second = two_stores
    key = second.key(list(range(40, 50)))
    prefetch = second.prefetch(key, second.match(key))
    assert prefetch is not None
    try:
        refused(first, ValueError, r"^finish_prefetch: ", first.finish_prefetch, prefetch)
        assert not prefetch.finished
        second.finish_prefetch(prefetch)
    finally:
        tier = second.storage
        if tier is not None and prefetch in tier.prefetches.open_prefetches():
            prefetch.finished = False  # undo the other service's mark: second's stop finishes it


@pytest.mark.parametrize("op", ["prefetch_ready", "wait_prefetch"])
def test_prefetch_calls_refuse_another_services_prefetch(
        two_stores: tuple[HiCacheService, HiCacheService], op: str) -> None:
    first, second = two_stores
    key = second.key(list(range(40, 50)))
    prefetch = second.prefetch(key, second.match(key))
    assert prefetch is not None
    try:
        args = (prefetch, 0.2) if op == "wait_prefetch" else (prefetch,)
        refused(first, ValueError, rf"^{op}: ", getattr(first, op), *args)
    finally:
        second.finish_prefetch(prefetch)


def test_prefetch_without_a_store_still_refuses_bad_tokens(service: HiCacheService) -> None:
    refused(service, TypeError, r"^prefetch: tokens must be", service.prefetch, None,
            service.match(A))


# ---- TokenKey built by hand ----------------------------------------------------------------


@pytest.mark.parametrize("op", ["match", "insert"])
def test_a_hand_made_key_with_negative_ids_is_refused(service: HiCacheService,
                                                      op: str) -> None:
    held = service.alloc_device(4)
    assert held is not None
    try:
        key = TokenKey((1, -2, 3, -4), PAGE)
    except ValueError as error:  # refused where it is made: as good
        assert "token ids must be >= 0" in str(error)
    else:
        args = (key,) if op == "match" else (key, held)
        refused(service, ValueError, rf"^{op}: token ids must be >= 0", getattr(service, op),
                *args)
    if service.engine_held_tokens:
        service.free_device(held)


def test_a_hand_made_key_of_page_size_zero_is_refused() -> None:
    with pytest.raises(ValueError, match="page_size"):
        TokenKey((1, 2), 0)


# ---- the device pool the engine writes through ---------------------------------------------


@pytest.fixture(params=["plain", "hybrid"])
def any_service(request: pytest.FixtureRequest) -> Iterator[HiCacheService]:
    built = build_service(make_config(hybrid=request.param == "hybrid"))
    yield built
    built.stop()


@pytest.mark.parametrize("locs", [torch.tensor([2, 3]), [2, 3], None],
                         ids=["bare-tensor", "list", "none"])
def test_forward_locs_of_a_bare_tensor_is_a_type_error(any_service: HiCacheService,
                                                       locs: object) -> None:
    refused(any_service, TypeError, r"^forward_locs: expected .*Indices",
            any_service.device_pool.forward_locs, locs)


@pytest.mark.parametrize("k", [None, [[0.0, 0.0]]], ids=["none", "list"])
def test_set_kv_rows_that_are_not_tensors_are_a_type_error(any_service: HiCacheService,
                                                           k: object) -> None:
    held = any_service.alloc_device(2)
    assert held is not None
    pool = any_service.device_pool
    locs = pool.forward_locs(held)
    refused(any_service, TypeError, r"set_kv", pool.set_kv, 0, locs, k, torch.zeros(2, 1, 2))
    any_service.free_device(held)


@pytest.mark.parametrize("layer", ["0", 0.0, None], ids=["str", "float", "none"])
@pytest.mark.parametrize("accessor", ["key_buffer", "value_buffer"])
def test_layer_accessors_refuse_a_layer_that_is_not_an_int(
        any_service: HiCacheService, accessor: str, layer: object) -> None:
    refused(any_service, (TypeError, ValueError), r"\blayer\b",
            getattr(any_service.device_pool, accessor), layer)


@pytest.mark.parametrize("layer", [5, -1])
def test_is_swa_layer_refuses_a_layer_the_model_lacks(hybrid: HiCacheService,
                                                      layer: int) -> None:
    pool = hybrid.device_pool
    assert isinstance(pool, HybridSWAPool)
    with pytest.raises(ValueError, match=rf"layer {layer} out of range \(0\.\.1\)"):
        pool.is_swa_layer(layer)


def _page_slots(service: HiCacheService, table: PageTable, row: object) -> Indices:
    pool = service.device_pool
    if isinstance(pool, HybridSWAPool):
        return pool.page_slots(0, table, row)  # type: ignore[arg-type]
    return pool.page_slots(table, row)  # type: ignore[arg-type]


def test_page_slots_refuses_a_table_of_another_page_size(any_service: HiCacheService) -> None:
    table = PageTable(torch.tensor([[1, 2]]), FULL, 4)
    refused(any_service, ValueError, r"page", _page_slots, any_service, table, 0)


def test_page_slots_refuses_a_row_out_of_range(any_service: HiCacheService) -> None:
    table = PageTable(torch.tensor([[1, 2]]), FULL, PAGE)
    refused(any_service, ValueError, r"^page_slots: row 1 of a table of 1 rows$", _page_slots,
            any_service, table, 1)


def test_page_slots_refuses_a_row_that_is_not_an_int(any_service: HiCacheService) -> None:
    table = PageTable(torch.tensor([[1, 2]]), FULL, PAGE)
    refused(any_service, (TypeError, ValueError), r"\brow\b", _page_slots, any_service, table,
            "0")


def test_page_table_space_that_is_not_an_index_space_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="IndexSpace"):
        PageTable(torch.tensor([[1]]), "device_full", PAGE)  # type: ignore[arg-type]


def test_page_table_and_indices_refuse_what_they_cannot_hold() -> None:
    with pytest.raises(TypeError, match=r"^PageTable\.tensor must be a torch\.Tensor, got list$"):
        PageTable([[1]], FULL, PAGE)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^a page table must be a 2-D int32/int64 tensor"):
        PageTable(torch.tensor([1, 2]), FULL, PAGE)
    with pytest.raises(ValueError, match=r"^a page table holds device pages, not "
                       r"IndexSpace\.HOST_FULL$"):
        PageTable(torch.tensor([[1]]), IndexSpace.HOST_FULL, PAGE)
    with pytest.raises(ValueError, match=r"^PageTable\.page_size must be an int >= 1, got 2\.0$"):
        PageTable(torch.tensor([[1]]), FULL, 2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^Indices\.space must be an IndexSpace, got str$"):
        Indices(torch.tensor([2, 3]), "device_full")  # type: ignore[arg-type]


# ---- release_window twice, and slots insert does not take ----------------------------------


def test_release_window_twice_in_one_step_is_skipped_or_refused_by_name(
        hybrid: HiCacheService) -> None:
    held = hybrid.alloc_device(6)
    assert held is not None
    page = Indices(held.tensor[:2], FULL)
    hybrid.release_window(page)
    before = snapshot(hybrid)
    try:
        hybrid.release_window(page)
    except ValueError as error:
        assert str(error).startswith("release_window: ")
        assert snapshot(hybrid) == before
    finally:
        hybrid.step()
        hybrid.free_device(held)
    hybrid.check_integrity()


@pytest.mark.parametrize("tail", [-1, 10**6], ids=["negative", "out-of-range"])
def test_insert_refuses_a_bad_slot_after_the_whole_pages(service: HiCacheService,
                                                         tail: int) -> None:
    held = service.alloc_device(4)
    assert held is not None
    slots = Indices(torch.cat([held.tensor, torch.tensor([tail])]), FULL)
    try:
        refused(service, BoundsError, rf"^insert: slot {tail} is", service.insert, [*NEW, 9],
                slots)
    finally:
        if service.engine_held_tokens:
            service.free_device(held)


# ---- load_config, config_from_dict and build_service ---------------------------------------


@pytest.mark.parametrize("path", [None, 7, {"page_size_tokens": 2}], ids=["none", "int", "dict"])
def test_load_config_of_what_is_not_a_path_names_itself(path: object) -> None:
    with pytest.raises(TypeError, match=r"^load_config: "):
        load_config(path)  # type: ignore[arg-type]


def test_config_from_dict_refuses_what_is_not_a_mapping() -> None:
    with pytest.raises(ConfigError, match=r"^the config is empty"):
        config_from_dict(None)
    with pytest.raises(ConfigError, match=r"^the config: expected a mapping of keys, got 'x'"):
        config_from_dict("x")
    with pytest.raises(ConfigError, match=r"^1: unknown key; valid keys: model, "):
        config_from_dict({**raw_config(), 1: 2})


@pytest.mark.parametrize("config", [raw_config(), None, "config.yaml"],
                         ids=["dict", "none", "path"])
def test_build_service_of_what_is_not_a_config_is_a_type_error(config: object) -> None:
    with pytest.raises(TypeError, match=r"^build_service: .*HiCacheConfig"):
        build_service(config)  # type: ignore[arg-type]


def test_a_cuda_device_this_machine_lacks_is_refused_by_key() -> None:
    device = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU: none on a CPU
    with pytest.raises(ValueError, match=r"device_pool\.device"):
        build_service(config_from_dict(raw_config(device=device), check_ram=False))


def test_build_service_refuses_a_tp_rank_that_is_not_an_int(tmp_path: Path) -> None:
    with pytest.raises((TypeError, ValueError), match="tp_rank"):
        build_service(_store_config(tmp_path / "l3"), **MODEL, tp_rank="0")  # type: ignore[arg-type]


def test_a_cpu_device_pool_larger_than_ram_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loading, "available_ram_bytes", lambda: 3 * GIB)
    data = raw_config(num_tokens=2**28, ratio=0.001)  # 8 GiB of device rows, 8 MiB of host
    with pytest.raises(ConfigError, match=r"device_pool\.num_tokens"):
        config_from_dict(data)


def test_the_ram_error_offers_a_fix_that_is_valid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loading, "available_ram_bytes", lambda: 3 * GIB)
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw_config(num_tokens=2**34))  # 1 TiB of host rows
    message = str(info.value)
    offered = re.search(r"at most ([0-9.]+)", message)
    assert "device_pool.num_tokens" in message or (
        offered is not None and float(offered.group(1)) > 0), message
