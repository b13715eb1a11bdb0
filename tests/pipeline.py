"""A whole pipeline of real processes for integration tests: replica, session worker,
replay buffer, each started through the ``rolloutbus`` command line on the test broker;
``pipeline_config`` builds its config and ``pipeline_running`` starts it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml
from confluent_kafka import Consumer, KafkaError, TopicPartition

from rolloutbus.config import Config
from rolloutbus.consumers.client import TrainerClient
from rolloutbus.consumers.groups import TrajectoryGroup
from rolloutbus.kafka.admin import ensure_topics
from rolloutbus.topics import Topics
from tests.helpers import free_port, unique_name
from tests.source_tree import PLUGINS

READY_TIMEOUT_S = 180.0  # seconds; torch import and model build on 2 shared cores


def pipeline_config(kafka_bootstrap: str, topic_prefix: str, **sections: Any) -> Config:
    """A pipeline's config on the test broker: topics of its own (``topic_prefix`` plus
    random hex, 2 partitions), tiny-qwen3's replica on a free port (16 sequences a batch,
    120 s a request), 64-token prompts, 4 concurrent sessions, groups of its own for the
    session worker and the replay buffer. Each of ``sections`` (a dict, keyed by the
    config's section name) adds to that section's values or overrides them."""
    port = free_port()
    values: dict[str, dict[str, Any]] = {
        "kafka": {
            "bootstrap_servers": kafka_bootstrap,
            "topic_prefix": unique_name(topic_prefix),
            "partitions": 2,
        },
        "model": {"name": "tiny-qwen3"},
        "replica_server": {"port": port, "max_batch_size": 16},
        "replicas": {"urls": [f"http://127.0.0.1:{port}"], "request_timeout_s": 120},
        "rollout": {"prompt_length": 64},
        "sessions": {"app_id": unique_name("sessions"), "concurrency": 4},
        "replay_buffer": {"group_id": unique_name("rb")},
    }
    for name, section in sections.items():
        values[name] = {**values.get(name, {}), **section}
    return Config.model_validate(values)


def agent_loop_registry(path: Path, loops: dict[str, str]) -> Path:
    """The file ``rollout.agent.agent_loop_config_path`` names: each loop's name and the
    import path of its class (importable by a session worker that ``pipeline_running``
    started: tests/plugins is on its path)."""
    path.write_text("".join(f"- name: {name}\n  _target_: {cls}\n" for name, cls in loops.items()))
    return path


def even_token_rollout(
    folder: Path, *, n: int, response_length: int, temperature: float
) -> dict[str, Any]:
    """The ``rollout`` section for groups of ``n`` sessions of tests/plugins/even_token_loop.py
    (its reward: the share of sampled token ids that are even), its registry written in
    ``folder``."""
    loops = {"even_token_agent": "even_token_loop.EvenTokenLoop"}
    registry = agent_loop_registry(folder / "agent_loops.yaml", loops)
    agent = {"default_agent_loop": "even_token_agent", "agent_loop_config_path": str(registry)}
    return {"n": n, "response_length": response_length, "temperature": temperature, "agent": agent}


@contextmanager
def pipeline_running(
    cfg: Config, config_path: Path, beside: dict[str, list[str]] | None = None
) -> Iterator[dict[str, Path]]:
    """``cfg``'s topics made and ``cfg`` written to ``config_path``, then its replica
    (healthy), a session worker that imports tests/plugins' agent loops, a replay buffer
    and each command of ``beside`` running, each logging to ``NAME.log`` beside the config
    file; yields those logs by name (replica, sessions, rb and the names of ``beside``)."""
    beside = beside or {}
    ensure_topics(cfg.kafka)
    write_config(cfg, config_path)
    names = ("replica", "sessions", "rb", *beside)
    logs = {name: config_path.parent / f"{name}.log" for name in names}
    replica = spawn(["replica", "serve"], config_path, logs["replica"])
    with running([replica]):
        wait_http_ok(f"{cfg.replicas.urls[0]}/health", replica, logs["replica"])
        workers = [
            spawn(["sessions", "run"], config_path, logs["sessions"], python_path=[PLUGINS]),
            spawn(["replay-buffer", "run"], config_path, logs["rb"]),
            *(spawn(argv, config_path, logs[name]) for name, argv in beside.items()),
        ]
        with running(workers):
            yield logs


def write_config(cfg: Config, path: Path) -> Path:
    """The config as YAML for a worker process, secrets included (JSON dumps mask them)."""
    data = cfg.model_dump(mode="json")
    if cfg.kafka.sasl_password is not None:
        data["kafka"]["sasl_password"] = cfg.kafka.sasl_password.get_secret_value()
    if cfg.broker.sasl_users:
        data["broker"]["sasl_users"] = {
            user: secret.get_secret_value() for user, secret in cfg.broker.sasl_users.items()
        }
    path.write_text(yaml.safe_dump(data))
    return path


def spawn(
    argv: list[str], config_path: Path, log_path: Path, python_path: list[Path] = ()
) -> subprocess.Popen:
    """``rolloutbus ARGV --config CONFIG`` with its output in ``log_path``; ``python_path``
    makes extra modules (custom agent loops) importable in the worker."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if python_path:
        env["PYTHONPATH"] = os.pathsep.join([*map(str, python_path), env.get("PYTHONPATH", "")])
    with log_path.open("wb") as log:  # the child writes through its own copy of the file
        return subprocess.Popen(
            [sys.executable, "-m", "rolloutbus.cli", *argv, "--config", str(config_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )


def wait_http_ok(url: str, proc: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited early:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready in {READY_TIMEOUT_S} s:\n{log_path.read_text()[-3000:]}")


def stop(proc: subprocess.Popen, timeout: float = 30) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def running(procs: list[subprocess.Popen]):
    try:
        yield procs
    finally:
        for p in reversed(procs):
            stop(p)


def receive_groups(
    cfg: Config, uids: set[str], timeout_s: float = 240.0
) -> dict[str, TrajectoryGroup]:
    got: dict[str, TrajectoryGroup] = {}
    deadline = time.monotonic() + timeout_s
    with TrainerClient(cfg.kafka, f"test-trainer-{time.monotonic_ns()}") as client:
        while set(got) < uids and time.monotonic() < deadline:
            for group in client.groups(max_groups=1, timeout_s=2.0):
                if group.uid in uids:
                    got[group.uid] = group
                client.commit(group)
    missing = uids - set(got)
    assert not missing, f"groups never arrived: {sorted(missing)}"
    return got


def read_topic(cfg: Config, topic: str, *, committed_only: bool = True) -> list[Any]:
    """Every record currently in ``topic`` (all partitions), in partition order."""
    consumer = Consumer(
        {
            **cfg.kafka.client_settings(),
            "group.id": f"reader-{time.monotonic_ns()}",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "isolation.level": "read_committed" if committed_only else "read_uncommitted",
        }
    )
    parts = [TopicPartition(topic, p, 0) for p in range(cfg.kafka.partitions)]
    consumer.assign(parts)
    out, eof = [], set()
    deadline = time.monotonic() + 30
    while len(eof) < len(parts) and time.monotonic() < deadline:
        msg = consumer.poll(1.0)
        if msg is None:
            continue
        if msg.error():
            if msg.error().code() == KafkaError._PARTITION_EOF:
                eof.add(msg.partition())
                continue
            raise RuntimeError(str(msg.error()))
        out.append(msg)
    consumer.close()
    return out


def dead_letters(cfg: Config) -> list[dict[str, Any]]:
    return [json.loads(m.value()) for m in read_topic(cfg, Topics.from_config(cfg.kafka).dlq)]
