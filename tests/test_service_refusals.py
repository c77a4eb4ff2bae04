"""HiCacheService refuses bad input with a clear error and changes nothing: device
allocation sizes, nodes of another cache or removed ones, token ids, a taken metrics port."""

from __future__ import annotations

import copy
import dataclasses
import socket
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from test_service import make_config as service_config
from thread_helpers import service_threads

from hicache.config import HiCacheConfig
from hicache.factory import build_service
from hicache.pools import IndexSpace, Indices
from hicache.service import HiCacheService

PAGE = 2
A = [1, 1, 2, 2, 3, 3]
B = [4, 4, 5, 5]


def make_config(hybrid: bool = False, metrics_port: int | None = None) -> HiCacheConfig:
    """test_service's small config, write-through; metrics only when a port is given."""
    return service_config(hybrid=hybrid, metrics=metrics_port is not None,
                          metrics_port=metrics_port or 0)


def put(service: HiCacheService, tokens: list[int]) -> None:
    """Allocate, insert and apply the backup acks (rows are not written: not read here)."""
    slots = service.alloc_device(len(tokens))
    assert slots is not None
    service.insert(tokens, slots)
    service.step()


def snapshot(service: HiCacheService) -> dict[str, object]:
    """Everything a refused call must leave as it was."""
    tree = service.tree
    return {
        "free": {space: a.num_free_tokens for space, a in tree.io.allocators().items()},
        "nodes": sorted((n.node_id, n.tokens, n.lock_count, n.caller_locks, n.hit_count,
                         n.on_device, n.host is not None, n.is_detached) for n in tree.nodes()),
        "root_locks": (tree.root.lock_count, tree.root.caller_locks),
        "engine_held_tokens": service.engine_held_tokens,
        "queued_backups": len(tree.queued_backups),
        "in_flight": service.controller.num_in_flight,
        "stats": {f.name: copy.copy(getattr(tree.stats, f.name))
                  for f in dataclasses.fields(tree.stats)},
    }


@pytest.fixture
def service() -> Iterator[HiCacheService]:
    """A plain service caching A and B on both tiers."""
    built = build_service(make_config())
    put(built, A)
    put(built, B)
    yield built
    built.stop()


@pytest.fixture
def other() -> Iterator[HiCacheService]:
    """A second service caching A, to take foreign nodes from."""
    built = build_service(make_config())
    put(built, A)
    yield built
    built.stop()


def refused(service: HiCacheService, error: type[Exception] | tuple[type[Exception], ...],
            match: str, call: Any, *args: object) -> None:
    """``call(*args)`` raises ``error`` matching ``match`` and ``service`` is unchanged."""
    before = snapshot(service)
    with pytest.raises(error, match=match):
        call(*args)
    assert snapshot(service) == before
    service.check_integrity()


# ---- alloc_device -------------------------------------------------------------------------


def test_alloc_device_above_capacity_is_refused_before_evicting(service: HiCacheService
                                                                ) -> None:
    """33 tokens of a 32-token pool: ValueError naming both, nothing evicted."""
    refused(service, ValueError,
            r"^alloc_device: 33 tokens exceed the device pool's capacity of 32 tokens; "
            r"allocate at most 32 tokens per call, or raise device_pool\.num_tokens$",
            service.alloc_device, 33)
    assert service.tree.stats.evicted_device_tokens == 0


def test_alloc_device_above_the_swa_capacity_is_refused() -> None:
    """A hybrid pool's bound is its smaller SWA pool (16 tokens): 17 is refused."""
    hybrid = build_service(make_config(hybrid=True))
    put(hybrid, A)
    refused(hybrid, ValueError,
            r"^alloc_device: 17 tokens exceed the device SWA pool's capacity of 16 tokens; "
            r"allocate at most 16 tokens per call, or raise device_pool\.swa_num_tokens$",
            hybrid.alloc_device, 17)
    hybrid.stop()


def test_alloc_device_of_the_whole_capacity_evicts_and_succeeds(service: HiCacheService
                                                                ) -> None:
    """31 tokens round up to exactly the 32-token capacity: allowed, evicting the cache."""
    slots = service.alloc_device(31)
    assert slots is not None and len(slots) == 32 and service.engine_held_tokens == 32
    assert service.tree.stats.evicted_device_tokens == len(A) + len(B)
    service.free_device(slots)
    service.check_integrity()


