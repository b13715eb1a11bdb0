"""P4: last turn → trainer latency, at a steady moderate rate and at saturation.

A producer thread writes prompt groups' turn events (the synthetic groups of
``tests/synthetic.py``: what the session runner logs, made with an instant scripted
replica, a test double) to rollout.turns, stamping each group's terminal events with the
time they are written, as a session worker does. The replay buffer runs as its own
process (``rolloutbus replay-buffer run``, as in production) and stamps each trajectory
record with its group's last turn time; a trainer client in this process yields the
groups. Latency = the moment the client yields a group − the group's last turn time.

* moderate: ``--rate`` groups/s for ``--seconds`` (one group's events together, as the
  last session of a group finishes);
* saturation: ``--burst`` groups written as fast as the producer can; the latency is then
  mostly queueing (the last group waits for every group before it), and the groups/s the
  pipeline sustained is printed with it.

Printed per phase: groups, p50/p90/p99/max latency in ms, groups/s delivered, and the
replay buffer's CPU µs per event (its process, from psutil). ``--settings KEY=VALUE ...``
passes replay-buffer config keys (e.g. ``replay_buffer.batch_window_s=0.1``), to compare
batching settings in one run: each settings string is one column.

    python benchmarks/latency.py [--rate 10] [--seconds 30] [--burst 1000]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from bench_harness import (
    CpuMeter,
    add_common_args,
    broker,
    drop_topics,
    machine_line,
    quantile,
)

from rolloutbus.config import Config, KafkaConfig
from rolloutbus.consumers.client import TrainerClient
from rolloutbus.kafka.admin import ensure_topics
from rolloutbus.kafka.clients import idempotent_producer
from rolloutbus.schemas.turns import TERMINAL_TYPES, decode_turn_event, encode_turn_event
from rolloutbus.topics import Topics, partition_for
from tests.pipeline import spawn, stop, write_config
from tests.synthetic import group_events

WARMUP_GROUPS = 10  # groups through the pipeline before anything is measured
READY_TIMEOUT_S = 180.0  # seconds for the replay buffer process to start and recover
LINGER_MS = 2  # ms; what a session worker's turn-log producer uses (async_producer.py)


@dataclass
class Phase:
    """What one phase measured."""

    name: str
    latencies_ms: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    events: int = 0
    buffer_cpu_s: float = 0.0

    def row(self) -> str:
        lat = self.latencies_ms
        rate = len(lat) / self.wall_s if self.wall_s else float("nan")
        cpu = self.buffer_cpu_s * 1e6 / self.events if self.events else float("nan")
        return (
            f"{self.name:<12} {len(lat):>6} {quantile(lat, 0.5):>8.1f} {quantile(lat, 0.9):>8.1f} "
            f"{quantile(lat, 0.99):>8.1f} {max(lat, default=float('nan')):>8.1f} "
            f"{rate:>9.1f} {cpu:>12.1f}"
        )


class GroupWriter:
    """Writes whole groups to rollout.turns, terminal events stamped with the write time;
    remembers each group's last turn time by uid."""

    def __init__(self, kafka: KafkaConfig):
        self.kafka = kafka
        self.topic = Topics.from_config(kafka).turns
        self.producer = idempotent_producer(kafka, {"linger.ms": LINGER_MS})
        self.last_turn: dict[str, float] = {}
        self.events = 0

    def write(self, events: list[tuple[str, str, bytes]]) -> None:
        now = time.time()
        for uid, key, value in events:
            if b'"session_finished"' in value or b'"session_failed"' in value:
                event = decode_turn_event(value)
                assert event.type in TERMINAL_TYPES
                value = encode_turn_event(event.model_copy(update={"ts": now}))
            self._produce(uid, key, value)
        self.last_turn[events[0][0]] = now
        self.events += len(events)
        self.producer.poll(0)

    def _produce(self, uid: str, key: str, value: bytes) -> None:
        part = partition_for(uid, self.kafka.partitions)
        while True:
            try:
                self.producer.produce(self.topic, key=key, value=value, partition=part)
                return
            except BufferError:
                self.producer.poll(0.01)

    def flush(self) -> None:
        self.producer.flush(60)


