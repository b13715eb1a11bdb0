"""Capacity: replay-buffer throughput per CPU-second as replay-buffer processes are added
over the partitions of the turn log (the input of the capacity model, docs/capacity.md).

For each count k in ``--processes``: k ``rolloutbus replay-buffer run`` processes in one
consumer group on a turn log of ``--partitions`` partitions; once every partition is
assigned, ``--groups`` synthetic groups (``tests/synthetic.py``: what the session runner
logs, made with an instant scripted replica, a test double) are written to it as fast as
a producer can, and the clock runs until the group's committed offsets reach the end of
every partition (every group folded, released and committed).

Printed per k: events/s (wall clock), the replay buffers' CPU seconds (user + system, all
k processes), events per replay-buffer CPU-second and CPU µs per event. On a machine with
fewer cores than processes the wall clock cannot grow with k; what shows the scaling is
that events per CPU-second stays flat: k processes fold k times what one does, given k
cores (they share nothing but the broker).

Then, with one process, the same groups with more sampled tokens per turn
(``--gen-tokens``), to split the replay buffer's cost into a part per event and a part
per sampled token; and a trainer client's CPU per trajectory received (this process,
reading every trajectory of the run once the log is folded).

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

from bench_harness import (
    CpuMeter,
    add_common_args,
    broker,
    drop_topics,
    machine_line,
    produce_all,
    wait_assigned,
)
from confluent_kafka import Consumer, TopicPartition

from rolloutbus.config import Config, KafkaConfig, ReplayBufferConfig
from rolloutbus.consumers.client import TrainerClient
from rolloutbus.kafka.admin import ensure_topics
from rolloutbus.topics import Topics
from tests.pipeline import spawn, stop, write_config
from tests.synthetic import GEN_TOKENS, TURNS, N, make_events

DONE_TIMEOUT_S = 900.0  # seconds for the log to be folded
POLL_S = 0.2  # seconds between checks of the committed offsets


@dataclass
class Scale:
    processes: int
    events: int
    wall_s: float
    cpu_s: float
    gen_tokens: int = GEN_TOKENS  # sampled tokens per turn
    sampled: int = 0  # sampled tokens in the run
    trainer_cpu_s: float = 0.0  # a trainer client reading every trajectory
    trajectories: int = 0

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


def run_scale(
    bootstrap: str, k: int, events, args, work: Path, gen_tokens: int = GEN_TOKENS
) -> Scale:
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
        for p in procs:
            stop(p)
        trainer = CpuMeter().start()
        trajectories = _receive_all(kafka, args.groups)
        trainer.stop()
    finally:
        for p in procs:
            stop(p)
        drop_topics(kafka, Topics.from_config(kafka).all())
    sampled = args.groups * N * TURNS * gen_tokens
    return Scale(
        k,
        len(events),
        meter.wall_s,
        sum(meter.others_s.values()),
        gen_tokens,
        sampled,
        trainer.own_s,
        trajectories,
    )


def _receive_all(kafka: KafkaConfig, groups: int) -> int:
    """Every group on the trajectory topic, through a trainer client: its trajectories."""
    with TrainerClient(kafka, f"{kafka.topic_prefix}-trainer") as client:
        received = list(zip(range(groups), client.groups(timeout_s=60), strict=False))
    if len(received) != groups:
        raise SystemExit(f"the trainer client received {len(received)} of {groups} groups")
    return sum(len(group) for _, group in received)


def _wait_folded(kafka: KafkaConfig, group_id: str) -> None:
    deadline = time.monotonic() + DONE_TIMEOUT_S
    while time.monotonic() < deadline:
        committed, ends = committed_and_end(kafka, group_id)
        if all(c >= e for c, e in zip(committed, ends, strict=True)):
            return
        time.sleep(POLL_S)
    raise SystemExit("the replay buffers did not fold the whole log in time")


def per_event_and_token(one: Scale, other: Scale) -> tuple[float, float]:
    """(µs per event, µs per sampled token) of one replay buffer, from two runs whose events
    carry different numbers of tokens: cpu/event = a + b * sampled tokens/event."""
    x1, y1 = one.sampled / one.events, one.cpu_s * 1e6 / one.events
    x2, y2 = other.sampled / other.events, other.cpu_s * 1e6 / other.events
    b = (y2 - y1) / (x2 - x1)
    return y1 - b * x1, b


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--groups", type=int, default=1000)
    ap.add_argument(
        "--gen-tokens", type=int, default=1024, help="sampled tokens per turn, second run"
    )
    add_common_args(ap)
    args = ap.parse_args()
    if args.quick:  # two processes sharing the partitions: the path a scale-out takes
        args.processes, args.partitions, args.groups, args.gen_tokens = [2], 2, 40, 512
    events = make_events(args.groups)
    scales = []
    with broker(args.bootstrap) as bus, tempfile.TemporaryDirectory() as tmp:
        for k in args.processes:
            scales.append(run_scale(bus.bootstrap, k, events, args, Path(tmp)))
            print(f"[capacity] {scales[-1].row()}", file=sys.stderr)
        del events
        bigger = make_events(args.groups, gen_tokens=args.gen_tokens)
        tokens = run_scale(bus.bootstrap, 1, bigger, args, Path(tmp), args.gen_tokens)
    print(
        f"{scales[0].events} turn events ({args.groups} groups x {N} sessions x {TURNS} turns "
        f"of {GEN_TOKENS} sampled tokens) on {args.partitions} partitions; {machine_line()}"
    )
    print(f"{'':<18} {'events/s':>10} {'CPU s':>9} {'events/CPU-s':>14} {'CPU us/event':>12}")
    for scale in scales:
        print(scale.row())
    a, b = per_event_and_token(scales[0], tokens)
    print(
        f"\none replay buffer, {args.gen_tokens} sampled tokens per turn: "
        f"{tokens.cpu_s * 1e6 / tokens.events:.1f} us/event; so per event {a:.1f} us "
        f"+ per sampled token {b * 1000:.2f} ns"
    )
    for scale in (scales[0], tokens):
        print(
            f"trainer client ({scale.gen_tokens} tokens per turn): "
            f"{scale.trainer_cpu_s * 1e6 / scale.trajectories:.0f} us per trajectory, "
            f"{scale.trainer_cpu_s * 1e6 / scale.events:.1f} us per turn event"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
