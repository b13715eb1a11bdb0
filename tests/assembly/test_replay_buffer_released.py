"""The replay buffer against a real broker: the released-groups topic makes releases
durable (new group ids, restarts, re-runs release nothing twice), partition counts are
read from the cluster, deadlines release unfinished groups, poison input becomes failed
records, two workers from one config do not fence each other, and a broker restart is
survived. Workers run in a thread (``ReplayBuffer.run``) or as ``rolloutbus replay-buffer
run`` processes."""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException
from confluent_kafka.admin import NewTopic
from prometheus_client import CollectorRegistry

import rolloutbus.streams.assembly.partition_recovery as partition_recovery
import rolloutbus.streams.assembly.released as released_module
import rolloutbus.streams.assembly.replay_buffer as replay_buffer_module
from rolloutbus.broker.embedded import start_broker, stop_broker
from rolloutbus.config import BrokerConfig, Config, KafkaConfig, with_overrides
from rolloutbus.errors import BrokerError, ConfigError
from rolloutbus.kafka.admin import check_partition_counts, delete_topics, ensure_topics
from rolloutbus.kafka.clients import (
    admin_client,
    idempotent_producer,
    read_committed_consumer_settings,
)
from rolloutbus.kafka.group_member import GroupMember
from rolloutbus.schemas.trajectories import batch_to_trajectories, decode_trajectory_batch
from rolloutbus.schemas.turns import (
    Generation,
    OutputSummary,
    SessionFinished,
    decode_turn_event,
    encode_turn_event,
)
from rolloutbus.streams.assembly.metrics import ReplayBufferMetrics
from rolloutbus.streams.assembly.partition_recovery import StuckConsumerWatch
from rolloutbus.streams.assembly.released import (
    Claim,
    ReleasedClaims,
    ReleasedRecord,
    TurnLogProbe,
)
from rolloutbus.streams.assembly.replay_buffer import ReplayBuffer
from rolloutbus.topics import Topics, partition_for
from tests.builders import make_group_started, make_session_failed
from tests.helpers import free_port, unique_name
from tests.pipeline import dead_letters, read_topic, running, spawn, write_config
from tests.synthetic import N, group_events

ROW = {"prompt": [{"role": "user", "content": "q"}]}
WAIT_S = 120.0  # seconds for a buffer to release what was produced (two busy cores)


def _config(kafka: KafkaConfig, **overrides) -> Config:
    return with_overrides(
        Config(kafka=kafka), {"replay_buffer.group_id": unique_name("rb"), **overrides}
    )


def _produce(kafka: KafkaConfig, events, flush_s: float = 30.0) -> None:
    """(uid, key, value) triples to the turn log, each on its uid's partition."""
    producer = idempotent_producer(kafka, {"linger.ms": 5})
    topic = Topics.from_config(kafka).turns
    for uid, key, value in events:
        producer.produce(
            topic, key=key, value=value, partition=partition_for(uid, kafka.partitions)
        )
        producer.poll(0)
    assert producer.flush(flush_s) == 0


def _raw(*events) -> list[tuple[str, str, bytes]]:
    return [(e.uid, e.uid, encode_turn_event(e)) for e in events]


def _uids_on_every_partition(kafka: KafkaConfig, prefix: str = "m") -> list[str]:
    """One fresh uid per partition: a marker released after everything produced before it."""
    found: dict[int, str] = {}
    while len(found) < kafka.partitions:
        uid = f"{prefix}{uuid.uuid4().hex[:10]}"
        found.setdefault(partition_for(uid, kafka.partitions), uid)
    return list(found.values())


def _keys(cfg: Config) -> list[str]:
    return [m.key().decode() for m in read_topic(cfg, Topics.from_config(cfg.kafka).trajectories)]


def _trajectories(cfg: Config) -> dict[str, list]:
    out: dict[str, list] = {}
    for msg in read_topic(cfg, Topics.from_config(cfg.kafka).trajectories):
        [t] = batch_to_trajectories(decode_trajectory_batch(msg.value()))
        out.setdefault(t.key, []).append(t)
    return out


def _wait_for_keys(cfg: Config, wanted: set[str], timeout_s: float = WAIT_S, procs=()) -> list[str]:
    deadline = time.monotonic() + timeout_s
    keys: list[str] = []
    while time.monotonic() < deadline:
        keys = _keys(cfg)
        if wanted <= set(keys):
            time.sleep(2)  # a duplicate, if any, has the time to appear
            return _keys(cfg)
        assert all(p.poll() is None for p in procs), "a replay buffer exited"
        time.sleep(0.5)
    raise AssertionError(f"not released within {timeout_s} s: {sorted(wanted - set(keys))[:5]}")


def _expected_keys(uids) -> set[str]:
    return {f"{uid}_{s}_0" for uid in uids for s in range(N)}


