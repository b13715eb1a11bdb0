"""A fault injector for the whole pipeline: real processes, one fault scenario, one table row.

A run starts, on its own topic prefix, one embedded replica (tiny-qwen3), M replay buffers
and K session workers through the ``rolloutbus`` command line; publishes G prompt groups
of ``tests/fixtures/seeded_paced_loop.py`` (n sessions each); hands the running processes
and the broker to a *scenario* (a callable that kills, restarts, adds processes or stops
the broker); waits until every trajectory key arrived on rollout.trajectories and the
replay buffer has folded the whole turn log; stops everything and measures:

- ``expected``: G x n sessions (one output each, so one trajectory key each);
- ``attempts``: session attempts started in the turn log (more than expected when
  sessions were resumed or run again);
- ``lost``: expected keys missing from rollout.trajectories (read_committed);
- ``duplicated``: keys on rollout.trajectories more than once;
- ``resumed``: resumed sessions (``session_started.resumed_from``) that replayed at least
  one logged generation, each replayed one equal to the logged one by engine_request_id
  and token ids: resumed without re-sampling;
- ``resampled``: turns sampled more than once, from the turn log: for each (uid,
  session, turn) the distinct engine request ids beyond the first (the LLM client draws a
  fresh engine request id per call, and a replayed turn keeps the logged one);
- ``failed``: trajectories released with status ``failed``;
- ``dead letters``: records on rollout.dlq;
- ``restarts``: processes the harness restarted after they exited, as a supervisor
  (systemd, Kubernetes) would; every process is supervised;
- ``differ``: trajectories not equal, column for column, to the fault-free reference run.

This is a fault injector: it stands in for the operators and machines that kill
processes in production. Nothing in it is a test double of the product.

**Comparing with a fault-free run.** Every turn of the fixture loop asks the replica for
a seed derived from (uid, session_id, turn), and the rows carry their own ``uid`` column,
so a fault run and the reference publish the same uids and every turn, sampled once or
again after a crash, gets the same tokens. The embedded replica is not batch-invariant:
a row's logits depend on what else is in its decode batch (float summation order and
left padding), measured on tiny-qwen3 with 24 seeded requests: max_batch_size 1 twice
gave bit-identical tokens and logprobs; max_batch_size 8 against 1 changed logprobs of
17/24 requests (by up to 1e-6, or 0.14 where a token changed) and the tokens of 1/24.
So the runs use ``replica_server.max_batch_size: 1``. Every trajectory column is
compared except ``attempt``: attempt ids are random by design (a resumed or re-run
session gets a fresh one, and so does every session of every run).
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from confluent_kafka import Consumer, TopicPartition
from helpers import free_port, unique_name
from pipeline import read_topic, wait_http_ok

from rolloutbus.config import BrokerConfig, Config, KafkaConfig, ReplayBufferConfig, load_config
from rolloutbus.errors import BrokerError
from rolloutbus.kafka.admin import delete_topics, ensure_topics
from rolloutbus.kafka.broker import start_broker, stop_broker
from rolloutbus.producers.datasets import write_jsonl
from rolloutbus.producers.publish import PromptPublisher
from rolloutbus.schemas.trajectories import decode_trajectory_batch
from rolloutbus.schemas.turns import decode_turn_event
from rolloutbus.topics import Topics, trajectory_key

FIXTURES = Path(__file__).parent / "fixtures"
LOOP_NAME = "seededpaced"
LOOP_TARGET = "seeded_paced_loop.SeededPacedLoop"
NOT_COMPARED = ("attempt",)  # random by design: see the module docstring

# sessions.broker_session_timeout_s: how long a SIGKILLed worker's partitions stay
# unassigned after every kill; 10 s is still over 3 heartbeats (3 s each)
SESSION_TIMEOUT_S = 10.0
WORKER_ENV: dict[str, str] = {}
RESTART_DELAY_S = 1.0  # seconds before a supervisor restarts a process that exited
RESTART_DELAY_MAX_S = 8.0  # seconds; the delay doubles while a process keeps exiting fast
CRASH_LOOP_S = 15.0  # seconds; an exit sooner than this after a start doubles the delay
STOP_TIMEOUT_S = 30.0  # seconds for a SIGTERMed process to exit before SIGKILL
COMPLETION_TIMEOUT_S = 600.0  # seconds for every key to arrive (restarts, rebalances)
SETTLE_TIMEOUT_S = 90.0  # seconds for the replay buffer to fold the whole turn log
SETTLE_STABLE_S = 3.0  # seconds the turn log must stay unchanged to count as settled
POLL_S = 0.5  # seconds between progress checks
PORT_RETRIES = 3  # a free port can be taken before the broker's JVM binds it
ERROR_CHARS = 200  # characters of a failed trajectory's error kept in a row's notes

ROWS: list[FaultRow] = []  # every row measured in this test session; conftest prints them


# -- the workload ----------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """G prompt groups of the seeded paced loop, n sessions each."""

    groups: int = 100
    n: int = 4
    turns: int = 3
    tokens_per_turn: int = 2
    tool_delay_s: float = 0.25  # seconds; a session waits this long between its turns

    def uids(self) -> list[str]:
        return [f"fault{i:05d}" for i in range(self.groups)]  # no "_": the key separator

    def expected_keys(self) -> set[str]:
        return {trajectory_key(uid, sid, 0) for uid in self.uids() for sid in range(self.n)}

    @property
    def sessions(self) -> int:
        return self.groups * self.n

    def rows(self) -> list[dict[str, Any]]:
        return [
            {
                "uid": uid,
                "__rollout_n__": self.n,
                "data_source": "faults",
                "agent_name": LOOP_NAME,
                "prompt": [{"role": "user", "content": f"count to {i}"}],
                "extra_info": {
                    "index": i,
                    "turns": self.turns,
                    "tokens_per_turn": self.tokens_per_turn,
                    "tool_delay_s": self.tool_delay_s,
                },
            }
            for i, uid in enumerate(self.uids())
        ]


# -- supervised processes --------------------------------------------------------------


class Service:
    """One ``rolloutbus ARGV --config CONFIG`` process, restarted by the supervisor when it
    exits (unless retired). Each incarnation logs to ``{name}.{incarnation}.log``."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        config_path: Path,
        workdir: Path,
        env: dict[str, str] | None = None,
    ):
        self.name, self.argv, self.config_path = name, argv, config_path
        self.workdir = workdir / name  # its own cwd: Faust writes {app_id}-data there
        self.workdir.mkdir(parents=True, exist_ok=True)
        # PYTHONFAULTHANDLER: SIGABRT writes every thread's stack to the log (dump_stacks)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", **(env or {})}
        self.env["PYTHONPATH"] = os.pathsep.join([str(FIXTURES), os.environ.get("PYTHONPATH", "")])
        self.popen: subprocess.Popen[bytes] | None = None
        self.incarnation = 0
        self.exits: list[int] = []  # return codes of every incarnation that ended
        self.restarts = 0
        self.retired = False
        self.metrics_port: int | None = None
        self.lock = threading.Lock()
        self._started_at = 0.0
        self._down_since: float | None = None
        self._delay = RESTART_DELAY_S

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.{self.incarnation}.log"

    def start(self) -> None:
        self.incarnation += 1
        with self.log_path.open("wb") as log:
            self.popen = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "rolloutbus.cli",
                    *self.argv,
                    "--config",
                    str(self.config_path),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.workdir,
            )
        self._started_at = time.monotonic()
        self._down_since = None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        with self.lock:
            if self.popen is not None and self.popen.poll() is None:
                self.popen.send_signal(sig)
                self.popen.wait()

    def retire(self) -> None:
        """Kill it for good: the supervisor leaves it down."""
        self.retired = True
        self.kill()

    def supervise(self) -> None:
        """Restart the process if it exited (after a delay that grows while it crash-loops)."""
        with self.lock:
            if self.retired or self.popen is None or self.popen.poll() is None:
                return
            now = time.monotonic()
            if self._down_since is None:
                self._down_since = now
                self.exits.append(self.popen.returncode)
                fast = now - self._started_at < CRASH_LOOP_S
                self._delay = min(self._delay * 2, RESTART_DELAY_MAX_S) if fast else RESTART_DELAY_S
            if now - self._down_since >= self._delay:
                self.restarts += 1
                self.start()

    def dump_stacks(self) -> bool:
        """SIGABRT a live process: faulthandler writes its threads' stacks to its log, then
        it dies (for a run that hangs). Returns whether it was alive."""
        with self.lock:
            self.retired = True
            if self.popen is None or self.popen.poll() is not None:
                return False
            self.popen.send_signal(signal.SIGABRT)
            self.popen.wait()
            return True

    def stop(self) -> None:
        with self.lock:
            self.retired = True
            if self.popen is None or self.popen.poll() is not None:
                return
            self.popen.terminate()
            try:
                self.popen.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""