def paced(writer: GroupWriter, groups: list[list], rate: float | None) -> threading.Thread:
    """A thread writing ``groups`` at ``rate`` groups/s (None: as fast as it can)."""

    def run() -> None:
        start = time.monotonic()
        for i, events in enumerate(groups):
            if rate is not None:
                time.sleep(max(0.0, start + i / rate - time.monotonic()))
            writer.write(events)
        writer.flush()

    thread = threading.Thread(target=run, name="group-writer")
    thread.start()
    return thread


def measure(
    client_groups, writer: GroupWriter, groups: list[list], rate: float | None, meter: CpuMeter
) -> Phase:
    phase = Phase("moderate" if rate is not None else "saturation")
    events_before = writer.events
    meter.start()
    thread = paced(writer, groups, rate)
    for _, group in zip(range(len(groups)), client_groups, strict=False):
        phase.latencies_ms.append((time.time() - writer.last_turn[group.uid]) * 1000)
    meter.stop()
    thread.join()
    phase.wall_s = meter.wall_s
    phase.events = writer.events - events_before
    phase.buffer_cpu_s = meter.others_s["replay_buffer"]
    if len(phase.latencies_ms) != len(groups):
        raise SystemExit(f"{phase.name}: {len(phase.latencies_ms)} of {len(groups)} groups came")
    return phase


def run_settings(bootstrap: str, settings: list[str], args, work: Path) -> list[Phase]:
    kafka = KafkaConfig(
        bootstrap_servers=bootstrap, topic_prefix=f"lat{uuid.uuid4().hex[:6]}", partitions=2
    )
    cfg = Config(kafka=kafka)
    ensure_topics(kafka)
    config = write_config(cfg, work / f"{kafka.topic_prefix}.yaml")
    log = work / f"{kafka.topic_prefix}.replay-buffer.log"
    buffer = spawn(["replay-buffer", "run", *settings], config, log)
    writer = GroupWriter(kafka)
    try:
        with TrainerClient(kafka, f"lat-trainer-{uuid.uuid4().hex[:6]}") as client:
            received = client.groups(timeout_s=READY_TIMEOUT_S)
            meter = CpuMeter({"replay_buffer": buffer.pid})
            warm = [group_events(uuid.uuid4().hex) for _ in range(WARMUP_GROUPS)]
            measure(received, writer, warm, None, meter)
            moderate = [group_events(uuid.uuid4().hex) for _ in range(args.moderate_groups)]
            burst = [group_events(uuid.uuid4().hex) for _ in range(args.burst)]
            return [
                measure(received, writer, moderate, args.rate, meter),
                measure(received, writer, burst, None, meter),
            ]
    finally:
        writer.flush()
        del writer
        stop(buffer)
        drop_topics(kafka, Topics.from_config(kafka).all())


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rate", type=float, default=10.0, help="groups/s, moderate phase (10)")
    ap.add_argument("--seconds", type=float, default=30.0, help="moderate phase length (30)")
    ap.add_argument("--burst", type=int, default=1000, help="groups, saturation phase (1000)")
    ap.add_argument(
        "--settings",
        nargs="*",
        default=[""],
        help="replay-buffer config overrides, one string of KEY=VALUE,... per column",
    )
    add_common_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.seconds, args.burst = 3.0, 40
    args.moderate_groups = max(1, int(args.rate * args.seconds))
    results: dict[str, list[Phase]] = {}
    with broker(args.bootstrap) as bus, tempfile.TemporaryDirectory() as tmp:
        for settings in args.settings:
            overrides = [s for s in settings.split(",") if s]
            results[settings or "defaults"] = run_settings(
                bus.bootstrap, overrides, args, Path(tmp)
            )
    print(
        f"last turn -> trainer latency (ms); moderate: {args.rate:g} groups/s for "
        f"{args.seconds:g} s; saturation: {args.burst} groups at once; {machine_line()}"
    )
    for label, phases in results.items():
        print(f"\nreplay buffer settings: {label}")
        print(
            f"{'phase':<12} {'groups':>6} {'p50':>8} {'p90':>8} {'p99':>8} {'max':>8} "
            f"{'groups/s':>9} {'RB us/event':>12}"
        )
        for phase in phases:
            print(phase.row())
    return 0


if __name__ == "__main__":
    sys.exit(main())
