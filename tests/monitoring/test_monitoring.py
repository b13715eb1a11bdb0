"""Monitoring without a broker: ops/ files in step with the code, the RL figures computed at
release, tool outcomes, the top view, inspect's key parsing. The real run scraped by a
real Prometheus is tests/monitoring/test_monitoring_prometheus.py."""

from __future__ import annotations

import importlib.util
import json
import re
import sys

import pytest
import yaml
from prometheus_client import CollectorRegistry

from rolloutbus.config import Config, load_config
from rolloutbus.consumers.metrics import DeliveryMetrics, StalenessMetrics
from rolloutbus.consumers.training.metrics import TRAINER_GAUGES, TrainerMetrics
from rolloutbus.errors import ConfigError
from rolloutbus.metrics import exposition
from rolloutbus.monitoring.lag_exporter import LagCollector
from rolloutbus.monitoring.scrape import Sample, Scrape, metrics_targets
from rolloutbus.monitoring.top import render, summarize
from rolloutbus.monitoring.trajectory_view import parse_key
from rolloutbus.producers.dispatch import DispatchReport
from rolloutbus.producers.dispatch_metrics import DispatchCollector
from rolloutbus.replica.scripted import ScriptedEngine
from rolloutbus.replica.server import REGISTRY_KEY, build_app
from rolloutbus.schemas.trajectories import Trajectory, TrajectoryStatus
from rolloutbus.streams.agent_loop.tool_metrics import ToolMetrics, call_outcome
from rolloutbus.streams.assembly.metrics import ReplayBufferMetrics, RolloutMetrics
from rolloutbus.streams.assembly.partition_fold import ReleasedGroup
from rolloutbus.streams.assembly.release_metrics import ReleaseObserver
from rolloutbus.streams.inference.llm_client import ClientMetrics
from rolloutbus.streams.inference.weight_sync_metrics import WeightSyncMetrics
from rolloutbus.streams.sessions.metrics import SessionMetrics
from tests.builders import make_group_started, make_trajectory
from tests.source_tree import ROOT

OPS = ROOT / "ops"
_SUFFIXES = {
    "counter": ["_total"],
    "histogram": ["_bucket", "_sum", "_count"],
    "gauge": [""],
    "summary": ["_sum", "_count"],
}
# what a help text may end with: its unit (every metric of rolloutbus/metrics.py states one)
UNIT_WORDS = re.compile(
    r"(seconds|tokens|ratio|versions|version number|groups|sessions|events|trajectories|"
    r"calls|rows|partitions|transactions|uids|records|steps|syncs|turns|preemptions|"
    r"consumers|readings|replicas|warnings|boolean|scorer's units|unitless|loss units|"
    r"nats per token|per second|"
    r"else 0|the loop's own units|as the kind says)",
)


def _registries() -> list[CollectorRegistry]:
    registry = CollectorRegistry()
    for metrics in (
        SessionMetrics,
        ReplayBufferMetrics,
        RolloutMetrics,
        ToolMetrics,
        DeliveryMetrics,
        StalenessMetrics,
        WeightSyncMetrics,
        TrainerMetrics,
        ClientMetrics,
    ):
        metrics(registry)
    registry.register(DispatchCollector(lambda: DispatchReport(), lambda: False))
    registry.register(LagCollector({}))
    return [registry, build_app(ScriptedEngine([]))[REGISTRY_KEY]]


def _exposed_names() -> set[str]:
    names = set()
    for reg in _registries():
        for family in reg.collect():
            names.update(family.name + s for s in _SUFFIXES.get(family.type, [""]))
    return names


def _dashboards() -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in (OPS / "grafana/dashboards").glob("*.json")}


def _make_dashboards():
    spec = importlib.util.spec_from_file_location(
        "make_dashboards", OPS / "grafana/make_dashboards.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_dashboards"] = module
    spec.loader.exec_module(module)
    return module


