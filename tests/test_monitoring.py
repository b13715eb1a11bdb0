"""ops/ monitoring files stay in step with the metrics the code exposes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry

from rolloutbus.config import Config
from rolloutbus.metrics import ReplayBufferMetrics, SessionMetrics
from rolloutbus.replica.scripted import ScriptedEngine
from rolloutbus.replica.server import REGISTRY_KEY, build_app
from rolloutbus.streams.inference.llm_client import ClientMetrics

OPS = Path(__file__).resolve().parents[1] / "ops"
_SUFFIXES = {
    "counter": ["_total"],
    "histogram": ["_bucket", "_sum", "_count"],
    "gauge": [""],
    "summary": ["_sum", "_count"],
}


def _exposed_names() -> set[str]:
    registry = CollectorRegistry()
    SessionMetrics(registry)
    ReplayBufferMetrics(registry)
    ClientMetrics(registry)
    names = set()
    for reg in (registry, build_app(ScriptedEngine([]))[REGISTRY_KEY]):
        for family in reg.collect():
            names.update(family.name + s for s in _SUFFIXES.get(family.type, [""]))
    return names


def test_every_dashboard_metric_is_exposed_by_the_code():
    exposed = _exposed_names()
    dashboard = json.loads((OPS / "grafana/dashboards/pipeline.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"rolloutbus_[a-z_]+", e)}
    assert used, "the dashboard queries no rolloutbus metric"
    assert used <= exposed, f"dashboard queries metrics nobody exposes: {sorted(used - exposed)}"
    assert all(p["datasource"]["uid"] == "prom" for p in dashboard["panels"])


def test_prometheus_targets_match_the_documented_ports():
    scrape = yaml.safe_load((OPS / "prometheus/prometheus.yml").read_text())["scrape_configs"]
    targets = {job["job_name"]: job["static_configs"][0]["targets"][0] for job in scrape}
    assert targets["rolloutbus-replica"] == f"127.0.0.1:{Config().replica_server.port}"
    assert set(targets) == {"rolloutbus-sessions", "rolloutbus-replay-buffer", "rolloutbus-replica"}
