"""Strict config loading (hicache.config) and pool sizes (hicache.config.sizing)."""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import re
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache.config import (
    GIB,
    ConfigError,
    ControllerConfig,
    DevicePoolConfig,
    DType,
    HiCacheConfig,
    HostTierConfig,
    IOBackend,
    ModelConfig,
    ServiceConfig,
    StorageConfig,
    SWAHistory,
    WritePolicy,
    config_from_dict,
    load_config,
    loading,
)
from hicache.config.sizing import (
    PoolSize,
    device_num_pages,
    host_num_pages,
    pool_layers,
    pool_names,
    pool_sizes,
    staging_bytes,
    token_bytes,
)
from hicache.pools import AttentionKind, HostLayout

MISSING = object()


def hybrid() -> dict[str, Any]:
    """The default config.yaml as a dict: 4 layers, SWA layers 1 and 3, page 16."""
    return {
        "page_size_tokens": 16,
        "model": {"num_layers": 4, "swa_layers": [1, 3], "window_tokens": 64,
                  "attention": "mha", "num_kv_heads": 2, "head_dim": 32, "dtype": "float32"},
        "device_pool": {"num_tokens": 1024, "swa_num_tokens": 256},
        "host": {"ratio": 4.0, "layout": "layer_first"},
    }


def dense() -> dict[str, Any]:
    """A model without SWA: 2 layers, 4 KV heads x 16 dims, bfloat16, page 8."""
    return {
        "page_size_tokens": 8,
        "model": {"num_layers": 2, "num_kv_heads": 4, "head_dim": 16, "dtype": "bfloat16"},
        "device_pool": {"num_tokens": 256},
        "host": {"ratio": 2.5},
    }


def edited(base: dict[str, Any], key: str, value: object) -> dict[str, Any]:
    """A deep copy of ``base`` with dotted ``key`` set to ``value`` (removed if MISSING)."""
    data = copy.deepcopy(base)
    *sections, name = key.split(".")
    node = data
    for section in sections:
        node = node.setdefault(section, {})
    if value is MISSING:
        del node[name]
    else:
        node[name] = value
    return data


# ---- the default file -----------------------------------------------------------------------


def test_default_config_loads(repo_root: Path) -> None:
    """config.yaml loads into the documented small hybrid model."""
    config = load_config(repo_root / "config.yaml")
    assert config.model == ModelConfig(
        num_layers=4, dtype=DType.FLOAT32, attention=AttentionKind.MHA, num_kv_heads=2,
        head_dim=32, swa_layers=(1, 3), window_tokens=64,
    )
    assert config.page_size_tokens == 16
    assert config.device_pool == DevicePoolConfig(num_tokens=1024, swa_num_tokens=256)
    assert config.host == HostTierConfig(ratio=4.0, layout=HostLayout.LAYER_FIRST)
    assert config.controller == ControllerConfig(write_policy=WritePolicy.WRITE_THROUGH)
    assert config.service == ServiceConfig()
    assert config.is_hybrid
    assert config.model.torch_dtype is torch.float32


@pytest.mark.parametrize("page_size", [1, 16])
def test_page_first_direct_layout_is_accepted(page_size: int) -> None:
    """host.layout: page_first_direct loads, at any page size (1 is page_first's bytes)."""
    data = edited(edited(dense(), "host.layout", "page_first_direct"), "page_size_tokens",
                  page_size)
    assert config_from_dict(data).host.layout is HostLayout.PAGE_FIRST_DIRECT


def test_default_sections_and_enums() -> None:
    """Omitted sections take their defaults; choices become enums."""
    config = config_from_dict(dense())
    assert config.controller.io_backend is IOBackend.AUTO
    assert config.controller.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE
    assert config.service.metrics_host == "127.0.0.1"
    assert config.service.metrics_port == 9400
    assert config.host.ram_reserve_gib == 2.0
    assert config.device_pool.device == "cpu"
    assert not config.is_hybrid
    # the README's documented defaults of the controller's tuning keys
    assert (config.controller.kernel_programs, config.controller.event_ring_size,
            config.controller.staging_tokens) == (16, 3, 1024)
    for section in (config.model, config.device_pool, config.host, config.controller,
                    config.service):
        with pytest.raises(dataclasses.FrozenInstanceError):
            section.__setattr__(dataclasses.fields(section)[0].name, None)