def _dupes(keys: list[str]) -> dict[str, int]:
    return {k: c for k, c in Counter(keys).items() if c > 1}


# --- 2. the released record replaces the lookback rescan ----------------------------------


@pytest.mark.slow
def test_a_new_group_id_releases_nothing_twice(kafka_config: KafkaConfig, replay_buffer_thread):
    """Lost offsets (a new consumer group) re-read the whole turn log: every group in it is
    known as released from the released topic, so no trajectory key appears twice."""
    first = _config(kafka_config)
    uids = [f"g{uuid.uuid4().hex[:10]}" for _ in range(12)]
    _produce(kafka_config, [e for uid in uids for e in group_events(uid)])
    with replay_buffer_thread(first):
        _wait_for_keys(first, _expected_keys(uids))

    second = _config(kafka_config)  # same topics, new group id: no committed offsets
    markers = _uids_on_every_partition(kafka_config)
    _produce(kafka_config, [e for uid in markers for e in group_events(uid)])
    with replay_buffer_thread(second):
        keys = _wait_for_keys(second, _expected_keys(uids + markers))
    assert not _dupes(keys), f"released twice: {sorted(_dupes(keys))[:5]}"
    assert set(keys) == _expected_keys(uids + markers)
    released = [
        ReleasedRecord.model_validate_json(m.value())
        for m in read_topic(first, Topics.from_config(kafka_config).released)
    ]
    assert sorted(r.uid for r in released) == sorted(uids + markers)
    assert all(
        r.trajectories == N and r.partition == partition_for(r.uid, kafka_config.partitions)
        for r in released
    )


def test_the_progress_line_counts_what_was_committed(
    kafka_config: KafkaConfig, replay_buffer_thread, caplog
):
    """The replay buffer's progress lines (monitoring.progress_log_s) add up to the groups,
    trajectories and turn events it committed."""
    cfg = _config(kafka_config, **{"monitoring.progress_log_s": 0.5})
    uids = [f"g{uuid.uuid4().hex[:10]}" for _ in range(5)]
    events = [e for uid in uids for e in group_events(uid)]
    _produce(kafka_config, events)
    with caplog.at_level(logging.INFO, logger=replay_buffer_module.__name__):
        with replay_buffer_thread(cfg):
            _wait_for_keys(cfg, _expected_keys(uids))
            time.sleep(1.5)  # the next line carries the last commit
    lines = [m for m in caplog.messages if m.startswith("replay buffer: ")]
    counted: Counter[str] = Counter()
    for line in lines:
        for n, what in re.findall(r"(\d+) (groups|trajectories|turn events) \(", line):
            counted[what] += int(n)
    assert counted == {"groups": 5, "trajectories": 5 * N, "turn events": len(events)}, lines


# --- 2b. a released record is obeyed only where the turn log backs it -----------------------


def _record(uid: str, first: int) -> ReleasedRecord:
    return ReleasedRecord(
        uid=uid, partition=0, trajectories=N, turns_first_offset=first, turns_last_offset=first + 5
    )


def _claim(uid: str, first: int, offset: int = 0) -> Claim:
    record = _record(uid, first)
    return Claim.of(record, offset, uid.encode(), record.encode())


def test_a_claim_is_settled_where_the_fold_passes_its_first_offset() -> None:
    claims = ReleasedClaims("t.released", 0, fold_start=10)
    claims.add(_claim("real", 12))
    claims.add(_claim("forged", 14, offset=1))
    claims.add(_claim("old", 3, offset=2))  # before the fold's start: checked by a read
    assert claims.passed(12, "real") == [] and not claims.pending("real")
    [bad] = claims.passed(14, "someone")
    assert bad.source == "t.released[0]@1" and bad.value == _claim("forged", 14).value
    assert "uid forged" in bad.reason and "turns[0]@14" in bad.reason
    assert "an event of uid someone" in bad.reason
    assert claims.take_freed() == ["forged"] and claims.take_freed() == []
    assert claims.pending("old") and len(claims) == 1


def test_an_event_before_the_claimed_start_refuses_the_claim() -> None:
    """A forged record for a group still running names a start after one of its events."""
    claims = ReleasedClaims("t.released", 0, fold_start=10)
    claims.add(_claim("live", 20))
    [bad] = claims.suppressing(15, "live", probe=None)  # type: ignore[arg-type]  # no read
    assert "event at offset 15, before the claimed start" in bad.reason
    assert claims.take_freed() == ["live"]
    claims.add(_claim("skipped", 11))  # the fold went past 11 without an event of it
    [bad] = claims.suppressing(16, "skipped", probe=None)  # type: ignore[arg-type]
    assert "found no event of it there" in bad.reason


def test_a_uid_with_one_backed_claim_stays_released() -> None:
    claims = ReleasedClaims("t.released", 0, fold_start=0)
    claims.add(_claim("g", 7, offset=1))  # forged, written first
    claims.add(_claim("g", 4, offset=2))  # the buffer's own
    claims.passed(4, "g")
    assert not claims.pending("g") and claims.passed(7, "x") == []
    assert claims.take_freed() == []