def test_alloc_device_of_a_negative_count_is_refused(service: HiCacheService) -> None:
    refused(service, ValueError, r"^alloc_device: num_tokens must be >= 0, got -1$",
            service.alloc_device, -1)


@pytest.mark.parametrize("count,match", [
    ("8", r"^alloc_device: num_tokens must be an int, got str '8'$"),
    (2.5, r"^alloc_device: num_tokens must be an int, got float 2\.5$"),
    (True, r"^alloc_device: num_tokens must be an int, got bool True$"),
    (None, r"^alloc_device: num_tokens must be an int, got NoneType None$"),
])
def test_alloc_device_of_a_non_int_count_is_a_type_error(
    service: HiCacheService, count: object, match: str
) -> None:
    refused(service, TypeError, match, service.alloc_device, count)


def test_alloc_device_of_zero_is_a_no_op(service: HiCacheService) -> None:
    """Empty DEVICE_FULL indices, nothing allocated or evicted."""
    before = snapshot(service)
    slots = service.alloc_device(0)
    assert slots is not None and slots.space is IndexSpace.DEVICE_FULL and len(slots) == 0
    assert snapshot(service) == before


def test_alloc_device_accepts_a_numpy_int(service: HiCacheService) -> None:
    slots = service.alloc_device(np.int64(3))
    assert slots is not None and len(slots) == 4 and service.engine_held_tokens == 4
    service.free_device(slots)
    before = snapshot(service)
    none = service.alloc_device(np.int32(0))
    assert none is not None and len(none) == 0
    assert snapshot(service) == before
    refused(service, ValueError, r"^alloc_device: num_tokens must be >= 0, got -2$",
            service.alloc_device, np.int64(-2))


def test_alloc_device_above_equal_full_and_swa_capacities_names_the_device_pool() -> None:
    """SWA pool as large as the full one: the bound is named by the full pool's key."""
    config = make_config(hybrid=True)
    config = dataclasses.replace(config, device_pool=dataclasses.replace(
        config.device_pool, swa_num_tokens=32))
    hybrid = build_service(config)
    try:
        refused(hybrid, ValueError,
                r"^alloc_device: 33 tokens exceed the device pool's capacity of 32 tokens; "
                r"allocate at most 32 tokens per call, or raise device_pool\.num_tokens$",
                hybrid.alloc_device, 33)
    finally:
        hybrid.stop()


# ---- lock and release ---------------------------------------------------------------------


def test_lock_of_another_services_node_changes_neither_tree(
    service: HiCacheService, other: HiCacheService
) -> None:
    """ValueError; the other tree's locks stay at 0, so its host eviction still frees."""
    node = other.match(A).last_device_node
    before_other = snapshot(other)
    refused(service, ValueError, r"^lock: TreeNode\(id=\d+, .*\) belongs to another cache "
            r"\(tree \d+, not \d+\); pass a node from this cache's own match\(\)$",
            service.lock, node)
    assert snapshot(other) == before_other and other.tree.root.lock_count == 0
    other.evict(10**6)
    assert other.evict_host(10**6) == len(A)
    other.check_integrity()


def test_lock_of_another_services_root_is_refused(
    service: HiCacheService, other: HiCacheService
) -> None:
    """A miss in the other service returns its root, which is not this cache's either."""
    root = other.match([9, 9]).last_device_node
    assert root is other.tree.root
    refused(service, ValueError, "belongs to another cache", service.lock, root)
    assert other.tree.root.lock_count == 0


def test_release_of_another_services_node_says_so(
    service: HiCacheService, other: HiCacheService
) -> None:
    """Not "not locked": the node belongs to another cache; its own lock stays held."""
    node = other.match(A).last_device_node
    other.lock(node)
    refused(service, ValueError, r"^release: .* belongs to another cache", service.release,
            node)
    assert node.lock_count == 1
    other.release(node)
    other.check_integrity()


