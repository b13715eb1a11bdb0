"""Kill the session worker with SIGKILL while groups are in flight, restart it: every group
still arrives, every trajectory key exactly once (re-run sessions get a new attempt id and
the replay buffer folds one attempt per session)."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter

import pytest
from helpers import free_port, unique_name
from pipeline import read_topic, receive_groups, running, spawn, stop, wait_http_ok, write_config

from rolloutbus.config import Config
from rolloutbus.kafka.admin import ensure_topics
from rolloutbus.producers.datasets import make_arithmetic_rows, write_jsonl
from rolloutbus.producers.publish import PromptPublisher
from rolloutbus.schemas.turns import decode_turn_event
from rolloutbus.topics import Topics

pytestmark = pytest.mark.kafka  # worker processes on the test broker

GROUPS, N = 8, 2


@pytest.mark.slow
def test_sigkill_session_worker_mid_run(kafka_bootstrap, tmp_path):
    port = free_port()
    cfg = Config.model_validate({
        "kafka": {"bootstrap_servers": kafka_bootstrap, "topic_prefix": unique_name("k"), "partitions": 2},
        "model": {"name": "tiny-qwen3"},
        "replica_server": {"port": port, "max_batch_size": 8},
        "replicas": {"urls": [f"http://127.0.0.1:{port}"]},
        # random weights rarely emit EOS: sessions run to the budget, long enough to be killed
        "rollout": {"n": N, "response_length": 160},
        "sessions": {"app_id": unique_name("s"), "concurrency": 2},
        "replay_buffer": {"group_id": unique_name("rb"), "transactional_id": unique_name("tx")},
    })
    ensure_topics(cfg.kafka)
    config_path = write_config(cfg, tmp_path / "c.yaml")
    topics = Topics.from_config(cfg.kafka)
    replica = spawn(["replica", "serve"], config_path, tmp_path / "replica.log")
    with running([replica]):
        wait_http_ok(f"http://127.0.0.1:{port}/health", replica, tmp_path / "replica.log")
        buffer = spawn(["replay-buffer", "run"], config_path, tmp_path / "rb.log")
        with running([buffer]):
            report = PromptPublisher(cfg).publish_file(
                write_jsonl(make_arithmetic_rows(GROUPS, seed=5, tool_fraction=0), tmp_path / "rows.jsonl"),
                progress=False)
            worker = spawn(["sessions", "run"], config_path, tmp_path / "sessions1.log")
            _wait_for_generations(cfg, topics.turns, minimum=4, timeout_s=180)
            os.kill(worker.pid, signal.SIGKILL)
            worker.wait()
            worker = spawn(["sessions", "run"], config_path, tmp_path / "sessions2.log")
            try:
                groups = receive_groups(cfg, set(report.uids), timeout_s=300)
            finally:
                stop(worker)
    keys = [m.key().decode() for m in read_topic(cfg, topics.trajectories)]
    assert not [k for k, c in Counter(keys).items() if c > 1], "a trajectory key was written twice"
    assert len(keys) == GROUPS * N
    assert all(len(g) == N for g in groups.values())
    starts = Counter(e.uid for e in map(decode_turn_event, (m.value() for m in read_topic(cfg, topics.turns)))
                     if e.type == "group_started")
    assert max(starts.values()) > 1  # some group really was re-run after the kill


def _wait_for_generations(cfg: Config, topic: str, minimum: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        generations = [m for m in read_topic(cfg, topic) if b'"type":"generation"' in m.value()]
        if len(generations) >= minimum:
            return
        time.sleep(0.5)
    raise AssertionError("the session worker logged no generations in time")
