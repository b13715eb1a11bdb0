"""SIGKILL the session worker while a slow group is in flight behind faster ones, restart it:
the slow group is resumed from the turn log (not lost, not re-sampled), every trajectory key
arrives exactly once.

Before the turn log became the source of truth this lost the slow group for good:
faust-streaming committed the prompts offset past it once a later group finished (its
``Consumer._new_offset`` holds a commit back only for a gap of more than one message).
Real processes throughout: broker, embedded replica (tiny-qwen3), session worker, replay
buffer; the agent loop is ``tests/plugins/paced_loop.py`` (a slow, constant "tool").
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from rolloutbus.config import Config
from rolloutbus.kafka.admin import ensure_topics
from rolloutbus.producers.datasets import write_jsonl
from rolloutbus.producers.publish import PromptPublisher
from rolloutbus.schemas.turns import decode_turn_event
from rolloutbus.topics import Topics
from tests.helpers import free_port, unique_name
from tests.pipeline import (
    read_topic,
    receive_groups,
    running,
    spawn,
    stop,
    wait_http_ok,
    write_config,
)
from tests.source_tree import PLUGINS

pytestmark = pytest.mark.kafka

N = 2
SLOW_TURNS, FAST_GROUPS = 6, 3


def _row(index: int, turns: int, delay_s: float) -> dict:
    return {
        "data_source": "paced",
        "agent_name": "paced",
        "prompt": [{"role": "user", "content": f"count to {index}"}],
        "extra_info": {"turns": turns, "tool_delay_s": delay_s, "index": index},
    }


def _config(kafka_bootstrap: str, tmp_path: Path, port: int) -> Config:
    registry = tmp_path / "loops.yaml"
    registry.write_text("- name: paced\n  _target_: paced_loop.PacedToolLoop\n")
    return Config.model_validate(
        {
            "kafka": {
                "bootstrap_servers": kafka_bootstrap,
                "topic_prefix": unique_name("k"),
                "partitions": 1,
            },  # one partition: the slow group sits before the fast ones
            "model": {"name": "tiny-qwen3"},
            "replica_server": {"port": port, "max_batch_size": 8},
            "replicas": {"urls": [f"http://127.0.0.1:{port}"]},
            "rollout": {
                "n": N,
                "prompt_length": 64,
                "response_length": 64,
                "agent": {"agent_loop_config_path": str(registry)},
            },
            "sessions": {"app_id": unique_name("s"), "concurrency": 4},
            "replay_buffer": {"group_id": unique_name("rb"), "transactional_id": unique_name("tx")},
        }
    )


@pytest.mark.slow
def test_sigkill_with_a_slow_group_behind_finished_ones_resumes_it(kafka_bootstrap, tmp_path):
    port = free_port()
    cfg = _config(kafka_bootstrap, tmp_path, port)
    ensure_topics(cfg.kafka)
    config_path = write_config(cfg, tmp_path / "c.yaml")
    topics = Topics.from_config(cfg.kafka)
    rows = [_row(0, SLOW_TURNS, 1.5)] + [_row(i, 1, 0.0) for i in range(1, FAST_GROUPS + 1)]
    replica = spawn(["replica", "serve"], config_path, tmp_path / "replica.log")
    with running([replica]):
        wait_http_ok(f"http://127.0.0.1:{port}/health", replica, tmp_path / "replica.log")
        buffer = spawn(["replay-buffer", "run"], config_path, tmp_path / "rb.log")
        with running([buffer]):
            report = PromptPublisher(cfg).publish_file(
                write_jsonl(rows, tmp_path / "rows.jsonl"), progress=False
            )
            slow_uid, fast_uids = report.uids[0], set(report.uids[1:])
            worker = spawn(
                ["sessions", "run"], config_path, tmp_path / "sessions1.log", python_path=[PLUGINS]
            )
            receive_groups(cfg, fast_uids, timeout_s=240)  # the later groups are released
            _wait_for(
                lambda: _generations(cfg, topics.turns, slow_uid) >= 2 * N,
                120,
                "the slow group logged no turns",
            )
            os.kill(worker.pid, signal.SIGKILL)
            worker.wait()
            worker = spawn(
                ["sessions", "run"], config_path, tmp_path / "sessions2.log", python_path=[PLUGINS]
            )
            try:
                groups = receive_groups(cfg, {slow_uid}, timeout_s=300)
            finally:
                stop(worker)
    keys = [m.key().decode() for m in read_topic(cfg, topics.trajectories)]
    assert not [k for k, c in Counter(keys).items() if c > 1], "a trajectory key was written twice"
    assert len(keys) == len(rows) * N
    assert len(groups[slow_uid]) == N and set(
        groups[slow_uid].batch.column("status").to_pylist()
    ) == {"completed"}
    events = [decode_turn_event(m.value()) for m in read_topic(cfg, topics.turns)]
    _assert_resumed_without_resampling(events, slow_uid)


def _assert_resumed_without_resampling(events: list, uid: str) -> None:
    mine = [e for e in events if e.uid == uid]
    assert sum(e.type == "group_started" for e in mine) == 1, "the group was started twice"
    resumed = [e for e in mine if e.type == "session_started" and e.resumed_from]
    assert resumed, "no session of the slow group was resumed from the log"
    for start in resumed:
        old = [
            e
            for e in mine
            if e.type == "generation"
            and e.attempt == start.resumed_from
            and e.session_id == start.session_id
        ]
        new = [e for e in mine if e.type == "generation" and e.attempt == start.attempt]
        assert old, "the resumed attempt had logged generations"
        # replayed turns are the logged ones (same engine request): nothing sampled twice
        assert [g.engine_request_id for g in new[: len(old)]] == [g.engine_request_id for g in old]
        assert [g.token_ids for g in new[: len(old)]] == [g.token_ids for g in old]
        assert len(new) == SLOW_TURNS


def _generations(cfg: Config, topic: str, uid: str) -> int:
    return sum(
        1
        for m in read_topic(cfg, topic)
        if b'"type":"generation"' in m.value() and uid.encode() in m.value()
    )


def _wait_for(condition, timeout_s: float, message: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.5)
    raise AssertionError(message)
