"""The ``storage`` config section (hicache.config.storage) and the store built from it
(hicache.factory.storage_namespace, open_configured_store)."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from storage_helpers import needs_redis

from hicache.bench.redis_local import RedisServer
from hicache.config import (
    GIB,
    ConfigError,
    HiCacheConfig,
    PrefetchPolicy,
    StorageConfig,
    StorageKind,
    WritePolicy,
    config_from_dict,
)
from hicache.config.sizing import host_num_pages
from hicache.factory import open_configured_store, storage_namespace
from hicache.pools import HostKVPool, HostLayout, IndexSpace, Indices
from hicache.storage import (
    FileStore,
    Namespace,
    PageStatus,
    RedisStore,
    host_page_views,
    parse_location,
)
from hicache.storage.store_url import parse_address

MODEL = {"model_id": "test/model", "model_revision": "r1"}


def base(storage: dict[str, Any] | None = None, **top: Any) -> dict[str, Any]:
    """A small dense config (2 layers, 2 KV heads x 8 dims, bfloat16, page 4) with
    ``storage`` as its storage section (left out when ``None``)."""
    data: dict[str, Any] = {
        "page_size_tokens": 4,
        "model": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "bfloat16"},
        "device_pool": {"num_tokens": 64},
        "host": {"ratio": 2.0, "layout": "page_first"},
    }
    if storage is not None:
        data["storage"] = copy.deepcopy(storage)
    return data | top


def load(storage: dict[str, Any] | None = None) -> HiCacheConfig:
    return config_from_dict(base(storage), check_ram=False)


FILE = {"backend": "file", "path": "/srv/pages"}
REDIS = {"backend": "redis", "url": "redis://127.0.0.1:6379"}


# ---- accepted -------------------------------------------------------------------------------


def test_no_section_is_no_store() -> None:
    """Without a storage section (or with an empty one) there is no L3, and the defaults hold."""
    for config in (load(), config_from_dict(base() | {"storage": None}, check_ram=False)):
        storage = config.storage
        assert storage == StorageConfig()
        assert storage.backend is StorageKind.NONE and not storage.is_enabled
        assert storage.location is None and storage.capacity_bytes is None
        assert (storage.timeout_s, storage.checksum) == (2.0, True)
        assert storage.prefetch_policy is PrefetchPolicy.TIMEOUT
        assert storage.write_policy is WritePolicy.WRITE_THROUGH
        assert storage.write_through_hits == 2


def test_file_store_location_and_cap() -> None:
    """backend file: the path is the location, the cap is in bytes; file:// URLs work too."""
    storage = load(FILE | {"size_cap_gib": 1.5}).storage
    assert storage.is_enabled and storage.location == "/srv/pages"
    assert storage.capacity_bytes == int(1.5 * GIB)
    assert load(FILE | {"path": "file:///srv/pages"}).storage.location == "file:///srv/pages"
    assert load(FILE | {"path": "pages"}).storage.location == "pages"


@pytest.mark.parametrize(("storage", "location"), [
    (REDIS, "redis://127.0.0.1:6379"),
    (REDIS | {"url": "redis://:pw@cache.local:6380"}, "redis://:pw@cache.local:6380"),
    (REDIS | {"url": "redis+cluster://10.0.0.1:7000,10.0.0.2:7000"},
     "redis+cluster://10.0.0.1:7000,10.0.0.2:7000"),
    ({"backend": "redis", "nodes": ["10.0.0.1:7000", "[::1]:7001"]},
     "redis+cluster://10.0.0.1:7000,[::1]:7001"),
])
def test_redis_locations(storage: dict[str, Any], location: str) -> None:
    """backend redis: one server by url, a cluster by redis+cluster:// or by nodes."""
    assert load(storage).storage.location == location


