"""Fault rows at the edges of the cluster (``tests/faults/`` pieces, its table):

- **poison on every topic**: junk written to prompts, turns, trajectories, released and
  control while a run goes on, and released records forged for a group still running and
  for a uid that never started, read back by a replay buffer stopped and started around
  them. Every junk record becomes a dead letter of the stage that read it (the control
  readers ignore theirs); nothing is lost, duplicated or sampled twice, and the trainer
  client receives every group once.
- **a leader kill on 3 brokers**: the pipeline on a local 3-node KRaft cluster (topics with
  three replicas, min.insync.replicas 2); the node leading a partition of rollout.turns is
  SIGKILLed mid-run and started again later. Nothing is lost, duplicated or re-sampled.

Lean workloads (a few dozen groups): what they prove is fixed by where the fault lands, not
by the volume. This is fault injection, not a test double: real processes, real brokers.
"""

from __future__ import annotations

import base64
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, TopicPartition

from rolloutbus.broker.embedded import kill_node, start_broker
from rolloutbus.config import Config
from rolloutbus.consumers.client import TrainerClient
from rolloutbus.errors import RolloutBusError
from rolloutbus.kafka.clients import idempotent_producer, record_location
from rolloutbus.kafka.control import latest_policy_version
from rolloutbus.schemas.trajectories import decode_trajectory_batch
from rolloutbus.schemas.turns import decode_turn_event
from rolloutbus.streams.assembly.released import ReleasedRecord
from tests.cluster import local_cluster
from tests.faults import (
    ROWS,
    FaultContext,
    FaultRow,
    Pipeline,
    Service,
    Workload,
    run_fault_scenario,
    turn_log_counts,
)
from tests.helpers import unique_name
from tests.pipeline import dead_letters, read_topic

fault_scenario = pytest.mark.slow  # and kafka: every row needs a broker

POISON_WORKLOAD = Workload(groups=16, n=4, turns=3, tokens_per_turn=2, tool_delay_s=0.25)
CLUSTER_WORKLOAD = Workload(groups=24, n=4, turns=3, tokens_per_turn=2, tool_delay_s=0.25)
RUN_TIMEOUT_S = 600.0  # seconds for every key to arrive (restarts, leader elections)
SETTLE_TIMEOUT_S = 90.0  # seconds for the replay buffer to fold the turn log to its end
SETTLE_STABLE_S = 3.0  # seconds the turn log must stay unchanged to count as settled
TRAINER_IDLE_S = 15.0  # seconds without a record before the trainer client's read ends
POLL_S = 0.5

# junk as another writer might leave it: not JSON, the wrong JSON, another topic's record
JUNK = [b"\x00\xffnot json", b"{}", b'{"uid": 5, "n": "four"}', b"[1, 2, 3]"]


# -- poison -----------------------------------------------------------------------------------


@dataclass
class Poison:
    """The junk written during a run, by topic: the source (topic[partition]@offset) of each."""

    sources: dict[str, list[str]] = field(default_factory=dict)
    forged_for: str = ""  # the running group a forged released record named

    def add(self, kind: str, source: str) -> None:
        self.sources.setdefault(kind, []).append(source)


def _produce(cfg: Config, records: list[tuple[str, int, bytes, bytes]]) -> list[str]:
    """(topic, partition, key, value) records, delivered; their sources."""
    sources: list[str] = []
    producer = idempotent_producer(cfg.kafka)
    for topic, partition, key, value in records:
        producer.produce(
            topic,
            key=key,
            value=value,
            partition=partition,
            on_delivery=lambda err, msg: sources.append(
                record_location(msg.topic(), msg.partition(), msg.offset())
            ),
        )
    assert producer.flush(30.0) == 0 and len(sources) == len(records)
    return sources