def _offsets_by_uid(kafka: KafkaConfig) -> dict[str, int]:
    """The turn-log offset of each group's first event."""
    first: dict[str, int] = {}
    for msg in read_topic(Config(kafka=kafka), Topics.from_config(kafka).turns):
        first.setdefault(decode_turn_event(msg.value()).uid, msg.offset())
    return first


class _FirstConsumerDestroyed(TurnLogProbe):
    """Fault injector, not a double of the product: the first consumer the probe opens fails
    as librdkafka's handle does after its broker was SIGKILLed ("Broker handle destroyed");
    with ``always`` every one does."""

    def __init__(self, *args, always: bool = False):
        super().__init__(*args)
        self.opened, self.always = 0, always

    def _open(self):
        consumer = super()._open()
        self.opened += 1
        if self.always or self.opened == 1:
            self._consumer = _Destroyed(consumer)
        return self._consumer


class _Destroyed:
    """A consumer whose broker handle is gone: every query fails; close() still closes."""

    def __init__(self, consumer):
        self.close = consumer.close

    def get_watermark_offsets(self, *_args, **_kwargs):
        raise KafkaException(KafkaError(KafkaError._DESTROY, "Broker handle destroyed"))


def test_a_claim_check_that_meets_a_broker_error_retries_on_a_fresh_consumer(
    kafka_config: KafkaConfig, monkeypatch: pytest.MonkeyPatch
):
    """The replay buffer's claim check (TurnLogProbe) after a broker kill: the error is
    retried on a new consumer, which reads the event; the process does not end for it.
    A broker that keeps failing past PROBE_RETRY_S ends in a BrokerError naming the offset."""
    monkeypatch.setattr(released_module, "PROBE_RETRY_BACKOFF_S", 0.0)
    uid = f"g{uuid.uuid4().hex[:10]}"
    _produce(kafka_config, _raw(make_group_started(uid)))
    partition = partition_for(uid, kafka_config.partitions)
    topic = Topics.from_config(kafka_config).turns
    probe = _FirstConsumerDestroyed(kafka_config, topic, partition)
    try:
        assert probe.uid_at(0) == uid
        assert probe.opened == 2  # the destroyed handle was dropped, not reused
    finally:
        probe.close()

    monkeypatch.setattr(released_module, "PROBE_RETRY_S", 0.5)
    failing = _FirstConsumerDestroyed(kafka_config, topic, partition, always=True)
    with pytest.raises(BrokerError, match=rf"{topic}\[{partition}\]@0"):
        failing.uid_at(0)
    assert failing.opened >= 2


class _FirstConsumerHangs(TurnLogProbe):
    """Fault injector, not a double of the product: the first consumer's watermark query
    does not return (as one of librdkafka's polls did after a broker restart in CI) until
    ``released`` is set."""

    def __init__(self, *args):
        super().__init__(*args)
        self.opened, self.released, self.returned = 0, threading.Event(), threading.Event()

    def _open(self):
        consumer = super()._open()
        self.opened += 1
        if self.opened == 1:
            self._consumer = _Hangs(consumer, self.released, self.returned)
        return self._consumer


class _Hangs:
    def __init__(self, consumer, released: threading.Event, returned: threading.Event):
        self.close, self.released, self.returned = consumer.close, released, returned

    def get_watermark_offsets(self, *_args, **_kwargs):
        self.released.wait(WAIT_S)
        self.returned.set()
        raise KafkaException(KafkaError(KafkaError._DESTROY, "Broker handle destroyed"))