def test_every_choice_and_number_is_kept() -> None:
    """Every policy choice loads as its enum; integers are fine numbers."""
    for policy in PrefetchPolicy:
        assert load(FILE | {"prefetch_policy": policy.value}).storage.prefetch_policy is policy
    for write in WritePolicy:
        assert load(FILE | {"write_policy": write.value}).storage.write_policy is write
    storage = load(FILE | {"timeout_s": 1, "checksum": False, "write_through_hits": 5,
                           "prefetch_timeout_s": 1, "prefetch_timeout_max_s": 1}).storage
    assert storage.timeout_s == 1.0 and isinstance(storage.timeout_s, float)
    assert not storage.checksum and storage.write_through_hits == 5
    # a cap of exactly one page (4 tokens x 2 layers x K and V x 2 heads x 8 dims x 2 bytes)
    assert load(FILE | {"size_cap_gib": 4608 / 2**30}).storage.capacity_bytes == 4608
    # the README's default, and 0 (every tail asked for) at the bound
    assert load(FILE).storage.prefetch_threshold_tokens == 256
    assert load(FILE | {"prefetch_threshold_tokens": 0}).storage.prefetch_threshold_tokens == 0


def test_prefetch_timeout_grows_with_tokens_up_to_its_cap() -> None:
    """timeout: base + per-1024-tokens x tokens / 1024, at most the max (the study's formula)."""
    storage = load(FILE).storage
    assert storage.prefetch_timeout_for(0) == 2.0
    assert storage.prefetch_timeout_for(8192) == pytest.approx(2.8)
    assert storage.prefetch_timeout_for(10**7) == 30.0


# ---- refused: every message names the key, the value and the fix -------------------------------

