"""The ``storage`` config section (hicache.config.storage)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

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
    (FILE | {"size_cap_gib": 1e-9}, r"storage\.size_cap_gib = 1e-09: smaller than one page "
     r"\(512 bytes\); raise it to at least 1e-06"),
    # redis locations
    ({"backend": "redis"}, r"storage\.url: missing, required for backend redis; add url: "
     r"redis://host:6379 \(or nodes: \[host:port, \.\.\.\] for a cluster\)"),
    (REDIS | {"nodes": ["h:1"]}, r"storage\.url = 'redis://127\.0\.0\.1:6379' and storage\.nodes "
     r"= \['h:1'\]: both given; keep url"),
    (REDIS | {"url": "redis://localhost"}, r"storage\.url = 'redis://localhost': 'localhost' is "
     r"not host:port \(e\.g\. 127\.0\.0\.1:6379\)"),
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
