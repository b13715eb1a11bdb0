"""Records are readable forever (``docs/schema-evolution.md``).

Every released format's samples (``tests/data/formats/<release>/``, written by that
release's own code) are read with today's code: the prompt groups, control events and
dead letters decode; the trajectories decode into today's layout keeping every value their
writer wrote; the turn log folds (as the replay buffer and ``rolloutbus replay`` fold it)
into the trajectories that release released. The ``current`` samples pin today's formats:
a model change without new samples (add-only) or a version bump (breaking) fails here,
saying what to run. The rules for records of other versions (unknown fields, newer and
older ``SCHEMA_VERSION``, upcasters) are tested on records made to break them.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import logging
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args

import pyarrow as pa
import pytest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rolloutbus.config import KafkaConfig
from rolloutbus.consumers.client import TrainerClient
from rolloutbus.consumers.log_replay import replay_turns
from rolloutbus.consumers.tensors import to_padded
from rolloutbus.errors import SchemaError
from rolloutbus.schemas import evolution, version
from rolloutbus.schemas.arrow_layout import Arrow, ArrowLayout, Derived, Flatten
from rolloutbus.schemas.control import decode_control_event
from rolloutbus.schemas.dlq import decode_dead_letter
from rolloutbus.schemas.prompts import decode_prompt_group
from rolloutbus.schemas.tokens import Int32
from rolloutbus.schemas.trajectories import (
    TRAJECTORY_LAYOUT,
    TRAJECTORY_SCHEMA,
    Trajectory,
    batch_to_trajectories,
    decode_trajectory_batch,
    encode_trajectories,
    trajectories_to_batch,
)
from rolloutbus.schemas.turns import (
    Generation,
    TurnEvent,
    decode_turn_event,
    encode_turn_event,
)
from rolloutbus.streams.assembly.partition_fold import FoldLimits, PartitionFold
from rolloutbus.streams.assembly.trajectories import finalize_group, max_record_bytes
from rolloutbus.topics import Topics, partition_for, session_key, uid_of_key
from tests.helpers import unique_name
from tests.source_tree import TEST_DATA

DATA = TEST_DATA
FORMATS = DATA / "formats"
REGENERATE = "python tests/data/make_format_samples.py"


def _load_generator() -> Any:
    spec = importlib.util.spec_from_file_location(
        "make_format_samples", DATA / "make_format_samples.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


samples = _load_generator()
RELEASED = sorted(samples.RELEASES, key=lambda name: int(name.split("-")[1]))
ALL = [*RELEASED, samples.CURRENT]


def _lines(release: str, name: str) -> list[bytes]:
    path = FORMATS / release / name
    return path.read_bytes().splitlines() if path.exists() else []


def _trajectory_records(release: str) -> list[tuple[str, bytes]]:
    rows = [json.loads(line) for line in _lines(release, "trajectories.jsonl")]
    return [(r["key"], base64.b64decode(r["value_b64"])) for r in rows]


def _raw_batch(value: bytes) -> pa.RecordBatch:
    """A record's batch exactly as its writer laid it out (no decoding rules applied)."""
    return pa.ipc.open_stream(pa.py_buffer(value)).read_next_batch()


def _fold(release: str) -> tuple[list[tuple[str, bytes]], PartitionFold]:
    """Today's replay-buffer fold of the release's turn log: (key, record) released."""
    cfg = samples.sample_config()
    fold = PartitionFold(0, limits=FoldLimits.from_config(cfg))
    out = []
    for offset, value in enumerate(_lines(release, "turns.jsonl")):
        for group in fold.fold(offset, decode_turn_event(value)):
            done = finalize_group(group, cfg.rollout, max_record_bytes=max_record_bytes(cfg.kafka))
            assert not done.letters, f"{release}: {done.letters}"
            out += list(zip((t.key for t in done.trajectories), done.records, strict=True))
    return out, fold


# -- the Arrow layout derived from a model ----------------------------------------------


class _Inner(BaseModel):
    seconds: float = 0.0
    count: Int32 = -1