def test_int_accepted_for_float() -> None:
    """An integer is a valid float and is stored as one."""
    config = config_from_dict(edited(dense(), "host.ratio", 3))
    assert config.host.ratio == 3.0
    assert isinstance(config.host.ratio, float)


def test_empty_section_takes_defaults() -> None:
    """``controller:`` with nothing under it (null) is the default section."""
    config = config_from_dict(edited(dense(), "controller", None))
    assert config.controller == ControllerConfig()


def test_config_is_frozen() -> None:
    """Configs cannot be changed after validation."""
    config = config_from_dict(dense())
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.page_size_tokens = 32  # type: ignore[misc]


# ---- errors: every message names the key, the value and the fix -----------------------------

ERRORS = [
    # unknown keys, with the closest valid one
    ("model.num_layer", 4, r"model\.num_layer: unknown key; did you mean 'num_layers'\?"),
    ("hots", {}, r"hots: unknown key; did you mean 'host'\?"),
    ("controller.zzz", 1, r"controller\.zzz: unknown key; valid keys: io_backend, "),
    # missing required keys
    ("model.num_layers", MISSING, r"model\.num_layers: missing required key; add it \(an int"),
    ("page_size_tokens", MISSING, r"page_size_tokens: missing required key"),
    ("host", MISSING, r"host: missing required key; add it \(a section of keys\)"),
    ("model.dtype", MISSING,
     r"model\.dtype: missing required key; add it \(one of: bfloat16, float16, float32\)"),
    # a key of another section: where it belongs
    ("controller.page_size_tokens", 16,
     r"controller\.page_size_tokens: unknown key in this section; it belongs in "
     r"page_size_tokens \(top level\): move it there"),
    ("model.num_kv_heads", MISSING, r"model\.num_kv_heads: missing, required for attention mha"),
    ("device_pool.swa_num_tokens", MISSING,
     r"device_pool\.swa_num_tokens: missing; the model has sliding-window layers \[1, 3\], "
     r"so add it \(at least 64 tokens\)"),
    # wrong types: bool is not an int, float is not an int, int is not a bool
    ("model.num_layers", True, r"model\.num_layers = true: expected an integer, got a boolean"),
    ("device_pool.num_tokens", 1024.0,
     r"device_pool\.num_tokens = 1024\.0: expected an integer, got a number"),
    ("page_size_tokens", "16", r"page_size_tokens = '16': expected an integer, got a string"),
    ("host.ratio", False, r"host\.ratio = false: expected a number, got a boolean"),
    ("host.ratio", float("nan"), r"host\.ratio = nan: not a finite number"),
    ("service.metrics_enabled", 1,
     r"service\.metrics_enabled = 1: expected true or false, got an integer"),
    ("model.swa_layers", 1, r"model\.swa_layers = 1: expected a list of integers"),
    ("model.swa_layers", [1, "3"], r"model\.swa_layers\[1\] = '3': expected an integer"),
    ("model", [1], r"model: expected a mapping of keys, got \[1\]"),
    # bad choices list the valid ones
    ("host.layout", "row_first",
     r"host\.layout = 'row_first': not a valid choice; use one of: layer_first, page_first, "
     r"page_first_direct"),
    ("host.layout", "page_first_directt",
     r"host\.layout = 'page_first_directt': not a valid choice; use one of: layer_first, "
     r"page_first, page_first_direct"),
    ("model.dtype", "fp8", r"model\.dtype = 'fp8': .*use one of: bfloat16, float16, float32"),
    ("controller.io_backend", "cuda",
     r"controller\.io_backend = 'cuda': .*use one of: torch, kernel, staged, direct, auto"),
    ("controller.write_policy", "lazy", r"controller\.write_policy = 'lazy': not a valid"),
    ("controller.eviction_policy", "fifo", r"use one of: lru, lfu"),
    ("model.attention", "gqa", r"model\.attention = 'gqa': .*use one of: mha, mla"),
    # ranges
    ("model.num_layers", 0, r"model\.num_layers = 0: must be >= 1"),
    ("page_size_tokens", 0, r"page_size_tokens = 0: must be >= 1"),
    ("controller.event_ring_size", 1, r"controller\.event_ring_size = 1: must be >= 2"),
    ("controller.kernel_programs", 0, r"controller\.kernel_programs = 0: must be >= 1"),
    ("controller.load_back_threshold_tokens", -1, r"load_back_threshold_tokens = -1: must be"),
    ("service.metrics_port", 70000, r"service\.metrics_port = 70000: not a TCP port; use 0"),
    ("service.metrics_port", 65536, r"service\.metrics_port = 65536: not a TCP port; use 0"),
    ("host.ratio", 2.0**63 * 1.5, r"host\.ratio = 1\.38\d+e\+19: more host tokens per "
     r"device token than a slot index can count \(2\*\*63\)"),
    ("service.integrity_check_interval_s", -0.5, r"integrity_check_interval_s = -0\.5: must"),
    ("host.ram_reserve_gib", -1, r"host\.ram_reserve_gib = -1\.0: must be >= 0"),
    ("host.ram_reserve_gib", 2.0**33 + 1024,
     r"host\.ram_reserve_gib = 8589935616\.0: more than 2\*\*63 bytes, the most a byte "
     r"count can hold; give the size in GiB \(at most 8589934592\), e\.g\. 64"),
    ("model.num_layers", 4097, r"model\.num_layers = 4097: must be <= 4096 \(no model"),
    ("controller.event_ring_size", 65, r"controller\.event_ring_size = 65: must be <= 64"),
    ("host.ratio", 0, r"host\.ratio = 0\.0: must be > 0"),
    ("device_pool.device", "gpu", r"device_pool\.device = 'gpu': not a device; use cpu, cuda"),
    # page multiples suggest the rounded values
    ("device_pool.num_tokens", 1000,
     r"device_pool\.num_tokens = 1000: not a multiple of page_size_tokens \(16\); use 992 or "
     r"1008"),
    ("device_pool.swa_num_tokens", 250,
     r"device_pool\.swa_num_tokens = 250: not a multiple .*use 240 or 256"),
    ("device_pool.num_tokens", 8, r"device_pool\.num_tokens = 8: .*use 16$"),
    # the window against the pools
    ("device_pool.swa_num_tokens", 48,
     r"device_pool\.swa_num_tokens = 48: SWA pool smaller than the window "
     r"\(model\.window_tokens = 64\); set it to at least 64"),
    ("model.window_tokens", 2000,
     r"model\.window_tokens = 2000: window larger than the device pool; raise "
     r"device_pool\.num_tokens \(1024\) to at least 2000"),
    ("device_pool.swa_num_tokens", 2048,
     r"device_pool\.swa_num_tokens = 2048: larger than device_pool\.num_tokens \(1024\)"),
    ("model.window_tokens", MISSING, r"model\.window_tokens: missing, required when"),
    ("model.window_tokens", 0, r"model\.window_tokens = 0: must be >= 1"),
    # SWA layer ids
    ("model.swa_layers", [1, 4],
     r"model\.swa_layers\[1\] = 4: layer id out of range; use ids 0\.\.3"),
    ("model.swa_layers", [-1], r"model\.swa_layers\[0\] = -1: layer id out of range"),
    ("model.swa_layers", [3, 1, 3],
     r"model\.swa_layers\[2\] = 3: duplicated layer id; list each sliding-window layer once"),
    ("model.swa_layers", [0, 1, 2, 3],
     r"model\.swa_layers = \[0, 1, 2, 3\]: every layer is sliding-window"),
    # MHA / MLA fields
    ("model.latent_dim", 512,
     r"model\.latent_dim = 512: not used: it is for attention mla only; remove it"),
    ("model.attention", "mla", r"model\.latent_dim: missing, required for attention mla"),
    # host sizing
    ("host.size_gib", 1,
     r"host\.ratio = 4\.0 and host\.size_gib = 1\.0: both given; keep exactly one of them"),
    ("host.ratio", MISSING, r"host: neither host\.ratio nor host\.size_gib given; add exactly"),
    ("host.ratio", 0.01,
     r"host\.ratio = 0\.01: host smaller than one page for pool 'full' \(0\.01 x 64 device "
     r"pages is 0\.64 pages, page_size_tokens = 16\); raise host\.ratio to at least 0\.0157"),
]


