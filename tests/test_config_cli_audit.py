"""Audit of bad input in the YAML configuration (``load_config``, ``config_from_dict``).

The project's rule: every bad input gets one ``ConfigError`` naming the dotted key, the
value as written and what to do. The type, null and range tables below are built from the
section dataclasses themselves, so a key added later is enumerated too. Tests that expose a
gap assert the correct behaviour and fail until it is fixed: floats near the largest double
(an ``OverflowError``), a ``model.num_layers`` or ``controller.event_ring_size`` so large that
loading or building exhausts memory, keys put in the wrong section, choices in the wrong
case, YAML exponents without a dot, store locations that parse into something else, and
option pairs that only ``build_service`` refuses. The CLI side is in
``test_config_cli_audit_2.py``.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from test_config import MISSING, dense, edited, hybrid

from hicache.config import (
    ConfigError,
    ControllerConfig,
    DevicePoolConfig,
    HiCacheConfig,
    HostTierConfig,
    ModelConfig,
    ServiceConfig,
    StorageConfig,
    config_from_dict,
    load_config,
)

SECTIONS: dict[str, Any] = {"model": ModelConfig, "device_pool": DevicePoolConfig,
                            "host": HostTierConfig, "controller": ControllerConfig,
                            "service": ServiceConfig, "storage": StorageConfig}
FILE_STORE = {"backend": "file", "path": "/srv/pages"}


def _fields() -> list[tuple[str, Any, bool]]:
    """Every scalar key: (dotted key, its type without None, whether null is allowed)."""
    found = [("page_size_tokens", int, False)]
    for section, cls in SECTIONS.items():
        for name, hint in typing.get_type_hints(cls).items():
            args = typing.get_args(hint)
            optional = typing.get_origin(hint) in (types.UnionType, typing.Union)
            inner = next(a for a in args if a is not type(None)) if optional else hint
            found.append((f"{section}.{name}", inner, optional))
    return found


FIELDS = _fields()
INT_KEYS = [key for key, kind, _ in FIELDS if kind is int]
FLOAT_KEYS = [key for key, kind, _ in FIELDS if kind is float]
ENUM_KEYS = [(key, kind) for key, kind, _ in FIELDS
             if isinstance(kind, type) and issubclass(kind, enum.Enum)]


def base_for(key: str) -> dict[str, Any]:
    """A valid config in which ``key`` is used (a file store, MLA or size_gib as needed)."""
    data = hybrid()
    if key.startswith("storage."):
        data["storage"] = dict(FILE_STORE)
    if key == "model.latent_dim":
        data["model"] = {"num_layers": 4, "attention": "mla", "latent_dim": 64,
                         "dtype": "float32"}
        data["device_pool"] = {"num_tokens": 1024}
    if key == "host.size_gib":
        data = edited(edited(data, "host.ratio", MISSING), "host.size_gib", 0.01)
    return data


def refused(data: object, key: str, *shown: str) -> ConfigError:
    """The ConfigError of ``data``, checked to name ``key`` and each of ``shown``."""
    with pytest.raises(ConfigError) as info:
        config_from_dict(data, check_ram=False)
    message = str(info.value)
    assert key in message, message
    for text in shown:
        assert text in message, message
    return info.value


# ---- types, null and ranges of every key -------------------------------------------------


@pytest.mark.parametrize(("key", "kind", "optional"), FIELDS, ids=[f[0] for f in FIELDS])
def test_a_value_of_the_wrong_shape_names_the_key_and_value(key: str, kind: Any,
                                                            optional: bool) -> None:
    """A list where a scalar belongs (a mapping where a list belongs) is refused by key."""
    value: object = {"k": 1} if typing.get_origin(kind) is tuple else [7]
    error = refused(edited(base_for(key), key, value), key, repr(value))
    assert error.key == key


@pytest.mark.parametrize("key", [k for k, _, optional in FIELDS if not optional])
def test_null_for_a_key_that_cannot_be_null_is_refused(key: str) -> None:
    """``key: null`` where no null is allowed names the key and ``null``."""
    refused(edited(base_for(key), key, None), key, "= null")


@pytest.mark.parametrize("key", INT_KEYS)
@pytest.mark.parametrize("value", [True, 2.5], ids=["bool", "fraction"])
def test_an_integer_key_refuses_booleans_and_fractions(key: str, value: object) -> None:
    """An integer key refuses ``true`` and ``2.5``, naming both."""
    refused(edited(base_for(key), key, value), key, "true" if value is True else "2.5",
            "expected an integer")


@pytest.mark.parametrize("key", FLOAT_KEYS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_a_number_key_refuses_nan_and_infinity(key: str, value: float) -> None:
    """NaN and infinities are refused as not finite, by key."""
    refused(edited(base_for(key), key, value), key, repr(value), "not a finite number")


@pytest.mark.parametrize("key", INT_KEYS + FLOAT_KEYS)
def test_a_negative_number_is_refused_by_key(key: str) -> None:
    """Every count, size and time refuses -3, naming the key and the value."""
    value = -3 if key in INT_KEYS else -3.0
    refused(edited(base_for(key), key, value), key, "-3")


@pytest.mark.parametrize("key", ["host.ratio", "host.ram_reserve_gib", "host.size_gib",
                                 "storage.size_cap_gib"])
def test_a_float_near_the_largest_double_is_a_config_error(key: str) -> None:
    """1e308 GiB (or x) overflows to infinity when scaled: a ConfigError, not OverflowError."""
    data = edited(base_for(key), key, 1e308)
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)  # with the RAM check, as load_config runs it
    assert key in str(info.value) and "1e+308" in str(info.value)


def test_a_huge_event_ring_is_refused_before_build_allocates_it() -> None:
    """10**9 event sets (build_service allocates sets x layers events) is refused by key."""
    refused(edited(hybrid(), "controller.event_ring_size", 10**9),
            "controller.event_ring_size", "1000000000")


HUGE_LAYERS = """
import resource
from hicache.config import ConfigError, config_from_dict
vm = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (vm + 2**29, vm + 2**29))
model = {"num_layers": 10**12, "num_kv_heads": 2, "head_dim": 32, "dtype": "float32"}
try:
    config_from_dict({"page_size_tokens": 16, "model": model,
                      "device_pool": {"num_tokens": 1024}, "host": {"ratio": 1.0}})
    print("accepted")
