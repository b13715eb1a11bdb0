"""The msgspec wire decoder agrees with pydantic's turn-event decode, and hands back
(None) every record it does not cover, so the fallback keeps pydantic's reasons."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutbus.schemas.turns import (
    Generation,
    GenerationChunk,
    Observation,
    SegmentStarted,
    decode_turn_event,
    encode_turn_event,
)
from rolloutbus.schemas.wire_turns import decode_token_event

_ids = st.lists(st.integers(-(2**31), 2**31 - 1), max_size=40)
_ids_fields = dict(
    uid=st.text(max_size=8),
    session_id=st.integers(0, 2**31 - 1),
    attempt=st.text(max_size=4),
    seq=st.integers(0, 10**6),
    segment=st.integers(0, 5),
    turn=st.integers(0, 50),
)


_Covered = Generation | GenerationChunk | Observation | SegmentStarted


@st.composite
def _events(draw: st.DrawFn) -> _Covered:
    ids = draw(_ids)
    common: dict[str, Any] = {name: draw(strategy) for name, strategy in _ids_fields.items()}
    logprobs = draw(st.none() | st.just([float(np.float32(-i / 7)) for i in range(len(ids))]))
    kind = draw(st.sampled_from(["generation", "generation_chunk", "observation", "segment"]))
    if kind == "segment":
        common.pop("turn")
        return SegmentStarted(prompt_ids=ids, **common)
    if kind == "observation":
        return Observation(token_ids=ids, **common)
    version = draw(st.none() | st.integers(-(2**63), 2**63 - 1))
    if kind == "generation_chunk":
        index, start = draw(st.integers(0, 9)), draw(st.integers(0, 999))
        return GenerationChunk(
            token_ids=ids,
            logprobs=logprobs,
            policy_version=version,
            index=index,
            start=start,
            **common,
        )
    return Generation(token_ids=ids, logprobs=logprobs, policy_version=version, **common)


@settings(max_examples=300, deadline=None)
@given(_events())
def test_wire_decode_equals_pydantic_decode(event: _Covered) -> None:
    data = encode_turn_event(event)
    wire = decode_token_event(data)
    model = decode_turn_event(data)
    assert isinstance(model, _Covered)
    assert wire is not None
    assert wire.type == model.type and wire.seq == model.seq and wire.uid == model.uid
    assert (wire.session_id, wire.attempt) == (model.session_id, model.attempt)
    assert (wire.segment, wire.turn) == (model.segment, getattr(model, "turn", None))
    ids = model.prompt_ids if isinstance(model, SegmentStarted) else model.token_ids
    assert wire.token_ids.tolist() == ids
    model_logprobs = getattr(model, "logprobs", None)
    assert (None if wire.logprobs is None else wire.logprobs.tolist()) == model_logprobs
    assert wire.policy_version == getattr(model, "policy_version", None)
    assert wire.index == getattr(model, "index", None)
    assert wire.start == getattr(model, "start", None) and wire.ts == model.ts


def _record(**changes: object) -> bytes:
    event = Generation(uid="u", session_id=1, attempt="a", segment=0, turn=0, token_ids=[1, 2])
    fields = json.loads(encode_turn_event(event))
    fields.update(changes)
    return json.dumps({k: v for k, v in fields.items() if v is not ...}).encode()


def test_uncovered_records_fall_back_to_pydantic() -> None:
    uncovered = {
        "an unknown field": _record(surprise=1),
        "a chunk's field on a generation": _record(index=0),
        "another schema version": _record(schema_version=99),
        "ids as a JSON list": _record(token_ids=[1, 2]),
        "routed experts": _record(routed_experts={"layers": 1}),
        "a negative seq": _record(seq=-1),
        "a session id past int32": _record(session_id=2**31),
        "ids that are not whole int32s": _record(token_ids="AAE="),
        "another event type": _record(type="session_started"),
        "a segment start with a turn": _record(
            type="segment_started", prompt_ids="", token_ids=...
        ),
        "not JSON": b"{",
        "no ts (pydantic stamps the clock's)": _record(ts=...),
        "a ts past float": b'{"type":"generation","uid":"u","session_id":1,"attempt":"a",'
        b'"segment":0,"turn":0,"token_ids":"","ts":1e999}',
        "min_global_steps a float": _record(extra_fields={"min_global_steps": 2.5}),
        "min_global_steps a bool": _record(extra_fields={"min_global_steps": True}),
    }
    for what, data in uncovered.items():
        assert decode_token_event(data) is None, what
    assert decode_token_event(_record()) is not None


def test_the_first_policy_version_of_a_generation_is_kept() -> None:
    """extra_fields' min_global_steps (the turn's first version) is the one extra field the
    fold reads; an int or a string is carried as logged, the other fields are not needed."""
    for value in (3, "4", "default", None):
        extra = {"min_global_steps": value, "finish_reason": "stop"}
        wire = decode_token_event(_record(extra_fields=extra))
        assert wire is not None and wire.min_global_steps == value
    wire = decode_token_event(_record(extra_fields={"replica_id": "r0"}))
    assert wire is not None and wire.min_global_steps is None
