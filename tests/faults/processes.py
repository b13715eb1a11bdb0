"""The pipeline under test: replica, replay buffers and session workers on one topic prefix,
every process supervised; and what the harness reads from the topics while it runs."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Any

import yaml
from confluent_kafka import Consumer, TopicPartition

from rolloutbus.config import Config, load_config
from rolloutbus.kafka.admin import delete_topics, ensure_topics
from rolloutbus.producers.datasets import write_jsonl
from rolloutbus.producers.publish import PromptPublisher
from rolloutbus.topics import Topics
from tests.faults.services import Service
from tests.faults.workload import LOOP_NAME, LOOP_TARGET, Workload
from tests.helpers import free_port, unique_name
from tests.pipeline import wait_http_ok

# sessions.broker_session_timeout_s: how long a SIGKILLed worker's partitions stay
# unassigned after every kill; 10 s is still over 3 heartbeats (3 s each)
SESSION_TIMEOUT_S = 10.0
# sessions.stall_warn_s: a run's sessions take seconds, so a minute without progress is a
# stall worth a line in the worker's log (what it waits on) when a run hangs
STALL_WARN_S = 60.0
# sessions.consumer_stall_s: a worker whose consumer delivers nothing while prompts wait
# exits after this for the supervisor to restart it (streams/sessions/consumer_watch.py)
CONSUMER_STALL_S = 60.0
WORKER_ENV: dict[str, str] = {}
POLL_S = 0.5  # seconds between progress checks


class TrajectoryWatcher(threading.Thread):
    """Counts committed keys on rollout.trajectories while the run goes on (progress)."""

    def __init__(self, cfg: Config):
        super().__init__(name="trajectory-watcher", daemon=True)
        self.topic = Topics.from_config(cfg.kafka).trajectories
        self._consumer = Consumer(
            {
                **cfg.kafka.client_settings(),
                "group.id": unique_name("watch"),
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
                "log_level": 2,
            }
        )
        self._consumer.assign(
            [TopicPartition(self.topic, p, 0) for p in range(cfg.kafka.partitions)]
        )
        self.keys: Counter[str] = Counter()
        self._halt = threading.Event()

    def run(self) -> None:
        try:
            while not self._halt.is_set():
                msg = self._consumer.poll(POLL_S)
                if msg is not None and msg.error() is None:
                    self.keys[(msg.key() or b"").decode()] += 1
                # errors (a broker restart) are librdkafka's to retry: keep polling
        finally:
            self._consumer.close()

    def stop(self) -> None:
        self._halt.set()
        self.join(10)


class Pipeline:
    """Replica, replay buffers and session workers on one topic prefix, all supervised."""

    def __init__(
        self,
        bootstrap: str,
        workdir: Path,
        *,
        partitions: int = 2,
        concurrency: int = 8,
        replica_batch: int = 1,
        metrics: bool = False,
    ):
        self.workdir = workdir
        self.port = free_port()
        self.metrics = metrics
        raw = _raw_config(bootstrap, workdir, self.port, partitions, concurrency, replica_batch)
        self.cfg = Config.model_validate(raw)
        self.topics = Topics.from_config(self.cfg.kafka)
        ensure_topics(self.cfg.kafka)
        # only the keys set here, so the file stays valid while config defaults change
        self.config_path = workdir / "config.yaml"
        self.config_path.write_text(yaml.safe_dump(raw))
        self.replica = Service("replica", ["replica", "serve"], self.config_path, workdir)
        self.workers: list[Service] = []
        self.buffers: list[Service] = []
        self.watcher = TrajectoryWatcher(self.cfg)
        self._closing = threading.Event()
        self._supervisor = threading.Thread(target=self._supervise, name="supervisor", daemon=True)

    def start(self, session_workers: int = 1, replay_buffers: int = 1) -> None:
        self.replica.start()
        wait_http_ok(
            f"http://127.0.0.1:{self.port}/health", self.replica.popen, self.replica.log_path
        )
        for _ in range(replay_buffers):
            self.add_replay_buffer()
        for _ in range(session_workers):
            self.add_session_worker()
        self.watcher.start()
        self._supervisor.start()

    def add_session_worker(self) -> Service:
        worker = Service(
            f"sessions{len(self.workers)}",
            ["sessions", "run"],
            self.config_path,
            self.workdir,
            env=WORKER_ENV,
        )
        worker.start()
        self.workers.append(worker)
        return worker

    def add_replay_buffer(self) -> Service:
        """Each instance runs as one member of a deployment would (a StatefulSet's pod): its
        own ``replay_buffer.group_instance_id``, kept across restarts, from which its
        transactional id follows. With ``metrics``, each instance gets its own /metrics port."""
        index = len(self.buffers)
        env = {"ROLLOUTBUS__REPLAY_BUFFER__GROUP_INSTANCE_ID": f"rb{index}"}
        buffer = Service(
            f"replaybuffer{index}",
            ["replay-buffer", "run"],
            self.config_path,
            self.workdir,
            env=env,
        )
        if self.metrics:
            buffer.metrics_port = free_port()
            buffer.env["ROLLOUTBUS__REPLAY_BUFFER__METRICS_PORT"] = str(buffer.metrics_port)
        buffer.start()
        self.buffers.append(buffer)
        return buffer

    def services(self) -> list[Service]:
        return [self.replica, *self.buffers, *self.workers]

    def publish(self, workload: Workload) -> list[str]:
        rows = write_jsonl(workload.rows(), self.workdir / "rows.jsonl")
        # checked as the workers will run them: with WORKER_ENV's settings (a row's scorer)
        cfg = load_config(self.config_path, env=WORKER_ENV)
        report = PromptPublisher(cfg).publish_file(rows, progress=False)
        # a refused row would only show as a run waiting for keys that never come
        assert report.dead_lettered == 0, f"rows refused by the publisher: {report.examples}"
        return list(report.uids or [])

    def _supervise(self) -> None:
        while not self._closing.wait(POLL_S):
            for service in self.services():
                service.supervise()

    def close(self) -> None:
        self._closing.set()
        if self._supervisor.is_alive():
            self._supervisor.join(10)
        for service in [*self.workers, *self.buffers, self.replica]:
            service.stop()
        if self.watcher.is_alive():
            self.watcher.stop()

    def turn_log_settled(self) -> bool:
        """The replay buffer committed every turn partition up to its end: no group open."""
        ends = end_offsets(self.cfg, self.topics.turns)
        committed = _committed_offsets(self.cfg, self.cfg.replay_buffer.group_id, self.topics.turns)
        return all(committed.get(p, -1) >= end for p, end in ends.items())

    def delete_topics(self) -> None:
        delete_topics(self.cfg.kafka, self.topics.all())


def _raw_config(
    bootstrap: str, workdir: Path, port: int, partitions: int, concurrency: int, replica_batch: int
) -> dict[str, Any]:
    registry = workdir / "loops.yaml"
    registry.write_text(yaml.safe_dump([{"name": LOOP_NAME, "_target_": LOOP_TARGET}]))
    return {
        "kafka": {
            "bootstrap_servers": bootstrap,
            "topic_prefix": unique_name("f"),
            "partitions": partitions,
        },
        "model": {"name": "tiny-qwen3"},
        # 1 (the default here): decoding is not batch-invariant (see the package docstring)
        "replica_server": {"port": port, "max_batch_size": replica_batch},
        "replicas": {"urls": [f"http://127.0.0.1:{port}"]},
        "rollout": {
            "n": 1,
            "prompt_length": 64,
            "response_length": 64,
            "agent": {"agent_loop_config_path": str(registry)},
        },
        "sessions": {
            "app_id": unique_name("s"),
            "concurrency": concurrency,
            "broker_session_timeout_s": SESSION_TIMEOUT_S,
            "stall_warn_s": STALL_WARN_S,
            "consumer_stall_s": CONSUMER_STALL_S,
        },
        "replay_buffer": {"group_id": unique_name("rb")},
    }


def end_offsets(cfg: Config, topic: str) -> dict[int, int]:
    consumer = Consumer(
        {
            **cfg.kafka.client_settings(),
            "group.id": unique_name("ends"),
            "isolation.level": "read_committed",
            "log_level": 2,
        }
    )
    try:
        return {
            p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10, cached=False)[1]
            for p in range(cfg.kafka.partitions)
        }
    finally:
        consumer.close()


def _committed_offsets(cfg: Config, group_id: str, topic: str) -> dict[int, int]:
    """A group's committed offsets, read without joining the group."""
    consumer = Consumer({**cfg.kafka.client_settings(), "group.id": group_id, "log_level": 2})
    try:
        parts = consumer.committed(
            [TopicPartition(topic, p) for p in range(cfg.kafka.partitions)], timeout=10
        )
        return {tp.partition: tp.offset for tp in parts}
    finally:
        consumer.close()


__all__ = ["Pipeline", "TrajectoryWatcher", "end_offsets"]
