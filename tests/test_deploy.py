"""``deploy/``: the Grafana dashboard (provisionable from a file and importable), the
Prometheus scrape config and alert rules, and the compose file that ties them together.

promtool checks the config, every rule and every dashboard expression (turned into recording
rules) and runs the alert rules' unit tests; it skips without promtool unless
$HICACHE_REQUIRE_PROMTOOL is set, as CI does.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from hicache.config import load_default_config
from hicache.metrics import sample_names

PROMTOOL_REQUIRED = "HICACHE_REQUIRE_PROMTOOL"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# Metrics of Prometheus itself that the rules may use besides hicache's.
PROMETHEUS_METRICS = {"up"}


@pytest.fixture
def deploy(repo_root: Path) -> Path:
    return repo_root / "deploy"


def dashboard(deploy: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(
        (deploy / "grafana" / "dashboards" / "hicache.json").read_text(encoding="utf-8"))
    return data


def dashboard_queries(board: dict[str, Any]) -> list[str]:
    """Every panel's queries (a row has none)."""
    return [target["expr"] for panel in board["panels"] for target in panel.get("targets", [])]


def alert_rules(deploy: Path) -> list[dict[str, Any]]:
    rules = yaml.safe_load((deploy / "prometheus" / "alerts.yml").read_text(encoding="utf-8"))
    return [rule for group in rules["groups"] for rule in group["rules"]]


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get(PROMTOOL_REQUIRED):
            pytest.fail(f"promtool is not installed and {PROMTOOL_REQUIRED} is set")
        pytest.skip("promtool is not installed (Debian package prometheus)")
    return path


def run_promtool(*args: str, cwd: Path) -> str:
    result = subprocess.run([promtool(), *args], cwd=cwd, capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


# ---- the dashboard --------------------------------------------------------------------------


def test_dashboard_picks_its_datasource_through_a_variable(deploy: Path) -> None:
    """No import-time ``${DS_...}`` input: a ``datasource`` variable of type prometheus, and
    every panel, target and query variable uses it, so file provisioning works as is."""
    text = (deploy / "grafana" / "dashboards" / "hicache.json").read_text(encoding="utf-8")
    board = json.loads(text)
    assert "__inputs" not in board and "${DS_" not in text
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["instance"]["datasource"] == DATASOURCE
    for panel in board["panels"]:
        assert panel["datasource"] == DATASOURCE, panel["title"]
        for target in panel.get("targets", []):
            assert target.get("datasource", DATASOURCE) == DATASOURCE, panel["title"]


def test_dashboard_is_importable(deploy: Path) -> None:
    """A null id (Grafana assigns one), a fixed uid, unique panel ids, a title."""
    board = dashboard(deploy)
    assert board["id"] is None and board["uid"] == "hicache-overview" and board["title"]
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))


def test_dashboard_references_only_exported_metrics(deploy: Path) -> None:
    """Every expression names real metrics, and the key ones are all shown."""
    board = dashboard(deploy)
    queries = dashboard_queries(board)
    queries += [var.get("definition", "") for var in board["templating"]["list"]]
    used = {name for query in queries for name in re.findall(r"\bhicache_\w+", query)}
    assert used <= sample_names(), used - sample_names()
    for needed in ("hicache_transfer_bytes_total", "hicache_transfer_tokens_total",
                   "hicache_transfer_duration_seconds_bucket", "hicache_pool_used_tokens",
                   "hicache_hit_tokens_total", "hicache_dropped_tokens_total",
                   "hicache_evicted_tokens_total", "hicache_transfer_in_flight_ops",
                   "hicache_background_errors_total", "hicache_l3_prefetch_tokens_total",
                   "hicache_l3_found_tokens_total", "hicache_l3_queried_tokens_total",
                   "hicache_l3_store_pages_total", "hicache_l3_backup_pages_total",
                   "hicache_l3_store_bytes_total", "hicache_l3_store_op_duration_seconds_bucket",
                   "hicache_l3_queued_jobs", "hicache_l3_open_circuits",
                   "hicache_l3_circuit_opens_total", "hicache_l3_worker_errors_total"):
        assert needed in used, needed


def test_dashboard_has_an_l3_row_without_overlaps(deploy: Path) -> None:
    """The shared store's panels sit under a row of their own, after every other panel;
    no two panels share a grid cell and none is wider than the 24 columns."""
    panels = dashboard(deploy)["panels"]
    (row,) = [panel for panel in panels if panel["type"] == "row"]
    assert row["title"] == "Shared store (L3)"
    for panel in panels:
        uses_l3 = any("hicache_l3_" in t["expr"] for t in panel.get("targets", []))
        is_below = panel["gridPos"]["y"] > row["gridPos"]["y"]
        assert uses_l3 == is_below, panel["title"]
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        mine = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"])
                for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not mine & cells, panel["title"]
        cells |= mine


