"""Ranks built from configs that differ where they must not are refused at build, on every
rank, naming the keys: before, a rank with another prefetch policy sent a collective of
another length at its first step with an open prefetch (gloo aborted a process and the
other read garbage), and MLA ranks with a store on one rank only made collectives at build
that the other never joined. Keys that only say where a rank's own things are may differ."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from rank_helpers import make_config, run_ranks
from rank_store_helpers import MODEL, store_config

from hicache.config import StorageConfig, config_from_dict
from hicache.factory import build_service
from hicache.rank_settings import PER_RANK, shared_settings


def build_on_rank(rank: int, case: str, out: str) -> dict[str, Any]:
    import torch.distributed as dist

    if case == "prefetch_policy":
        config = store_config(f"{out}/l3", prefetch_policy="timeout" if rank else "wait_complete")
    elif case == "store_on_one_rank":
        config = store_config(f"{out}/l3", mla=True)
        if rank == 1:
            config = dataclasses.replace(config, storage=StorageConfig())
    elif case == "pool_and_policy":
        config = make_config("write_back" if rank else "write_through",
                             device_tokens=32 + 16 * rank)
    else:  # per_rank: only keys a rank may set its own way differ
        config = store_config(f"{out}/l3-{rank}")
        config = dataclasses.replace(config, service=dataclasses.replace(
            config.service, metrics_port=9400 + rank, integrity_check_interval_s=1.0 + rank))
    group = dist.new_group(backend="gloo")
    try:
        service = build_service(config, tp_group=group, **MODEL)
    except ValueError as error:
        return {"error": str(error)}
    try:
        service.step()
        return {"error": None, "agreements": service._poller.agreement.agreements}
    finally:
        service.stop()


@pytest.mark.parametrize(("case", "keys"), [
    ("prefetch_policy", ["storage.prefetch_policy"]),
    ("store_on_one_rank", None),  # every storage key but the per-rank ones
    ("pool_and_policy", ["controller.write_policy", "device_pool.num_tokens"]),
])
def test_ranks_whose_configs_differ_are_refused_on_every_rank(
        tmp_path: Path, case: str, keys: list[str] | None) -> None:
    results = run_ranks(build_on_rank, 2, tmp_path, case, str(tmp_path))
    for rank, result in enumerate(results):
        error = result["error"]
        assert error is not None and "tp_group: the ranks' configs differ in" in error, results
        assert f"(rank {rank} has " in error
        named = error.split("differ in ")[1].split(" (rank")[0].split(", ")
        if keys is not None:
            assert named == keys, named
        else:
            assert "storage.backend" in named and not set(named) & PER_RANK


def test_keys_a_rank_may_set_its_own_way_are_not_compared(tmp_path: Path) -> None:
    results = run_ranks(build_on_rank, 2, tmp_path, "per_rank", str(tmp_path))
    assert results == [{"error": None, "agreements": 1}] * 2


def test_shared_settings_cover_every_key_but_the_per_rank_ones(tmp_path: Path) -> None:
    config = store_config(str(tmp_path / "l3"))
    keys = [key for key, _ in shared_settings(config)]
    assert keys == sorted(keys) and not set(keys) & PER_RANK
    assert {"page_size_tokens", "model.num_layers", "device_pool.num_tokens", "host.ratio",
            "controller.write_policy", "storage.prefetch_policy",
            "storage.backend"} <= set(keys)
    mapping: dict[str, Any] = {"page_size_tokens": 2, "model": {
        "num_layers": 2, "attention": "mha", "num_kv_heads": 1, "head_dim": 2,
        "dtype": "float32"}, "device_pool": {"num_tokens": 32},
        "host": {"ratio": 1.0, "ram_reserve_gib": 0.0}}
    assert len(keys) == len(shared_settings(config_from_dict(mapping)))
