"""A real Prometheus scraping a real run: every dashboard query returns data (or is
declared empty here, with the reason), consumer lag appears when a consumer stops, the
shipped config and alert rules pass promtool, and ``top --once`` and ``inspect`` work on
the run.

Prometheus is Debian's package (``ops/test.sh`` installs it as root); without it the tests
skip and say so. It runs as a child process of the test with its data in a temporary
folder on a free port, never as the system service. The run: the embedded replica (tiny
random Qwen3), a session worker, the replay buffer, the weight sync, the dispatcher, the
lag exporter and ``rolloutbus train``, each a process with metrics on, on the
test broker.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from confluent_kafka import Consumer, TopicPartition

from rolloutbus.config import Config
from rolloutbus.kafka.admin import ensure_topics
from rolloutbus.producers.datasets import make_arithmetic_rows, write_jsonl
from rolloutbus.producers.publish import PromptPublisher
from rolloutbus.topics import Topics
from tests.helpers import free_port, unique_name
from tests.pipeline import read_topic, running, spawn, stop, wait_http_ok, write_config
from tests.source_tree import ROOT

OPS = ROOT / "ops"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
NO_PROMETHEUS = (
    "Debian's prometheus package is not installed (ops/test.sh installs it when run as "
    "root: apt-get install -y prometheus)"
)
TRAIN_STEPS = 2  # train steps seen before the checks (the trainer runs until stopped)
TRAIN_TIMEOUT_S = 600.0  # seconds; ~1-2 min on an idle 2-core machine
LAG_TIMEOUT_S = 90.0  # seconds for a stopped worker's lag to reach Prometheus
SCRAPE_INTERVAL = "1s"  # the test's own scrape interval: a short run still has many samples

# Dashboard queries that have no data in this run, and why. Every other query must return
# data; one listed here that does return data fails too (the list must stay true).
EXPECTED_EMPTY = {
    # the tiny random model emits no tool call (tool metrics: tests/monitoring/test_monitoring.py)
    ("Tool call duration by tool, p99", "{{tool}}"): "no tool call",
    ("Tool calls by outcome", "{{tool}} {{outcome}}"): "no tool call",
    # nothing fails in a healthy run
    ("Failed trajectories by failure class", "{{failure_class}}"): "no failure",
    ("Failure rate of released trajectories", "failed share"): "no failure",
    ("Sessions failed by failure class (session workers)", "{{failure_class}}"): "no failure",
    ("Groups released early, by reason", "{{kind}}"): "no deadline or bound hit",
    ("generate() calls that did not complete", "{{outcome}}"): "every call completes",
    ("Replay-buffer transactions aborted, by cause", "{{cause}}"): "no aborted transaction",
    (
        "Sessions resumed after a crash, and turns replayed from the log",
        "{{kind}}",
    ): "no crash, nothing resumed",
}
# queries whose data depends on the host's speed: each runs (a bad query fails the test),
# with or without data. Stale groups: the dispatcher bounds how many groups start per
# published version, not when each is trained; on a slow host a group that finishes late
# (or whose first tokens came from a replica still on the previous weights) reaches the
# trainer staler than the threshold, and is counted, as designed (seen in a fresh-clone
# CI run with two test workers: 1.14 versions stale on average at training)
EITHER = {
    ("Stale groups dropped or down-weighted", "{{action}}"): "depends on the host's speed",
}

pytestmark = pytest.mark.skipif(PROMETHEUS is None or PROMTOOL is None, reason=NO_PROMETHEUS)


def _make_dashboards() -> Any:
    path = OPS / "grafana/make_dashboards.py"
    spec = importlib.util.spec_from_file_location("make_dashboards", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_dashboards"] = module
    spec.loader.exec_module(module)
    return module


def _promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_promtool_passes_the_shipped_config_rules_and_alert_tests():
    prom = OPS / "prometheus"
    for args in (
        ("check", "config", "prometheus.yml"),
        ("check", "rules", "alerts.yml"),
        ("test", "rules", "alerts.test.yml"),
    ):
        result = _promtool(*args, cwd=prom)
        assert result.returncode == 0, f"promtool {' '.join(args)}:\n{result.stdout}{result.stderr}"
    assert "SUCCESS" in _promtool("test", "rules", "alerts.test.yml", cwd=prom).stdout


# -- the real run ----------------------------------------------------------------------------


@pytest.fixture
def run_config(kafka_bootstrap: str, tmp_path: Path) -> Config:
    replica = free_port()
    return Config.model_validate(
        {
            "kafka": {
                "bootstrap_servers": kafka_bootstrap,
                "topic_prefix": unique_name("mon"),
                "partitions": 2,
            },
            "model": {"name": "tiny-qwen3", "seed": 0},
            "replica_server": {"port": replica, "max_batch_size": 8},
            "replicas": {"urls": [f"http://127.0.0.1:{replica}"], "request_timeout_s": 120},
            "rollout": {"n": 2, "prompt_length": 256, "response_length": 8},
            "sessions": {
                "app_id": unique_name("sessions"),
                "concurrency": 4,
                "metrics_port": free_port(),
                "data_dir": str(tmp_path / "faust"),
            },
            "replay_buffer": {"group_id": unique_name("rb"), "metrics_port": free_port()},
            "async_training": {
                "staleness_threshold": 1,
                "ppo_mini_batch_size": 1,
                "require_batches": 1,
                "trigger_parameter_sync_step": 1,
            },
            "trainer": {
                "group_id": unique_name("trainer"),
                "default_local_dir": str(tmp_path / "ckpt"),
                "metrics_port": free_port(),
                "torch_threads": 1,
            },
            "monitoring": {
                "weight_sync_metrics_port": free_port(),
                "dispatch_metrics_port": free_port(),
                "lag_exporter_port": free_port(),
                "lag_poll_s": 1.0,
            },
        }
    )


def _prometheus_config(cfg: Config, path: Path) -> Path:
    """The shipped prometheus.yml with this run's ports, the shipped rules, a 1 s scrape."""
    shipped = yaml.safe_load((OPS / "prometheus/prometheus.yml").read_text())
    m = cfg.monitoring
    ports = {
        "rolloutbus-sessions": cfg.sessions.metrics_port,
        "rolloutbus-replay-buffer": cfg.replay_buffer.metrics_port,
        "rolloutbus-trainer": cfg.trainer.metrics_port,
        "rolloutbus-weight-sync": m.weight_sync_metrics_port,
        "rolloutbus-dispatch": m.dispatch_metrics_port,
        "rolloutbus-lag-exporter": m.lag_exporter_port,
        "rolloutbus-replica": cfg.replica_server.port,
    }
    for job in shipped["scrape_configs"]:
        job["static_configs"] = [{"targets": [f"127.0.0.1:{ports[job['job_name']]}"]}]
    shipped["global"] = {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": "5s"}
    shipped["rule_files"] = [str(OPS / "prometheus/alerts.yml")]
    path.write_text(yaml.safe_dump(shipped))
    return path


class Prometheus:
    def __init__(self, config: Path, data: Path, log: Path):
        self.url = f"http://127.0.0.1:{free_port()}"
        with log.open("wb") as out:  # Prometheus writes through its own copy of the file
            self.proc = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={data}",
                    f"--web.listen-address={self.url.removeprefix('http://')}",
                    "--storage.tsdb.retention.time=1h",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.log = log

    def query_range(self, expr: str, start: float, end: float) -> list[dict]:
        answer = httpx.get(
            f"{self.url}/api/v1/query_range",
            params={"query": expr, "start": start, "end": end, "step": "2s"},
            timeout=30,
        ).json()
        assert answer["status"] == "success", f"{expr}: {answer}"
        return answer["data"]["result"]

    def query(self, expr: str) -> list[dict]:
        answer = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=30).json()
        assert answer["status"] == "success", f"{expr}: {answer}"
        return answer["data"]["result"]