def test_release_of_an_unlocked_node_is_refused(service: HiCacheService) -> None:
    node = service.match(A).last_device_node
    refused(service, RuntimeError, r"^release: TreeNode\(id=\d+, .*\) is not locked by the "
            r"engine: release only what lock\(\) took", service.release, node)


def test_load_back_of_another_services_match_is_refused(
    service: HiCacheService, other: HiCacheService
) -> None:
    """The same ownership check guards load_back: nothing is loaded into either cache."""
    other.evict(10**6)
    match = other.match(A)
    assert match.host_hit_tokens == len(A)
    before_other = snapshot(other)
    refused(service, ValueError, r"^load_back: .* belongs to another cache",
            service.load_back, match, 32)
    assert snapshot(other) == before_other


def test_lock_of_none_is_a_type_error(service: HiCacheService) -> None:
    refused(service, TypeError,
            r"^lock: expected a TreeNode of this cache \(MatchResult\.last_device_node or "
            r"last_host_node from its match\(\)\), got NoneType$", service.lock, None)


def test_lock_of_a_match_result_points_at_its_node(service: HiCacheService) -> None:
    match = service.match(A)
    refused(service, TypeError,
            r"got MatchResult; pass its last_device_node \(or last_host_node\)$",
            service.lock, match)


def test_release_of_none_is_a_type_error(service: HiCacheService) -> None:
    refused(service, TypeError, r"^release: expected a TreeNode", service.release, None)


def test_lock_of_a_removed_node_is_refused(service: HiCacheService) -> None:
    """A node evicted from both tiers is detached: lock refuses it and changes nothing."""
    node = service.match(B).last_device_node
    service.evict(10**6)
    service.evict_host(10**6)
    assert node.is_detached
    refused(service, ValueError, r"^lock: TreeNode\(id=\d+, .*\) was removed from the tree "
            r"\(evicted or dropped\); match\(\) again for a live node$", service.lock, node)


# ---- token ids ----------------------------------------------------------------------------


BAD_TOKENS = [
    pytest.param([800.7, 1], TypeError, r"tokens\[0\] = 800\.7 \(float\)", id="float"),
    pytest.param([1, 1, 2.0, 2], TypeError, r"tokens\[2\] = 2\.0 \(float\)", id="whole-float"),
    pytest.param([1, 1, 3.5], TypeError, r"tokens\[2\] = 3\.5 \(float\)", id="float-in-tail"),
    pytest.param(None, TypeError, r"tokens must be a list or tuple of ints, or a 1-D integer "
                 r"torch tensor or numpy array, got NoneType$", id="none"),
    pytest.param("1122", TypeError, r"got str$", id="string"),
    pytest.param([[1, 1], [2, 2]], TypeError, r"tokens\[0\] = \[1, 1\] \(list\)", id="nested"),
    pytest.param([True, True], TypeError, r"tokens\[0\] = True \(bool\)", id="bools"),
    pytest.param([1, True], TypeError, r"tokens\[1\] = True \(bool\)", id="int-and-bool"),
    pytest.param([1, None], TypeError, r"tokens\[1\] = None \(NoneType\)", id="int-and-none"),
    pytest.param(torch.tensor([1.0, 1.0]), TypeError, r"got a torch\.float32 tensor$",
                 id="float-tensor"),
    pytest.param(torch.tensor([True, True]), TypeError, r"got a torch\.bool tensor$",
                 id="bool-tensor"),
    pytest.param(torch.tensor([[1, 1]]), TypeError, r"got a 2-D array of int64$",
                 id="2d-tensor"),
    pytest.param(np.array([1.0, 1.0]), TypeError, r"got a 1-D array of float64$",
                 id="float-array"),
    pytest.param(np.array(["1", "1"]), TypeError, r"got a 1-D array of <U1$", id="str-array"),
    pytest.param(np.array(7), TypeError, r"got a 0-D array of int64$", id="0d-array"),
    pytest.param([1, 1, -2, 2], ValueError, r"token ids must be >= 0, got tokens\[2\] = -2$",
                 id="negative"),
    pytest.param(torch.tensor([3, -1]), ValueError, r"got tokens\[1\] = -1$",
                 id="negative-tensor"),
    pytest.param(np.array([-5, 1], dtype=np.int32), ValueError, r"got tokens\[0\] = -5$",
                 id="negative-array"),
]


