"""The consumer watch on a real broker and real session workers.

- A worker whose Faust consumer never delivers (fault injector:
  ``tests/programs/wedged_session_worker.py``) while prompts wait on its partitions exits 75
  within its ``consumer_stall_s``, naming the partitions, instead of idling forever.
- A healthy worker that takes no prompt for longer than ``consumer_stall_s`` because every
  group slot is busy (concurrency 1, a slow group in front) is not stalled: it runs every
  group and stays up. Real replica (tiny-qwen3), replay buffer and trainer client.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rolloutbus.config import Config
from rolloutbus.kafka.admin import ensure_topics
from rolloutbus.producers.datasets import write_jsonl
from rolloutbus.producers.publish import PromptPublisher
from rolloutbus.streams.sessions.consumer_watch import EXIT_CONSUMER_STALLED
from tests.helpers import free_port, unique_name
from tests.pipeline import receive_groups, running, spawn, stop, wait_http_ok, write_config
from tests.source_tree import PLUGINS, PROGRAMS

pytestmark = pytest.mark.kafka

WEDGED = PROGRAMS / "wedged_session_worker.py"
EXIT_WAIT_S = 150.0  # seconds: start (imports on a busy host) + stall window + one check


def _config(kafka_bootstrap: str, tmp_path: Path, port: int, stall_s: float) -> Config:
    registry = tmp_path / "loops.yaml"
    registry.write_text("- name: paced\n  _target_: paced_loop.PacedToolLoop\n")
    return Config.model_validate(
        {
            "kafka": {
                "bootstrap_servers": kafka_bootstrap,
                "topic_prefix": unique_name("w"),
                "partitions": 1,
            },
            "model": {"name": "tiny-qwen3"},
            "replica_server": {"port": port, "max_batch_size": 8},
            "replicas": {"urls": [f"http://127.0.0.1:{port}"]},
            "rollout": {
                "n": 2,
                "prompt_length": 64,
                "response_length": 64,
                "agent": {"agent_loop_config_path": str(registry)},
            },
            "sessions": {
                "app_id": unique_name("s"),
                "concurrency": 1,
                "consumer_stall_s": stall_s,
            },
            "replay_buffer": {"group_id": unique_name("rb")},
        }
    )


def _rows(specs: list[tuple[int, float]]) -> list[dict]:
    return [
        {
            "data_source": "paced",
            "agent_name": "paced",
            "prompt": [{"role": "user", "content": f"count to {i}"}],
            "extra_info": {"turns": turns, "tool_delay_s": delay, "index": i},
        }
        for i, (turns, delay) in enumerate(specs)
    ]


def _publish(cfg: Config, rows: list[dict], tmp_path: Path) -> set[str]:
    report = PromptPublisher(cfg).publish_file(
        write_jsonl(rows, tmp_path / "rows.jsonl"), progress=False
    )
    return set(report.uids)


def test_a_worker_whose_consumer_delivers_nothing_exits_for_its_supervisor(
    kafka_bootstrap, tmp_path
):
    cfg = _config(kafka_bootstrap, tmp_path, free_port(), stall_s=5.0)
    ensure_topics(cfg.kafka)
    _publish(cfg, _rows([(1, 0.0), (1, 0.0)]), tmp_path)
    log_path = tmp_path / "wedged.log"
    with log_path.open("wb") as log:
        worker = subprocess.Popen(
            [sys.executable, str(WEDGED), str(write_config(cfg, tmp_path / "c.yaml"))],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        code = worker.wait(EXIT_WAIT_S)
    except subprocess.TimeoutExpired:
        stop(worker)
        pytest.fail(f"the wedged worker is still running:\n{log_path.read_text()[-3000:]}")
    text = log_path.read_text()
    assert code == EXIT_CONSUMER_STALLED, text[-3000:]
    assert "session worker consumer stalled" in text
    assert "2 prompt group(s) wait on" in text and "partition(s) [0]" in text


@pytest.mark.slow
def test_a_worker_waiting_for_a_free_slot_is_not_stalled(kafka_bootstrap, tmp_path):
    port = free_port()
    stall_s = 6.0
    cfg = _config(kafka_bootstrap, tmp_path, port, stall_s=stall_s)
    ensure_topics(cfg.kafka)
    config_path = write_config(cfg, tmp_path / "c.yaml")
    replica = spawn(["replica", "serve"], config_path, tmp_path / "replica.log")
    with running([replica]):
        wait_http_ok(f"http://127.0.0.1:{port}/health", replica, tmp_path / "replica.log")
        buffer = spawn(["replay-buffer", "run"], config_path, tmp_path / "rb.log")
        # the first group holds the only slot for well over stall_s; the next two wait
        uids = _publish(cfg, _rows([(5, 2 * stall_s / 5 + 1.0), (1, 0.0), (1, 0.0)]), tmp_path)
        worker_log = tmp_path / "sessions.log"
        worker = spawn(["sessions", "run"], config_path, worker_log, python_path=[PLUGINS])
        with running([buffer, worker]):
            receive_groups(cfg, uids, timeout_s=300)
            assert worker.poll() is None, worker_log.read_text()[-3000:]
    assert "consumer stalled" not in worker_log.read_text()