def test_every_dashboard_metric_is_exposed_by_the_code():
    exposed = _exposed_names()
    dashboards = _dashboards()
    assert set(dashboards) == {
        "flowing",
        "long-tail",
        "replicas",
        "trainer",
        "failures",
        "learning",
    }
    for name, board in dashboards.items():
        exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
        used = {m for e in exprs for m in re.findall(r"rolloutbus_[a-z_]+", e)}
        assert used, f"{name}: queries no rolloutbus metric"
        assert used <= exposed, f"{name} queries metrics nobody exposes: {sorted(used - exposed)}"
        assert all(p["datasource"]["uid"] == "prom" for p in board["panels"])


def test_dashboards_are_what_the_generator_writes():
    make = _make_dashboards()
    for stem in make.ALL:
        written = (OPS / f"grafana/dashboards/{stem}.json").read_text()
        assert written == make.render(stem), f"run python ops/grafana/make_dashboards.py ({stem})"


def test_prometheus_scrapes_every_process_at_the_metrics_on_ports():
    scrape = yaml.safe_load((OPS / "prometheus/prometheus.yml").read_text())["scrape_configs"]
    targets = {job["job_name"]: job["static_configs"][0]["targets"][0] for job in scrape}
    cfg = load_config(OPS / "metrics-on.yaml")
    m = cfg.monitoring
    assert targets == {
        "rolloutbus-sessions": f"127.0.0.1:{cfg.sessions.metrics_port}",
        "rolloutbus-replay-buffer": f"127.0.0.1:{cfg.replay_buffer.metrics_port}",
        "rolloutbus-trainer": f"127.0.0.1:{cfg.trainer.metrics_port}",
        "rolloutbus-weight-sync": f"127.0.0.1:{m.weight_sync_metrics_port}",
        "rolloutbus-dispatch": f"127.0.0.1:{m.dispatch_metrics_port}",
        "rolloutbus-lag-exporter": f"127.0.0.1:{m.lag_exporter_port}",
        "rolloutbus-replica": f"127.0.0.1:{cfg.replica_server.port}",
    }
    # top reads the same ports from the same config
    assert len(metrics_targets(cfg)) == len(targets)


def test_every_help_text_states_a_unit_and_no_created_series():
    registry = _registries()[0]
    SessionMetrics(registry).sessions.labels(outcome="finished").inc()
    missing = [f.name for f in registry.collect() if not UNIT_WORDS.search(f.documentation)]
    assert not missing, f"help texts without a unit: {missing}"
    text = exposition(registry).decode()
    assert "rolloutbus_sessions_total" in text and "_created" not in text
    replica = exposition(_registries()[1]).decode()
    assert "_created" not in replica


def test_trainer_figures_are_named_gauges_not_a_label():
    names = {suffix for suffix, _ in TRAINER_GAUGES.values()}
    assert {"pg_loss", "grad_norm", "pg_clipfrac", "ppo_kl", "rollout_kl"} <= names
    assert "rolloutbus_trainer_step_value" not in _exposed_names()


def _trajectory(i: int, source: str, reward: float | None, length: int, **kw) -> Trajectory:
    return make_trajectory(
        f"u{i}",
        prompts=[],
        responses=[1] * length,
        reward_score=reward,
        data_source=source,
        num_turns=kw.pop("num_turns", 2),
        **kw,
    )