def test_a_claim_check_with_no_answer_is_given_up_and_made_on_a_fresh_consumer(
    kafka_config: KafkaConfig, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    """The claim check's read runs under the watchdog (PROBE_LIMIT_S): a call into
    librdkafka that does not return is left on its thread with its stack logged, and the
    check is made again on a new consumer, while the hung call has still not returned."""
    monkeypatch.setattr(released_module, "PROBE_RETRY_BACKOFF_S", 0.0)
    monkeypatch.setattr(released_module, "PROBE_LIMIT_S", 1.0)
    uid = f"g{uuid.uuid4().hex[:10]}"
    _produce(kafka_config, _raw(make_group_started(uid)))
    partition = partition_for(uid, kafka_config.partitions)
    probe = _FirstConsumerHangs(kafka_config, Topics.from_config(kafka_config).turns, partition)
    try:
        with caplog.at_level(logging.WARNING, logger=released_module.__name__):
            assert probe.uid_at(0) == uid
        assert not probe.returned.is_set()  # answered while the first call still hangs
    finally:
        probe.released.set()
        probe.close()
    assert probe.opened == 2
    given_up = caplog.records[0].getMessage()
    assert "no answer within 1 s" in given_up and "get_watermark_offsets" in given_up


@pytest.mark.slow
def test_forged_and_junk_released_records_are_dead_lettered_not_obeyed(
    kafka_config: KafkaConfig, replay_buffer_thread
):
    """A forged released record for a group still running, one for a uid that never
    started, one without a turn-log range and one that is not JSON are read back when the
    buffer restarts: each becomes a dead letter, the running group is released once when
    it ends, and a re-run of a genuinely released group is still recognised."""
    cfg = _config(kafka_config)
    kafka = kafka_config
    done, live, after = (_uids_on_partition(kafka, 0, prefix) for prefix in ("x", "u", "w"))
    live_events = group_events(live)
    tail = N + 4  # the last session's events: the group stays open without them
    _produce(kafka, group_events(done) + live_events[:-tail] + group_events(after))
    with replay_buffer_thread(cfg):
        _wait_for_keys(cfg, _expected_keys([done, after]))
    first = _offsets_by_uid(kafka)
    forged = [
        _record(live, first[done]),  # the group's start is elsewhere
        _record("neverstarted", first[live]),
        ReleasedRecord(uid=live, partition=0, trajectories=0),  # no turn-log range
    ]
    topics = Topics.from_config(kafka)
    producer = idempotent_producer(kafka)
    for record in forged:
        producer.produce(topics.released, key=record.uid, value=record.encode(), partition=0)
    producer.produce(topics.released, key=b"junk", value=b"\x00not json", partition=0)
    assert producer.flush(30) == 0

    with replay_buffer_thread(cfg):  # reads the forged records back; the live group ends afterwards
        _produce(kafka, live_events[-tail:] + group_events(done, attempt="rerun"))
        keys = _wait_for_keys(cfg, _expected_keys([done, live, after]))
        letters = _wait_for_letters(cfg, 4)
    assert Counter(keys) == Counter(_expected_keys([done, live, after]))
    assert {t.attempt for k in _expected_keys([done]) for t in _trajectories(cfg)[k]} == {"a"}
    sources = sorted(letter["source"] for letter in letters)
    assert all(source.startswith(f"{topics.released}[0]@") for source in sources), sources
    reasons = " | ".join(letter["reason"] for letter in letters)
    assert f"uid {live} claims its group started at turns[0]@{first[done]}" in reasons
    assert f"an event of uid {done}" in reasons
    assert "uid neverstarted" in reasons and "names no turn-log range" in reasons
    assert "not a released record" in reasons


def _uids_on_partition(kafka: KafkaConfig, partition: int, prefix: str) -> str:
    while True:
        uid = f"{prefix}{uuid.uuid4().hex[:10]}"
        if partition_for(uid, kafka.partitions) == partition:
            return uid


def _wait_for_letters(cfg: Config, count: int, timeout_s: float = WAIT_S) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while len(letters := dead_letters(cfg)) < count and time.monotonic() < deadline:
        time.sleep(0.5)
    return letters


# --- 3. a uid with the key separator ---------------------------------------------------------


@pytest.mark.slow
def test_uid_with_an_underscore_is_released_once_across_a_restart(
    kafka_config: KafkaConfig, replay_buffer_thread
):
    cfg = _config(kafka_config)
    uid = f"with_under_{uuid.uuid4().hex[:6]}"  # keys {uid}_{s}_0 split wrongly at the first "_"
    _produce(kafka_config, group_events(uid))
    with replay_buffer_thread(cfg):
        _wait_for_keys(cfg, _expected_keys([uid]))
    # the session worker re-runs the released group (a redelivered prompt), then restart
    markers = _uids_on_every_partition(kafka_config)
    _produce(
        kafka_config,
        group_events(uid, attempt="rerun") + [e for m in markers for e in group_events(m)],
    )
    with replay_buffer_thread(cfg):
        keys = _wait_for_keys(cfg, _expected_keys(markers))
    assert Counter(keys) == Counter(_expected_keys([uid] + markers))
    assert {t.attempt for k in _expected_keys([uid]) for t in _trajectories(cfg)[k]} == {"a"}


# --- 4. partition counts read from the cluster -----------------------------------------------


def test_partition_counts_are_checked_against_the_cluster(kafka_bootstrap: str):
    kafka = KafkaConfig(
        bootstrap_servers=kafka_bootstrap, topic_prefix=unique_name("t"), partitions=2
    )
    topics = Topics.from_config(kafka)
    admin = admin_client(kafka)
    counts = {topics.prompts: 2, topics.turns: 3, topics.trajectories: 2, topics.dlq: 1}
    try:
        for future in admin.create_topics([NewTopic(n, c, 1) for n, c in counts.items()]).values():
            future.result()
        with pytest.raises(BrokerError, match="rolloutbus topics"):
            check_partition_counts(kafka)  # no released topic yet
        admin.create_topics([NewTopic(topics.released, 2, 1)])[topics.released].result()
        _wait_until_visible(kafka, topics.released)
        with pytest.raises(BrokerError, match=f"{topics.turns} has 3") as info:
            check_partition_counts(kafka)
        assert "recreate" in str(info.value)
        with pytest.raises(BrokerError, match="disagree"):
            ReplayBuffer(Config(kafka=kafka)).run()  # the buffer checks before consuming
    finally:
        delete_topics(kafka, topics.all())

    ensure_topics(kafka.model_copy(update={"partitions": 3}))
    try:
        with pytest.raises(ConfigError, match="set kafka.partitions: 3"):
            check_partition_counts(kafka)
        assert check_partition_counts(kafka.model_copy(update={"partitions": 3})) == 3
    finally:
        delete_topics(kafka, topics.all())


def _wait_until_visible(kafka: KafkaConfig, topic: str, timeout_s: float = 30.0) -> None:
    """A topic just created may take a moment to show in the broker's metadata."""
    admin = admin_client(kafka)
    deadline = time.monotonic() + timeout_s
    while topic not in admin.list_topics(timeout=10).topics:
        assert time.monotonic() < deadline, f"{topic} not visible after {timeout_s} s"
        time.sleep(0.2)


# --- 6. deadlines ----------------------------------------------------------------------------


def _stamped(events, ts: float) -> list[tuple[str, str, bytes]]:
    return [
        (uid, key, encode_turn_event(decode_turn_event(value).model_copy(update={"ts": ts})))
        for uid, key, value in events
    ]


@pytest.mark.slow
def test_a_group_past_its_deadline_is_released_as_failed_records(
    kafka_config: KafkaConfig, replay_buffer_thread
):
    cfg = _config(kafka_config, **{"deadlines.group_s": 5.0})
    stuck = f"s{uuid.uuid4().hex[:10]}"
    later = next(
        u
        for u in (f"l{uuid.uuid4().hex[:10]}" for _ in range(100))
        if partition_for(u, 2) == partition_for(stuck, 2)
    )
    now = time.time()
    _produce(kafka_config, _stamped(group_events(stuck)[:-1], now))  # the last session never ends
    _produce(kafka_config, _stamped(group_events(later), now + 10))  # 10 s of log time later
    with replay_buffer_thread(cfg):
        keys = _wait_for_keys(cfg, _expected_keys([stuck, later]))
    assert not _dupes(keys)
    records = _trajectories(cfg)
    last = f"{stuck}_{N - 1}_0"
    [failed] = records[last]
    assert failed.status.value == "failed" and "deadlines.group_s = 5 s" in failed.error
    assert all(
        records[k][0].status.value == "completed" for k in _expected_keys([stuck, later]) - {last}
    )
    assert any("deadlines.group_s" in letter["reason"] for letter in dead_letters(cfg))


# --- 5. poison input, as a real process ------------------------------------------------------


@pytest.mark.slow
def test_poison_groups_become_failed_records_and_the_process_goes_on(
    kafka_config: KafkaConfig, tmp_path
):
    cfg = _config(kafka_config)
    string_prompt, orphan = f"p{uuid.uuid4().hex[:10]}", f"o{uuid.uuid4().hex[:10]}"
    ids = {"uid": orphan, "session_id": 0, "attempt": "a"}
    poison = _raw(
        make_group_started(string_prompt, row={"prompt": "a string prompt"}),
        make_session_failed(string_prompt, error="no prompt", seq=1),
        make_group_started(orphan, row=ROW),
        # the head of the session is missing: a generation and a finish, seq 1 and 2
        Generation(**ids, segment=0, turn=0, token_ids=[1], seq=1),
        SessionFinished(
            **ids, outputs=[OutputSummary(segment=0, prompt_len=0, response_len=1)], seq=2
        ),
    )
    good = _uids_on_every_partition(kafka_config, "good")
    _produce(kafka_config, poison)
    log = tmp_path / "rb.log"
    with running(
        [spawn(["replay-buffer", "run"], write_config(cfg, tmp_path / "c.yaml"), log)]
    ) as [proc]:
        _wait_for_keys(cfg, {f"{string_prompt}_0_0", f"{orphan}_0_0"}, procs=[proc])
        _produce(kafka_config, [e for uid in good for e in group_events(uid)])
        keys = _wait_for_keys(
            cfg, _expected_keys(good) | {f"{string_prompt}_0_0", f"{orphan}_0_0"}, procs=[proc]
        )
        assert proc.poll() is None, log.read_text()[-3000:]
    assert not _dupes(keys)
    records = _trajectories(cfg)
    [bad_row] = records[f"{string_prompt}_0_0"]
    assert bad_row.status.value == "failed" and "row cannot be carried" in bad_row.error
    [headless] = records[f"{orphan}_0_0"]
    assert (
        headless.status.value == "failed" and "seq 0..1 are not in the turn log" in headless.error
    )
    reasons = [letter["reason"] for letter in dead_letters(cfg)]
    assert any(string_prompt in r and "row.prompt must be a list" in r for r in reasons)
    assert any(f"{orphan}_0" in r and "not in the turn log" in r for r in reasons)


# --- 8. transactional ids and broker restarts ------------------------------------------------


@pytest.mark.slow
def test_two_buffers_from_one_config_share_the_work_without_fencing(
    kafka_config: KafkaConfig, tmp_path
):
    cfg = _config(kafka_config)
    assert cfg.replay_buffer.transactional_id is None  # each process makes its own
    config_path = write_config(cfg, tmp_path / "c.yaml")
    logs = [tmp_path / "rb1.log", tmp_path / "rb2.log"]
    uids = [f"g{uuid.uuid4().hex[:10]}" for _ in range(30)]
    with running([spawn(["replay-buffer", "run"], config_path, log) for log in logs]) as procs:
        _produce(kafka_config, [e for uid in uids[:15] for e in group_events(uid)])
        for log, proc in zip(logs, procs, strict=True):  # both join: rebalances mid-stream
            _wait_for_recovered(log, proc, partitions=1)
        _produce(kafka_config, [e for uid in uids[15:] for e in group_events(uid)])
        keys = _wait_for_keys(cfg, _expected_keys(uids), procs=procs)
        alive = [p.poll() is None for p in procs]
    assert alive == [True, True], "\n".join(log.read_text()[-2000:] for log in logs)
    assert not _dupes(keys) and set(keys) == _expected_keys(uids)


@pytest.mark.slow
def test_a_pinned_transactional_id_in_two_processes_ends_one_with_one_line(
    kafka_config: KafkaConfig, tmp_path
):
    """Pinning replay_buffer.transactional_id and starting it twice: each fatal fencing
    replaces the fenced producer (which fences the other process in turn), so the two fence
    each other again and again with no commit between; the first to be fenced
    ``FENCED_LIMIT`` times in a row (usually the older; under load either) ends with exit
    code 1 and one line naming the cause, and the other goes on (a restart or a broker kill
    fences only once)."""
    cfg = _config(kafka_config, **{"replay_buffer.transactional_id": unique_name("pinned")})
    config_path = write_config(cfg, tmp_path / "c.yaml")
    logs = [tmp_path / "rb1.log", tmp_path / "rb2.log"]
    uids = [f"g{uuid.uuid4().hex[:10]}" for _ in range(10)]
    with running([spawn(["replay-buffer", "run"], config_path, logs[0])]) as [first]:
        _produce(kafka_config, [e for uid in uids[:5] for e in group_events(uid)])
        _wait_for_keys(cfg, _expected_keys(uids[:5]), procs=[first])
        with running([spawn(["replay-buffer", "run"], config_path, logs[1])]) as [second]:
            procs = [first, second]
            deadline = time.monotonic() + WAIT_S
            while all(p.poll() is None for p in procs) and time.monotonic() < deadline:
                _produce(kafka_config, group_events(f"f{uuid.uuid4().hex[:10]}"))  # gives it work
                time.sleep(1)
            ended = [i for i, p in enumerate(procs) if p.poll() is not None]
            assert len(ended) == 1, "\n".join(log.read_text()[-3000:] for log in logs)
            [gone] = ended
            assert procs[gone].returncode == 1, logs[gone].read_text()[-3000:]
            time.sleep(2)  # seconds: the other one is not ended by the same cause just after
            assert procs[1 - gone].poll() is None, logs[1 - gone].read_text()[-3000:]
    last_line = logs[gone].read_text().strip().splitlines()[-1]
    assert last_line.startswith("rolloutbus: ") and "fatal" in last_line
    assert "replay_buffer.transactional_id" in last_line


class StuckCoordinator(Consumer):
    """Fault injector (a test double): a real consumer whose committed-offset queries time
    out, as a consumer's coordinator requests did for a minute after a broker restart in the
    broker-restart row. Everything else is the real consumer's."""

    queries = 0

    def committed(self, *args, **kwargs):
        type(self).queries += 1
        raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "injected: coordinator stuck"))