# -- the trajectory topic, as it fills ---------------------------------------------------


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


# -- a pipeline --------------------------------------------------------------------------


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
        """Each instance needs its own transactional id (a shared one would fence the other):
        pinned here per instance where the config's default is one fixed id; where the
        default is None, every process draws its own. With ``metrics``, each instance gets
        its own /metrics port."""
        index = len(self.buffers)
        env: dict[str, str] = {}
        pinned = ReplayBufferConfig.model_fields.get("transactional_id")
        if pinned is not None and pinned.default is not None:
            env["ROLLOUTBUS__REPLAY_BUFFER__TRANSACTIONAL_ID"] = (
                f"{self.cfg.sessions.app_id}-tx{index}"
            )
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
        ends = _end_offsets(self.cfg, self.topics.turns)
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
        # 1 (the default here): decoding is not batch-invariant (see the module docstring)
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
        },
        "replay_buffer": {"group_id": unique_name("rb")},
    }


def _end_offsets(cfg: Config, topic: str) -> dict[int, int]:
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


# -- scenarios -----------------------------------------------------------------------------


class ScenarioTimeout(AssertionError):
    """The run did not get where a scenario waits for it."""


@dataclass
class FaultContext:
    """What a scenario gets: the pipeline, a seeded RNG, progress, and a timeline."""

    pipeline: Pipeline
    workload: Workload
    rng: random.Random
    deadline: float
    broker: Config | None = None  # a dedicated broker the scenario may stop and start
    timeline: list[str] = field(default_factory=list)
    kills: int = 0
    _t0: float = field(default_factory=time.monotonic)

    def released(self) -> int:
        """Expected trajectory keys on rollout.trajectories so far."""
        return len(self.workload.expected_keys() & set(self.pipeline.watcher.keys))

    def wait_for_released(self, count: int) -> None:
        count = min(count, self.workload.sessions)
        while self.released() < count:
            if time.monotonic() > self.deadline:
                raise ScenarioTimeout(f"only {self.released()} of {count} trajectories arrived")
            time.sleep(POLL_S)

    def wait_for_fraction(self, fraction: float) -> None:
        self.wait_for_released(int(fraction * self.workload.sessions))

    def kill(self, service: Service) -> None:
        """SIGKILL; the supervisor starts it again."""
        self.note(f"SIGKILL {service.name} (pid {service.popen.pid if service.popen else '-'})")
        service.kill()
        self.kills += 1

    def retire(self, service: Service) -> None:
        self.note(f"SIGKILL {service.name} for good")
        service.retire()
        self.kills += 1

    def note(self, what: str) -> None:
        line = f"{time.monotonic() - self._t0:7.1f} s  {self.released():4d} released  {what}"
        self.timeline.append(line)
        with (self.pipeline.workdir / "timeline.txt").open("a") as out:  # to follow a run live
            out.write(line + "\n")