class _Record(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str
    kind: Literal["loop", "reward"] | None = None
    width: Annotated[int, Arrow(pa.int16())] = 0
    wide: int = 0
    ids: Annotated[list[int], Arrow(pa.large_list(pa.int32()))] = []
    inner: Annotated[_Inner, Flatten()] = _Inner()
    notes: dict[str, Any] = {}
    flag: bool = Field(default=False, alias="on")


def test_an_arrow_layout_is_derived_from_the_model_and_read_back_by_name() -> None:
    layout = ArrowLayout(
        _Record, [Derived("n_ids", pa.int32(), "ids", lambda r: len(r.ids))], metadata={"v": "1"}
    )
    assert [(f.name, str(f.type)) for f in layout.schema] == [
        ("name", "string"),
        ("kind", "string"),
        ("width", "int16"),
        ("wide", "int64"),
        ("ids", "large_list<item: int32>"),
        ("n_ids", "int32"),
        ("seconds", "double"),
        ("count", "int32"),
        ("notes", "string"),
        ("on", "bool"),
    ]
    record = _Record(name="a", kind="loop", ids=[1, 2], inner=_Inner(seconds=0.5), notes={"k": 1})
    batch = layout.batch([record])
    assert batch.column("notes").to_pylist() == ['{"k": 1}'] and layout.records(batch) == [record]
    older = batch.drop_columns(["kind", "count", "notes", "n_ids"])
    assert layout.records(older) == [record.model_copy(update={"kind": None, "notes": {}})]
    assert layout.required == ("name",)


def test_a_field_without_an_arrow_type_is_refused_when_the_layout_is_made() -> None:
    class Odd(BaseModel):
        when: complex = 0j

    with pytest.raises(TypeError, match=r"Odd.when: no Arrow column type"):
        ArrowLayout(Odd)


# -- every release's samples, read with today's code ------------------------------------


def test_every_release_has_samples_written_by_its_commit() -> None:
    for release in ALL:
        manifest = json.loads((FORMATS / release / "manifest.json").read_text())
        assert manifest["release"] == release
        assert manifest["commit"] == samples.RELEASES.get(release, "")
        assert manifest["schema_version"] <= version.SCHEMA_VERSION
        for name, count in manifest["records"].items():
            assert len(_lines(release, name)) == count > 0, f"{release}/{name}"


@pytest.mark.parametrize("release", ALL)
def test_prompt_groups_decode(release: str) -> None:
    groups = [decode_prompt_group(line) for line in _lines(release, "prompts.jsonl")]
    assert [g.uid for g in groups] == list(samples.ROWS)
    for group in groups:
        row = {k: v for k, v in samples.ROWS[group.uid].items() if k != "__rollout_n__"}
        assert group.row == row
        assert group.n == samples.ROWS[group.uid]["__rollout_n__"]
        assert group.created_at == samples.T0


@pytest.mark.parametrize("release", ALL)
def test_control_events_and_dead_letters_decode(release: str) -> None:
    events = [decode_control_event(line) for line in _lines(release, "control.jsonl")]
    if release in ("stop-4", "stop-11"):  # released before rollout.control existed
        assert events == []
    else:
        assert [(e.policy_version, e.weights_path) for e in events] == [
            (0, None),
            (1, "/checkpoints/policy-1"),
        ]
    letters = [decode_dead_letter(line) for line in _lines(release, "dead_letters.jsonl")]
    assert [(d.stage, d.original) for d in letters] == [
        ("sessions", b"\xff not a prompt group"),
        ("replay_buffer", b""),
    ]


@pytest.mark.parametrize("release", ALL)
def test_trajectories_decode_keeping_every_value_their_writer_wrote(release: str) -> None:
    records = _trajectory_records(release)
    assert len(records) == 5
    for key, value in records:
        batch = decode_trajectory_batch(value)
        assert batch.schema.equals(TRAJECTORY_SCHEMA, check_metadata=True)
        [trajectory] = batch_to_trajectories(batch)
        assert trajectory.key == key
        written = _raw_batch(value)
        for name in written.schema.names:
            assert batch.column(name).equals(written.column(name)), f"{release} {key}: {name}"
        for name in set(TRAJECTORY_SCHEMA.names) - set(written.schema.names):
            # a column added after the release: its field's default
            fresh = trajectories_to_batch([Trajectory(**_required(trajectory))])
            assert batch.column(name).equals(fresh.column(name)), f"{release} {key}: {name}"


def _required(t: Trajectory) -> dict[str, Any]:
    return {
        name: getattr(t, name)
        for name, info in Trajectory.model_fields.items()
        if info.is_required()
    }


@pytest.mark.parametrize("release", ALL)
def test_turn_log_folds_into_what_the_release_released(release: str) -> None:
    """Today's fold of the release's turn log gives, in every column the release wrote,
    the values the release's own fold wrote (columns added since: what the log says)."""
    folded, fold = _fold(release)
    assert not fold.open
    released = _trajectory_records(release)
    assert [k for k, _ in folded] == [k for k, _ in released]
    for (key, today), (_, then) in zip(folded, released, strict=True):
        written = _raw_batch(then)
        again = decode_trajectory_batch(today)
        for name in written.schema.names:
            assert again.column(name).equals(written.column(name)), f"{release} {key}: {name}"
    statuses = [batch_to_trajectories(decode_trajectory_batch(r))[0].status for _, r in folded]
    assert statuses == ["completed", "completed", "completed", "failed", "failed"]


def test_a_batch_mixing_every_release_pads_for_the_trainer() -> None:
    """The trainer client concatenates a group's rows under TRAJECTORY_SCHEMA and pads."""
    batches = [decode_trajectory_batch(v) for r in ALL for _, v in _trajectory_records(r)]
    batch = pa.Table.from_batches(batches, TRAJECTORY_SCHEMA).combine_chunks().to_batches()[0]
    padded = to_padded(batch, prompt_length=8, response_length=8, pad_token_id=0)
    assert padded["input_ids"].shape == (len(batches), 16)
    tool = next(i for i, t in enumerate(batch_to_trajectories(batch)) if t.key == "fmt-tool_0_0")
    assert padded["response_mask"][tool].tolist() == [1, 1, 1, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("release", ALL)
def test_old_records_on_real_topics_are_read_by_replay_and_the_trainer_client(
    release: str, kafka_config: KafkaConfig, make_producer: Any
) -> None:
    """The release's records, produced to a real broker as its workers did: ``rolloutbus
    replay`` (``replay_turns``) folds its turn log, and the trainer client takes its
    trajectory records as complete groups and pads them."""
    topics = Topics.from_config(kafka_config)
    producer = make_producer(kafka=kafka_config)
    for value in _lines(release, "turns.jsonl"):
        event = json.loads(value)
        key = (
            session_key(event["uid"], event["session_id"])
            if "session_id" in event
            else event["uid"]
        )
        _produce(producer, kafka_config, topics.turns, key, value, event["uid"])
    released = _trajectory_records(release)
    for key, value in released:
        _produce(producer, kafka_config, topics.trajectories, key, value, uid_of_key(key))
    assert producer.flush(30) == 0

    replayed = replay_turns(samples.sample_config().model_copy(update={"kafka": kafka_config}))
    assert (replayed.undecodable, replayed.open_groups) == (0, [])
    assert sorted(replayed.records) == sorted(key for key, _ in released)
    for key, value in released:
        again, written = decode_trajectory_batch(replayed.records[key]), _raw_batch(value)
        assert all(again.column(n).equals(written.column(n)) for n in written.schema.names), key

    groups = {}
    with TrainerClient(kafka_config, unique_name("evolution")) as client:
        for group in client.groups(max_groups=3, timeout_s=60):
            groups[group.uid] = group
            client.commit(group)
    assert {uid: g.batch.num_rows for uid, g in groups.items()} == {
        "fmt-single": 2,
        "fmt-tool": 2,
        "fmt-fail": 1,
    }
    padded = to_padded(groups["fmt-tool"].batch, prompt_length=8, response_length=8, pad_token_id=0)
    assert padded["response_mask"][0].tolist() == [1, 1, 1, 0, 0, 1, 1, 1]


def _produce(
    producer: Any, kafka: KafkaConfig, topic: str, key: str, value: bytes, uid: str
) -> None:
    producer.produce(topic, key=key, value=value, partition=partition_for(uid, kafka.partitions))


# -- the current samples pin today's formats -----------------------------------------------


def _what_changed(stored: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Per record kind, the definitions whose schema differs (added, removed or changed)."""
    out = []
    for kind in sorted(set(stored) | set(now)):
        if stored.get(kind) == now.get(kind):
            continue
        before, after = _definitions(stored.get(kind)), _definitions(now.get(kind))
        changed = sorted(n for n in set(before) | set(after) if before.get(n) != after.get(n))
        out.append(f"{kind}: {', '.join(changed) or 'changed'}")
    return out


def _definitions(schemas: dict[str, Any] | None) -> dict[str, Any]:
    """Each model of a kind's schemas (``$defs`` and the top one), by mode and name."""
    out: dict[str, Any] = {}
    for mode, schema in (schemas or {}).items():
        if mode == "columns":  # the Arrow columns: one definition each
            out.update({f"column {c[0]}": c[1:] for c in schema})
            continue
        if not isinstance(schema, dict):
            out[mode] = schema
            continue
        for name, definition in schema.get("$defs", {}).items():
            out[f"{name} ({mode})"] = definition
        top = {k: v for k, v in schema.items() if k != "$defs"}
        out[f"top ({mode})"] = top
    return out


def _pin_message(changes: list[str]) -> str:
    return (
        "the record formats differ from tests/data/formats/current:\n  "
        + "\n  ".join(changes)
        + "\nAn add-only change (a new optional field with a default, docs/schema-evolution.md):"
        f" run `{REGENERATE}` and commit tests/data/formats/current. A breaking change: bump"
        " SCHEMA_VERSION (schemas/version.py), register an upcaster from the previous version"
        " (schemas/evolution.py), then regenerate."
    )


def test_models_match_the_current_fingerprint() -> None:
    stored = json.loads((FORMATS / samples.CURRENT / "schemas.json").read_text())
    now = samples.record_schemas(*samples.current_models())
    changes = _what_changed(stored, now)
    assert not changes, _pin_message(changes)
    manifest = json.loads((FORMATS / samples.CURRENT / "manifest.json").read_text())
    assert manifest["fingerprint"] == samples.fingerprint(now)
    assert manifest["schema_version"] == version.SCHEMA_VERSION, _pin_message(["SCHEMA_VERSION"])


def test_current_samples_are_what_this_code_writes(tmp_path: Path) -> None:
    """Byte for byte: an encoding change the JSON schemas do not show fails here too."""
    samples.write_samples(samples.CURRENT, tmp_path)
    stored = FORMATS / samples.CURRENT
    differ = [
        p.name
        for p in sorted(stored.iterdir())
        if p.read_bytes() != (tmp_path / p.name).read_bytes()
    ]
    assert not differ, _pin_message([f"{name} is not what this code writes" for name in differ])


def test_current_trajectories_re_encode_to_their_bytes() -> None:
    """Deriving the Arrow schema from the model kept the wire bytes. (The buffer encodes a
    group in one batch and writes each row as a slice, so a record's bytes depend on its
    group: each group is encoded again as a whole.)"""
    records = _trajectory_records(samples.CURRENT)
    by_group: dict[str, list[Trajectory]] = {}
    for _, value in records:
        [t] = batch_to_trajectories(decode_trajectory_batch(value))
        by_group.setdefault(t.uid, []).append(t)
    again = [r for group in by_group.values() for r in encode_trajectories(group)]
    assert again == [value for _, value in records]


def _turn_events_with_generation_field(name: str, kind: type, *default: Any) -> Any:
    """The TurnEvent union, its Generation given one more field (with ``default``, if any)."""
    body: dict[str, Any] = {"__annotations__": {name: kind}, "__module__": __name__}
    body.update(dict.fromkeys([name], *default) if default else {})
    wider = type("Generation", (Generation,), body)
    union, *_ = get_args(TurnEvent)
    members = tuple(wider if m is Generation else m for m in get_args(union))
    return Annotated[Union[members], Field(discriminator="type")]  # noqa: UP007


def test_a_changed_model_fails_the_fingerprint() -> None:
    """The pin notices a new field on a nested model, with its name in the message."""

    models, arrow = samples.current_models()
    stored = samples.record_schemas(models, arrow)
    models["turn_event"] = _turn_events_with_generation_field("spare", int, 0)
    changes = _what_changed(stored, samples.record_schemas(models, arrow))
    assert changes == ["turn_event: Generation (serialization), Generation (validation)"]
    assert "make_format_samples.py" in _pin_message(changes)
    wider = pa.schema(
        [*TRAJECTORY_SCHEMA, pa.field("spare", pa.int32())], metadata=TRAJECTORY_SCHEMA.metadata
    )
    assert _what_changed(stored, samples.record_schemas(samples.current_models()[0], wider)) == [
        "trajectory_arrow: column spare"
    ]


def _breaking_changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What an older reader or an older record cannot survive: a field or column removed,
    or a field added without a default, in a model both schemas define."""
    out = []
    for kind in sorted(set(before) & set(after)):
        if kind == "trajectory_arrow":
            gone = {c[0] for c in before[kind]["columns"]} - {c[0] for c in after[kind]["columns"]}
            out += [f"{kind}: column {name} removed" for name in sorted(gone)]
            continue
        old, new = _models(before[kind]["validation"]), _models(after[kind]["validation"])
        for name in sorted(set(old) & set(new)):
            removed = set(old[name].get("properties", {})) - set(new[name].get("properties", {}))
            added = set(new[name].get("properties", {})) - set(old[name].get("properties", {}))
            required = added & set(new[name].get("required", []))
            out += [f"{kind}: {name}.{f} removed" for f in sorted(removed)]
            out += [f"{kind}: {name}.{f} added without a default" for f in sorted(required)]
    return out


def _models(schema: dict[str, Any]) -> dict[str, Any]:
    """Every model a JSON schema defines, by name: a top-level model by its title (so a
    record kind that became a union of models, as control events did, is compared model by
    model), a top-level union by its members in ``$defs`` only."""
    models = dict(schema.get("$defs", {}))
    if "properties" in schema:
        models[schema.get("title", "<top>")] = schema
    return models


def test_every_change_since_a_release_is_add_only_or_bumps_the_version() -> None:
    """The rule, checked against every release: within one SCHEMA_VERSION, fields and
    columns are only added, each with a default."""
    now = samples.record_schemas(*samples.current_models())
    for release in RELEASED:
        manifest = json.loads((FORMATS / release / "manifest.json").read_text())
        if manifest["schema_version"] < version.SCHEMA_VERSION:
            continue  # a breaking change since: read through the upcasters (test below)
        stored = json.loads((FORMATS / release / "schemas.json").read_text())
        breaking = _breaking_changes(stored, now)
        assert not breaking, (
            f"breaking changes since {release} without a SCHEMA_VERSION bump: {breaking}; "
            "give new fields defaults, or bump SCHEMA_VERSION and register an upcaster "
            "(docs/schema-evolution.md)"
        )


def test_the_breaking_change_check_notices_one() -> None:
    models, arrow = samples.current_models()
    before = samples.record_schemas(models, arrow)

    models["turn_event"] = _turn_events_with_generation_field("replica_zone", str)
    narrower = pa.schema([f for f in arrow if f.name != "attempt"], metadata=arrow.metadata)
    after = samples.record_schemas(models, narrower)
    assert _breaking_changes(before, after) == [
        "trajectory_arrow: column attempt removed",
        "turn_event: Generation.replica_zone added without a default",
    ]


def test_released_versions_have_their_upcasters() -> None:
    """A sample of an older SCHEMA_VERSION is readable only through upcasters from it."""
    for release in ALL:
        written = json.loads((FORMATS / release / "manifest.json").read_text())["schema_version"]
        for kind in evolution.RECORD_KINDS:
            missing = set(range(written, version.SCHEMA_VERSION)) - evolution.upcaster_steps(kind)
            assert not missing, f"{release} ({written}): no {kind} upcaster from {sorted(missing)}"


# -- records of other versions -------------------------------------------------------------


def _current_trajectory() -> bytes:
    return _trajectory_records(samples.CURRENT)[0][1]


def _stream(batch: pa.RecordBatch) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def _with_metadata(batch: pa.RecordBatch, schema_version: str) -> pa.RecordBatch:
    return batch.replace_schema_metadata({version.SCHEMA_VERSION_KEY: schema_version})


def test_a_newer_writers_extra_column_is_skipped_with_a_warning(caplog: Any) -> None:
    batch = _raw_batch(_current_trajectory())
    newer = batch.append_column("failure_class_v9", pa.array(["tool_timeout"]))
    with caplog.at_level(logging.WARNING, logger="rolloutbus.schemas.evolution"):
        decoded = decode_trajectory_batch(_stream(_with_metadata(newer, "1")))
    assert decoded.equals(batch)
    assert "failure_class_v9" in caplog.text


def test_a_trajectory_of_a_newer_schema_version_is_refused_naming_both() -> None:
    batch = _with_metadata(_raw_batch(_current_trajectory()), str(version.SCHEMA_VERSION + 1))
    with pytest.raises(SchemaError, match=rf"schema version {version.SCHEMA_VERSION + 1}, newer"):
        decode_trajectory_batch(_stream(batch))


def test_a_trajectory_without_a_required_column_is_refused_naming_it() -> None:
    batch = _raw_batch(_current_trajectory())
    without = batch.drop_columns(["uid", "status"])
    with pytest.raises(SchemaError, match="lacks the required columns uid, status"):
        decode_trajectory_batch(_stream(without))
    assert set(TRAJECTORY_LAYOUT.required) == {
        "key",
        "uid",
        "session_id",
        "output_index",
        "num_outputs",
        "group_size",
        "status",
    }


def test_a_missing_optional_column_takes_its_fields_default() -> None:
    batch = _raw_batch(_current_trajectory())
    older = batch.drop_columns(["attempt", "tool_calls", "extra_columns"])
    [t] = batch_to_trajectories(decode_trajectory_batch(_stream(older)))
    assert (t.attempt, t.metrics.tool_calls, t.extra_columns) == ("", 0.0, {})


def _event(value: bytes) -> dict[str, Any]:
    return json.loads(value)


def _session_finished() -> dict[str, Any]:
    lines = _lines(samples.CURRENT, "turns.jsonl")
    return next(_event(v) for v in lines if _event(v)["type"] == "session_finished")


def test_a_newer_writers_event_fields_are_skipped_top_level_and_nested(caplog: Any) -> None:
    record = _session_finished()
    record["failure_class"] = "none"
    record["outputs"][0]["teacher_logprobs"] = [0.5]
    with caplog.at_level(logging.WARNING, logger="rolloutbus.schemas.evolution"):
        event = decode_turn_event(json.dumps(record).encode())
    assert event.outputs[0].response_len == record["outputs"][0]["response_len"]
    assert "failure_class" in caplog.text and "teacher_logprobs" in caplog.text


def test_an_unknown_field_does_not_hide_a_bad_value() -> None:
    record = _session_finished()
    record["failure_class"] = "none"
    record["session_id"] = -1
    with pytest.raises(ValidationError, match="session_id"):
        decode_turn_event(json.dumps(record).encode())


@pytest.mark.parametrize("decode", [decode_turn_event, decode_prompt_group, decode_control_event])
def test_a_json_record_of_a_newer_schema_version_is_refused(decode: Any) -> None:
    release_file = {decode_turn_event: "turns.jsonl", decode_prompt_group: "prompts.jsonl"}
    name = release_file.get(decode, "control.jsonl")
    record = _event(_lines(samples.CURRENT, name)[0])
    record["schema_version"] = version.SCHEMA_VERSION + 1
    with pytest.raises(SchemaError, match="upgrade the reader"):
        decode(json.dumps(record).encode())


def test_a_breaking_change_reads_the_previous_version_through_its_upcaster(
    monkeypatch: Any,
) -> None:
    """SCHEMA_VERSION 2 renamed a field (here: latency_s was latency_ms in version 1): a
    version-1 record is upcast on read; without the upcaster it is refused, saying so."""
    old = next(
        _event(v)
        for v in _lines(samples.CURRENT, "turns.jsonl")
        if _event(v)["type"] == "generation"
    )
    old["latency_ms"] = old.pop("latency_s") * 1000
    monkeypatch.setattr(version, "SCHEMA_VERSION", 2)
    with pytest.raises(SchemaError, match="no upcaster from version 1 to 2"):
        decode_turn_event(json.dumps(old).encode())

    def latency_in_seconds(record: dict[str, Any]) -> dict[str, Any]:
        record["latency_s"] = record.pop("latency_ms") / 1000
        return record

    monkeypatch.setitem(evolution._UPCASTERS, ("turn_event", 1), latency_in_seconds)
    event = decode_turn_event(json.dumps(old).encode())
    assert (event.latency_s, event.schema_version) == (0.125, 2)
    assert decode_turn_event(encode_turn_event(event)) == event  # a version-2 record: as is


def test_a_trajectory_upcaster_gets_the_old_batch(monkeypatch: Any) -> None:
    batch = _raw_batch(_current_trajectory())
    names = ["group_uid" if n == "uid" else n for n in batch.schema.names]
    old = _stream(_with_metadata(batch.rename_columns(names), "1"))
    monkeypatch.setattr(version, "SCHEMA_VERSION", 2)
    with pytest.raises(SchemaError, match="no upcaster"):
        decode_trajectory_batch(old)
    monkeypatch.setitem(
        evolution._UPCASTERS,
        ("trajectory", 1),
        lambda b: b.rename_columns(["uid" if n == "group_uid" else n for n in b.schema.names]),
    )
    [t] = batch_to_trajectories(decode_trajectory_batch(old))
    assert t.uid == "fmt-single"


def test_upcasters_are_registered_per_known_kind() -> None:
    with pytest.raises(ValueError, match="record kind 'turns'"):
        evolution.register_upcaster("turns", 1)