@pytest.mark.parametrize("tokens,error,match", BAD_TOKENS)
def test_match_refuses_bad_tokens(service: HiCacheService, tokens: object,
                                  error: type[Exception], match: str) -> None:
    refused(service, error, "^match: .*" + match, service.match, tokens)


@pytest.mark.parametrize("tokens,error,match", BAD_TOKENS)
def test_insert_refuses_bad_tokens(service: HiCacheService, tokens: object,
                                   error: type[Exception], match: str) -> None:
    """Refused before the engine's slots are taken: they stay held, then are freed."""
    slots = service.alloc_device(4)
    assert slots is not None
    refused(service, error, "^insert: .*" + match, service.insert, tokens, slots)
    assert service.engine_held_tokens == 4
    service.free_device(slots)


def test_a_float_token_no_longer_matches_its_truncation(service: HiCacheService) -> None:
    """[800.7, 800] used to match [800, 800]; now it is refused."""
    put(service, [800, 800])
    refused(service, TypeError, r"tokens\[0\] = 800\.7", service.match, [800.7, 800])


@pytest.mark.parametrize("tokens", [
    pytest.param(tuple(A), id="tuple"),
    pytest.param(torch.tensor(A), id="int64-tensor"),
    pytest.param(torch.tensor(A, dtype=torch.int32), id="int32-tensor"),
    pytest.param(np.array(A), id="int64-array"),
    pytest.param(np.array(A, dtype=np.uint16), id="uint16-array"),
    pytest.param([np.int64(t) for t in A], id="numpy-ints"),
    pytest.param(range(1, 1), id="empty-range"),
])
def test_every_integer_form_of_tokens_matches_like_a_list(service: HiCacheService,
                                                          tokens: object) -> None:
    """Tuples, integer tensors and arrays, numpy ints: the same device prefix as a list."""
    num_tokens = len(tokens)  # type: ignore[arg-type]
    expected = service.tree.device_prefix(A[:num_tokens])
    match = service.match(tokens)  # type: ignore[arg-type]
    assert match.device_hit_tokens == num_tokens
    assert torch.equal(match.device_indices.tensor, expected.tensor)


def test_insert_takes_a_tensor_of_tokens(service: HiCacheService) -> None:
    tokens = torch.tensor([7, 7, 8, 8, 9], dtype=torch.int32)
    slots = service.alloc_device(5)
    assert slots is not None
    assert service.insert(tokens, slots) == 0
    service.free_device(Indices(slots.tensor[4:], IndexSpace.DEVICE_FULL))
    assert service.match([7, 7, 8, 8]).device_hit_tokens == 4
    service.check_integrity()


# ---- metrics port -------------------------------------------------------------------------


@pytest.fixture
def taken_port() -> Iterator[socket.socket]:
    """A listening socket on a free port of 127.0.0.1; closed at the end."""
    blocker = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    yield blocker
    blocker.close()


def test_start_on_a_taken_metrics_port_names_it_and_the_fix(taken_port: socket.socket
                                                            ) -> None:
    """OSError (errno kept) naming host:port and the fix; nothing started; start works
    once the port is free."""
    port = taken_port.getsockname()[1]
    service = build_service(make_config(metrics_port=port))
    threads = service_threads()
    with pytest.raises(OSError, match=rf"^\[Errno \d+\] metrics endpoint: cannot bind "
                       rf"127\.0\.0\.1:{port} \(.*\); set service\.metrics_port to a free "
                       rf"port, or 0 to pick one$"):
        service.start()
    assert service_threads() == threads and service.exporter is not None
    assert service.exporter.port is None
    taken_port.close()
    service.start()
    assert service.exporter.port == port
    put(service, A)
    service.stop()
    assert service.exporter.port is None
    service.check_integrity()


def test_stop_after_a_failed_start_works(taken_port: socket.socket) -> None:
    service = build_service(make_config(metrics_port=taken_port.getsockname()[1]))
    with pytest.raises(OSError, match=r"set service\.metrics_port"):
        service.start()
    service.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        service.match(A)
    service.check_integrity()
