"""Sections made in Python (``dataclasses.replace``, as the README shows) are checked as a
file's values are: a choice given as text was kept as text, and every test of it is an
``is`` against the enum, so ``swa_history="all"`` built window-tail pools and
``eviction_policy="lfu"`` an LRU tree, silently; ``io_backend="torch"`` failed deep in
``build_service``. Text naming a choice now becomes the choice; anything else is refused
naming the key."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from hicache import build_service
from hicache.config import (
    ConfigError,
    EvictionPolicy,
    HiCacheConfig,
    IOBackend,
    SWAHistory,
    WritePolicy,
    load_default_config,
)
from hicache.pools import HostLayout


def config() -> HiCacheConfig:
    base = load_default_config(check_ram=False)
    return dataclasses.replace(base, service=dataclasses.replace(
        base.service, metrics_enabled=False))


@pytest.mark.parametrize(("section", "name", "text", "choice"), [
    ("host", "swa_history", "all", SWAHistory.ALL),
    ("host", "swa_history", "window_tails", SWAHistory.WINDOW_TAILS),
    ("host", "layout", "page_first", HostLayout.PAGE_FIRST),
    ("controller", "eviction_policy", "lfu", EvictionPolicy.LFU),
    ("controller", "io_backend", "torch", IOBackend.TORCH),
    ("controller", "write_policy", "write_back", WritePolicy.WRITE_BACK),
])
def test_a_choice_given_as_text_becomes_the_choice(section: str, name: str, text: str,
                                                   choice: Any) -> None:
    base = config()
    made = dataclasses.replace(getattr(base, section), **{name: text})
    assert getattr(made, name) is choice


def test_a_service_built_from_replaced_text_choices_is_what_they_say() -> None:
    base = config()
    made = dataclasses.replace(
        base, host=dataclasses.replace(base.host, swa_history="all"),
        controller=dataclasses.replace(base.controller, eviction_policy="lfu"))
    service = build_service(made)
    try:
        full, swa = (pool.allocator.capacity_tokens for pool in service._host_pools)
        assert swa == full  # every SWA row kept on the host: the 'all' history
        assert service.tree.eviction_policy is EvictionPolicy.LFU
    finally:
        service.stop()


@pytest.mark.parametrize(("section", "name", "value", "key"), [
    ("controller", "eviction_policy", "lfx", "controller.eviction_policy"),
    ("device_pool", "num_tokens", "4096", "device_pool.num_tokens"),
    ("device_pool", "num_tokens", 4096.0, "device_pool.num_tokens"),
    ("service", "metrics_enabled", "no", "service.metrics_enabled"),
    ("storage", "backend", "fil", "storage.backend"),
    ("model", "swa_layers", [1, "x"], "model.swa_layers[1]"),
])
def test_a_wrongly_typed_value_is_refused_naming_its_key(section: str, name: str,
                                                         value: object, key: str) -> None:
    base = config()
    with pytest.raises(ConfigError, match=rf"^{key.replace('[', '.').replace(']', '.')}"):
        dataclasses.replace(getattr(base, section), **{name: value})


def test_an_int_where_a_float_goes_is_a_float() -> None:
    base = config()
    service = dataclasses.replace(base.service, integrity_check_interval_s=5)
    assert type(service.integrity_check_interval_s) is float


@pytest.mark.parametrize("host", ["", " ", "\t"])
def test_a_blank_metrics_host_is_refused(host: str) -> None:
    base = config()
    with pytest.raises(ConfigError, match=r"service\.metrics_host .*empty address"):
        dataclasses.replace(base.service, metrics_host=host)