@pytest.fixture
def prometheus(run_config: Config, tmp_path: Path) -> Iterator[Prometheus]:
    config = _prometheus_config(run_config, tmp_path / "prometheus.yml")
    check = _promtool("check", "config", str(config), cwd=tmp_path)
    assert check.returncode == 0, check.stdout + check.stderr
    prom = Prometheus(config, tmp_path / "tsdb", tmp_path / "prometheus.log")
    try:
        wait_http_ok(f"{prom.url}/-/ready", prom.proc, prom.log)
        yield prom
    finally:
        stop(prom.proc)


def _value(prom: Prometheus, expr: str) -> float:
    """The first sample of an instant query; -1 when there is none yet."""
    result = prom.query(expr)
    return float(result[0]["value"][1]) if result else -1.0


def _broker_lag(cfg: Config, group: str, topic: str) -> int:
    """End offset minus committed offset over the topic's partitions, read with a plain
    consumer of the group (it commits nothing): what the exporter should report."""
    consumer = Consumer({**cfg.kafka.client_settings(), "group.id": group})
    try:
        parts = [TopicPartition(topic, p) for p in range(cfg.kafka.partitions)]
        total = 0
        for tp in consumer.committed(parts, timeout=30):
            _, high = consumer.get_watermark_offsets(tp, timeout=30, cached=False)
            total += high - max(tp.offset, 0)
        return total
    finally:
        consumer.close()


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(1.0)
    raise AssertionError(f"not within {timeout_s:.0f} s: {what}")


