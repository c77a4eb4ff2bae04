"""Audit of the reference engine and the demo run.

- The "from the store" figure counted every token a prefetch attached to the host tier,
  pages fetched again for a request retracted and admitted again too: it could pass the
  prompt tokens reused from any tier. It is now counted per request, at its admission.
- A device pool (full or SWA) smaller than one prefill chunk failed half way with
  ``alloc_device``'s advice to its caller (a usage error, exit 2): now an ``EngineError``
  before serving, naming the key to raise (exit 1).
- ``DemoOptions(max_running=0)`` served forever, ``-1`` failed in a tensor's shape,
  ``conversations=0`` or ``turns=0`` became the defaults: each is refused, naming it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from hicache.cli import main
from hicache.config import config_from_dict
from hicache.config.loading import default_config_text, load_default_config
from hicache.engine import DemoOptions, EngineError, run_demo


def default_data(**changes: Any) -> dict[str, Any]:
    data = yaml.safe_load(default_config_text())
    data["service"]["metrics_enabled"] = False
    for key, value in changes.items():
        section, name = key.split("__")
        data[section][name] = value
    return data


def full_attention(data: dict[str, Any]) -> dict[str, Any]:
    data["model"]["swa_layers"] = []
    del data["model"]["window_tokens"]
    del data["device_pool"]["swa_num_tokens"]
    data["host"].pop("swa_history", None)
    return data


def test_tokens_from_the_store_are_prompt_tokens_reused() -> None:
    data = full_attention(default_data(device_pool__num_tokens=192, host__ratio=0.5))
    report = run_demo(config_from_dict(data, check_ram=False),
                      DemoOptions(quick=True, conversations=4, turns=2, storage="file"))
    assert report.passed, report.failure()
    l3 = report.l3
    assert l3 is not None
    assert 0 < l3["second_from_store_tokens"] <= l3["second_host_hit_tokens"]
    assert report.l3_from_store_tokens <= report.host_hit_tokens


def small_swa_pool() -> dict[str, Any]:
    data = default_data(device_pool__swa_num_tokens=8, device_pool__num_tokens=256)
    data["page_size_tokens"] = 4
    data["model"]["window_tokens"] = 4
    return data


def small_full_pool() -> dict[str, Any]:
    data = full_attention(default_data(device_pool__num_tokens=8))
    data["page_size_tokens"] = 4
    return data


@pytest.mark.parametrize(("make", "key"), [(small_swa_pool, "device_pool.swa_num_tokens"),
                                           (small_full_pool, "device_pool.num_tokens")])
def test_pools_smaller_than_a_chunk_are_an_engine_error(make: Any, key: str, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    config = config_from_dict(make(), check_ram=False)
    with pytest.raises(EngineError, match=rf"but {key} holds 8; raise {key} to 20 or more"):
        run_demo(config, DemoOptions(quick=True, conversations=1, turns=1))
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(make()))
    assert main(["check-config", str(path)]) == 0
    capsys.readouterr()
    assert main(["demo", "--config", str(path), "--quick", "--conversations", "1"]) == 1
    err = capsys.readouterr().err
    assert key in err and "per call" not in err


@pytest.mark.parametrize("field", ["max_running", "prefill_chunk_tokens", "conversations",
                                   "turns"])
@pytest.mark.parametrize("value", [0, -1])
def test_demo_options_below_one_are_refused_naming_them(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=rf"DemoOptions\.{field} must be >= 1, got {value}"):
        DemoOptions(quick=True, **{field: value})


def test_demo_options_of_another_type_are_refused() -> None:
    with pytest.raises(TypeError, match=r"DemoOptions\.max_running must be an int"):
        DemoOptions(max_running=2.0)  # type: ignore[arg-type]
    assert DemoOptions(quick=True, conversations=1, turns=1).workload_spec().num_turns == 1


def test_a_demo_with_one_request_at_a_time_serves_and_passes() -> None:
    config = load_default_config(check_ram=False)
    config = dataclasses.replace(config, service=dataclasses.replace(config.service,
                                                                     metrics_enabled=False))
    report = run_demo(config, DemoOptions(quick=True, conversations=2, turns=2, max_running=1))
    assert report.passed, report.failure()