Scenario = Callable[[FaultContext], None]


# -- a run and its row -----------------------------------------------------------------------


@dataclass
class FaultRow:
    scenario: str
    expected: int
    attempts: int = 0
    lost: int = 0
    duplicated: int = 0
    resumed: int = 0
    resampled: int = 0
    failed: int = 0
    dead_letters: int = 0
    restarts: int = 0
    differ: int | None = None  # None: no reference to compare with
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)


@dataclass
class FaultRun:
    row: FaultRow
    trajectories: dict[str, dict[str, Any]]  # key -> the first record's columns but attempt
    timeline: list[str]
    logs: dict[str, str]  # service -> the tail of its last log, for failure messages

    def explain(self) -> str:
        lines = [f"{self.row}", "timeline:", *self.timeline]
        for name, tail in self.logs.items():
            lines += [f"--- {name} (last log) ---", tail]
        return "\n".join(lines)


def run_fault_scenario(
    name: str,
    *,
    bootstrap: str,
    workdir: Path,
    workload: Workload,
    scenario: Scenario | None = None,
    seed: int = 0,
    partitions: int = 2,
    session_workers: int = 1,
    replay_buffers: int = 1,
    reference: dict[str, dict[str, Any]] | None = None,
    broker: Config | None = None,
) -> FaultRun:
    """Run the pipeline under ``scenario`` and record its row in ``ROWS``."""
    started = time.monotonic()
    row = FaultRow(name, expected=workload.sessions)
    pipeline = Pipeline(bootstrap, workdir, partitions=partitions)
    ctx = FaultContext(
        pipeline, workload, random.Random(seed), started + COMPLETION_TIMEOUT_S, broker=broker
    )
    try:
        pipeline.start(session_workers, replay_buffers)
        ctx.note("pipeline started")
        pipeline.publish(workload)
        ctx.note(f"published {workload.groups} groups x {workload.n}")
        try:
            if scenario is not None:
                scenario(ctx)
            ctx.wait_for_released(workload.sessions)
            ctx.note("every key arrived")
            row.notes += _settle(pipeline, ctx)
        except ScenarioTimeout as exc:
            row.notes.append(f"timed out: {exc}")
            ctx.note(f"timed out: {exc}")
            dumped = [s.name for s in pipeline.services() if s.dump_stacks()]
            row.notes.append(f"Python stacks of {dumped} are at the end of their logs")
    finally:
        pipeline.close()
    run = _measure(pipeline, workload, row, reference, ctx)
    row.wall_s = time.monotonic() - started
    ROWS.append(row)
    pipeline.delete_topics()
    return run