ERRORS = [
    # choices, types, unknown keys
    ({"backend": "s3"}, r"storage\.backend = 's3': not a valid choice; use one of: none, file, "
     r"redis"),
    ({"backend": "file", "paht": "/x"}, r"storage\.paht: unknown key; did you mean 'path'\?"),
    (FILE | {"path": 5}, r"storage\.path = 5: expected a string, got an integer"),
    (FILE | {"checksum": "yes"}, r"storage\.checksum = 'yes': expected true or false"),
    (FILE | {"timeout_s": True}, r"storage\.timeout_s = true: expected a number, got a boolean"),
    (FILE | {"prefetch_policy": "eager"}, r"storage\.prefetch_policy = 'eager': not a valid "
     r"choice; use one of: best_effort, wait_complete, timeout"),
    (FILE | {"write_policy": "lazy"}, r"storage\.write_policy = 'lazy': not a valid choice; use "
     r"one of: write_through, write_through_selective, write_back"),
    # keys the backend does not use
    ({"path": "/x"}, r"storage\.path = '/x': not used: storage\.backend is none \(no L3\); "
     r"remove it, or set storage\.backend: file"),
    ({"url": "redis://h:1"}, r"storage\.url = 'redis://h:1': not used: storage\.backend is none "
     r"\(no L3\); remove it, or set storage\.backend: redis"),
    ({"nodes": ["h:1"]}, r"storage\.nodes = \['h:1'\]: not used: .*storage\.backend: redis"),
    ({"size_cap_gib": 1}, r"storage\.size_cap_gib = 1\.0: not used: storage\.backend is none"),
    (FILE | {"url": "redis://h:1"}, r"storage\.url = 'redis://h:1': not used: backend file keeps "
     r"pages in storage\.path; remove it, or set storage\.backend: redis"),
    (REDIS | {"path": "/x"}, r"storage\.path = '/x': not used: backend redis keeps pages in the "
     r"server that storage\.url or storage\.nodes names; remove it, or set storage\.backend: "
     r"file to keep pages in that directory"),
    (REDIS | {"size_cap_gib": 8}, r"storage\.size_cap_gib = 8\.0: not used: the server's "
     r"maxmemory caps a Redis store; remove it and set maxmemory on the server"),
    # file locations and cap
    ({"backend": "file"}, r"storage\.path: missing, required for backend file; add the "
     r"directory of the pages"),
    (FILE | {"path": ""}, r"storage\.path = '': empty"),
    (FILE | {"path": "redis://h:1"}, r"storage\.path = 'redis://h:1': a Redis URL, not a "
     r"directory; set storage\.backend: redis and url, or give a directory"),
    (FILE | {"path": "s3://bucket"}, r"storage\.path = 's3://bucket': unknown storage scheme "
     r"'s3'; use a directory path or one of"),
    (FILE | {"size_cap_gib": 0}, r"storage\.size_cap_gib = 0\.0: must be > 0"),
    (FILE | {"size_cap_gib": 1e-9}, r"storage\.size_cap_gib = 1e-09: smaller than one page's "
     r"file \(4608 bytes: 512 of rows, a header of 4096\); raise it to at least 5e-06"),
    # redis locations
    ({"backend": "redis"}, r"storage\.url: missing, required for backend redis; add url: "
     r"redis://host:6379 \(or nodes: \[host:port, \.\.\.\] for a cluster\)"),
    (REDIS | {"nodes": ["h:1"]}, r"storage\.url = 'redis://127\.0\.0\.1:6379' and storage\.nodes "
     r"= \['h:1'\]: both given; keep url"),
    (REDIS | {"url": "redis://localhost"}, r"storage\.url = 'redis://localhost': 'localhost' is "
     r"not host:port \(e\.g\. 127\.0\.0\.1:6379, \[::1\]:6379\)"),
    (REDIS | {"url": "redis://a:1,b:2"}, r"storage\.url = 'redis://a:1,b:2': several hosts need "
     r"redis\+cluster://"),
    (REDIS | {"url": "redis://a:1/2"}, r"storage\.url = 'redis://a:1/2': only database 0"),
    (REDIS | {"url": "/var/cache"}, r"storage\.url = '/var/cache': not a Redis URL; use "
     r"redis://host:port or redis\+cluster://host:port,\.\.\.; a directory goes in storage\.path"),
    ({"backend": "redis", "nodes": []}, r"storage\.nodes = \[\]: no nodes; list at least one "),
    ({"backend": "redis", "nodes": "h:1"}, r"storage\.nodes = 'h:1': expected a list of "
     r"strings, got a string; write it as \[first, second\]"),
    ({"backend": "redis", "nodes": ["h:1", 7000]}, r"storage\.nodes\[1\] = 7000: expected a "
     r"string, got an integer"),
    ({"backend": "redis", "nodes": ["h:1", "h"]}, r"storage\.nodes\[1\] = 'h': not host:port; "
     r"write it as host:port, e\.g\. 10\.0\.0\.1:7000"),
    ({"backend": "redis", "nodes": ["h:1", "h:1"]}, r"storage\.nodes\[1\] = 'h:1': listed twice"),
    # numbers
    (FILE | {"timeout_s": 0}, r"storage\.timeout_s = 0\.0: must be > 0"),
    (FILE | {"prefetch_timeout_s": -1}, r"storage\.prefetch_timeout_s = -1\.0: must be > 0"),
    (FILE | {"prefetch_timeout_per_1024_tokens_s": -0.1},
     r"storage\.prefetch_timeout_per_1024_tokens_s = -0\.1: must be >= 0"),
    (FILE | {"prefetch_timeout_max_s": 1}, r"storage\.prefetch_timeout_max_s = 1\.0: below "
     r"storage\.prefetch_timeout_s \(2\.0\); set it to at least 2\.0"),
    (FILE | {"write_through_hits": 0}, r"storage\.write_through_hits = 0: must be >= 1"),
]


@pytest.mark.parametrize(("storage", "message"), ERRORS)
def test_bad_storage_section_names_key_value_and_fix(storage: dict[str, Any],
                                                     message: str) -> None:
    """A bad storage section raises one ConfigError whose message names the key and the fix."""
    with pytest.raises(ConfigError, match=message) as info:
        load(storage)
    assert info.value.key is not None and info.value.key.startswith("storage")


# ---- the store built from the config ------------------------------------------------------------