@pytest.mark.parametrize(("key", "value", "message"), ERRORS,
                         ids=[f"{key}={value!r}" for key, value, _ in ERRORS])
def test_invalid_setting_names_key_value_and_fix(key: str, value: object, message: str) -> None:
    """Each invalid setting raises ConfigError with the key, the value and the fix."""
    with pytest.raises(ConfigError, match=message):
        config_from_dict(edited(hybrid(), key, value), check_ram=False)


BOUNDS = [("model.num_layers", 4096), ("controller.event_ring_size", 64),
          ("host.ram_reserve_gib", 2.0**33), ("host.ratio", 1e9),
          ("service.integrity_check_interval_s", 0),
          ("service.integrity_check_interval_s", threading.TIMEOUT_MAX),
          ("controller.staging_tokens", 1),
          ("controller.write_through_hits", 1), ("controller.load_back_threshold_tokens", 0),
          ("service.metrics_port", 0), ("service.metrics_port", 65535),
          ("model.num_kv_heads", 1), ("model.head_dim", 1)]


@pytest.mark.parametrize(("key", "value"), BOUNDS, ids=[f"{k}={v!r}" for k, v in BOUNDS])
def test_each_bound_itself_is_accepted(key: str, value: float) -> None:
    config = config_from_dict(edited(hybrid(), key, value), check_ram=False)
    section, _, name = key.rpartition(".")
    assert getattr(getattr(config, section) if section else config, name) == value