def test_every_dashboard_expression_passes_promtool(deploy: Path, tmp_path: Path) -> None:
    """Each panel query, with Grafana's variables filled in, is a valid PromQL recording
    rule for promtool check rules."""
    queries = dashboard_queries(dashboard(deploy))
    rules = [{"record": f"hicache:dashboard_query_{i}:value",
              "expr": query.replace("$__rate_interval", "1m").replace("$__range", "1h")
              .replace("$instance", ".*")}
             for i, query in enumerate(queries)]
    assert all("$" not in rule["expr"] for rule in rules), rules
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    output = run_promtool("check", "rules", str(path), cwd=tmp_path)
    assert f"SUCCESS: {len(rules)} rules found" in output


# ---- Prometheus ---------------------------------------------------------------------------


def test_scrape_config_and_rules_pass_promtool(deploy: Path) -> None:
    """promtool check config (which checks the rule file it names) and check rules."""
    prometheus = deploy / "prometheus"
    output = run_promtool("check", "config", "prometheus.yml", cwd=prometheus)
    assert "SUCCESS: 1 rule files found" in output
    output = run_promtool("check", "rules", "alerts.yml", cwd=prometheus)
    assert f"SUCCESS: {len(alert_rules(deploy))} rules found" in output


def test_alert_rules_unit_tests(deploy: Path) -> None:
    """promtool test rules: each alert fires on its input series, and only there."""
    output = run_promtool("test", "rules", "alerts_test.yml", cwd=deploy / "prometheus")
    assert "SUCCESS" in output


def test_alerts_cover_errors_and_refusals(deploy: Path) -> None:
    """Background errors, refusals and the shared store (an open circuit, corrupt pages,
    worker errors) have alerts over real metrics; each alert has a severity and a summary;
    the L3 circuit alert is critical."""
    rules = alert_rules(deploy)
    used = {name for rule in rules for name in re.findall(r"\b[a-z_][a-z0-9_]*(?=[{(\[ )]|$)",
                                                         rule["expr"])
            if name.startswith("hicache_") or name in PROMETHEUS_METRICS}
    assert used - PROMETHEUS_METRICS <= sample_names(), used - sample_names()
    for needed in ("hicache_background_errors_total", "hicache_refused_load_back_tokens_total",
                   "hicache_refused_backup_tokens_total", "hicache_l3_open_circuits",
                   "hicache_l3_store_pages_total", "hicache_l3_worker_errors_total"):
        assert needed in used, needed
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]
    assert "L3 circuit breaker" in (deploy / "prometheus" / "alerts.yml").read_text()
    circuit = next(rule for rule in rules if rule["alert"] == "HicacheL3CircuitOpen")
    assert circuit["labels"]["severity"] == "critical" and circuit["for"] == "5m"


def test_scrape_target_is_the_default_metrics_address(deploy: Path) -> None:
    """The scrape config's target is the default config's metrics host and port."""
    config = yaml.safe_load((deploy / "prometheus" / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    service = load_default_config().service
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == [
        f"{service.metrics_host}:{service.metrics_port}"]


# ---- Grafana provisioning and compose -------------------------------------------------------


def test_compose_mounts_the_files_the_services_read(deploy: Path) -> None:
    """Every volume of compose.yaml is a folder of deploy/; Grafana's dashboard provider
    reads the folder the dashboards are mounted at; its data source is compose's
    Prometheus."""
    compose = yaml.safe_load((deploy / "compose.yaml").read_text())
    mounts: dict[str, str] = {}
    for service in compose["services"].values():
        assert service["network_mode"] == "host"
        for volume in service["volumes"]:
            source, target, mode = volume.split(":")
            assert (deploy / source).is_dir() and mode == "ro", volume
            mounts[target] = source
    provisioning = deploy / mounts["/etc/grafana/provisioning"]
    provider = yaml.safe_load((provisioning / "dashboards" / "hicache.yaml").read_text())
    path = provider["providers"][0]["options"]["path"]
    assert (deploy / mounts[path] / "hicache.json").is_file()
    sources = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())
    prometheus = compose["services"]["prometheus"]["command"]
    listen = next(arg.split("=", 1)[1] for arg in prometheus
                  if arg.startswith("--web.listen-address="))
    assert sources["datasources"][0]["url"] == f"http://{listen}"
    assert sources["datasources"][0]["type"] == "prometheus"
    assert (deploy / mounts["/etc/prometheus"] / "prometheus.yml").is_file()
