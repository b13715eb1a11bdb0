"""A whole pipeline of real processes for integration tests: replica, session worker,
replay buffer, each started through the ``rolloutbus`` command line on the test broker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml
from confluent_kafka import Consumer, KafkaError, TopicPartition

from rolloutbus.config import Config
from rolloutbus.consumers.client import TrainerClient
from rolloutbus.consumers.groups import TrajectoryGroup
from rolloutbus.topics import Topics

READY_TIMEOUT_S = 180.0  # seconds; torch import and model build on 2 shared cores


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