def _settle(pipeline: Pipeline, ctx: FaultContext) -> list[str]:
    """Wait until the replay buffer folded the whole turn log and nothing more is written,
    so a group released twice late would still be seen."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    stable_since, last_ends = time.monotonic(), None
    while time.monotonic() < deadline:
        ends = _end_offsets(pipeline.cfg, pipeline.topics.turns)
        if ends != last_ends:
            stable_since, last_ends = time.monotonic(), ends
        elif time.monotonic() - stable_since >= SETTLE_STABLE_S and pipeline.turn_log_settled():
            ctx.note("turn log folded to its end")
            return []
        time.sleep(POLL_S)
    ctx.note("the replay buffer never committed the turn log to its end")
    return [
        f"not settled within {SETTLE_TIMEOUT_S:.0f} s (replay buffer offsets behind the turn log)"
    ]


def _measure(
    pipeline: Pipeline,
    workload: Workload,
    row: FaultRow,
    reference: dict[str, dict[str, Any]] | None,
    ctx: FaultContext,
) -> FaultRun:
    cfg, topics = pipeline.cfg, pipeline.topics
    records = read_topic(cfg, topics.trajectories)
    keys = Counter((m.key() or b"").decode() for m in records)
    trajectories: dict[str, dict[str, Any]] = {}
    for msg in records:
        trajectories.setdefault((msg.key() or b"").decode(), _columns(msg.value()))
    expected = workload.expected_keys()
    row.lost = len(expected - set(keys))
    row.duplicated = sum(1 for count in keys.values() if count > 1)
    unexpected = set(keys) - expected
    if unexpected:
        row.notes.append(f"{len(unexpected)} unexpected keys, e.g. {sorted(unexpected)[:3]}")
    row.failed = sum(1 for t in trajectories.values() if t["status"] == "failed")
    if row.failed:
        errors = Counter(
            _error_kind(t["error"]) for t in trajectories.values() if t["status"] == "failed"
        )
        row.notes.append(f"failed trajectories by error: {dict(errors.most_common(3))}")
    row.dead_letters = len(read_topic(cfg, topics.dlq))
    turn_log_counts([decode_turn_event(m.value()) for m in read_topic(cfg, topics.turns)], row)
    row.restarts = sum(s.restarts for s in pipeline.services())
    exits = Counter(code for s in pipeline.services() for code in s.exits)
    if exits:
        row.notes.append(f"exit codes {dict(exits)} (-9: SIGKILL), {ctx.kills} injected kills")
    if reference is not None:
        row.differ, first = _compare(trajectories, reference, expected)
        if first:
            row.notes.append(first)
    logs = {s.name: s.log_tail() for s in pipeline.services()}
    return FaultRun(row, trajectories, ctx.timeline, logs)


def _error_kind(error: str | None) -> str:
    """An error message without the quoted names (request ids) that make each one unique."""
    return re.sub(r"'[^']*'", "'..'", error or "")[:ERROR_CHARS]


def _columns(value: bytes | None) -> dict[str, Any]:
    columns = decode_trajectory_batch(value or b"").to_pylist()[0]
    for name in NOT_COMPARED:
        columns.pop(name, None)
    return columns


def _compare(
    got: dict[str, dict[str, Any]], reference: dict[str, dict[str, Any]], expected: set[str]
) -> tuple[int, str]:
    """Trajectories that differ from the reference's (a missing one counts as lost, not here)."""
    differ, first = 0, ""
    for key in sorted(expected & set(got)):
        mine, theirs = got[key], reference.get(key)
        if mine == theirs:
            continue
        differ += 1
        if not first:
            columns = sorted(c for c in mine if theirs is None or mine[c] != theirs.get(c))
            first = f"first difference from the reference: {key} in {columns}"
    return differ, first


