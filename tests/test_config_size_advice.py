"""A size refusal's advice is a value that is then taken:

- "lower host.ratio to at most X" scaled the size linearly, ignoring each host pool's
  reserved page and its rounding to whole pages: X itself was refused, often.
- "raise host.ratio to at least X" named the least for the first pool only: with
  ``swa_history: window_tails`` the smaller SWA pool then refused X, with another value.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from hicache.config import ConfigError, check_machine_memory, config_from_dict, default_config_text


def default_dict() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(default_config_text())
    data["service"]["metrics_port"] = 0
    return data


@pytest.mark.parametrize("head_dim", [8, 24, 32, 40, 56, 64, 72, 100])
def test_the_host_ratio_the_ram_refusal_offers_fits_and_is_the_most(head_dim: int) -> None:
    data = default_dict()
    data["model"].update(swa_layers=[], head_dim=head_dim)
    del data["model"]["window_tokens"]
    data["device_pool"] = {"num_tokens": 16}  # one device page: X is about K host pages
    data["host"] = {"ratio": 1e9, "ram_reserve_gib": 0.0}
    with pytest.raises(ConfigError) as refused:
        check_machine_memory(config_from_dict(data, check_ram=False))
    found = re.search(r"lower host\.ratio to at most ([0-9.]+)", str(refused.value))
    assert found is not None, refused.value
    data["host"]["ratio"] = float(found.group(1))
    check_machine_memory(config_from_dict(data, check_ram=False))  # taken
    data["host"]["ratio"] = float(found.group(1)) + 1  # a page more does not fit
    with pytest.raises(ConfigError):
        check_machine_memory(config_from_dict(data, check_ram=False))


@pytest.mark.parametrize("host", [{"ratio": 0.01, "swa_history": "window_tails"},
                                  {"size_gib": 1e-6, "swa_history": "window_tails"},
                                  {"ratio": 0.01}])
def test_the_host_size_the_too_small_refusal_offers_fits(host: dict[str, Any]) -> None:
    data = default_dict()
    data["host"] = host
    with pytest.raises(ConfigError) as refused:
        config_from_dict(data, check_ram=False)
    found = re.search(r"raise (host\.\w+) to at least ([0-9.e-]+)", str(refused.value))
    assert found is not None, refused.value
    data["host"][found.group(1).split(".")[1]] = float(found.group(2))
    config_from_dict(data, check_ram=False)  # taken