def _cli(cfg_path: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rolloutbus.cli", *argv, "--config", str(cfg_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_real_prometheus_sees_every_panel_lag_top_and_inspect(
    run_config: Config, prometheus: Prometheus, tmp_path: Path
):
    cfg = run_config
    started = time.time()
    ensure_topics(cfg.kafka)
    config_path = write_config(cfg, tmp_path / "config.yaml")
    dataset = write_jsonl(make_arithmetic_rows(8, seed=3, tool_fraction=0.5), tmp_path / "d.jsonl")
    logs = {
        n: tmp_path / f"{n}.log" for n in ("replica", "sessions", "rb", "sync", "lag", "dispatch")
    }
    replica = spawn(["replica", "serve"], config_path, logs["replica"])
    with running([replica]):
        wait_http_ok(f"{cfg.replicas.urls[0]}/health", replica, logs["replica"])
        sessions = spawn(["sessions", "run"], config_path, logs["sessions"])
        workers = [
            spawn(["replay-buffer", "run"], config_path, logs["rb"]),
            spawn(["weight-sync"], config_path, logs["sync"]),
            spawn(["lag-exporter"], config_path, logs["lag"]),
            spawn(["dispatch", str(dataset)], config_path, logs["dispatch"]),
        ]
        trainer = spawn(["train"], config_path, tmp_path / "train.log")
        with running([sessions, *workers, trainer]):
            _wait_for(
                lambda: _value(prometheus, "max(rolloutbus_trainer_global_step)") >= TRAIN_STEPS,
                TRAIN_TIMEOUT_S,
                f"{TRAIN_STEPS} train steps\n{_tails(tmp_path)}",
            )
            # `top --once` on the live run
            top = _cli(config_path, "top", "--once", "--interval", "2")
            assert top.returncode == 0, top.stderr
            print(f"\n$ rolloutbus top --once\n{top.stdout}")
            _check_top(top.stdout)

            # lag appears when a consumer stops: the session worker goes, prompts keep coming.
            # The dispatcher and the trainer stop first, so the prompt topic then holds
            # still and the exporter's figure can be checked against the broker's own.
            for proc in (workers[-1], trainer, sessions):
                stop(proc)
            extra = write_jsonl(make_arithmetic_rows(4, seed=11), tmp_path / "more.jsonl")
            PromptPublisher(cfg).publish_file(extra, progress=False, dataset_id=unique_name("more"))
            expected = _broker_lag(cfg, cfg.sessions.app_id, Topics.from_config(cfg.kafka).prompts)
            assert expected >= 4, expected  # at least the 4 nobody took
            lag = 'sum(rolloutbus_consumer_lag_records{stage="sessions"})'
            _wait_for(
                lambda: _value(prometheus, lag) == expected,
                LAG_TIMEOUT_S,
                f"the stopped session worker's lag ({expected} records) in Prometheus",
            )
            oldest = 'max(rolloutbus_consumer_lag_seconds{stage="sessions"})'
            assert _value(prometheus, oldest) > 0
            members = 'sum(rolloutbus_consumer_group_members{stage="sessions"})'
            _wait_for(lambda: _value(prometheus, members) == 0, LAG_TIMEOUT_S, "no member left")
    _check_every_panel(prometheus, started, time.time())
    _check_inspect(cfg, config_path)
    print(f"\nmonitoring run: {time.time() - started:.0f} s wall")