def test_release_figures_per_data_source():
    registry = CollectorRegistry()
    observer = ReleaseObserver(RolloutMetrics(registry), response_length=8, window=4)
    group = make_group_started(ts=1000.0)
    released = ReleasedGroup(group=group, sessions=[])
    batch = [
        _trajectory(0, "gsm8k", 0.0, 3, min_global_steps=1, max_global_steps=1),
        _trajectory(1, "gsm8k", 1.0, 8, status=TrajectoryStatus.TRUNCATED, max_global_steps=3),
        _trajectory(2, "math", 0.5, 5),
        _trajectory(3, "gsm8k", None, 0, status=TrajectoryStatus.FAILED, error="boom"),
        _trajectory(4, "gsm8k", 0.0, 4),
    ]
    observer.observe(released, batch, now=1012.5)
    value = registry.get_sample_value
    gsm = {"data_source": "gsm8k"}
    assert value("rolloutbus_rollout_reward_mean", gsm) == pytest.approx(1 / 3)
    assert value("rolloutbus_rollout_reward_std", gsm) == pytest.approx((2 / 9) ** 0.5)
    assert value("rolloutbus_rollout_reward_min", gsm) == 0.0
    assert value("rolloutbus_rollout_reward_max", gsm) == 1.0
    assert value("rolloutbus_rollout_reward_zero_ratio", gsm) == pytest.approx(2 / 3)
    assert value("rolloutbus_rollout_reward_one_ratio", gsm) == pytest.approx(1 / 3)
    assert value("rolloutbus_rollout_response_length_mean_tokens", gsm) == 5
    assert value("rolloutbus_rollout_response_length_max_tokens", gsm) == 8
    assert value("rolloutbus_rollout_response_length_clip_ratio", gsm) == pytest.approx(1 / 3)
    assert value("rolloutbus_rollout_reward_mean", {"data_source": "math"}) == 0.5
    assert value("rolloutbus_rollout_failed_trajectories_total", {"failure_class": "unknown"}) == 1
    assert value("rolloutbus_rollout_group_latency_seconds_sum") == 12.5
    # newest version released is 3; the first trajectory's oldest token is v1
    assert value("rolloutbus_rollout_staleness_at_release_versions_sum") == 2
    assert value("rolloutbus_rollout_num_turns_count", {"agent_name": "unknown"}) == 4
    # the window keeps the last 4 of a source: four 1.0 scores push the 0.0s out
    observer.observe(released, [_trajectory(9, "gsm8k", 1.0, 2) for _ in range(4)], now=1013)
    assert value("rolloutbus_rollout_reward_mean", gsm) == 1.0
    # a window of unscored trajectories: the length figures move, the reward ones keep the
    # last scores seen (they are computed when scraped, from the window as it is then)
    observer.observe(released, [_trajectory(9, "gsm8k", None, 6) for _ in range(4)], now=1014)
    assert value("rolloutbus_rollout_response_length_mean_tokens", gsm) == 6
    assert value("rolloutbus_rollout_reward_mean", gsm) == 1.0


def test_a_failure_class_on_the_record_is_its_label():
    registry = CollectorRegistry()
    observer = ReleaseObserver(RolloutMetrics(registry), response_length=8)
    failed = _trajectory(0, "s", None, 0, status=TrajectoryStatus.FAILED, error="x")
    object.__setattr__(failed, "failure_class", "reward")  # the field helper a2 adds
    group = make_group_started()
    observer.observe(ReleasedGroup(group=group, sessions=[]), [failed])
    labels = {"failure_class": "reward"}
    assert registry.get_sample_value("rolloutbus_rollout_failed_trajectories_total", labels) == 1


def test_tool_outcomes_from_verls_error_texts():
    assert call_outcome("42") == "ok"
    assert call_outcome("Unknown function 'x'. Available tools: ['calc']") == "unknown_tool"
    assert call_outcome("Invalid JSON in arguments for 'calc': ...") == "invalid_arguments"
    assert call_outcome("Error executing tool 'calc': division by zero") == "error"
    assert call_outcome("Error executing tool 'calc': timed out after 30 s") == "timeout"


def _scrape(at: float, trajectories: float, lag: float) -> Scrape:
    return Scrape(
        at=at,
        samples=[
            Sample(
                "rolloutbus_replay_buffer_trajectories_total", {"status": "completed"}, trajectories
            ),
            Sample("rolloutbus_consumer_lag_records", {"stage": "trainer"}, lag),
            Sample("rolloutbus_consumer_lag_seconds", {"stage": "trainer"}, 4.0),
            Sample("rolloutbus_consumer_group_members", {"stage": "trainer"}, 0),
            Sample("rolloutbus_client_replica_healthy", {"replica": "http://r:8000"}, 0),
            Sample("rolloutbus_rollout_failed_trajectories_total", {"failure_class": "loop"}, 3),
        ],
        up={"sessions": True, "trainer": False},
    )


