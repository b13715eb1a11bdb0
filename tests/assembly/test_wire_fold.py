"""The fold reading token events with the msgspec wire decoder (issue 28 item 2), its numpy
chunks kept through the fold into the columnar build (the default), writes the bytes the
pure pydantic fold and build write, and a record the wire decoder refuses reaches the
dead-letter reason it always did."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rolloutbus.config import Config, KafkaConfig, RolloutConfig
from rolloutbus.schemas.turns import Generation, decode_turn_event, encode_turn_event
from rolloutbus.schemas.wire_turns import WireTokens, decode_token_event
from rolloutbus.streams.assembly import trajectories
from rolloutbus.streams.assembly.fold_events import decode_fold_event
from rolloutbus.streams.assembly.partition_fold import FoldLimits, PartitionFold
from rolloutbus.streams.assembly.replay_buffer import ReplayBuffer
from rolloutbus.streams.assembly.trajectories import finalize_group
from tests.assembly.test_columnar_fold import turn_log
from tests.fuzz_records import bad_turn_record

ROLLOUT = RolloutConfig(prompt_length=48, response_length=64)
# how the generated token events were decoded; groups of wire-decoded (numpy-chunked) folds
# the columnar build took, or left to pydantic's
Counts = dict[str, int]

# what a generation's extra_fields may hold: the fold reads min_global_steps (an int, a
# string or anything else: the wire decoder takes ints and strings and leaves the rest)
_extra_fields = st.sampled_from(
    [
        {},
        {"finish_reason": "stop", "replica_id": "r0", "global_steps": 3},
        {"min_global_steps": 1},
        {"min_global_steps": "2"},
        {"min_global_steps": "default"},
        {"min_global_steps": "v7"},
        {"min_global_steps": None},
        {"min_global_steps": 2.5},
        {"min_global_steps": True},
        {"min_global_steps": [1]},
        {"min_global_steps": 2**70},
    ]
)


@st.composite
def varied_turn_log(draw: Any) -> list[bytes]:
    """``turn_log``'s records, each generation given other extra_fields, some token
    events an unknown field (a newer writer's: pydantic drops it with a warning), some
    records written twice (a producer retry: a duplicate) or lost (a gap)."""
    out = []
    for value in draw(turn_log()):
        kind = json.loads(value)["type"]
        if kind in ("generation", "generation_chunk", "observation"):
            fate = draw(st.integers(0, 39))
            if fate == 0:
                continue  # lost: a gap
            if fate == 1:
                out.append(value)  # written twice: the second one a duplicate
        fields = json.loads(value)
        if fields["type"] == "generation" and draw(st.booleans()):
            extra = draw(_extra_fields)
            fields["extra_fields"] = {**fields["extra_fields"], **extra}
        if fields["type"] in ("generation", "observation") and draw(st.integers(0, 19)) == 0:
            fields["from_a_newer_writer"] = 1
        out.append(json.dumps(fields).encode())
    return out


def _finalized(
    wire: list[bytes],
    *,
    wire_decode: bool,
    limits: FoldLimits,
    columnar: bool,
    limit: int,
    counts: Counts,
) -> list[Any]:
    fold, out = PartitionFold(0, limits=limits), []
    for offset, value in enumerate(wire):
        event = decode_fold_event(value, wire=wire_decode)
        if wire_decode and json.loads(value)["type"] in _TOKEN_EVENTS:
            counts["wire" if isinstance(event, WireTokens) else "pydantic"] += 1
        for released in fold.fold(offset, event):
            if wire_decode and columnar:
                taken = trajectories._columnar(released, ROLLOUT, limit) is not None
                counts["columnar" if taken else "pydantic build"] += 1
            out.append(finalize_group(released, ROLLOUT, max_record_bytes=limit, columnar=columnar))
    return out


_TOKEN_EVENTS = ("generation", "generation_chunk", "observation")
_FOLDS = (
    varied_turn_log(),
    st.sampled_from([FoldLimits(), FoldLimits(max_open_groups=1)]),
    st.booleans(),
    st.sampled_from([4000, 1 << 20]),
)


def _check_byte_identical(
    wire: list[bytes], limits: FoldLimits, columnar: bool, limit: int, counts: Counts
) -> None:
    """The pure pydantic path (the baseline) against the wire decode, with the columnar
    build (the default) or the pydantic build of the numpy-chunked segments."""
    old = _finalized(
        wire, wire_decode=False, limits=limits, columnar=False, limit=limit, counts=counts
    )
    new = _finalized(
        wire, wire_decode=True, limits=limits, columnar=columnar, limit=limit, counts=counts
    )
    assert len(new) == len(old)
    for a, b in zip(new, old, strict=True):
        assert a.records == b.records
        assert a.trajectories == b.trajectories
        assert a.letters == b.letters
        assert a.batch.equals(b.batch)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(*_FOLDS)
@pytest.mark.filterwarnings("ignore")
def test_wire_fold_records_are_byte_identical(
    wire: list[bytes], limits: FoldLimits, columnar: bool, limit: int
) -> None:
    _check_byte_identical(wire, limits, columnar, limit, Counter())


@pytest.mark.filterwarnings("ignore")
def test_the_logs_reach_both_decoders_and_both_builds() -> None:
    """The generator reaches every path the property compares: wire-decoded events and
    fallbacks among them, numpy-chunked groups built column by column and by pydantic.
    A fixed-seed run of the property, as random ones vary widely (4 to 44 columnar
    groups in 300 examples): a count here changes only with the generator or the fold."""
    counts: Counts = Counter()

    @settings(
        derandomize=True,
        database=None,
        max_examples=300,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(*_FOLDS)
    def fixed_seed(wire: list[bytes], limits: FoldLimits, columnar: bool, limit: int) -> None:
        _check_byte_identical(wire, limits, columnar, limit, counts)

    fixed_seed()
    assert counts["wire"] > 500 and counts["pydantic"] > 20, counts
    assert counts["columnar"] > 5 and counts["pydantic build"] > 20, counts


def _outcome(decode: Any, value: bytes) -> tuple[str, str]:
    try:
        return "ok", type(decode(value)).__name__  # (a record without ts takes the clock's)
    except Exception as exc:  # compared below: the same class and message either way
        return type(exc).__name__, str(exc)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bad_turn_record)
@pytest.mark.filterwarnings("ignore")
def test_a_record_the_wire_decoder_refuses_fails_as_pydantic_fails_it(value: bytes) -> None:
    wire = decode_token_event(value)
    if wire is None:  # the fallback: pydantic's error, or pydantic's event
        assert _outcome(lambda v: decode_fold_event(v, wire=True), value) == _outcome(
            decode_turn_event, value
        )
        return
    event = decode_turn_event(value)  # what the wire decoder takes, pydantic takes alike
    assert (wire.type, wire.uid, wire.session_id, wire.attempt) == (
        event.type,
        event.uid,
        event.session_id,  # type: ignore[union-attr]
        event.attempt,
    )
    ids = event.prompt_ids if event.type == "segment_started" else event.token_ids  # type: ignore[union-attr]
    assert (wire.seq, wire.ts, wire.token_ids.tolist()) == (event.seq, event.ts, ids)


class _Message:
    """A consumed turn-log record, as much of confluent-kafka's Message as the fold reads."""

    def __init__(self, value: bytes, offset: int):
        self._value, self._offset = value, offset

    def topic(self) -> str:
        return "rollout.turns"

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return self._offset

    def value(self) -> bytes:
        return self._value

    def key(self) -> bytes:
        return b"u_1"


def _generation(**changes: Any) -> bytes:
    event = Generation(uid="u", session_id=1, attempt="a", segment=0, turn=0, token_ids=[1, 2])
    fields = json.loads(encode_turn_event(event))
    fields.update(changes)
    return json.dumps(fields).encode()


REFUSED = {
    "bad base64 ids": _generation(token_ids="AAE="),
    "a session id past int32": _generation(session_id=2**31),
    "a negative seq": _generation(seq=-1),
    "a newer schema version": _generation(schema_version=99),
    "ids out of int32 as a JSON list": _generation(token_ids=[2**40]),
    "a wrong type": _generation(turn="one"),
    "not JSON": b"{",
}


@pytest.mark.parametrize("what", sorted(REFUSED))
def test_a_refused_record_reaches_the_same_dead_letter(
    what: str, kafka_config: KafkaConfig
) -> None:
    """The replay buffer's own fold step, with and without the wire decoder: one dead letter
    each, with the same reason and the same original bytes."""
    letters = []
    for wire_decode in (False, True):
        buffer = ReplayBuffer(Config(kafka=kafka_config), wire_decode=wire_decode)
        try:
            buffer.partitions[0] = PartitionFold(0)
            outgoing: list[Any] = []
            buffer._fold_message(_Message(REFUSED[what], 0), outgoing)  # type: ignore[arg-type]
        finally:
            buffer._member.close()
            buffer._transactions.close()
        assert len(outgoing) == 1
        letters.append(outgoing[0])
    assert decode_token_event(REFUSED[what]) is None
    plain, wired = (json.loads(letter.value) for letter in letters)
    plain.pop("ts"), wired.pop("ts")
    assert wired == plain and "does not match its schema" in plain["reason"]