def _junk_everywhere(ctx: FaultContext, poison: Poison) -> None:
    """Junk on prompts, turns, trajectories and control, on every partition, mid-run."""
    cfg, topics = ctx.pipeline.cfg, ctx.pipeline.topics
    parts = range(cfg.kafka.partitions)
    for kind, topic in (
        ("prompts", topics.prompts),
        ("turns", topics.turns),
        ("trajectories", topics.trajectories),
    ):
        records = [(topic, p, f"junk{i}".encode(), v) for p in parts for i, v in enumerate(JUNK)]
        for source in _produce(cfg, records):
            poison.add(kind, source)
    # the control topic is compacted: a record needs a key, so junk comes keyed
    control = [(topics.control, 0, f"junk{i}".encode(), v) for i, v in enumerate(JUNK)]
    for source in _produce(cfg, control):
        poison.add("control", source)
    ctx.note(f"junk on every topic: {sum(map(len, poison.sources.values()))} records")


def _forge_released(ctx: FaultContext, poison: Poison, buffer: Service) -> None:
    """Stop the replay buffer; forge released records for a group still running and for a
    uid that never started, each naming a turn-log offset past the buffer's committed one
    (so the restarted buffer's fold passes it and must refuse it), plus junk. The caller
    starts the buffer again (``_restart``)."""
    cfg, topics = ctx.pipeline.cfg, ctx.pipeline.topics
    # stopped, not killed: it leaves its group at once, so its next start is assigned the
    # partitions without waiting out a dead member's session (the kill rows measure that)
    buffer.stop()
    ctx.note(f"stopped {buffer.name}")
    committed = _committed(cfg, cfg.replay_buffer.group_id, topics.turns)
    released_keys = set(ctx.pipeline.watcher.keys)
    log = [m for m in read_topic(cfg, topics.turns) if _is_event(m)]
    for part in range(cfg.kafka.partitions):
        events = [
            (m.offset(), decode_turn_event(m.value()).uid)
            for m in log
            if m.partition() == part and m.offset() >= committed.get(part, 0)
        ]
        live = [
            uid for _, uid in events if not any(key.startswith(f"{uid}_") for key in released_keys)
        ]
        if not live:
            continue
        victim = live[-1]
        # an offset holding another group's event: the claim names it as the victim's start
        other = next((offset for offset, uid in events if uid != victim), None)
        if other is None:
            continue
        forged = [
            ReleasedRecord(
                uid=uid,
                partition=part,
                trajectories=ctx.workload.n,
                turns_first_offset=other,
                turns_last_offset=events[-1][0],
            )
            for uid in (victim, "neverstarted")
        ]
        records = [(topics.released, part, r.uid.encode(), r.encode()) for r in forged]
        records.append((topics.released, part, b"junk", JUNK[0]))
        for source in _produce(cfg, records):
            poison.add("released", source)
        poison.forged_for = victim
        ctx.note(f"forged released records for running {victim} and for a uid never started")
        break
    assert poison.forged_for, (
        "no group was unreleased when the replay buffer went down (the run outpaced the "
        f"fault: committed {committed}, {len(released_keys)} keys released)"
    )


def _restart(ctx: FaultContext, buffer: Service) -> None:
    with buffer.lock:  # back, as a supervisor would start it
        buffer.retired = False
        buffer.start()
    ctx.note(f"started {buffer.name} again")


def _is_event(msg: Any) -> bool:
    try:
        decode_turn_event(msg.value() or b"")
    except (ValueError, RolloutBusError):
        return False
    return True


def _committed(cfg: Config, group_id: str, topic: str) -> dict[int, int]:
    consumer = Consumer({**cfg.kafka.client_settings(), "group.id": group_id, "log_level": 2})
    try:
        parts = [TopicPartition(topic, p) for p in range(cfg.kafka.partitions)]
        return {tp.partition: tp.offset for tp in consumer.committed(parts, timeout=10)}
    finally:
        consumer.close()


def _end_offsets(cfg: Config, topic: str) -> dict[int, int]:
    consumer = Consumer({**cfg.kafka.client_settings(), "group.id": unique_name("ends")})
    try:
        return {
            p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10, cached=False)[1]
            for p in range(cfg.kafka.partitions)
        }
    finally:
        consumer.close()