def test_top_summarizes_rates_lag_health_and_failures():
    sections = {s.title: dict(s.rows) for s in summarize(_scrape(0, 10, 1), _scrape(2, 30, 5))}
    assert sections["flow"]["trajectories"] == "10.00/s, 30 in all"
    assert sections["consumer lag"]["trainer"] == "5 records, oldest 4.0 s, 0 consumers"
    assert sections["consumer lag"]["sessions"] == "- (no lag exporter)"
    assert sections["replicas"]["http://r:8000"].startswith("UNHEALTHY")
    assert sections["failures"]["failed trajectories: loop"] == "3"
    assert sections["processes"] == {"sessions": "up", "trainer": "DOWN"}
    render(summarize(_scrape(0, 10, 1), _scrape(2, 30, 5)), 2.0)  # lays out without error


@pytest.mark.parametrize(
    ("key", "expected"),
    [("abc", ("abc", None)), ("abc_3", ("abc", 3)), ("abc_3_0", ("abc", 3))],
)
def test_inspect_takes_a_uid_a_session_or_a_trajectory_key(key, expected):
    assert parse_key(key) == expected


@pytest.mark.parametrize("bad", ["", "_1", "abc_x", "a_1_2_3"])
def test_inspect_names_a_bad_key(bad):
    with pytest.raises(ConfigError, match="not a uid or key"):
        parse_key(bad)


def test_metrics_on_config_loads_with_the_defaults_elsewhere():
    cfg = load_config(OPS / "metrics-on.yaml")
    assert cfg.kafka == Config().kafka
    assert cfg.sessions.metrics_port == 9101


def test_the_demo_picture_has_progress_reward_outcomes_and_lengths(tmp_path):
    from rolloutbus.consumers.report import write_trajectories
    from rolloutbus.monitoring.demo_picture import (
        METRICS_ON_PORTS,
        cumulative,
        draw_demo_picture,
        reward_outcomes,
    )

    on = load_config(OPS / "metrics-on.yaml")
    assert METRICS_ON_PORTS == {
        "sessions.metrics_port": on.sessions.metrics_port,
        "replay_buffer.metrics_port": on.replay_buffer.metrics_port,
    }
    # tokens logged steadily; trajectories released in one batch at t=3 (a group at a time)
    scrapes = [
        Scrape(
            at=10.0 + t,
            samples=[
                Sample("rolloutbus_sessions_tokens_total", {"kind": "sampled"}, 100.0 * t),
                Sample("rolloutbus_sessions_tokens_total", {"kind": "observed"}, 7.0 * t),
                Sample("rolloutbus_replay_buffer_trajectories_total", {}, 4.0 * (t >= 3)),
            ],
        )
        for t in range(4)
    ] + [Scrape(at=14.0, samples=[])]  # the processes stopped: nothing to read
    times, tokens, released = cumulative(scrapes)
    assert times == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert tokens == [0.0, 100.0, 200.0, 300.0, 300.0]  # sampled only, at logging time
    assert released == [0.0, 0.0, 0.0, 4.0, 4.0]
    # the last group released after the last scrape: the curve ends at the demo's total
    times, tokens, released = cumulative(scrapes, released_in_the_end=6)
    assert times[-1] > 4.0 and tokens[-1] == 300.0 and released[-2:] == [4.0, 6.0]
    assert cumulative(scrapes, released_in_the_end=4)[2] == [0.0, 0.0, 0.0, 4.0, 4.0]
    rows = [
        {"data_source": "gsm8k", "reward_score": 0.0},
        {"data_source": "gsm8k", "reward_score": 0.0},
        {"data_source": "gsm8k", "reward_score": 1.0},
        {"data_source": "math", "reward_score": None},
    ]
    assert reward_outcomes(rows) == {
        "gsm8k": {"reward > 0": 1, "reward <= 0": 2, "unscored": 0},
        "math": {"reward > 0": 0, "reward <= 0": 0, "unscored": 1},
    }
    arrow = tmp_path / "trajectories.arrow"
    write_trajectories([_trajectory(i, f"s{i % 2}", 0.0, 3 + i) for i in range(4)], arrow)
    picture = draw_demo_picture(scrapes, arrow, tmp_path / "demo.png", response_length=6)
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and picture.stat().st_size > 10_000
