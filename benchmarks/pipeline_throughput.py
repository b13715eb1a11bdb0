"""P1: turn events through the real broker, the replay buffer and the trainer client, against
plain confluent-kafka produce→consume of the same bytes, in the same run.

Events come from the real session runner path (RecordingLLMClient) driven by an instant
scripted replica (a test double: no model, fixed tokens), so the bytes are exactly what
workers write. Each round runs both paths on fresh topics, after a warm-up of
``WARMUP_GROUPS`` groups through the same clients (group joins, the replay buffer's
recovery and the first fetches are start-up, not throughput):

* baseline: one producer thread writes the events to a plain topic while a consumer reads
  them back;
* pipeline: the producer thread writes them to rollout.turns while the replay buffer folds
  them into trajectories, transactionally, and a trainer client in this process yields the
  groups. The replay buffer runs as it does in production: its own process
  (``rolloutbus replay-buffer run``), started before the round.

Printed: events/s, MB/s and groups/s (medians over rounds), the ratio pipeline/baseline
(of the median times), and CPU µs per event: the bus's processes (this one: producer and
consumer, or producer and trainer client, librdkafka's threads included; plus the replay
buffer's) and, when the run started the broker, the broker's JVM.

    python benchmarks/pipeline_throughput.py [--groups 2000] [--rounds 3] [--bootstrap HOST:PORT]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from bench_harness import (
    Broker,
    CpuMeter,
    add_common_args,
    broker,
    drop_topics,
    machine_line,
    median,
    produce_all,
    wait_assigned,
)

from rolloutbus.config import Config, KafkaConfig, ReplayBufferConfig
from rolloutbus.consumers.client import TrainerClient
from rolloutbus.kafka.admin import ensure_topics
from rolloutbus.kafka.clients import (
    admin_client,
    consume_records,
    read_committed_consumer,
)
from rolloutbus.topics import Topics
from tests.pipeline import spawn, stop, write_config
from tests.synthetic import TURNS, N, make_events

WARMUP_GROUPS = 20  # groups through each path before the clock starts
READY_TIMEOUT_S = 120.0  # seconds for the warm-up (group joins on a busy machine)
PARTITIONS = 2

Event = tuple[str, str, bytes]  # uid, key, value


@dataclass
class Run:
    """One path in one round: wall seconds and CPU seconds (this process, the broker)."""

    wall_s: float
    own_cpu_s: float
    broker_cpu_s: float
    replay_buffer_cpu_s: float = float("nan")  # the replay-buffer processes' share of own_cpu_s


def _producer_thread(kafka: KafkaConfig, topic: str, events: list[Event]) -> threading.Thread:
    thread = threading.Thread(target=produce_all, args=(kafka, topic, events), name="producer")
    thread.start()
    return thread


def run_pipeline(
    kafka: KafkaConfig,
    warmup: list[Event],
    events: list[Event],
    groups: int,
    bus: Broker,
    work: Path,
    settings: list[str],
    replay_buffers: int = 1,
) -> Run:
    group_id = f"{kafka.topic_prefix}-rb"
    cfg = Config(kafka=kafka, replay_buffer=ReplayBufferConfig(group_id=group_id))
    config = write_config(cfg, work / f"{kafka.topic_prefix}.yaml")
    buffers = [
        spawn(["replay-buffer", "run", *settings], config, work / f"{kafka.topic_prefix}.rb{i}.log")
        for i in range(replay_buffers)
    ]
    topic = Topics.from_config(kafka).turns
    try:
        wait_assigned(kafka, group_id, replay_buffers)
        with TrainerClient(kafka, f"bench-trainer-{uuid.uuid4().hex[:6]}") as client:
            received = client.groups(timeout_s=READY_TIMEOUT_S)
            _producer_thread(kafka, topic, warmup).join()
            _take(received, WARMUP_GROUPS, "warm-up")
            pids = {f"rb{i}": b.pid for i, b in enumerate(buffers)}
            meter = CpuMeter({"broker": bus.pid, **pids}).start()
            producer = _producer_thread(kafka, topic, events)
            _take(received, groups, "pipeline")
            meter.stop()
            producer.join()
    finally:
        for buffer in buffers:
            stop(buffer)
    buffers_cpu = sum(meter.others_s[name] for name in pids)
    return Run(meter.wall_s, meter.own_s + buffers_cpu, meter.others_s["broker"], buffers_cpu)


def _take(received, count: int, what: str) -> None:
    got = sum(1 for _, _ in zip(range(count), received, strict=False))
    if got != count:
        raise SystemExit(f"{what}: the trainer client received {got} of {count} groups")


def run_baseline(kafka: KafkaConfig, warmup: list[Event], events: list[Event], bus: Broker) -> Run:
    # a fresh topic per round: re-creating a just-deleted name races its deletion
    topic = f"{Topics.from_config(kafka).control}-baseline-{uuid.uuid4().hex[:6]}"
    _create_topic(kafka, topic)
    # nothing on this topic is transactional, so read_committed reads what any consumer would
    c = read_committed_consumer(
        kafka, f"bench-base-{uuid.uuid4().hex[:6]}", overrides={"auto.offset.reset": "earliest"}
    )
    try:
        _wait_until_visible(c, topic)  # a consumer errors on a topic its broker does not know
        c.subscribe([topic])
        _producer_thread(kafka, topic, warmup).join()
        _consume(c, len(warmup))
        meter = CpuMeter({"broker": bus.pid}).start()
        producer = _producer_thread(kafka, topic, events)
        _consume(c, len(events))
        meter.stop()
        producer.join()
    finally:
        c.close()
        drop_topics(kafka, [topic])
    return Run(meter.wall_s, meter.own_s, meter.others_s["broker"])


def _consume(consumer, count: int) -> None:
    seen, deadline = 0, time.monotonic() + READY_TIMEOUT_S
    while seen < count:
        if time.monotonic() > deadline:
            raise SystemExit(f"baseline: consumed {seen} of {count} records")
        seen += len(consume_records(consumer, 500, 1.0))


def _wait_until_visible(consumer, topic: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        meta = consumer.list_topics(topic, timeout=5).topics.get(topic)
        if meta is not None and meta.error is None and meta.partitions:
            if all(p.leader >= 0 for p in meta.partitions.values()):
                return
        time.sleep(0.1)
    raise SystemExit(f"topic {topic} did not become visible in {timeout_s} s")


def _create_topic(kafka: KafkaConfig, topic: str) -> None:
    from confluent_kafka.admin import NewTopic

    config = {"max.message.bytes": str(kafka.max_message_bytes)}
    admin = admin_client(kafka)
    admin.create_topics([NewTopic(topic, kafka.partitions, 1, config=config)])[topic].result()


def print_table(args, events: list[Event], pipe: list[Run], base: list[Run], bus: Broker) -> None:
    total_bytes = sum(len(v) for _, _, v in events)
    n = len(events)
    print(
        f"events: {n} ({total_bytes / 1e6:.1f} MB), groups: {args.groups}, "
        f"trajectories: {args.groups * N}, rounds: {args.rounds}, replay-buffer processes: "
        f"{args.replay_buffers}; {machine_line()}"
    )
    print(
        f"{'path':<50} {'events/s':>9} {'MB/s':>6} {'groups/s':>9} "
        f"{'bus CPU us/event':>17} {'broker CPU us/event':>20}"
    )
    for label, runs in (
        ("plain confluent-kafka produce->consume (baseline)", base),
        ("turns -> replay buffer (txn) -> trainer client", pipe),
    ):
        wall = median([r.wall_s for r in runs])
        own = median([r.own_cpu_s for r in runs]) * 1e6 / n
        broker_cpu = median([r.broker_cpu_s for r in runs]) * 1e6 / n if bus.pid else float("nan")
        print(
            f"{label:<50} {n / wall:>9.0f} {total_bytes / 1e6 / wall:>6.1f} "
            f"{args.groups / wall:>9.1f} {own:>17.1f} {broker_cpu:>20.1f}"
        )
    buffers = median([r.replay_buffer_cpu_s for r in pipe]) * 1e6 / n
    print(
        f"of the pipeline's bus CPU: replay buffer {buffers:.1f} us/event, "
        "producer and trainer client (this process) the rest"
    )
    ratio = median([r.wall_s for r in base]) / median([r.wall_s for r in pipe])
    print(f"ratio pipeline/baseline throughput: {ratio:.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--settings",
        nargs="*",
        default=[],
        help="replay-buffer config overrides (KEY=VALUE), e.g. replay_buffer.batch_max_records=500",
    )
    ap.add_argument(
        "--replay-buffers",
        type=int,
        default=1,
        help=f"replay-buffer processes sharing the {PARTITIONS} partitions (1)",
    )
    add_common_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.groups, args.rounds = 40, 1
    print(f"generating {args.groups} groups x {N} sessions x {TURNS} turns", file=sys.stderr)
    events = make_events(args.groups)
    warmup = make_events(WARMUP_GROUPS)
    with broker(args.bootstrap) as bus, tempfile.TemporaryDirectory() as tmp:
        pipe: list[Run] = []
        base: list[Run] = []
        for r in range(args.rounds):
            kafka = KafkaConfig(
                bootstrap_servers=bus.bootstrap,
                topic_prefix=f"bench{uuid.uuid4().hex[:6]}",
                partitions=PARTITIONS,
            )
            ensure_topics(kafka)
            try:
                base.append(run_baseline(kafka, warmup, events, bus))
                pipe.append(
                    run_pipeline(
                        kafka,
                        warmup,
                        events,
                        args.groups,
                        bus,
                        Path(tmp),
                        args.settings,
                        args.replay_buffers,
                    )
                )
            finally:
                drop_topics(kafka, Topics.from_config(kafka).all())
            print(
                f"round {r + 1}: pipeline {pipe[-1].wall_s:.2f} s, "
                f"baseline {base[-1].wall_s:.2f} s",
                file=sys.stderr,
            )
        print_table(args, events, pipe, base, bus)
    return 0


if __name__ == "__main__":
    sys.exit(main())