def turn_log_counts(events: list[Any], row: FaultRow) -> None:
    """attempts, resumed (without re-sampling) and re-sampled turns, from the turn log's
    events in log order."""
    generations: dict[tuple[str, int, str], list[Any]] = defaultdict(list)
    request_ids: dict[tuple[str, int, int], set[str]] = defaultdict(set)
    seen: set[tuple[str, int, str, int]] = set()
    starts, group_starts = [], Counter()
    for event in events:
        if event.type == "group_started":
            group_starts[event.uid] += 1
            continue
        if (event.uid, event.session_id, event.attempt, event.seq) in seen:
            continue  # a duplicate write: the fold ignores it too
        seen.add((event.uid, event.session_id, event.attempt, event.seq))
        if event.type == "session_started":
            starts.append(event)
        elif event.type == "generation":
            generations[(event.uid, event.session_id, event.attempt)].append(event)
            request_ids[(event.uid, event.session_id, event.turn)].add(event.engine_request_id)
    row.attempts = len(starts)
    row.resumed = sum(1 for s in starts if s.resumed_from and _replayed_as_logged(s, generations))
    row.resampled = sum(len(ids) - 1 for ids in request_ids.values())
    again = sum(1 for count in group_starts.values() if count > 1)
    if again:
        row.notes.append(f"{again} groups started twice")
    resumed = [s for s in starts if s.resumed_from]
    nothing = sum(1 for s in resumed if not generations.get((s.uid, s.session_id, s.resumed_from)))
    if nothing:
        row.notes.append(f"{nothing} more sessions resumed with no generation logged yet")
    mismatched = len(resumed) - nothing - row.resumed
    if mismatched:
        row.notes.append(f"{mismatched} resumed sessions did not replay what was logged")