def test_a_host_ratio_making_a_pool_of_2_63_bytes_is_refused() -> None:
    """The ratio's own bound (2**63) makes a host pool no byte count holds."""
    with pytest.raises(ConfigError, match=r"host\.ratio = .*its host pool 'full' would take "
                                          r"\d+ bytes, more than 2\*\*63"):
        config_from_dict(edited(hybrid(), "host.ratio", 2.0**63), check_ram=False)


def test_an_mla_latent_row_of_one_is_accepted() -> None:
    config = config_from_dict(edited(edited(edited(edited(
        dense(), "model.attention", "mla"), "model.num_kv_heads", MISSING),
        "model.head_dim", MISSING), "model.latent_dim", 1))
    assert config.model.latent_dim == 1


def test_error_carries_the_key() -> None:
    """ConfigError.key is the dotted key at fault."""
    with pytest.raises(ConfigError) as info:
        config_from_dict(edited(hybrid(), "host.layout", "row_first"))
    assert info.value.key == "host.layout"
    assert isinstance(info.value, ValueError)


def test_window_only_with_swa_layers() -> None:
    """A window without sliding-window layers is a mistake, not ignored."""
    with pytest.raises(ConfigError, match=r"model\.window_tokens = 64: not used: "
                       r"model\.swa_layers is empty"):
        config_from_dict(edited(dense(), "model.window_tokens", 64))


def test_swa_pool_only_with_swa_layers() -> None:
    """An SWA pool size for a model without SWA layers is an error."""
    with pytest.raises(ConfigError, match=r"device_pool\.swa_num_tokens = 128: not used"):
        config_from_dict(edited(dense(), "device_pool.swa_num_tokens", 128))


def test_mla_rejects_head_fields() -> None:
    """MLA has one latent row; num_kv_heads/head_dim are rejected."""
    data = edited(dense(), "model.attention", "mla")
    data = edited(data, "model.latent_dim", 576)
    with pytest.raises(ConfigError, match=r"model\.num_kv_heads = 4: not used: mla stores"):
        config_from_dict(data)


def test_host_size_gib_smaller_than_one_page() -> None:
    """A size_gib whose share cannot hold one page plus the reserved page is an error."""
    data = edited(edited(dense(), "host.ratio", MISSING), "host.size_gib", 1e-6)
    # page bytes: 8 tokens x 512 bytes = 4096; needs 2 pages = 8192 bytes = 7.63e-6 GiB
    with pytest.raises(ConfigError, match=r"host\.size_gib = 1e-06: host smaller than one page "
                       r"for pool 'full' \(its share is 1073 bytes but one page plus the "
                       r"reserved page take 8192 bytes.*at least 8e-06"):
        config_from_dict(data)


# ---- RAM check --------------------------------------------------------------------------------