def host_pool(config: HiCacheConfig) -> HostKVPool:
    """The host pool of a dense ``config``, filled with random values."""
    pool = HostKVPool(name="full", space=IndexSpace.HOST_FULL,
                      num_layers=config.model.num_layers,
                      num_pages=host_num_pages(config, "full"),
                      page_size=config.page_size_tokens, geometry=config.model.row_geometry,
                      layout=config.host.layout, pin=False)
    pool.data.copy_(torch.randn(pool.data.shape, generator=torch.Generator().manual_seed(0)))
    return pool


def page_slots(first_page: int, num_pages: int, page_size: int = 4) -> Indices:
    start = first_page * page_size
    return Indices(torch.arange(start, start + num_pages * page_size), IndexSpace.HOST_FULL)


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_namespace_from_config_is_the_host_pools(layout: str) -> None:
    """A dense config's namespace is the one its host pool's pages are stored under."""
    config = config_from_dict(base(FILE) | {"host": {"ratio": 2.0, "layout": layout}},
                              check_ram=False)
    assert storage_namespace(config, **MODEL) == Namespace.for_host_pool(host_pool(config),
                                                                        **MODEL)


def test_hybrid_namespace_carries_the_swa_rows_as_a_second_segment() -> None:
    """A hybrid page's payload is its full rows, then its SWA rows; a new revision is a new
    namespace."""
    data = base(FILE)
    data["model"] |= {"num_layers": 3, "swa_layers": [1], "window_tokens": 8}
    data["device_pool"]["swa_num_tokens"] = 16
    config = config_from_dict(data, check_ram=False)
    namespace = storage_namespace(config, **MODEL)
    row_bytes = 2 * 8 * 2  # heads x dims x bfloat16
    assert namespace.num_layers == 2 and namespace.layout == "page_first"
    assert namespace.segment_bytes == (4 * 2 * 2 * row_bytes, 4 * 2 * 1 * row_bytes)
    other = storage_namespace(config, model_id="test/model", model_revision="r2")
    assert other.digest != namespace.digest


def test_no_store_without_a_backend() -> None:
    """backend none builds nothing."""
    config = load()
    assert open_configured_store(config, storage_namespace(config, **MODEL)) is None


def test_file_store_from_config_round_trips_pages(tmp_path: Path) -> None:
    """The configured file store keeps pages in storage.path under its cap, and a get brings
    them back bit for bit into other host slots."""
    config = load(FILE | {"path": str(tmp_path / "pages"), "size_cap_gib": 0.001,
                          "timeout_s": 5, "checksum": False})
    pool = host_pool(config)
    hashes = [bytes([i]) * 32 for i in range(3)]
    with open_configured_store(config, storage_namespace(config, **MODEL)) as store:
        assert isinstance(store, FileStore)
        assert store.directory.parent == tmp_path / "pages"
        assert store.lru.capacity_bytes == int(0.001 * GIB) and store.timeout_s == 5.0
        assert not store.format.checksum
        assert store.put(hashes, host_page_views(pool, page_slots(1, 3))).statuses == (
            PageStatus.OK,) * 3
        assert store.get(hashes, host_page_views(pool, page_slots(10, 3))).num_leading_ok == 3
    assert torch.equal(pool.read_rows(page_slots(10, 3)), pool.read_rows(page_slots(1, 3)))


@needs_redis
def test_redis_store_from_config_round_trips_pages(redis_server: RedisServer) -> None:
    """The configured Redis store reaches the server of storage.url."""
    config = load(REDIS | {"url": f"redis://127.0.0.1:{redis_server.port}"})
    pool = host_pool(config)
    hashes = [bytes([i + 7]) * 32 for i in range(2)]
    with open_configured_store(config, storage_namespace(config, **MODEL)) as store:
        assert isinstance(store, RedisStore)
        assert store.put(hashes, host_page_views(pool, page_slots(1, 2))).num_leading_ok == 2
        assert store.get(hashes, host_page_views(pool, page_slots(5, 2))).num_leading_ok == 2
    assert torch.equal(pool.read_rows(page_slots(5, 2)), pool.read_rows(page_slots(1, 2)))