def _replayed_as_logged(start: Any, generations: dict[tuple[str, int, str], list[Any]]) -> bool:
    old = generations.get((start.uid, start.session_id, start.resumed_from), [])
    new = generations.get((start.uid, start.session_id, start.attempt), [])
    replayed = [(g.engine_request_id, list(g.token_ids)) for g in new[: len(old)]]
    return bool(old) and replayed == [(g.engine_request_id, list(g.token_ids)) for g in old]


# -- a dedicated broker ------------------------------------------------------------------------


@contextmanager
def dedicated_broker(data_root: Path) -> Iterator[Config]:
    """A broker of its own on free ports (as tests/conftest.py starts the session's), for a
    scenario that stops and starts it; stopped at the end."""
    cfg = _start_dedicated(data_root)
    try:
        yield cfg
    finally:
        stop_broker(cfg)


def _start_dedicated(data_root: Path) -> Config:
    for attempt in range(PORT_RETRIES):
        port = controller = free_port()
        while controller == port:
            controller = free_port()
        broker = BrokerConfig(
            data_dir=data_root / f"kafka{attempt}",
            port=port,
            controller_port=controller,
            start_timeout_s=120.0,
        )
        cfg = Config(broker=broker, kafka=KafkaConfig(bootstrap_servers=f"127.0.0.1:{port}"))
        try:
            start_broker(cfg)
        except BrokerError as exc:
            if "already in use" in str(exc) and attempt < PORT_RETRIES - 1:
                continue
            raise
        return cfg
    raise AssertionError("unreachable")


def restart_broker(cfg: Config, outage_s: float) -> None:
    stop_broker(cfg)
    time.sleep(outage_s)
    start_broker(cfg)


# -- the table -----------------------------------------------------------------------------------

COLUMNS = [
    ("fault scenario", 34, "scenario"),
    ("sessions", 8, "expected"),
    ("attempts", 8, "attempts"),
    ("lost", 5, "lost"),
    ("dup", 4, "duplicated"),
    ("resumed", 7, "resumed"),
    ("resampled", 9, "resampled"),
    ("failed", 6, "failed"),
    ("dead letters", 12, "dead_letters"),
    ("restarts", 8, "restarts"),
    ("differ", 6, "differ"),
    ("wall s", 7, "wall_s"),
]


def format_table(rows: list[FaultRow]) -> list[str]:
    header = "  ".join(
        title.ljust(width) if i == 0 else title.rjust(width)
        for i, (title, width, _) in enumerate(COLUMNS)
    )
    lines = [header]
    for row in rows:
        cells = []
        for i, (_, width, attr) in enumerate(COLUMNS):
            value = getattr(row, attr)
            text = (
                "-" if value is None else f"{value:.0f}" if isinstance(value, float) else str(value)
            )
            cells.append(text.ljust(width) if i == 0 else text.rjust(width))
        lines.append("  ".join(cells))
    for row in rows:
        for note in row.notes:
            lines.append(f"  {row.scenario}: {note}")
    return lines


__all__ = [
    "FIXTURES",
    "ROWS",
    "FaultContext",
    "FaultRow",
    "FaultRun",
    "Pipeline",
    "ScenarioTimeout",
    "Service",
    "Workload",
    "dedicated_broker",
    "format_table",
    "restart_broker",
    "run_fault_scenario",
    "turn_log_counts",
]
