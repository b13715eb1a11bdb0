"""The replay buffer's fast paths give what the plain paths give (pure: no broker).

* a wire string of tokens decodes to the list the item-by-item check would accept;
* trajectories become Arrow columns equal to a row-by-row conversion, and records the same
  bytes as ``pa.ipc.new_stream`` writes; a written record is read back without parsing its
  schema, equal to what the stream reader returns.
"""

from __future__ import annotations

import base64
import json
import math

import numpy as np
import pyarrow as pa
import pytest
from pydantic import ValidationError

from rolloutbus.errors import SchemaError
from rolloutbus.schemas.routed_experts import RoutedExperts
from rolloutbus.schemas.trajectories import (
    TRAJECTORY_SCHEMA,
    Trajectory,
    TrajectoryStatus,
    decode_trajectory_batch,
    encode_trajectories,
    trajectories_to_batch,
    trajectory_row,
)
from rolloutbus.schemas.turns import Generation, OutputSummary, decode_turn_event

IDS = {"uid": "u", "session_id": 0, "attempt": "a", "segment": 0, "turn": 0, "ts": 1.0}


def _b64(values, dtype) -> str:
    return base64.b64encode(np.asarray(values, dtype=dtype).tobytes()).decode()


# -- tokens ------------------------------------------------------------------------------


def test_a_token_string_decodes_to_the_list_the_item_check_accepts() -> None:
    tokens = [0, 1, 2**31 - 1, -(2**31), 151_000]
    logprobs = [0.0, -0.5, -math.inf, 1e-30, -3.25]
    wire = json.dumps(
        {
            **IDS,
            "type": "generation",
            "token_ids": _b64(tokens, "<i4"),
            "logprobs": _b64(logprobs, "<f4"),
        }
    )
    from_wire = decode_turn_event(wire.encode())
    from_lists = Generation(**IDS, token_ids=tokens, logprobs=np.float32(logprobs).tolist())
    assert from_wire == from_lists
    assert all(type(t) is int for t in from_wire.token_ids)
    assert all(type(x) is float for x in from_wire.logprobs)


def test_a_mask_string_decodes_to_ints() -> None:
    summary = OutputSummary.model_validate(
        {"segment": 0, "prompt_len": 0, "response_len": 3, "mask_override": _b64([1, 0, 1], "i1")}
    )
    assert summary.mask_override == [1, 0, 1]
    assert all(type(m) is int for m in summary.mask_override)


@pytest.mark.parametrize(
    "token_ids",
    ["AAAA!", base64.b64encode(b"\x01\x02\x03").decode(), "é"],
    ids=["not-base64", "not-whole-int32s", "not-ascii"],
)
def test_a_bad_token_string_is_a_validation_error(token_ids: str) -> None:
    wire = json.dumps({**IDS, "type": "generation", "token_ids": token_ids})
    with pytest.raises(ValidationError):
        decode_turn_event(wire.encode())


def test_a_token_list_is_still_checked_item_by_item() -> None:
    with pytest.raises(ValidationError, match="less than or equal"):
        Generation(**IDS, token_ids=[2**31])
    wire = json.dumps({**IDS, "type": "generation", "token_ids": [1, 2**40]})
    with pytest.raises(ValidationError):
        decode_turn_event(wire.encode())


# -- Arrow -------------------------------------------------------------------------------


def _reference_row(t: Trajectory) -> dict:
    """A trajectory's Arrow row as the layout's row-wise ``trajectory_row`` gives it (from
    model_dump): the definition the column-wise build must equal."""
    row = trajectory_row(t)
    row["routed_experts"] = (
        None if t.routed_experts is None else t.routed_experts.to_numpy().tolist()
    )
    return row


def _trajectories() -> list[Trajectory]:
    head = {"uid": "g", "num_outputs": 1, "group_size": 3}
    return [
        Trajectory(key="g_0_0", session_id=0, output_index=0, status="failed", error="x", **head),
        Trajectory(
            key="g_1_0",
            session_id=1,
            output_index=0,
            status=TrajectoryStatus.COMPLETED,
            prompts=[1, 2, 3],
            responses=[4, 5],
            response_mask=[1, 0],
            rm_scores=[0.0, 1e300],  # beyond float32: inf, as Arrow's conversion makes it
            reward_score=1.0,
            extra_fields={"b": [1, {"z": 2}], "a": None},
            extra_info={"k": (1, 2)},
            raw_prompt=[{"role": "user", "content": "é"}],
            routed_experts=RoutedExperts.from_array(np.arange(12, dtype=np.int16).reshape(2, 3, 2)),
            min_global_steps=3,
            max_global_steps=5,
            validate=True,
            **head,
        ),
        Trajectory(
            key="g_2_0",
            session_id=2,
            output_index=0,
            status="truncated",
            rollout_log_probs=[],
            reward_extra_info={"acc": 1.0},
            **head,
        ),
        Trajectory(
            key="g_3_0",
            session_id=3,
            output_index=0,
            status="completed",
            prompts=list(range(7)),
            responses=[9] * 5,
            response_mask=[1, 1, 0, 1, 1],
            rollout_log_probs=[-0.25, -1.5, 0.0, -3.0, -0.125],
            **head,
        ),
    ]


def test_arrow_columns_equal_a_row_by_row_conversion() -> None:
    trajectories = _trajectories()
    for chosen in (trajectories, trajectories[1:2], trajectories[::2]):
        expected = pa.RecordBatch.from_pylist(
            [_reference_row(t) for t in chosen], TRAJECTORY_SCHEMA
        )
        assert trajectories_to_batch(chosen).equals(expected)


def test_records_are_the_bytes_a_stream_writer_writes() -> None:
    trajectories = _trajectories()
    batch = trajectories_to_batch(trajectories)
    for i, record in enumerate(encode_trajectories(trajectories)):
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, TRAJECTORY_SCHEMA) as writer:
            writer.write_batch(batch.slice(i, 1))
        assert record == sink.getvalue().to_pybytes()
        read = pa.ipc.open_stream(record).read_next_batch()
        assert decode_trajectory_batch(record).equals(read)


def test_a_record_depends_on_the_batch_it_was_cut_from() -> None:
    """Why the replay buffer builds each group's batch on its own, never several groups'
    together (benchmarks/README.md): pyarrow fills a one-row slice's padding with its
    neighbours' bytes, so the same trajectory encoded with other rows is other bytes, and
    a replay would not reproduce the records the log's release wrote. Same values all the
    same: each record reads back as the trajectory encoded alone."""
    trajectories = _trajectories()
    together = encode_trajectories(trajectories)
    alone = [encode_trajectories([t])[0] for t in trajectories]
    assert all(a != b for a, b in zip(together, alone, strict=True))
    for a, b in zip(together, alone, strict=True):
        assert decode_trajectory_batch(a).equals(decode_trajectory_batch(b))


def test_a_record_of_two_rows_is_refused_as_before() -> None:
    """Only the exact shape this release writes takes the fast path; anything else is read
    (or refused) by the stream reader, as before."""
    first, second = encode_trajectories(_trajectories()[1:3])
    schema = len(TRAJECTORY_SCHEMA.serialize())
    two_rows = first[:-8] + second[schema:]  # schema, row, row, end of stream
    with pytest.raises(SchemaError, match="got 2 batches of 2 rows"):
        decode_trajectory_batch(two_rows)