def test_host_larger_than_available_ram(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host pools beyond available RAM minus the reserve name the key, figures and fix."""
    monkeypatch.setattr(loading, "available_ram_bytes", lambda: 3 * GIB)
    data = edited(edited(dense(), "host.ratio", MISSING), "host.size_gib", 1.5)
    with pytest.raises(ConfigError, match=r"host\.size_gib = 1\.5: host and CPU device pools "
                       r"need 1\.50 GiB but 3\.00 GiB of RAM is available and "
                       r"host\.ram_reserve_gib keeps 2\.00 GiB of it; lower host\.size_gib to "
                       r"at most 0\.99"):
        config_from_dict(data)


def test_host_within_available_ram(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same host tier fits once the reserve is lowered."""
    monkeypatch.setattr(loading, "available_ram_bytes", lambda: 3 * GIB)
    data = edited(edited(dense(), "host.ratio", MISSING), "host.size_gib", 1.5)
    config = config_from_dict(edited(data, "host.ram_reserve_gib", 1.0))
    assert config.host.size_gib == 1.5


def test_ram_check_can_be_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """check_ram=False validates everything but the RAM."""
    monkeypatch.setattr(loading, "available_ram_bytes", lambda: 0)
    assert config_from_dict(dense(), check_ram=False).host.ratio == 2.5
    with pytest.raises(ConfigError, match=r"device_pool\.num_tokens = 256: host and CPU device "
                       r"pools need"):
        config_from_dict(dense())


def test_unknown_ram_is_not_checked(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """When available RAM cannot be read, loading warns and goes on."""
    monkeypatch.setattr(loading, "available_ram_bytes", lambda: None)
    with caplog.at_level(logging.WARNING, logger="hicache.config.loading"):
        config_from_dict(dense())
    assert "cannot read available RAM" in caplog.text


def test_available_ram_is_read() -> None:
    """This machine reports a positive amount of available RAM, and its total RAM as the
    kernel counts it (MemTotal is the physical pages sysconf counts, in bytes)."""
    available = loading.available_ram_bytes()
    assert available is not None and available > 0
    total = loading.total_ram_bytes()
    assert total == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert available <= total


def test_every_loader_checks_ram_unless_told_not_to(monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path, repo_root: Path) -> None:
    monkeypatch.setattr(loading, "available_ram_bytes", lambda: 2 * GIB + 1024)
    text = (repo_root / "config.yaml").read_text(encoding="utf-8")
    (tmp_path / "config.yaml").write_text(text, encoding="utf-8")
    for load in (lambda **kw: loading.load_default_config(**kw),
                 lambda **kw: loading.load_config(tmp_path / "config.yaml", **kw),
                 lambda **kw: loading.config_from_yaml(text, "config.yaml", **kw)):
        with pytest.raises(ConfigError, match="of RAM is available"):
            load()
        load(check_ram=False)


def test_pools_that_fill_the_budget_exactly_fit_and_a_cpu_device_pool_counts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Host and CPU device pools are both in RAM: their sum against available RAM minus the
    reserve, an exact fit accepted, one byte less refused."""
    data = edited(edited(edited(dense(), "host.ratio", MISSING), "host.size_gib", 0.01),
                  "device_pool.num_tokens", 4096 * 8)
    sizes = pool_sizes(config_from_dict(data, check_ram=False))
    host = sum(size.size_bytes for size in sizes if size.tier == "host")
    device = sum(size.size_bytes for size in sizes if size.tier == "device")
    assert device > host // 8  # a device pool that matters
    reserve = 2 * GIB
    monkeypatch.setattr(loading, "available_ram_bytes", lambda: reserve + host + device)
    config_from_dict(data)
    monkeypatch.setattr(loading, "available_ram_bytes", lambda: reserve + host + device - 1)
    with pytest.raises(ConfigError, match="host and CPU device pools need"):
        config_from_dict(data)


# ---- files ------------------------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    """A missing file is a one-line ConfigError naming the path and how to get a config."""
    path = tmp_path / "absent.yaml"
    expected = (f"{path}: no such config file; write one to start from with 'hicache init "
                f"{path}', or leave the path out to use the built-in default")
    with pytest.raises(ConfigError, match=f"^{re.escape(expected)}$"):
        load_config(path)


def test_invalid_yaml(tmp_path: Path) -> None:
    """Invalid YAML reports the line and column in one line."""
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  num_layers: [4\npage_size_tokens: 16\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: invalid YAML at line \d+, column \d+: "
                       r"[^\n]+$") as info:
        load_config(path)
    assert "\n" not in str(info.value)


def test_duplicate_yaml_key(tmp_path: Path) -> None:
    """A key given twice is an error (plain YAML loaders keep the last one silently)."""
    path = tmp_path / "twice.yaml"
    path.write_text("page_size_tokens: 16\npage_size_tokens: 32\n")
    with pytest.raises(ConfigError, match=r"invalid YAML at line 2, column 1: duplicate key "
                       r"'page_size_tokens'"):
        load_config(path)


def test_empty_file(tmp_path: Path) -> None:
    """An empty file says which sections are needed."""
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing\n")
    with pytest.raises(ConfigError, match=r"empty\.yaml: the config is empty; it needs"):
        load_config(path)


def test_top_level_not_a_mapping(tmp_path: Path) -> None:
    """A YAML list at the top is rejected."""
    path = tmp_path / "list.yaml"
    path.write_text("- model\n")
    with pytest.raises(ConfigError, match=r"list\.yaml: the config: expected a mapping"):
        load_config(path)


def test_file_errors_name_path_and_key(tmp_path: Path) -> None:
    """Errors from a file start with its path and keep the dotted key."""
    path = tmp_path / "typo.yaml"
    path.write_text("page_size_tokens: 16\nmodell: {}\n")
    with pytest.raises(ConfigError, match=r"typo\.yaml: modell: unknown key; did you mean "
                       r"'model'\?") as info:
        load_config(path)
    assert info.value.key == "modell"


# ---- sizes ------------------------------------------------------------------------------------


def test_pool_sizes_hybrid() -> None:
    """Default geometry: 2 layers per pool x K,V x 64 float32 = 1024 bytes per token; the
    host SWA pool holds as many tokens as the host full pool (``swa_history: all``)."""
    config = config_from_dict(hybrid())
    assert pool_sizes(config) == [
        PoolSize("device", "full", 1024, 64, 65 * 16 * 1024),
        PoolSize("device", "swa", 256, 16, 17 * 16 * 1024),
        PoolSize("host", "full", 4096, 256, 257 * 16 * 1024),
        PoolSize("host", "swa", 4096, 256, 257 * 16 * 1024),
    ]
    tails = config_from_dict(edited(hybrid(), "host.swa_history", "window_tails"))
    assert pool_sizes(tails)[3] == PoolSize("host", "swa", 1024, 64, 65 * 16 * 1024)
    assert pool_layers(config, "full") == (0, 2)
    assert pool_layers(config, "swa") == (1, 3)


def test_swa_history_all_splits_size_gib_into_equal_token_counts() -> None:
    """With ``all`` a GiB budget gives both host pools the same tokens, and the whole
    allocation, reserved pages included, fits in it."""
    data = edited(edited(hybrid(), "host.ratio", MISSING), "host.size_gib", 0.01)
    sizes = pool_sizes(config_from_dict(data))
    host = [s for s in sizes if s.tier == "host"]
    assert host[0].num_tokens == host[1].num_tokens > 0
    assert sum(s.size_bytes for s in host) <= int(0.01 * 2**30)


def test_swa_history_unknown_value_names_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"host\.swa_history"):
        config_from_dict(edited(hybrid(), "host.swa_history", "some"))


def test_pool_sizes_dense() -> None:
    """No SWA: one full pool of all layers; 2 layers x K,V x 64 bf16 = 512 bytes per token."""
    assert pool_sizes(config_from_dict(dense())) == [
        PoolSize("device", "full", 256, 32, 33 * 8 * 512),
        PoolSize("host", "full", 640, 80, 81 * 8 * 512),
    ]


def test_pool_sizes_mla() -> None:
    """MLA: one latent row of 576 float16 per layer = 3 x 1152 bytes per token."""
    data = {
        "page_size_tokens": 4,
        "model": {"num_layers": 3, "attention": "mla", "latent_dim": 576, "dtype": "float16"},
        "device_pool": {"num_tokens": 64},
        "host": {"ratio": 1.0},
    }
    assert pool_sizes(config_from_dict(data)) == [
        PoolSize("device", "full", 64, 16, 17 * 4 * 3456),
        PoolSize("host", "full", 64, 16, 17 * 4 * 3456),
    ]


def test_host_ratio_rounds_down_to_pages() -> None:
    """1.25 x 32 device pages = 40 pages; 1.3 x 32 = 41.6 -> 41 pages."""
    assert host_num_pages(config_from_dict(edited(dense(), "host.ratio", 1.25)), "full") == 40
    assert host_num_pages(config_from_dict(edited(dense(), "host.ratio", 1.3)), "full") == 41


def test_host_size_gib_split_by_device_bytes() -> None:
    """``swa_history: window_tails``: 9 MiB split 8:1 like the device pools (1 MiB full,
    128 KiB SWA), reserved page inside."""
    data = hybrid()
    data["model"].update(num_layers=3, swa_layers=[1])  # full: 2 layers, SWA: 1 layer
    data["host"] = {"size_gib": 9 / 1024, "swa_history": "window_tails"}
    config = config_from_dict(data)
    # full: 1024 bytes per token, 8 MiB / (16 x 1024) = 512 pages, one reserved
    # swa: 512 bytes per token, 1 MiB / (16 x 512) = 128 pages, one reserved
    sizes = pool_sizes(config)
    assert sizes[2:] == [
        PoolSize("host", "full", 511 * 16, 511, 8 * 2**20),
        PoolSize("host", "swa", 127 * 16, 127, 2**20),
    ]
    assert sizes[2].size_bytes + sizes[3].size_bytes == 9 * 2**20
    assert host_num_pages(config, "full") == 511
    assert host_num_pages(config, "swa") == 127


def test_host_num_pages_rejects_unknown_pool() -> None:
    """A model without SWA has no 'swa' pool."""
    with pytest.raises(ValueError, match=r"pool 'swa' is not a pool of this config; its pools "
                       r"are full"):
        host_num_pages(config_from_dict(dense()), "swa")


# ---- docs -------------------------------------------------------------------------------------


def test_readme_documents_every_key(repo_root: Path) -> None:
    """The README's configuration table has a row for every key."""
    readme = (repo_root / "README.md").read_text(encoding="utf-8")
    sections = {"model": ModelConfig, "device_pool": DevicePoolConfig, "host": HostTierConfig,
                "controller": ControllerConfig, "service": ServiceConfig,
                "storage": StorageConfig}
    keys = ["page_size_tokens"] + [
        f"{name}.{spec.name}" for name, cls in sections.items()
        for spec in dataclasses.fields(cls)
    ]
    missing = [key for key in keys if f"| `{key}` |" not in readme]
    assert missing == []
    top = {spec.name for spec in dataclasses.fields(HiCacheConfig)}
    assert top == set(sections) | {"page_size_tokens"}


def test_a_window_tails_variant_of_a_store_config_can_still_be_made() -> None:
    """The window_tails-with-a-store check runs on loading, not on construction: a report
    (check-config) can still price the other swa_history choice of a loaded config."""
    data = hybrid()
    data["storage"] = {"backend": "file", "path": "/srv/pages"}
    config = config_from_dict(data, check_ram=False)
    host = dataclasses.replace(config.host, swa_history=SWAHistory.WINDOW_TAILS)
    assert dataclasses.replace(config, host=host).host.swa_history is SWAHistory.WINDOW_TAILS
    with pytest.raises(ConfigError, match=r"^host\.swa_history = 'window_tails': .*"
                                          r"set host\.swa_history: all"):
        config_from_dict(edited(data, "host.swa_history", "window_tails"), check_ram=False)


@pytest.mark.parametrize(("backend", "device", "staged"), [
    ("staged", "cuda", True), ("auto", "cuda", True), ("auto", "cpu", False),
    ("torch", "cuda", False), ("kernel", "cuda", False)])
def test_staging_bytes_are_two_chunks_per_side_stream_where_staged_copies_run(
        backend: str, device: str, staged: bool) -> None:
    """Two buffers of staging_tokens plus a page of the widest pool's tokens, for each of
    the write and load streams; none where no staged move runs."""
    config = config_from_dict(edited(edited(edited(
        hybrid(), "controller.io_backend", backend), "device_pool.device", device),
        "controller.staging_tokens", 100), check_ram=False)
    widest = max(token_bytes(config, name) for name in pool_names(config))
    assert staging_bytes(config) == (2 * 2 * (100 + config.page_size_tokens) * widest
                                     if staged else 0)


def test_a_host_of_exactly_one_page_is_accepted() -> None:
    """The smallest host: one usable page, by ratio or by size (which also pays for the
    reserved padding page)."""
    config = config_from_dict(dense(), check_ram=False)
    pages = device_num_pages(config, "full")
    by_ratio = config_from_dict(edited(dense(), "host.ratio", 1 / pages), check_ram=False)
    assert host_num_pages(by_ratio, "full") == 1
    page_bytes = config.page_size_tokens * token_bytes(config, "full")
    by_size = config_from_dict(edited(edited(dense(), "host.ratio", MISSING), "host.size_gib",
                                      2 * page_bytes / 2**30), check_ram=False)
    assert host_num_pages(by_size, "full") == 1
