"""Small host pools, namespaces and page views for the storage tests, and fixtures that start
real Redis servers (skipped when ``redis-server`` is not installed)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hicache.bench.redis_local import RedisCluster, RedisServer, have_redis
from hicache.pools import AttentionKind, HostKVPool, HostLayout, IndexSpace, Indices, RowGeometry
from hicache.storage import Namespace, StorageBackend, chain_page_hashes, host_page_views

PAGE_SIZE = 4
needs_redis = pytest.mark.skipif(not have_redis(), reason="redis-server/redis-cli not "
                                 "installed (Debian package redis-server; .ci/run installs it)")


def make_pool(layout: HostLayout = HostLayout.PAGE_FIRST, *, num_pages: int = 24,
              page_size: int = PAGE_SIZE, heads: int = 2, head_dim: int = 8,
              num_layers: int = 3) -> HostKVPool:
    """A host pool filled with position-dependent values (row r of slot s holds s + r/1000)."""
    geometry = RowGeometry(kind=AttentionKind.MHA, num_kv_heads=heads, head_dim=head_dim,
                           latent_dim=0, dtype=torch.bfloat16)
    pool = HostKVPool(name="full", space=IndexSpace.HOST_FULL, num_layers=num_layers,
                      num_pages=num_pages, page_size=page_size, geometry=geometry,
                      layout=layout, pin=False)
    pool.data.copy_(torch.randn(pool.data.shape, generator=torch.Generator().manual_seed(0)))
    return pool


def namespace(pool: HostKVPool, revision: str = "r1") -> Namespace:
    return Namespace.for_host_pool(pool, model_id="test/model", model_revision=revision)


def slots(first_page: int, num_pages: int, page_size: int = PAGE_SIZE) -> Indices:
    start = first_page * page_size
    return Indices(torch.arange(start, start + num_pages * page_size), IndexSpace.HOST_FULL)


def views(pool: HostKVPool, first_page: int, num_pages: int) -> list[list[memoryview]]:
    return host_page_views(pool, slots(first_page, num_pages, pool.page_size))


def hashes(num_pages: int, seed: int = 0) -> list[bytes]:
    tokens = torch.randint(0, 50_000, (num_pages * PAGE_SIZE,),
                           generator=torch.Generator().manual_seed(seed))
    return chain_page_hashes(tokens, PAGE_SIZE)


def rows(pool: HostKVPool, first_page: int, num_pages: int) -> torch.Tensor:
    return pool.read_rows(slots(first_page, num_pages, pool.page_size))


def fill(pool: HostKVPool, first_page: int, num_pages: int, value: float) -> None:
    index = slots(first_page, num_pages, pool.page_size)
    shape = (len(index), pool.geometry.num_components, pool.num_layers,
             pool.geometry.row_elems)
    pool.write_rows(index, torch.full(shape, value, dtype=pool.geometry.dtype))


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One standalone server for a test module."""
    if not have_redis():
        pytest.skip("redis-server not installed")
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """One 3-master cluster for a test module."""
    if not have_redis():
        pytest.skip("redis-server not installed")
    cluster = RedisCluster(tmp_path_factory.mktemp("cluster")).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A standalone server this test may kill or pause."""
    if not have_redis():
        pytest.skip("redis-server not installed")
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


def check_each_call_timed(store: StorageBackend, pool: HostKVPool, keys: list[bytes]) -> None:
    """A put, an exists and a get of ``keys`` (pages 1.. of ``pool``, read back into pages
    5..) on a fresh ``store``: each is counted once, with a time above 0 and at most the
    call's own wall time."""
    calls = [("put", lambda: store.put(keys, views(pool, 1, len(keys)))),
             ("exists", lambda: store.exists(keys)),
             ("get", lambda: store.get(keys, views(pool, 5, len(keys))))]
    for name, call in calls:
        before = getattr(store.stats(), f"{name}_seconds")
        began = time.perf_counter()
        call()
        wall = time.perf_counter() - began
        stats = store.stats()
        assert getattr(stats, f"{name}_calls") == 1, name
        assert 0 < getattr(stats, f"{name}_seconds") - before <= wall, name
