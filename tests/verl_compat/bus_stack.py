"""The bus side of the verl trainer tests: a config for a tiny-qwen3 replica and the even-token
loop (tests/plugins), and the replica, session worker and replay buffer running on it as
processes while verl's side runs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from rolloutbus.config import Config
from rolloutbus.kafka.admin import ensure_topics
from tests.helpers import free_port, unique_name
from tests.pipeline import running, spawn, wait_http_ok, write_config
from tests.source_tree import PLUGINS


def even_token_config(
    kafka_bootstrap: str, tmp_path: Path, prefix: str, trainer_group: str
) -> Config:
    """Topics of their own (``prefix``), groups of 2 even-token sessions of 8 tokens."""
    port = free_port()
    registry = tmp_path / "agent_loops.yaml"
    registry.write_text("- name: even_token_agent\n  _target_: even_token_loop.EvenTokenLoop\n")
    return Config.model_validate(
        {
            "kafka": {
                "bootstrap_servers": kafka_bootstrap,
                "topic_prefix": unique_name(prefix),
                "partitions": 2,
            },
            "model": {"name": "tiny-qwen3", "seed": 0},
            "replica_server": {"port": port, "max_batch_size": 16},
            "replicas": {"urls": [f"http://127.0.0.1:{port}"], "request_timeout_s": 120},
            "rollout": {
                "n": 2,
                "prompt_length": 64,
                "response_length": 8,
                "temperature": 1.0,
                "agent": {
                    "default_agent_loop": "even_token_agent",
                    "agent_loop_config_path": str(registry),
                },
            },
            "sessions": {"app_id": unique_name("sessions"), "concurrency": 4},
            "replay_buffer": {"group_id": unique_name("rb")},
            "trainer": {"group_id": unique_name(trainer_group)},
        }
    )


@contextlib.contextmanager
def bus_running(cfg: Config, tmp_path: Path) -> Iterator[tuple[Path, dict[str, Path]]]:
    """``cfg``'s topics made, then its replica (healthy), a session worker and a replay
    buffer running; yields the config file and the processes' logs."""
    ensure_topics(cfg.kafka)
    config_path = write_config(cfg, tmp_path / "bus.yaml")
    logs = {n: tmp_path / f"{n}.log" for n in ("replica", "sessions", "rb")}
    replica = spawn(["replica", "serve"], config_path, logs["replica"])
    with running([replica]):
        wait_http_ok(f"{cfg.replicas.urls[0]}/health", replica, logs["replica"])
        workers = [
            spawn(["sessions", "run"], config_path, logs["sessions"], python_path=[PLUGINS]),
            spawn(["replay-buffer", "run"], config_path, logs["rb"]),
        ]
        with running(workers):
            yield config_path, logs
