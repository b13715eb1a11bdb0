"""Capacity: replay-buffer throughput per CPU-second as replay-buffer processes are added
over the partitions of the turn log (the input of the capacity model, docs/capacity.md).

For each count k in ``--processes``: k ``rolloutbus replay-buffer run`` processes in one
consumer group on a turn log of ``--partitions`` partitions; once every partition is
assigned, ``--groups`` synthetic groups (``tests/synthetic.py``: what the session runner
logs, made with an instant scripted replica, a test double) are written to it as fast as
a producer can, and the clock runs until the group's committed offsets reach the end of
every partition (every group folded, released and committed).

Printed per k: events/s (wall clock), the replay buffers' CPU seconds (user + system, all
k processes), events per replay-buffer CPU-second and per process. On a machine with
fewer cores than processes the wall clock cannot grow with k; what shows the scaling is
that events per CPU-second stays flat: k processes fold k times what one does, given k
cores (they share nothing but the broker).

    python benchmarks/capacity.py [--processes 1 2 4] [--partitions 4] [--groups 1000]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from bench_harness import CpuMeter, add_common_args, broker, drop_topics, machine_line
from confluent_kafka import Consumer, TopicPartition
from pipeline import spawn, stop, write_config
from pipeline_throughput import produce_all
from synthetic import N, make_events

from rolloutbus.config import Config, KafkaConfig, ReplayBufferConfig
from rolloutbus.kafka.admin import ensure_topics
from rolloutbus.kafka.clients import admin_client
from rolloutbus.topics import Topics

READY_TIMEOUT_S = 300.0  # seconds for k processes to start and share the partitions
DONE_TIMEOUT_S = 900.0  # seconds for the log to be folded
POLL_S = 0.2  # seconds between checks of the committed offsets


@dataclass
class Scale:
    processes: int
    events: int
    wall_s: float
    cpu_s: float

    def row(self) -> str:
        per_cpu = self.events / self.cpu_s if self.cpu_s else float("nan")
        return (
            f"replay buffers {self.processes:>3} {self.events / self.wall_s:>10.0f} "
            f"{self.cpu_s:>9.2f} {per_cpu:>14.0f} {1e6 / per_cpu:>12.1f}"
        )


def committed_and_end(kafka: KafkaConfig, group_id: str) -> tuple[list[int], list[int]]:
    topic = Topics.from_config(kafka).turns
    parts = [TopicPartition(topic, p) for p in range(kafka.partitions)]
    consumer = Consumer(
        {**kafka.client_settings(), "group.id": group_id, "isolation.level": "read_committed"}
    )
    try:
        committed = [tp.offset for tp in consumer.committed(parts, timeout=30)]
        ends = [consumer.get_watermark_offsets(tp, timeout=30)[1] for tp in parts]
    finally:
        consumer.close()
    return committed, ends


def wait_assigned(kafka: KafkaConfig, group_id: str, members: int) -> None:
    """Until the group has ``members`` members and every partition is assigned."""
    admin = admin_client(kafka)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        [future] = admin.describe_consumer_groups([group_id]).values()
        try:
            group = future.result()
        except Exception:  # noqa: BLE001 - not known yet: keep waiting
            time.sleep(1.0)
            continue
        assigned = sum(len(m.assignment.topic_partitions) for m in group.members)
        if len(group.members) == members and assigned == kafka.partitions:
            admin.poll(0.5)
            return
        time.sleep(1.0)
    raise SystemExit(f"{members} replay buffers did not share the partitions")


def run_scale(bootstrap: str, k: int, events, args, work: Path) -> Scale:
    kafka = KafkaConfig(
        bootstrap_servers=bootstrap,
        topic_prefix=f"cap{uuid.uuid4().hex[:6]}",
        partitions=args.partitions,
    )
    group_id = f"{kafka.topic_prefix}-rb"
    cfg = Config(kafka=kafka, replay_buffer=ReplayBufferConfig(group_id=group_id))
    ensure_topics(kafka)
    config = write_config(cfg, work / f"{kafka.topic_prefix}.yaml")
    procs = [
        spawn(["replay-buffer", "run"], config, work / f"{kafka.topic_prefix}.{i}.log")
        for i in range(k)
    ]
    try:
        wait_assigned(kafka, group_id, k)
        meter = CpuMeter({f"rb{i}": p.pid for i, p in enumerate(procs)}).start()
        produce_all(kafka, Topics.from_config(kafka).turns, events)
        _wait_folded(kafka, group_id)
        meter.stop()
    finally:
        for p in procs:
            stop(p)
        drop_topics(kafka, Topics.from_config(kafka).all())
    return Scale(k, len(events), meter.wall_s, sum(meter.others_s.values()))


def _wait_folded(kafka: KafkaConfig, group_id: str) -> None:
    deadline = time.monotonic() + DONE_TIMEOUT_S
    while time.monotonic() < deadline:
        committed, ends = committed_and_end(kafka, group_id)
        if all(c >= e for c, e in zip(committed, ends, strict=True)):
            return
        time.sleep(POLL_S)
    raise SystemExit("the replay buffers did not fold the whole log in time")


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--groups", type=int, default=1000)
    add_common_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.processes, args.partitions, args.groups = [1, 2], 2, 40
    events = make_events(args.groups)
    scales = []
    with broker(args.bootstrap) as bus, tempfile.TemporaryDirectory() as tmp:
        for k in args.processes:
            scales.append(run_scale(bus.bootstrap, k, events, args, Path(tmp)))
            print(f"[capacity] {scales[-1].row()}", file=sys.stderr)
    print(
        f"{len(events)} turn events ({args.groups} groups x {N} sessions) on "
        f"{args.partitions} partitions; {machine_line()}"
    )
    print(f"{'':<18} {'events/s':>10} {'CPU s':>9} {'events/CPU-s':>14} {'CPU us/event':>12}")
    for scale in scales:
        print(scale.row())
    return 0


if __name__ == "__main__":
    sys.exit(main())
