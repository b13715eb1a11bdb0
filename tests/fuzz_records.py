"""Hypothesis strategies for bad records on every topic (``tests/faults/test_fuzz_bad_records.py``).

Each ``bad_*_record`` strategy yields record values (bytes) that a worker may find on its
input topic: random bytes, bytes that are not UTF-8, JSON of the wrong shape, a valid record
with one field dropped, retyped, made huge or negative, or an unknown field added, a valid
record cut short, and records that belong on another topic. Whether a given value is
rejected is for the decoder to say; what the strategies promise is variety, and that the
families marked ``always invalid`` never yield a value a decoder should accept.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pyarrow as pa
from hypothesis import strategies as st

from rolloutbus.schemas.prompts import GroupSamplingParams, PromptGroup
from rolloutbus.schemas.trajectories import encode_trajectory
from rolloutbus.schemas.turns import (
    Generation,
    Observation,
    OutputSummary,
    SegmentStarted,
    SessionFailed,
    SessionFinished,
    SessionStarted,
    encode_turn_event,
)
from tests.builders import make_group_started, make_trajectory

UID = "0123456789abcdef0123456789abcdef"  # a publisher-style uid (32 hex, no "_")
ROW = {
    "data_source": "rolloutbus/arithmetic",
    "prompt": [{"role": "user", "content": "What is 2 + 3? Answer with the number only."}],
    "reward_model": {"style": "rule", "ground_truth": "5"},
    "extra_info": {"index": 0},
}

# -- valid templates, as they are on the wire -----------------------------------------------


def prompt_group_template() -> dict[str, Any]:
    group = PromptGroup(
        uid=UID, row=ROW, n=2, sampling_params=GroupSamplingParams(), created_at=0.0
    )
    return json.loads(group.model_dump_json(by_alias=True))


def turn_event_templates() -> list[dict[str, Any]]:
    ids = {"uid": UID, "session_id": 0, "attempt": "a0", "ts": 0.0}
    events = [
        make_group_started(UID, 2, attempt="a0", row=ROW, ts=0.0),
        SessionStarted(**ids, agent_name="single_turn_agent"),
        SegmentStarted(**ids, segment=0, prompt_ids=[1, 2, 3]),
        Generation(
            **ids,
            segment=0,
            turn=0,
            token_ids=[4, 5],
            logprobs=[-0.5, -0.25],
            policy_version=0,
            stop_reason="completed",
        ),
        Observation(**ids, segment=0, turn=1, token_ids=[6]),
        SessionFinished(
            **ids,
            outputs=[
                OutputSummary(
                    segment=0, prompt_len=3, response_len=3, reward_score=1.0, num_turns=2
                )
            ],
        ),
        SessionFailed(**ids, agent_name=None, error="boom"),
    ]
    return [json.loads(encode_turn_event(e)) for e in events]


def trajectory_template() -> bytes:
    return encode_trajectory(
        make_trajectory(UID, prompts=[1, 2, 3], responses=[4, 5], rollout_log_probs=[-0.5, -0.25])
    )


PROMPT_GROUP = prompt_group_template()
TURN_EVENTS = turn_event_templates()
TRAJECTORY = trajectory_template()
TOKEN_FIELDS = ("prompt_ids", "token_ids", "logprobs", "mask_override")

# -- building blocks ------------------------------------------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)
huge_ints = st.integers(min_value=2**31, max_value=2**200) | st.integers(
    min_value=-(2**200), max_value=-(2**31) - 1
)
# values for a field that are usually of the wrong type (the decoder decides)
odd_values = json_values | huge_ints | st.sampled_from([-1, "", "1", [], {}, 1.5, True, None])
# base64 text that is not a whole number of int32/float32 values, or not base64 at all
bad_token_text = st.sampled_from(
    ["!!!", "AAA", "AAAAAA==", "AQID", "é", "not base64", "===="]
) | st.text(max_size=10)
bad_token_values = (
    bad_token_text
    | st.lists(huge_ints, min_size=1, max_size=3)
    | st.lists(st.text(max_size=3), min_size=1, max_size=3)
    | json_values
)


def _dumps(value: Any) -> bytes:
    return json.dumps(value).encode()


# always invalid: no JSON text starts with 0xff, and no valid record is empty
random_bytes = st.binary(max_size=128)
not_utf8 = st.binary(max_size=64).map(lambda raw: b"\xff\xfe" + raw)
wrong_shape_json = (
    json_values.filter(lambda v: not isinstance(v, dict))
    | st.dictionaries(st.text(max_size=8), json_values, max_size=5)
).map(_dumps)


@st.composite
def truncated(draw: st.DrawFn, valid: list[bytes]) -> bytes:
    """A valid record cut short (always invalid: a strict prefix of a JSON object or of an
    Arrow stream is never a whole one)."""
    raw = draw(st.sampled_from(valid))
    return raw[: draw(st.integers(min_value=0, max_value=len(raw) - 1))]


@st.composite
def mutated(draw: st.DrawFn, templates: list[dict[str, Any]]) -> bytes:
    """A valid JSON record with one thing changed: a field dropped, retyped, made huge or
    negative, an unknown field added, or a nested field (row, sampling_params, outputs)
    changed the same way. Some of these stay valid (a string where the decoder coerces)."""
    record = copy.deepcopy(draw(st.sampled_from(templates)))
    target = record
    nested = [k for k, v in record.items() if isinstance(v, dict) and v] + (
        ["outputs"] if record.get("outputs") else []
    )
    if nested and draw(st.booleans()):
        key = draw(st.sampled_from(nested))
        target = record[key][0] if key == "outputs" else record[key]
    change = draw(st.sampled_from(["drop", "retype", "huge", "negative", "extra", "tokens"]))
    # huge and negative values go to integer fields, bad token arrays to token fields,
    # where there are any: that is where a near miss can slip through
    ints = [k for k, v in target.items() if isinstance(v, int) and not isinstance(v, bool)]
    tokens = [k for k in TOKEN_FIELDS if k in target]
    candidates = {"huge": ints, "negative": ints, "tokens": tokens}.get(change) or sorted(target)
    key = draw(st.sampled_from(candidates))
    if change == "drop":
        del target[key]
    elif change == "retype":
        target[key] = draw(odd_values)
    elif change == "huge":
        target[key] = draw(huge_ints)
    elif change == "negative":
        target[key] = draw(st.integers(max_value=-1))
    elif change == "extra":
        target[draw(st.text(min_size=1, max_size=8).filter(lambda k: k not in target))] = draw(
            json_values
        )
    else:
        target[key] = draw(bad_token_values)
    return _dumps(record)


# -- per topic ------------------------------------------------------------------------------

# prompt groups that the decoder may accept and whose rows are nonetheless not verl rows:
# a string prompt, no prompt, an empty or odd one, columns of the wrong type
odd_rows = st.sampled_from(
    [
        {"prompt": "What is 2 + 3?"},
        {"data_source": "x"},
        {"prompt": []},
        {"prompt": [1, 2]},
        {"prompt": [{"role": "wizard", "content": "hi"}]},
        {"prompt": ROW["prompt"], "data_source": 5},
        {"prompt": ROW["prompt"], "reward_model": "5"},
        {"prompt": ROW["prompt"], "extra_info": [1]},
    ]
) | st.dictionaries(st.text(max_size=8), json_values, max_size=4)


@st.composite
def prompt_group_with_odd_row(draw: st.DrawFn) -> bytes:
    record = copy.deepcopy(PROMPT_GROUP)
    record["row"] = draw(odd_rows)
    return _dumps(record)


@st.composite
def prompt_group_with_bad_n(draw: st.DrawFn) -> bytes:
    record = copy.deepcopy(PROMPT_GROUP)
    record["n"] = draw(st.integers(max_value=0) | st.sampled_from(["two", 2.5, None, [2]]))
    return _dumps(record)


def _arrow_stream(batches: list[pa.RecordBatch], schema: pa.Schema) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        for batch in batches:
            writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def _wrong_arrow_records() -> list[bytes]:
    """Arrow IPC streams that are not one trajectory row: another schema, no rows, two
    batches, the right columns without the schema metadata."""
    from rolloutbus.schemas.trajectories import TRAJECTORY_SCHEMA

    right = pa.ipc.open_stream(pa.py_buffer(TRAJECTORY)).read_next_batch()
    other = pa.record_batch({"uid": ["x"], "n": [1]})
    bare = right.schema.remove_metadata()
    return [
        _arrow_stream([other], other.schema),
        _arrow_stream([], TRAJECTORY_SCHEMA),
        _arrow_stream([right, right], TRAJECTORY_SCHEMA),
        _arrow_stream([right.slice(0, 0)], TRAJECTORY_SCHEMA),
        _arrow_stream([pa.RecordBatch.from_arrays(right.columns, schema=bare)], bare),
        _arrow_stream([pa.concat_batches([right, right])], TRAJECTORY_SCHEMA),
    ]


# one_of picks its branches about evenly: the mutations, where the near misses are, are
# listed MUTATION_WEIGHT times so that they make up about half of the records
MUTATION_WEIGHT = 4
bad_prompt_record = st.one_of(
    random_bytes,
    not_utf8,
    wrong_shape_json,
    truncated([_dumps(PROMPT_GROUP)]),
    prompt_group_with_odd_row(),
    prompt_group_with_bad_n(),
    st.sampled_from([_dumps(e) for e in TURN_EVENTS] + [TRAJECTORY]),  # another topic's records
    *[mutated([PROMPT_GROUP])] * MUTATION_WEIGHT,
)
bad_turn_record = st.one_of(
    random_bytes,
    not_utf8,
    wrong_shape_json,
    truncated([_dumps(e) for e in TURN_EVENTS]),
    st.sampled_from([_dumps(PROMPT_GROUP), TRAJECTORY]),  # another topic's records
    *[mutated(TURN_EVENTS)] * MUTATION_WEIGHT,
)
bad_trajectory_record = st.one_of(
    random_bytes,
    not_utf8,
    wrong_shape_json,
    truncated([TRAJECTORY]),
    st.sampled_from(_wrong_arrow_records()),
    st.sampled_from([_dumps(PROMPT_GROUP), *(_dumps(e) for e in TURN_EVENTS)]),
)