@pytest.mark.slow
def test_a_consumer_stuck_on_its_coordinator_is_replaced_after_the_stall_limit(
    kafka_config: KafkaConfig, replay_buffer_thread, monkeypatch
):
    """The first consumer can never read a committed offset: after replay_buffer.txn_stall_s
    of failed recoveries it is replaced, and the new one releases every group once."""
    made = _first_consumer_is(StuckCoordinator, monkeypatch)
    _released_after_one_replacement(kafka_config, replay_buffer_thread, made)
    assert StuckCoordinator.queries >= 2  # retried before it was replaced


class NoBroker(Consumer):
    """Fault injector (a test double): a real consumer left with no broker, as librdkafka
    left one after a broker restart under load (it decommissioned the only broker it knew
    and never re-bootstrapped): it never joins its group, and metadata requests fail."""

    probes = 0

    def subscribe(self, *args, **kwargs):
        pass  # never reaches the coordinator: no assignment ever comes

    def list_topics(self, *args, **kwargs):
        type(self).probes += 1
        raise KafkaException(KafkaError(KafkaError._TRANSPORT, "injected: no usable brokers"))


@pytest.mark.slow
def test_a_consumer_left_with_no_broker_is_replaced_after_the_stall_limit(
    kafka_config: KafkaConfig, replay_buffer_thread, monkeypatch
):
    """The first consumer owns no partition and reads no metadata: after
    replay_buffer.txn_stall_s it is replaced, and the new one releases every group once."""
    made = _first_consumer_is(NoBroker, monkeypatch)
    _released_after_one_replacement(kafka_config, replay_buffer_thread, made)
    assert NoBroker.probes == 1  # probed once, after the stall limit