def test_a_namespace_of_other_pages_is_refused(tmp_path: Path) -> None:
    """A namespace whose page size or layout is not the config's raises before any I/O."""
    config = load(FILE | {"path": str(tmp_path / "pages")})
    pool = host_pool(config)
    wrong = Namespace.for_host_pool(pool, **MODEL)
    wrong = Namespace(**{**wrong.__dict__, "layout": HostLayout.LAYER_FIRST.value})
    with pytest.raises(ValueError, match=re.escape("namespace does not describe this config's "
                                                   "pages (layout differ: ['layer_first'] "
                                                   "given, ['page_first'] from the config)")):
        open_configured_store(config, wrong)
    assert not (tmp_path / "pages").exists()


@pytest.mark.parametrize(("location", "part"), [
    ("redis://user:pw@h:6379", "the user name 'user'"),
    ("redis+cluster://h:1,h:2?db=2", "the query ?db=2"),
    ("redis://h:6379#x", "the fragment #x"),
])
def test_open_store_refuses_url_parts_it_would_ignore(location: str, part: str) -> None:
    """open_store parses as the config does: a user name, a query or a fragment is refused,
    not dropped; a password alone is fine."""
    with pytest.raises(ValueError, match=re.escape(f"{location!r}: {part} is not supported")):
        parse_location(location)
    assert parse_location("redis://:pw@h:6379").password == "pw"


@pytest.mark.parametrize(("location", "message"), [
    ("", "storage location must be a path or URL, got ''"),
    (None, "storage location must be a path or URL, got None"),
    (5, "storage location must be a path or URL, got 5"),
    ("redis://127.0.0.1:0", "'redis://127.0.0.1:0': '127.0.0.1:0' is not host:port"),
    ("redis://127.0.0.1:65536", "'redis://127.0.0.1:65536': '127.0.0.1:65536' is not "
                                "host:port"),
    ("redis+cluster://h:1,h:x", "'redis+cluster://h:1,h:x': 'h:x' is not host:port"),
    ("file://otherhost/pages", "'file://otherhost/pages': write file URLs as "
                               "file:///absolute/path"),
    ("file://", "'file://': write file URLs as file:///absolute/path"),
])
def test_bad_locations_are_refused_by_name(location: object, message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        parse_location(location)  # type: ignore[arg-type]


def test_ports_run_from_1_to_65535_and_file_urls_are_local() -> None:
    assert parse_location("redis://127.0.0.1:1").seeds == (("127.0.0.1", 1),)
    assert parse_location("redis://127.0.0.1:65535").seeds == (("127.0.0.1", 65535),)
    assert parse_address("[::1]:7000") == ("::1", 7000)
    assert parse_location("file://localhost/srv/pages").path == "/srv/pages"
    with pytest.raises(ValueError,
                       match=r"^'h' is not host:port \(e\.g\. 127\.0\.0\.1:6379, \[::1\]:6379\)$"):
        parse_address("h")


def test_a_cluster_of_ipv6_seeds_after_the_first_is_parsed_on_every_python() -> None:
    """Newer Pythons' urlsplit refuses a bracket after the first host of a network location;
    the seeds are split as written, with the password, the database and the refusals kept."""
    location = parse_location("redis+cluster://:s%40cret@10.0.0.1:7000,[::1]:7001,[fe80::2]:7002/0")
    assert location.seeds == (("10.0.0.1", 7000), ("::1", 7001), ("fe80::2", 7002))
    assert location.password == "s@cret" and location.scheme == "redis+cluster"
    assert parse_location("REDIS://[::1]:6379").seeds == (("::1", 6379),)
    with pytest.raises(ValueError, match=r"the query \?db=1 is not supported"):
        parse_location("redis+cluster://10.0.0.1:7000,[::1]:7001?db=1")
    with pytest.raises(ValueError, match="only database 0 is supported"):
        parse_location("redis+cluster://10.0.0.1:7000,[::1]:7001/3")
