"""``run_demo`` and ``demo_config`` (hicache.engine.demo) on a CPU: the metrics port when the
configured one is taken, the device check, the workload's defaults, one CPU thread."""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from hicache.bench.redis_local import free_port
from hicache.config import HiCacheConfig, config_from_dict
from hicache.engine import DemoOptions, run_demo
from hicache.engine.demo import QUICK, demo_config
from hicache.engine.workload import WorkloadSpec
from hicache.metrics.exporter import MetricsBindError

TINY = DemoOptions(quick=True, conversations=2, turns=2)


def config_with_metrics(repo_root: Path, port: int) -> HiCacheConfig:
    data: dict[str, Any] = yaml.safe_load((repo_root / "config.yaml").read_text())
    data["service"]["metrics_port"] = port
    return config_from_dict(data, check_ram=False)


def test_a_free_metrics_port_is_kept(repo_root: Path) -> None:
    port = free_port()
    assert demo_config(config_with_metrics(repo_root, port), TINY).service.metrics_port == port


def test_the_metrics_address_is_reported(repo_root: Path) -> None:
    port = free_port()
    report = run_demo(config_with_metrics(repo_root, port), TINY)
    assert report.metrics == f"http://127.0.0.1:{port}/metrics"


def test_a_taken_metrics_port_is_swapped_for_a_free_one_and_said_so(repo_root: Path) -> None:
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        config = config_with_metrics(repo_root, port)
        assert demo_config(config, TINY).service.metrics_port == 0
        report = run_demo(config, TINY)
    assert report.passed, report.failure()
    assert report.metrics.startswith("http://127.0.0.1:")
    assert report.metrics.endswith(f"/metrics (port {port} was taken)")
    assert f":{port}/" not in report.metrics


def test_a_metrics_host_of_no_interface_is_an_error_not_a_taken_port(repo_root: Path
                                                                     ) -> None:
    config = config_with_metrics(repo_root, free_port())
    config = dataclasses.replace(
        config, service=dataclasses.replace(config.service, metrics_host="192.0.2.1"))
    with pytest.raises(MetricsBindError, match=r"set service\.metrics_host"):
        demo_config(config, TINY)


def test_metrics_off_are_reported_as_off(repo_root: Path) -> None:
    config = config_with_metrics(repo_root, free_port())
    config = dataclasses.replace(
        config, service=dataclasses.replace(config.service, metrics_enabled=False))
    report = run_demo(config, TINY)
    assert report.metrics == "off (service.metrics_enabled is false)"
    assert 0 < report.baseline_s < 60 and 0 < report.engine_s < 60


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_a_cuda_device_without_cuda_is_refused(repo_root: Path) -> None:
    config = config_with_metrics(repo_root, free_port())
    with pytest.raises(ValueError, match=r"device cuda: CUDA is not available here; use "
                                         r"--device cpu"):
        run_demo(config, dataclasses.replace(TINY, device="cuda"))


def test_the_workload_is_the_full_one_unless_quick() -> None:
    assert DemoOptions().workload_spec() == WorkloadSpec()
    assert DemoOptions(quick=True).workload_spec() == QUICK
    assert DemoOptions(quick=True, turns=2, seed=3).workload_spec() == dataclasses.replace(
        QUICK, num_turns=2, seed=3)


def test_the_demo_runs_on_one_cpu_thread_and_gives_the_others_back(repo_root: Path) -> None:
    config = config_with_metrics(repo_root, free_port())
    config = dataclasses.replace(
        config, service=dataclasses.replace(config.service, metrics_enabled=False))
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # whatever the machine has: more than one
    threads: set[int] = set()
    told: list[tuple[str, int, int]] = []

    def progress(phase: str, done: int, total: int, note: str) -> None:
        threads.add(torch.get_num_threads())
        told.append((phase, done, total))

    try:
        report = run_demo(config, TINY, on_progress=progress)
        assert threads == {1}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    turns = report.requests
    for phase in ("baseline", "engine"):  # from none done to all, never backwards
        seen = [(done, total) for name, done, total in told if name == phase]
        assert seen[0] == (0, turns) and seen[-1] == (turns, turns)
        assert [done for done, _ in seen] == sorted(done for done, _ in seen)
    assert told[0][0] == "baseline" and told[-1][0] == "engine"