@pytest.mark.slow
def test_a_released_read_that_never_returns_is_given_up_and_made_again(
    kafka_config: KafkaConfig, replay_buffer_thread, monkeypatch, caplog
):
    """Fault injector (a test double): the first read of the released topic blocks, as one
    of librdkafka's polls did after a broker restart in CI (eight minutes, nothing
    released). It is given up after RELEASED_READ_LIMIT_S with its stack logged, and the
    retry, on new clients, releases every group once."""
    release = threading.Event()
    parts_read: list[int] = []
    real_read_released = partition_recovery.read_released

    def hangs_the_first_time(*args):
        parts_read.append(args[2])
        if len(parts_read) == 1:
            release.wait(WAIT_S)  # a poll that does not return
            raise BrokerError("injected hang ended")
        return real_read_released(*args)

    monkeypatch.setattr(partition_recovery, "read_released", hangs_the_first_time)
    monkeypatch.setattr(partition_recovery, "RELEASED_READ_LIMIT_S", 5.0)
    cfg = _config(kafka_config)
    uids = [f"h{uuid.uuid4().hex[:10]}" for _ in range(6)]
    _produce(kafka_config, [e for uid in uids for e in group_events(uid)])
    try:
        with (
            caplog.at_level(logging.WARNING, logger=partition_recovery.__name__),
            replay_buffer_thread(cfg, ReplayBufferMetrics(CollectorRegistry())),
        ):
            keys = _wait_for_keys(cfg, _expected_keys(uids))
    finally:
        release.set()
    assert not _dupes(keys) and set(keys) == _expected_keys(uids)
    assert parts_read.count(parts_read[0]) >= 2  # the hung partition was read again
    # the injected hang, by where the abandoned read was (on two busy cores a real read may
    # also go 5 s without an answer, and is given up and made again as well)
    given_up = [r.getMessage() for r in caplog.records if r.name == partition_recovery.__name__]
    [hung] = [line for line in given_up if "release.wait(WAIT_S)" in line]
    assert "no answer within 5 s" in hung