except ConfigError as exc:
    print("ConfigError:", exc)
except MemoryError:
    print("MemoryError")
"""


def test_a_huge_layer_count_is_refused_without_exhausting_memory() -> None:
    """10**12 layers: a ConfigError within 512 MiB (a child with an address-space limit)."""
    result = subprocess.run([sys.executable, "-c", HUGE_LAYERS], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.stdout.startswith("ConfigError:"), result.stdout + result.stderr


# ---- unknown and misplaced keys, choices --------------------------------------------------


@pytest.mark.parametrize(("key", "close"), [
    ("device_pool.num_token", "num_tokens"), ("host.raito", "ratio"),
    ("service.metrics_prot", "metrics_port"), ("storage.timeout", "timeout_s"),
    ("page_size", "page_size_tokens"), ("Model", "model"),
])
def test_a_typo_suggests_the_closest_key(key: str, close: str) -> None:
    """A mistyped key in any section names itself and the closest valid key."""
    data = edited(base_for(key), key, 1) if key != "Model" else hybrid()
    if key == "Model":
        data["Model"] = data.pop("model")
    refused(data, key, f"did you mean '{close}'?")


@pytest.mark.parametrize(("key", "home"), [
    ("controller.metrics_port", "service.metrics_port"),
    ("model.page_size_tokens", "page_size_tokens"),
    ("host.device", "device_pool.device"),
    ("device_pool.ratio", "host.ratio"),
])
def test_a_key_in_the_wrong_section_names_where_it_belongs(key: str, home: str) -> None:
    """A valid key of another section is refused with the section it belongs in."""
    error = refused(edited(hybrid(), key, 1), key)
    assert home in str(error).replace(key, ""), str(error)


def wrong_case(key: str, written: str, meant: str) -> None:
    """``key: written`` is read as ``meant``, or refused with ``did you mean 'meant'?``."""
    try:
        config = config_from_dict(edited(base_for(key), key, written), check_ram=False)
    except ConfigError as exc:
        assert key in str(exc) and f"did you mean '{meant}'?" in str(exc), str(exc)
        return
    section, name = key.split(".")
    value = getattr(getattr(config, section), name)
    assert getattr(value, "value", value) == meant


@pytest.mark.parametrize(("key", "kind"), ENUM_KEYS, ids=[k for k, _ in ENUM_KEYS])
def test_a_choice_in_the_wrong_case_suggests_the_right_one(key: str, kind: Any) -> None:
    """``Float32`` for ``float32``: the lower-case choice is offered (or taken)."""
    value = list(kind)[-1].value
    wrong_case(key, value.title(), value)


def test_a_device_in_the_wrong_case_suggests_the_right_one() -> None:
    """``device_pool.device: CUDA``: ``cuda`` is offered (or taken)."""
    wrong_case("device_pool.device", "CUDA", "cuda")


# ---- combinations that only build_service refused -----------------------------------------


@pytest.mark.parametrize("backend", ["kernel", "staged", "direct"])
def test_a_cuda_only_backend_on_a_cpu_device_is_a_config_error(backend: str) -> None:
    """A backend that needs CUDA with ``device_pool.device: cpu`` is refused at load."""
    error = refused(edited(hybrid(), "controller.io_backend", backend),
                    "controller.io_backend", repr(backend), "device_pool.device")
    assert error.key == "controller.io_backend"


def test_window_tails_with_a_store_is_a_config_error() -> None:
    """Hybrid ``swa_history: window_tails`` with a store is refused at load, naming both."""
    data = edited(hybrid(), "host.swa_history", "window_tails")
    data["storage"] = dict(FILE_STORE)
    refused(data, "host.swa_history", "window_tails", "storage.backend")


def test_mla_with_sliding_window_layers_is_a_valid_config() -> None:
    """MLA with SWA layers is supported (not a contradiction): it loads as a hybrid model."""
    data = edited(hybrid(), "model", {"num_layers": 4, "attention": "mla", "latent_dim": 64,
                                      "swa_layers": [1], "window_tokens": 64,
                                      "dtype": "float32"})
    assert config_from_dict(data, check_ram=False).is_hybrid


# ---- store locations -----------------------------------------------------------------------


def test_a_cluster_node_with_a_scheme_is_named_as_written() -> None:
    """``nodes: [redis://h:7000]`` is refused as ``storage.nodes[0]``, shown as written."""
    error = refused({**dense(), "storage": {"backend": "redis", "nodes": ["redis://h:7000"]}},
                    "storage.nodes[0]", "'redis://h:7000'")
    assert "redis+cluster://" not in str(error)


@pytest.mark.parametrize(("url", "shown"), [("redis://user:pw@h:6379", "'redis://***@h:6379'"),
                                           ("redis://h:6379?db=2", "'redis://h:6379?db=2'")])
def test_redis_url_parts_the_store_ignores_are_refused(url: str, shown: str) -> None:
    """A user name or a query in ``storage.url`` would be dropped silently: refused (the
    URL shown without its user information: passwords are never printed)."""
    error = refused({**dense(), "storage": {"backend": "redis", "url": url}}, "storage.url",
                    shown)
    assert "pw" not in str(error).replace("password", "")


@pytest.mark.parametrize("path", ["~/pages", "   "])
def test_a_file_store_path_is_not_taken_literally_by_mistake(path: str) -> None:
    """``~/pages`` and a blank path are expanded, or refused naming ``storage.path``."""
    data = {**dense(), "storage": {"backend": "file", "path": path}}
    try:
        config = config_from_dict(data, check_ram=False)
    except ConfigError as exc:
        assert "storage.path" in str(exc)
        return
    assert config.storage.location == os.path.expanduser(path) != path


# ---- files ---------------------------------------------------------------------------------


def write(tmp_path: Path, text: str | bytes) -> Path:
    """``text`` as ``config.yaml`` in ``tmp_path``."""
    path = tmp_path / "config.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def test_a_yaml_exponent_without_a_dot_says_how_to_write_it(tmp_path: Path) -> None:
    """YAML reads ``1e-2`` as text: the error names the key and shows ``1.0e-2``."""
    text = "page_size_tokens: 8\nmodel: {num_layers: 2, num_kv_heads: 4, head_dim: 16, " \
           "dtype: bfloat16}\ndevice_pool: {num_tokens: 256}\nhost: {size_gib: 1e-2}\n"
    with pytest.raises(ConfigError, match=r"host\.size_gib = '1e-2'.*1\.0e-2"):
        load_config(write(tmp_path, text), check_ram=False)


@pytest.mark.parametrize(("text", "message"), [
    ("model:\n  num_layers: 4\n  num_layers: 5\n",
     r"invalid YAML at line 3, column 3: duplicate key 'num_layers'"),
    ("page_size_tokens: 16\n---\npage_size_tokens: 8\n",
     r"invalid YAML at line 2, column 1: but found another document"),
    ("just a sentence\n", r"the config: expected a mapping of keys, got 'just a sentence'"),
    (b"page_size_tokens: \xff\n", r"cannot read the config file \(not UTF-8 text\)"),
    ("model: !!python/object:os.system {}\n", r"invalid YAML at line 1, column 8: "),
], ids=["nested-duplicate", "two-documents", "scalar", "not-utf8", "python-tag"])
def test_a_bad_file_is_one_line_naming_the_file(tmp_path: Path, text: str | bytes,
                                                message: str) -> None:
    """Each bad file gives one line that starts with its path."""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=message) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: ") and "\n" not in str(info.value)


def test_a_directory_is_not_a_config_file(tmp_path: Path) -> None:
    """A directory given as the config path is named, with the reason."""
    with pytest.raises(ConfigError, match=r": cannot read the config file \(Is a directory\)"):
        load_config(tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files without read permission")
def test_an_unreadable_file_is_named(tmp_path: Path) -> None:
    """A file without read permission: the path and ``Permission denied``."""
    path = write(tmp_path, "page_size_tokens: 16\n")
    path.chmod(0)
    with pytest.raises(ConfigError, match=r"cannot read the config file \(Permission denied\)"):
        load_config(path)


def test_an_empty_path_is_named_as_empty() -> None:
    """``load_config("")`` says the path is empty, not that '' is a directory."""
    with pytest.raises(ConfigError, match=r"empty"):
        load_config("")


def test_the_enumeration_covers_every_key() -> None:
    """The tables above list every key of HiCacheConfig and nothing else."""
    top = {f.name for f in dataclasses.fields(HiCacheConfig)}
    assert top == set(SECTIONS) | {"page_size_tokens"}
    assert len(FIELDS) == 1 + sum(len(dataclasses.fields(c)) for c in SECTIONS.values())
