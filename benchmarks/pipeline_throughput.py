"""Turn events through the real broker, the replay buffer and the trainer client, against
plain confluent-kafka produce→consume of the same bytes, in the same run.

Events come from the real session runner path (RecordingLLMClient) driven by an instant
scripted replica (a test double: no model, fixed tokens), so the bytes are exactly what
workers write. Each round runs both pipelines; the table gives medians over rounds.

    python benchmarks/pipeline_throughput.py [--groups 200] [--rounds 3] [--bootstrap HOST:PORT]

Without --bootstrap it starts the embedded broker on free ports in a temporary folder.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from rolloutbus.config import BrokerConfig, Config, KafkaConfig, ReplayBufferConfig
from rolloutbus.consumers.client import TrainerClient
from rolloutbus.kafka.admin import delete_topics, ensure_topics
from rolloutbus.kafka.clients import (
    admin_client,
    consume_records,
    idempotent_producer,
    read_committed_consumer,
)
from rolloutbus.streams.assembly.replay_buffer import ReplayBuffer
from rolloutbus.topics import Topics, partition_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: ``tests``
from tests.helpers import free_port  # noqa: E402
from tests.synthetic import TURNS, N, make_events  # noqa: E402


def produce_all(kafka: KafkaConfig, topic: str, events) -> None:
    p = idempotent_producer(kafka, {"linger.ms": 5})  # ms of batching, as the replay buffer does
    for uid, key, value in events:
        while True:
            try:
                p.produce(
                    topic, key=key, value=value, partition=partition_for(uid, kafka.partitions)
                )
                break
            except BufferError:
                p.poll(0.05)
        p.poll(0)
    p.flush(60)


def run_pipeline(kafka: KafkaConfig, events, groups: int) -> float:
    cfg = Config(
        kafka=kafka,
        replay_buffer=ReplayBufferConfig(
            group_id=f"bench-rb-{uuid.uuid4().hex[:6]}",
            transactional_id=f"bench-tx-{uuid.uuid4().hex[:6]}",
        ),
    )
    buffer = ReplayBuffer(cfg)
    thread = threading.Thread(target=buffer.run, daemon=True)
    thread.start()
    started = time.perf_counter()
    produce_all(kafka, Topics.from_config(kafka).turns, events)
    with TrainerClient(kafka, f"bench-trainer-{uuid.uuid4().hex[:6]}") as client:
        received = sum(1 for _ in client.groups(max_groups=groups, timeout_s=120))
    elapsed = time.perf_counter() - started
    buffer.stop()
    thread.join(30)
    if received != groups:
        raise SystemExit(f"pipeline delivered {received} of {groups} groups")
    return elapsed


def run_baseline(kafka: KafkaConfig, events) -> float:
    # a fresh topic per round: re-creating a just-deleted name races its deletion
    topic = f"{Topics.from_config(kafka).control}-baseline-{uuid.uuid4().hex[:6]}"
    from confluent_kafka.admin import NewTopic

    admin = admin_client(kafka)
    admin.create_topics(
        [
            NewTopic(
                topic,
                kafka.partitions,
                1,
                config={"max.message.bytes": str(kafka.max_message_bytes)},
            )
        ]
    )[topic].result()
    # nothing on this topic is transactional, so read_committed reads what any consumer would
    c = read_committed_consumer(
        kafka, f"bench-base-{uuid.uuid4().hex[:6]}", overrides={"auto.offset.reset": "earliest"}
    )
    _wait_until_visible(c, topic)  # a consumer errors on a topic its broker does not know yet
    c.subscribe([topic])
    started = time.perf_counter()
    produce_all(kafka, topic, events)
    seen = 0
    while seen < len(events):
        seen += len(consume_records(c, 500, 1.0))
    elapsed = time.perf_counter() - started
    c.close()
    admin.delete_topics([topic])
    return elapsed


def _wait_until_visible(consumer, topic: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        meta = consumer.list_topics(topic, timeout=5).topics.get(topic)
        if meta is not None and meta.error is None and meta.partitions:
            if all(p.leader >= 0 for p in meta.partitions.values()):
                return
        time.sleep(0.1)
    raise RuntimeError(f"topic {topic} did not become visible in {timeout_s} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bootstrap", default=None)
    args = ap.parse_args()
    broker_cfg = None
    if args.bootstrap is None:
        from rolloutbus.kafka.broker import start_broker

        port, cport = free_port(), free_port()
        broker_cfg = Config(
            broker=BrokerConfig(
                data_dir=Path(tempfile.mkdtemp()), port=port, controller_port=cport
            ),
            kafka=KafkaConfig(bootstrap_servers=f"127.0.0.1:{port}"),
        )
        print(f"starting a broker on 127.0.0.1:{port}", file=sys.stderr)
        start_broker(broker_cfg)
        args.bootstrap = broker_cfg.kafka.bootstrap_servers
    try:
        print(f"generating {args.groups} groups x {N} sessions x {TURNS} turns", file=sys.stderr)
        events = make_events(args.groups)
        total_bytes = sum(len(v) for _, _, v in events)
        pipe_s, base_s = [], []
        for r in range(args.rounds):
            kafka = KafkaConfig(
                bootstrap_servers=args.bootstrap,
                topic_prefix=f"bench{uuid.uuid4().hex[:6]}",
                partitions=2,
            )
            ensure_topics(kafka)
            base_s.append(run_baseline(kafka, events))
            pipe_s.append(run_pipeline(kafka, events, args.groups))
            delete_topics(kafka, Topics.from_config(kafka).all())
            print(
                f"round {r + 1}: pipeline {pipe_s[-1]:.2f} s, baseline {base_s[-1]:.2f} s",
                file=sys.stderr,
            )
        pm, bm = statistics.median(pipe_s), statistics.median(base_s)
        print(
            f"events: {len(events)} ({total_bytes / 1e6:.1f} MB), groups: {args.groups}, "
            f"trajectories: {args.groups * N}, rounds: {args.rounds}"
        )
        print(f"{'path':<52} {'events/s':>10} {'MB/s':>7} {'groups/s':>9}")
        print(
            f"{'plain confluent-kafka produce->consume (baseline)':<52} {len(events) / bm:>10.0f} "
            f"{total_bytes / 1e6 / bm:>7.1f} {args.groups / bm:>9.1f}"
        )
        print(
            f"{'turns -> replay buffer (txn) -> trainer client':<52} {len(events) / pm:>10.0f} "
            f"{total_bytes / 1e6 / pm:>7.1f} {args.groups / pm:>9.1f}"
        )
        print(f"ratio pipeline/baseline throughput: {bm / pm:.2f}")
    finally:
        if broker_cfg is not None:
            from rolloutbus.kafka.broker import stop_broker

            stop_broker(broker_cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