def test_a_member_with_no_partition_that_reads_metadata_is_kept(kafka_config: KafkaConfig):
    """The other side of the rule above: a consumer that owns nothing (every partition is
    another member's) but reaches its broker is probed after the stall limit and kept."""
    cfg = _config(kafka_config, **{"replay_buffer.txn_stall_s": 0.2})
    member = GroupMember(
        kafka_config,
        unique_name("idle"),
        [Topics.from_config(kafka_config).turns],
        overrides={},
        on_assign=lambda consumer, partitions: None,
        on_revoke=lambda consumer, partitions: None,
        on_replaced=lambda: None,
    )
    first = member.consumer
    metrics = ReplayBufferMetrics(CollectorRegistry())
    watch = StuckConsumerWatch(cfg, member, metrics)
    try:
        assert not watch.check_unassigned(owns_partitions=False)  # the clock starts
        time.sleep(0.3)
        assert not watch.check_unassigned(owns_partitions=False)  # probed: metadata read
    finally:
        member.close()
    assert member.consumer is first and metrics.consumer_replacements._value.get() == 0


def _first_consumer_is(double: type[Consumer], monkeypatch) -> list[Consumer]:
    """Every consumer a GroupMember makes from now on; the first is ``double``'s."""
    made: list[Consumer] = []
    real_new_consumer = GroupMember._new_consumer

    def new_consumer(member):
        if made:
            made.append(real_new_consumer(member))
        else:
            settings = read_committed_consumer_settings(
                member.kafka, member.group_id, overrides=member._overrides
            )
            made.append(double(settings))
        return made[-1]

    monkeypatch.setattr(GroupMember, "_new_consumer", new_consumer)
    return made


