"""On a GPU, where every op carries a duration measured with device events: a service with
no metrics endpoint keeps none of them (they piled up one per op), and one with an endpoint
drains them into its histogram (the histogram's count is the ops acknowledged)."""

from __future__ import annotations

import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from hicache import build_service
from hicache.config import config_from_dict

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _config(metrics: bool):  # type: ignore[no-untyped-def]
    return config_from_dict({
        "page_size_tokens": 2,
        "model": {"num_layers": 2, "attention": "mha", "num_kv_heads": 1, "head_dim": 2,
                  "dtype": "float32"},
        "device_pool": {"num_tokens": 8192, "device": "cuda"},
        "host": {"ratio": 2.0, "ram_reserve_gib": 0.0},
        "controller": {"io_backend": "torch", "write_policy": "write_through",
                       "load_back_threshold_tokens": 0},
        "service": {"metrics_enabled": metrics, "metrics_port": 0}})


def test_transfer_durations_do_not_pile_up_without_a_metrics_exporter() -> None:
    """metrics_enabled: false on CUDA: every acknowledged op's duration is kept in
    controller.stats for a drain that never comes (only the exporter drains): one entry
    per op for the life of the engine."""
    config = _config(metrics=False)
    kept = []
    with build_service(config) as service:
        for rounds in range(2):
            for i in range(1000):
                tokens = [rounds, i, i + 1, i + 2]
                service.insert(tokens, service.alloc_device(4))
                service.step()
            torch.cuda.synchronize()
            service.step()
            kept.append(len(service.controller.stats.durations))
        acked = service.controller.stats.ops_acknowledged["device_to_host"]
    assert acked == 2000
    assert kept[1] <= kept[0], f"durations kept after 1000 and 2000 ops: {kept}"


def test_a_service_with_metrics_drains_every_duration_into_its_histogram() -> None:
    with build_service(_config(metrics=True)) as service:
        for i in range(300):
            service.insert([7, i, i + 1, i + 2], service.alloc_device(4))
            service.step()
        torch.cuda.synchronize()
        service.step()
        acked = service.controller.stats.ops_acknowledged["device_to_host"]
        assert service.exporter is not None and service.exporter.port is not None
        url = f"http://127.0.0.1:{service.exporter.port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
        assert len(service.controller.stats.durations) == 0
    counts = [s.value for f in text_string_to_metric_families(text) for s in f.samples
              if s.name == "hicache_transfer_duration_seconds_count"
              and s.labels.get("direction") == "device_to_host"]
    assert acked == 300 and counts == [300.0], (acked, counts)