def _check_top(out: str) -> None:
    assert "consumer lag" in out and "replicas" in out and "trainer" in out, out
    assert "(no lag exporter)" not in out, out  # every stage's lag came from the exporter
    assert "DOWN" not in out, out  # every process answers /metrics
    step = next(line for line in out.splitlines() if line.strip().startswith("step"))
    assert int(step.split()[-1]) >= TRAIN_STEPS, out
    rate = next(line for line in out.splitlines() if line.strip().startswith("trajectories"))
    assert re.search(r"trajectories +\d+\.\d+/s, \d+ in all", rate), out  # rate, then total


def _check_every_panel(prom: Prometheus, start: float, end: float) -> None:
    make = _make_dashboards()
    queries = {
        (panel["title"], target["legendFormat"]): target["expr"]
        for stem in make.ALL
        for panel in make.dashboard(stem)["panels"]
        for target in panel["targets"]
    }
    unknown = (set(EXPECTED_EMPTY) | set(EITHER)) - set(queries)
    assert not unknown, f"EXPECTED_EMPTY or EITHER names queries no panel has: {unknown}"
    empty, surprising = [], []
    for name, expr in queries.items():
        has_data = any(series["values"] for series in prom.query_range(expr, start, end))
        if name in EITHER:
            continue
        if name in EXPECTED_EMPTY and has_data:
            surprising.append(f"{name}: {expr}")
        elif name not in EXPECTED_EMPTY and not has_data:
            empty.append(f"{name}: {expr}")
    assert not empty, "panel queries without data:\n" + "\n".join(empty)
    assert not surprising, "queries declared empty that have data:\n" + "\n".join(surprising)


def _check_inspect(cfg: Config, config_path: Path) -> None:
    topic = Topics.from_config(cfg.kafka).trajectories
    key = read_topic(cfg, topic)[0].key().decode()
    text = _cli(config_path, "inspect", key)
    assert text.returncode == 0, text.stderr
    assert "PROMPT" in text.stdout and "mask 1 (trained)" in text.stdout, text.stdout
    assert "GENERATION turn 0" in text.stdout and "FINISHED" in text.stdout, text.stdout
    print(f"\n$ rolloutbus inspect {key}\n{text.stdout}")
    as_json = _cli(config_path, "inspect", key, "--json")
    view = json.loads(as_json.stdout)
    [session] = view["sessions"]
    generations = [t for t in session["turns"] if t["type"] == "generation"]
    assert generations and all(g["mask"] == 1 for g in generations)
    for g in generations:
        assert len(g["logprobs"]) == g["num_tokens"] == len(g["token_ids"])
        assert g["policy_version"] is not None and g["replica"]


def _tails(tmp_path: Path) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(tmp_path.glob("*.log"))
    )
