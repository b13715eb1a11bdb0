"""Fuzzed bad records on every topic (hypothesis; strategies in ``tests/fuzz_records.py``).

Pure part: each decoder a worker uses either returns a record the rest of the pipeline can
carry, or raises a pydantic ``ValidationError`` or a ``RolloutBusError`` (what the workers
catch and dead-letter) — never a ``KeyError``, ``TypeError``, ``UnicodeDecodeError`` or
``ArrowInvalid``, which would crash a worker.

Integration part (``kafka``, ``slow``): the session worker and the replay buffer run as
real processes (``rolloutbus ... run --config``) against a scripted replica (a test double
that returns fixed tokens: no model is needed to route bad records). A few hundred
generated bad records go to rollout.prompts and rollout.turns, interleaved with good
prompt groups; the workers must stay up, every good group must arrive exactly once, and
every bad record must come out as exactly one dead letter. "Bad" is what the workers'
decoders refuse: a valid record with an unknown field added is what a newer writer sends,
and is read, its field skipped (``docs/schema-evolution.md``).
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from rolloutbus.config import Config, KafkaConfig, with_overrides
from rolloutbus.errors import RolloutBusError
from rolloutbus.kafka.admin import ensure_topics
from rolloutbus.kafka.clients import idempotent_producer, record_location
from rolloutbus.producers.datasets import make_arithmetic_rows
from rolloutbus.producers.publish import PromptPublisher, build_group
from rolloutbus.replica.scripted import ScriptedEngine, ScriptedTurn
from rolloutbus.replica.server import replica_in_thread
from rolloutbus.schemas.prompts import DatasetRow, PromptGroup, decode_prompt_group
from rolloutbus.schemas.trajectories import TRAJECTORY_SCHEMA, decode_trajectory_batch
from rolloutbus.schemas.turns import (
    Generation,
    GroupStarted,
    SessionFinished,
    decode_turn_event,
    encode_turn_event,
)
from rolloutbus.topics import Topics, partition_for, trajectory_key, uid_of_key
from tests.builders import make_group_started, make_session_failed
from tests.fuzz_records import (
    PROMPT_GROUP,
    TRAJECTORY,
    TURN_EVENTS,
    bad_prompt_record,
    bad_trajectory_record,
    bad_turn_record,
    not_utf8,
    truncated,
)
from tests.helpers import unique_name
from tests.pipeline import dead_letters, read_topic, receive_groups, running, spawn, write_config
from tests.scripted_server import qwen3_tokenizer

HANDLED = (ValidationError, RolloutBusError)  # what the workers catch around a decoder
# derandomize: the same examples on every run and machine (a CI failure reproduces);
# database=None: nothing written under .hypothesis/
FUZZ = settings(
    max_examples=400,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _decode(decoder: Callable[[Any], Any], value: Any) -> Any:
    """The decoded record, or None when the decoder rejected it the way workers handle."""
    try:
        return decoder(value)
    except HANDLED:
        return None
    except Exception as exc:  # the finding: a worker catching HANDLED would crash here
        pytest.fail(
            f"{getattr(decoder, '__qualname__', decoder)} leaked {type(exc).__name__}: "
            f"{exc} (input {_short(value)})"
        )


def _short(value: Any, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def _decode_prompt_group(value: bytes) -> PromptGroup | None:
    return _decode(decode_prompt_group, value)  # the session worker's decoder


def _decode_turn(value: bytes) -> BaseModel | None:
    return _decode(decode_turn_event, value)


def _decode_trajectory(value: bytes) -> pa.RecordBatch | None:
    return _decode(decode_trajectory_batch, value)


# -- the valid templates decode (the mutations start from real records) -----------------


def test_templates_are_valid_records() -> None:
    assert _decode_prompt_group(json.dumps(PROMPT_GROUP).encode()) is not None
    assert all(_decode_turn(json.dumps(e).encode()) is not None for e in TURN_EVENTS)
    assert _decode_trajectory(TRAJECTORY) is not None


# -- each decoder, on its own topic's bad records ----------------------------------------


@FUZZ
@given(bad_prompt_record)
def test_prompt_group_decoder_rejects_cleanly(value: bytes) -> None:
    group = _decode_prompt_group(value)
    if group is None:
        return
    # accepted: the worker re-encodes it (dead letters, GroupStarted) and hands its row to
    # the agent loop and, through the turn log, to the trajectory's prompt columns
    again = PromptGroup.model_validate_json(group.model_dump_json(by_alias=True))
    assert again == group
    DatasetRow.model_validate(group.row)  # a row the publisher itself would have accepted
    GroupStarted(
        uid=group.uid,
        attempt="a",
        n=group.n,
        row=group.row,
        validate=group.validate_,
        global_steps=group.global_steps,
        policy_version=group.policy_version,
    )


# integers an accepted turn event carries into a trajectory column: they must fit its type
_ARROW_BOUND = {
    "session_id": "session_id",
    "global_steps": "global_steps",
    "policy_version": "min_global_steps",  # of a Generation: the trajectory's policy versions
    "num_turns": "num_turns",
    "num_preempted": "num_preempted",
}


def _assert_fits_trajectory_columns(event: BaseModel) -> None:
    values: list[tuple[str, Any]] = []
    if hasattr(event, "session_id"):
        values.append(("session_id", event.session_id))
    if isinstance(event, GroupStarted):
        values.append(("global_steps", event.global_steps))
    if isinstance(event, Generation):
        values.append(("policy_version", event.policy_version))
    if isinstance(event, SessionFinished):
        for out in event.outputs:
            values += [("num_turns", out.num_turns), ("num_preempted", out.metrics.num_preempted)]
    for field, value in values:
        column = TRAJECTORY_SCHEMA.field(_ARROW_BOUND[field])
        try:
            pa.array([value], type=column.type)
        except (pa.ArrowInvalid, OverflowError) as exc:
            pytest.fail(
                f"{type(event).__name__}.{field} = {value} was accepted but does not fit "
                f"the trajectory column {column.name} ({column.type}): {exc}"
            )


@FUZZ
@given(bad_turn_record)
def test_turn_event_decoder_rejects_cleanly(value: bytes) -> None:
    event = _decode_turn(value)
    if event is None:
        return
    # accepted: the replay buffer folds it, and replay re-encodes it; token arrays must
    # survive the int32/float32 wire encoding and integers must fit the Arrow columns
    try:
        again = decode_turn_event(encode_turn_event(event))
    except Exception as exc:
        pytest.fail(
            f"accepted turn event cannot be re-encoded: {type(exc).__name__}: {exc} "
            f"(input {_short(value)})"
        )
    assert type(again) is type(event)
    _assert_fits_trajectory_columns(event)


@FUZZ
@given(bad_trajectory_record)
def test_trajectory_decoder_rejects_cleanly(value: bytes) -> None:
    batch = _decode_trajectory(value)
    if batch is None:
        return
    # accepted: the trainer client reads row 0's uid and group_size, then concatenates
    # a group's rows under TRAJECTORY_SCHEMA
    assert batch.num_rows == 1 and batch.schema.equals(TRAJECTORY_SCHEMA)


@FUZZ
@given(
    st.one_of(
        not_utf8,
        truncated(
            [
                json.dumps(PROMPT_GROUP).encode(),
                TRAJECTORY,
                *(json.dumps(e).encode() for e in TURN_EVENTS),
            ]
        ),
    )
)
def test_always_invalid_records_are_rejected_by_every_decoder(value: bytes) -> None:
    assert _decode_prompt_group(value) is None
    assert _decode_turn(value) is None
    assert _decode_trajectory(value) is None


@pytest.mark.parametrize("value", [None, "", "{}", bytearray(b"{}"), memoryview(b"\x00")])
def test_values_that_are_not_bytes(value: Any) -> None:
    """A tombstone (value None) or a str from a client library: rejected, not a TypeError."""
    assert _decode_prompt_group(value) is None
    assert _decode_turn(value) is None
    assert _decode_trajectory(value) is None


# -- integration: the workers, on a stream of bad records ---------------------------------

N = 2  # sessions per good group
GOOD_GROUPS = 4
BAD_PER_TOPIC = 150  # records generated per topic: a few hundred in all
GROUPS_TIMEOUT_S = 180.0  # seconds for the good groups (workers start on 2 shared cores)
DEAD_LETTER_TIMEOUT_S = 60.0  # seconds for the last dead letter after the good groups arrived
SETTLE_S = 3.0  # seconds to wait for records beyond the expected ones
WORKER_STAGES = {
    "sessions": "prompts",
    "replay_buffer": "turns",
}  # dead-letter stage -> input topic
KEYS = [None, b"", b"\xff\x00not-a-uid", b"0123456789abcdef0123456789abcdef"]  # bad records' keys


def generate(strategy: st.SearchStrategy[bytes], count: int) -> list[bytes]:
    """``count`` examples of ``strategy``, the same ones on every run (derandomized)."""
    out: list[bytes] = []

    @settings(
        max_examples=count,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(value: bytes) -> None:
        out.append(value)

    collect()
    return out[:count]


def rejected(values: list[bytes], decoder: Callable[[bytes], Any]) -> list[bytes]:
    """The values ``decoder`` rejects. One it accepts is a valid (if odd) record that the
    worker would process like any other, not a bad one, so it stays out of the stream."""
    return [v for v in values if _decode(decoder, v) is None]


Workers = dict[str, Any]  # name -> Popen
Logs = dict[str, Path]


@pytest.fixture(scope="module")
def fuzz_pipeline(
    kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Config, Workers, Logs]]:
    """Session worker and replay buffer as processes, fed by a scripted replica (a test
    double answering every prompt with "5" and end-of-turn) served from this process."""
    tok = qwen3_tokenizer()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    answer = [*tok.encode("5"), end]
    engine = ScriptedEngine(
        lambda prompt: ScriptedTurn(answer, [-0.5] * len(answer)),
        tokenizer=tok,
        eos_token_ids=frozenset({end}),
    )
    tmp = tmp_path_factory.mktemp("fuzz")
    cfg = Config.model_validate(
        {
            "kafka": {
                "bootstrap_servers": kafka_bootstrap,
                "topic_prefix": unique_name("f"),
                "partitions": 2,
            },
            "model": {"name": "tiny-qwen3"},
            "replica_server": {"port": 0},
            "rollout": {"n": N, "prompt_length": 64, "response_length": 16},
            "sessions": {"app_id": unique_name("sessions"), "concurrency": 4},
            "replay_buffer": {
                "group_id": unique_name("rb"),
                "transactional_id": unique_name("rbtx"),
            },
        }
    )
    ensure_topics(cfg.kafka)
    with replica_in_thread(cfg, engine) as replica:
        cfg = with_overrides(cfg, {"replicas.urls": [replica.url]})
        config_path = write_config(cfg, tmp / "config.yaml")
        logs = {"sessions": tmp / "sessions.log", "replay": tmp / "replay.log"}
        workers = {
            "sessions": spawn(["sessions", "run"], config_path, logs["sessions"]),
            "replay": spawn(["replay-buffer", "run"], config_path, logs["replay"]),
        }
        with running(list(workers.values())):
            yield cfg, workers, logs


def _assert_alive(workers: Workers, logs: Logs) -> None:
    for name, proc in workers.items():
        assert proc.poll() is None, (
            f"the {name} worker exited ({proc.returncode}) on bad "
            f"records:\n{logs[name].read_text()[-4000:]}"
        )


def _produce(cfg: Config, records: list[tuple[str, int, bytes | None, bytes | None]]) -> list[int]:
    """Produce (topic, partition, key, value) records and wait; returns their offsets. The
    producer lives only in here: one kept alive by a failed test's traceback would go on
    reconnecting after the session broker stopped."""
    offsets: list[int] = []
    producer = idempotent_producer(cfg.kafka)
    for topic, partition, key, value in records:
        producer.produce(
            topic,
            key=key,
            value=value,
            partition=partition,
            on_delivery=lambda err, msg: offsets.append(msg.offset()),
        )
    assert producer.flush(30.0) == 0 and len(offsets) == len(records)
    return offsets


def _publish(cfg: Config, group: PromptGroup) -> None:
    publisher = PromptPublisher(cfg)
    publisher.publish_group(group)
    publisher.flush()


def _letters_by_stage(
    cfg: Config, expected: int, workers: Workers, logs: Logs
) -> dict[str, list[bytes]]:
    """The originals of the dead letters, by stage, once ``expected`` have arrived (or the
    time is up) and a little longer, so that a letter too many shows too."""
    deadline = time.monotonic() + DEAD_LETTER_TIMEOUT_S
    while len(dead_letters(cfg)) < expected and time.monotonic() < deadline:
        _assert_alive(workers, logs)
        time.sleep(1.0)
    time.sleep(SETTLE_S)
    by_stage: dict[str, list[bytes]] = {}
    for letter in dead_letters(cfg):
        assert letter["reason"].strip(), f"a dead letter without a reason: {letter}"
        by_stage.setdefault(letter["stage"], []).append(base64.b64decode(letter["original_b64"]))
    return by_stage


@pytest.mark.slow
def test_workers_survive_bad_records_and_dead_letter_each_once(fuzz_pipeline) -> None:
    cfg, workers, logs = fuzz_pipeline
    topics = Topics.from_config(cfg.kafka)
    bad = {
        "prompts": rejected(generate(bad_prompt_record, BAD_PER_TOPIC), decode_prompt_group),
        "turns": rejected(generate(bad_turn_record, BAD_PER_TOPIC), decode_turn_event),
    }
    assert all(len(values) > BAD_PER_TOPIC // 2 for values in bad.values()), {
        k: len(v) for k, v in bad.items()
    }
    good = [
        build_group(cfg, row) for row in make_arithmetic_rows(GOOD_GROUPS, seed=11, tool_fraction=0)
    ]

    # in: a good group, then every GOOD_GROUPS-th bad record of both topics, and again
    names = {"prompts": topics.prompts, "turns": topics.turns}
    for i, group in enumerate(good):
        _publish(cfg, group)
        _produce(
            cfg,
            [
                (names[topic], j % cfg.kafka.partitions, KEYS[j % len(KEYS)], values[j])
                for topic, values in bad.items()
                for j in range(i, len(values), GOOD_GROUPS)
            ],
        )

    # out: every good group, complete, and nothing else, once
    groups = receive_groups(cfg, {g.uid for g in good}, timeout_s=GROUPS_TIMEOUT_S)
    assert all(len(group) == N for group in groups.values())
    _assert_alive(workers, logs)
    keys = [m.key().decode() for m in read_topic(cfg, topics.trajectories)]
    assert sorted(keys) == sorted(trajectory_key(g.uid, s, 0) for g in good for s in range(N)), (
        "trajectories other than the good groups', or one of theirs twice"
    )
    assert {uid_of_key(k) for k in keys} == {g.uid for g in good}

    # dead letters: exactly one per bad record, from the stage that read it
    letters = _letters_by_stage(cfg, sum(map(len, bad.values())), workers, logs)
    _assert_alive(workers, logs)
    assert set(letters) <= set(WORKER_STAGES), sorted(letters)
    for stage, topic in WORKER_STAGES.items():
        got, sent = sorted(letters.get(stage, [])), sorted(bad[topic])
        assert got == sent, (
            f"{topic}: {len(sent)} bad records in, {len(got)} dead letters "
            f"from {stage} (missing {len(set(sent) - set(got))}, "
            f"unexpected {len(set(got) - set(sent))})"
        )


# -- near misses the decoders cannot catch: schema-valid records a worker once stumbled on --
# Found by the fuzzing above (a tombstone prompt crashed the session worker's parser; events
# the fold cannot apply ended the replay buffer); each is now a regression test.

PROBE_TIMEOUT_S = 20.0  # seconds for the worker to dead-letter the record or to die of it


@pytest.mark.slow
def test_a_tombstone_prompt_is_dead_lettered(fuzz_pipeline) -> None:
    cfg, workers, logs = fuzz_pipeline
    topic = Topics.from_config(cfg.kafka).prompts
    [offset] = _produce(cfg, [(topic, 0, b"tombstone", None)])
    source = record_location(topic, 0, offset)
    deadline = time.monotonic() + PROBE_TIMEOUT_S
    while not any(d["source"] == source and d["stage"] == "sessions" for d in dead_letters(cfg)):
        if time.monotonic() > deadline:
            pytest.fail(f"no dead letter for the tombstone at {source} within {PROBE_TIMEOUT_S} s")
        time.sleep(1.0)
    _assert_alive(workers, logs)


@pytest.fixture
def replay_buffer_alone(
    kafka_bootstrap: str, tmp_path: Path
) -> Iterator[tuple[Config, Workers, Logs]]:
    """A replay-buffer process on topics of its own: turn events go in by hand."""
    cfg = Config.model_validate(
        {
            "kafka": {
                "bootstrap_servers": kafka_bootstrap,
                "topic_prefix": unique_name("f"),
                "partitions": 2,
            },
            "replay_buffer": {
                "group_id": unique_name("rb"),
                "transactional_id": unique_name("rbtx"),
            },
        }
    )
    ensure_topics(cfg.kafka)
    log = tmp_path / "replay.log"
    proc = spawn(["replay-buffer", "run"], write_config(cfg, tmp_path / "config.yaml"), log)
    with running([proc]):
        yield cfg, {"replay": proc}, {"replay": log}


def _orphan_generation(uid: str) -> list[BaseModel]:
    # a generation whose segment_started never came: SessionFold raises SchemaError
    return [Generation(uid=uid, session_id=0, attempt="a", segment=0, turn=0, token_ids=[1])]


def _group_with_a_string_prompt(uid: str) -> list[BaseModel]:
    # GroupStarted.row is any dict: on release, Trajectory(raw_prompt=list("...")) fails
    return [
        make_group_started(uid, row={"prompt": "a string prompt"}),
        make_session_failed(uid, error="no prompt"),
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "bad_events",
    [_orphan_generation, _group_with_a_string_prompt],
    ids=["orphan_generation", "group_with_string_prompt"],
)
def test_replay_buffer_survives_schema_valid_events_it_cannot_fold(
    replay_buffer_alone, bad_events
) -> None:
    cfg, workers, logs = replay_buffer_alone
    topics = Topics.from_config(cfg.kafka)
    bad_uid, good_uid = "badbadbad", "goodgoodgood"
    good = [
        make_group_started(good_uid),
        make_session_failed(good_uid, error="no replica"),
    ]
    _produce(
        cfg,
        [
            (
                topics.turns,
                partition_for(e.uid, cfg.kafka.partitions),
                e.uid.encode(),
                encode_turn_event(e),
            )
            for e in [*bad_events(bad_uid), *good]
        ],
    )
    deadline = time.monotonic() + PROBE_TIMEOUT_S
    keys: list[str] = []
    while trajectory_key(good_uid, 0, 0) not in keys and time.monotonic() < deadline:
        _assert_alive(workers, logs)
        time.sleep(1.0)
        keys = [m.key().decode() for m in read_topic(cfg, topics.trajectories)]
    _assert_alive(workers, logs)
    assert trajectory_key(good_uid, 0, 0) in keys, "the group after the bad events was not released"
    letters = [
        base64.b64decode(d["original_b64"])
        for d in dead_letters(cfg)
        if d["stage"] == "replay_buffer"
    ]
    assert any(bad_uid.encode() in original for original in letters), (
        "the bad events were not dead-lettered"
    )


# -- the trainer client, on junk in the trajectory topic -----------------------------------


def test_the_trainer_client_dead_letters_junk_on_the_trajectory_topic(
    kafka_config: KafkaConfig,
) -> None:
    """Only the replay buffer writes trajectories, but a record another writer put there (or
    one corrupted on the way) must not end the trainer: each bad record is dead-lettered
    by the trainer client, once, and the good group around them is yielded whole."""
    from rolloutbus.consumers.client import TrainerClient
    from tests.fuzz_records import UID

    cfg = Config(kafka=kafka_config)
    topic = Topics.from_config(kafka_config).trajectories
    bad = rejected(generate(bad_trajectory_record, 40), decode_trajectory_batch)
    home = partition_for(UID, kafka_config.partitions)
    junk = [(topic, j % kafka_config.partitions, KEYS[j % len(KEYS)], v) for j, v in enumerate(bad)]
    good = (topic, home, trajectory_key(UID, 0, 0).encode(), TRAJECTORY)
    _produce(cfg, [*junk[: len(junk) // 2], good, *junk[len(junk) // 2 :]])

    with TrainerClient(kafka_config, unique_name("trainer")) as client:
        groups = list(client.groups(timeout_s=10.0))
    assert [(g.uid, len(g)) for g in groups] == [(UID, 1)]
    assert client.dead_letters == len(bad)
    letters = [d for d in dead_letters(cfg) if d["stage"] == "trainer"]
    assert sorted(base64.b64decode(d["original_b64"]) for d in letters) == sorted(bad)
    assert all(d["source"].startswith(f"{topic}[") for d in letters)