def _settle(pipeline: Pipeline) -> bool:
    """The replay buffer folded the turn log to its end, and it stopped growing."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    stable_since, last = time.monotonic(), None
    while time.monotonic() < deadline:
        ends = _end_offsets(pipeline.cfg, pipeline.topics.turns)
        if ends != last:
            stable_since, last = time.monotonic(), ends
        elif time.monotonic() - stable_since >= SETTLE_STABLE_S and pipeline.turn_log_settled():
            return True
        time.sleep(POLL_S)
    return False


@dataclass
class PoisonRun:
    row: FaultRow
    poison: Poison
    letters: list[dict[str, Any]]
    trained: Counter[str]  # uid -> times the trainer client yielded its group
    group_sizes: set[int]
    control_version: Any
    logs: dict[str, str]

    def explain(self) -> str:
        lines = [str(self.row), f"junk: {self.poison.sources}"]
        lines += [f"letter {d['stage']} {d['source']}: {d['reason'][:160]}" for d in self.letters]
        for name, tail in self.logs.items():
            lines += [f"--- {name} ---", tail]
        return "\n".join(lines)


def run_poison_row(bootstrap: str, workdir: Path, workload: Workload) -> PoisonRun:
    """The pipeline with junk written on every topic mid-run; measured like the harness's
    rows, except that the trajectory topic holds junk too (read through the trainer client,
    which dead-letters it)."""
    started = time.monotonic()
    row = FaultRow("poison on every topic", expected=workload.sessions)
    pipeline = Pipeline(bootstrap, workdir)
    ctx = FaultContext(pipeline, workload, random.Random(0), started + RUN_TIMEOUT_S)
    poison = Poison()
    try:
        pipeline.start()
        pipeline.publish(workload)
        ctx.note(f"published {workload.groups} groups x {workload.n}")
        ctx.wait_for_fraction(0.25)
        # the buffer goes down first, while groups are surely running (a quiet machine
        # finished every group while the junk was still being written); the junk waits
        # for it on the topics
        _forge_released(ctx, poison, pipeline.buffers[0])
        _junk_everywhere(ctx, poison)
        _restart(ctx, pipeline.buffers[0])
        ctx.wait_for_released(workload.sessions)
        ctx.note("every key arrived")
        if _settle(pipeline):
            ctx.note("turn log folded to its end")
        else:
            row.notes.append(f"turn log not folded to its end within {SETTLE_TIMEOUT_S:.0f} s")
    finally:
        pipeline.close()
    run = _measure_poison(pipeline, workload, row, poison)
    row.wall_s = time.monotonic() - started
    row.notes += _poison_notes(run)
    ROWS.append(row)
    pipeline.delete_topics()
    return run


def _measure_poison(pipeline: Pipeline, workload: Workload, row: FaultRow, poison: Poison):
    cfg, topics = pipeline.cfg, pipeline.topics
    keys: Counter[str] = Counter()
    for msg in read_topic(cfg, topics.trajectories):
        try:
            decode_trajectory_batch(msg.value() or b"")
        except (ValueError, RolloutBusError):
            continue  # the junk: counted by its dead letter below
        keys[(msg.key() or b"").decode()] += 1
    expected = workload.expected_keys()
    row.lost = len(expected - set(keys))
    row.duplicated = sum(1 for count in keys.values() if count > 1)
    events = [m for m in read_topic(cfg, topics.turns) if _is_event(m)]
    turn_log_counts([decode_turn_event(m.value()) for m in events], row)
    trained, sizes = _train(cfg)
    letters = dead_letters(cfg)
    row.dead_letters = len({(d["stage"], d["source"]) for d in letters})
    row.restarts = sum(s.restarts for s in pipeline.services())
    logs = {s.name: s.log_tail() for s in pipeline.services()}
    return PoisonRun(row, poison, letters, trained, sizes, latest_policy_version(cfg), logs)


def _train(cfg: Config) -> tuple[Counter[str], set[int]]:
    """Every group as the trainer client yields it (it dead-letters the junk)."""
    trained: Counter[str] = Counter()
    sizes: set[int] = set()
    with TrainerClient(cfg.kafka, unique_name("trainer")) as client:
        for group in client.groups(timeout_s=TRAINER_IDLE_S):
            trained[group.uid] += 1
            sizes.add(len(group))
    return trained, sizes


def _poison_notes(run: PoisonRun) -> list[str]:
    lettered = {d["source"] for d in run.letters}
    parts = []
    for kind, sources in run.poison.sources.items():
        got = sum(1 for s in sources if s in lettered)
        parts.append(f"{kind} {got}/{len(sources)}")
    return [f"junk dead-lettered by topic: {', '.join(parts)} (control: ignored by its readers)"]


@fault_scenario
def test_poison_on_every_topic(kafka_bootstrap: str, tmp_path: Path) -> None:
    run = run_poison_row(kafka_bootstrap, tmp_path, POISON_WORKLOAD)
    row = run.row
    assert (row.lost, row.duplicated, row.resampled) == (0, 0, 0), run.explain()
    assert set(run.trained) == set(POISON_WORKLOAD.uids()), run.explain()
    assert set(run.trained.values()) == {1} and run.group_sizes == {POISON_WORKLOAD.n}
    by_source: dict[str, set[str]] = {}
    for letter in run.letters:
        by_source.setdefault(letter["source"], set()).add(letter["stage"])
    stage_of = {
        "prompts": "sessions",
        "turns": "replay_buffer",
        "trajectories": "trainer",
        "released": "replay_buffer",
    }
    for kind, stage in stage_of.items():
        for source in run.poison.sources[kind]:
            assert stage in by_source.get(source, set()), (
                f"{kind} junk at {source}: no dead letter from {stage}\n{run.explain()}"
            )
    forged = [d for d in run.letters if f"uid {run.poison.forged_for} claims" in d["reason"]]
    assert forged, f"the forged released record was obeyed\n{run.explain()}"
    assert base64.b64decode(forged[0]["original_b64"]).startswith(b"{")
    # the control readers skip what is not a policy version: none was ever published
    assert run.control_version is None
    assert len(run.poison.sources["control"]) == len(JUNK)


# -- a leader kill on three brokers -------------------------------------------------------------


def kill_a_turns_leader(ctx: FaultContext) -> None:
    """SIGKILL the node leading rollout.turns partition 0 a third into the run; start it
    again two thirds in (its replicas catch up, the ISR is whole again)."""
    assert ctx.broker is not None
    ctx.wait_for_fraction(0.3)
    leader = _leader(ctx.pipeline.cfg, ctx.pipeline.topics.turns, 0)
    pid = kill_node(ctx.broker, leader)
    ctx.kills += 1
    ctx.note(f"SIGKILL broker node {leader} (pid {pid}), leader of turns[0]")
    ctx.wait_for_fraction(0.65)
    start_broker(ctx.broker)
    ctx.note(f"broker node {leader} started again")


def _leader(cfg: Config, topic: str, partition: int) -> int:
    from confluent_kafka.admin import AdminClient

    meta = AdminClient(cfg.kafka.client_settings()).list_topics(topic, timeout=10)
    return meta.topics[topic].partitions[partition].leader


@fault_scenario
def test_a_leader_kill_on_three_brokers(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    with local_cluster(tmp_path / "kafka") as cluster:
        run = run_fault_scenario(
            "a leader kill on 3 brokers",
            bootstrap=cluster.kafka.bootstrap_servers,
            workdir=tmp_path / "run",
            workload=CLUSTER_WORKLOAD,
            scenario=kill_a_turns_leader,
            broker=cluster,
        )
    row = run.row
    assert row.lost == 0, f"{row.lost} trajectories lost\n{run.explain()}"
    assert row.duplicated == 0, f"{row.duplicated} keys written twice\n{run.explain()}"
    assert row.resampled == 0, f"{row.resampled} logged turns sampled again\n{run.explain()}"
    assert row.failed == 0, run.explain()
    assert any("SIGKILL broker node" in line for line in run.timeline), run.explain()