def _released_after_one_replacement(
    kafka_config: KafkaConfig, replay_buffer_thread, made: list[Consumer]
) -> None:
    """A buffer with a 3 s stall limit releases six groups once each, having replaced its
    first consumer once."""
    cfg = _config(kafka_config, **{"replay_buffer.txn_stall_s": 3.0})
    uids = [f"s{uuid.uuid4().hex[:10]}" for _ in range(6)]
    _produce(kafka_config, [e for uid in uids for e in group_events(uid)])
    metrics = ReplayBufferMetrics(CollectorRegistry())
    with replay_buffer_thread(cfg, metrics):
        keys = _wait_for_keys(cfg, _expected_keys(uids))
    assert len(made) == 2, made
    assert metrics.consumer_replacements._value.get() == 1
    assert not _dupes(keys) and set(keys) == _expected_keys(uids)


@pytest.mark.slow
@pytest.mark.kafka  # a broker of its own, restarted mid-run
def test_the_buffer_survives_a_broker_restart(tmp_path: Path):
    port = free_port()
    broker_cfg = Config(
        broker=BrokerConfig(
            data_dir=tmp_path / "kafka",
            port=port,
            controller_port=free_port(),
            heap="256m",
            start_timeout_s=120.0,
        ),
        kafka=KafkaConfig(bootstrap_servers=f"127.0.0.1:{port}", topic_prefix="r", partitions=2),
    )
    cfg = _config(broker_cfg.kafka)
    uids = [f"b{uuid.uuid4().hex[:10]}" for _ in range(300)]
    markers = _uids_on_every_partition(cfg.kafka, "after")
    log = tmp_path / "rb.log"
    try:
        start_broker(broker_cfg)
        ensure_topics(cfg.kafka)
        with running(
            [spawn(["replay-buffer", "run"], write_config(cfg, tmp_path / "c.yaml"), log)]
        ) as [proc]:
            _wait_for_recovered(log, proc)
            # groups keep arriving (the producer queues while the broker is down), so the
            # buffer is between polls and commits when the broker goes away
            feeder = threading.Thread(target=_trickle, args=(cfg.kafka, uids, 0.02), daemon=True)
            feeder.start()
            time.sleep(2)
            assert stop_broker(broker_cfg)
            time.sleep(3)
            start_broker(broker_cfg)
            stall_s = _seconds_to_release_markers(cfg, markers, proc, log)
            # read by benchmarks/fault_row_loop.py (pytest -s)
            print(f"\nbroker-restart stall: {stall_s:.1f} s from the broker back to a release")
            feeder.join(180)
            keys = _wait_for_keys(cfg, _expected_keys(uids + markers), timeout_s=240, procs=[proc])
            assert proc.poll() is None, log.read_text()[-3000:]
    finally:
        stop_broker(broker_cfg)
    assert not _dupes(keys), f"released twice: {sorted(_dupes(keys))[:5]}"
    assert set(keys) == _expected_keys(uids + markers)


def _seconds_to_release_markers(
    cfg: Config, markers: list[str], proc, log: Path, timeout_s: float = 240.0
) -> float:
    """Seconds from the broker answering again until groups produced after that (one per
    partition) are released: the release stall as a trainer sees it. (Counting any release
    after a first read raced: that read could finish after the last group was released.)"""
    back = time.monotonic()
    # a new client right after the restart may wait for the coordinator to load
    _produce(cfg.kafka, [e for uid in markers for e in group_events(uid)], flush_s=timeout_s / 2)
    wanted = _expected_keys(markers)
    while time.monotonic() - back < timeout_s:
        assert proc.poll() is None, "the replay buffer exited: " + log.read_text()[-3000:]
        if wanted <= set(_keys(cfg)):
            return time.monotonic() - back
        time.sleep(0.5)
    raise AssertionError(
        f"groups produced after the broker restart not released within {timeout_s:.0f} s; "
        "the buffer's log:\n" + log.read_text(errors="replace")[-6000:]
    )


def _trickle(kafka: KafkaConfig, uids: list[str], pause_s: float) -> None:
    """One group every ``pause_s`` seconds; waits for every delivery at the end."""
    producer = idempotent_producer(kafka, {"linger.ms": 5})
    topic = Topics.from_config(kafka).turns
    for uid in uids:
        for _, key, value in group_events(uid):
            producer.produce(
                topic, key=key, value=value, partition=partition_for(uid, kafka.partitions)
            )
        producer.poll(pause_s)
    assert producer.flush(120) == 0


def _wait_for_recovered(log: Path, proc, timeout_s: float = 60.0, partitions: int = 2) -> None:
    """Until the buffer logging to ``log`` has recovered ``partitions`` partitions."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(log.read_text()[-3000:])
        if log.exists() and log.read_text().count("recovered") >= partitions:
            return
        time.sleep(0.5)
    raise AssertionError(f"buffer did not take its partitions: {log.read_text()[-3000:]}")
