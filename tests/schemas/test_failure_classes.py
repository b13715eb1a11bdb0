"""Failure classes on failed records (pure: the real fold, builder and Arrow codec).

A failed session logs its class (infrastructure, loop, reward); its trajectory record
carries it, and so does every failed record the replay buffer makes itself (an early
release is the pipeline's failure, a broken invariant the loop's). The class is an
add-only field: turn events and trajectory records written before it existed decode,
with the class null.
"""

from __future__ import annotations

import pyarrow as pa

from rolloutbus.config import RolloutConfig
from rolloutbus.schemas.trajectories import (
    TRAJECTORY_SCHEMA,
    TrajectoryStatus,
    batch_to_trajectories,
    decode_trajectory_batch,
    encode_trajectory,
    trajectory_row,
)
from rolloutbus.schemas.turns import (
    decode_turn_event,
    encode_turn_event,
)
from rolloutbus.streams.assembly.partition_fold import FoldLimits, PartitionFold
from rolloutbus.streams.assembly.trajectories import finalize_group
from tests.builders import (
    make_group_started,
    make_session_failed,
    make_session_started,
    make_trajectory,
    numbered,
)


def _failed(sid: int, failure_class: str | None) -> list:
    attempt = f"a{sid}"
    return numbered(
        [
            make_session_started("g", sid, attempt=attempt),
            make_session_failed(
                "g",
                sid,
                attempt=attempt,
                error="no replica could take the turn",
                failure_class=failure_class,
            ),
        ]
    )


def test_a_failed_record_carries_the_class_its_session_logged():
    events = [make_group_started("g", 3, attempt="g0")]
    events += _failed(0, "infrastructure") + _failed(1, "reward") + _failed(2, None)
    fold = PartitionFold(0)
    [released] = [r for i, e in enumerate(events) if (r := fold.apply(i, e)) is not None]
    done = finalize_group(released, RolloutConfig())
    assert [t.failure_class for t in done.trajectories] == ["infrastructure", "reward", None]
    decoded = [batch_to_trajectories(decode_trajectory_batch(r))[0] for r in done.records]
    assert [t.failure_class for t in decoded] == ["infrastructure", "reward", None]


def test_an_early_release_is_an_infrastructure_failure():
    fold = PartitionFold(0, limits=FoldLimits(max_open_groups=1))
    fold.apply(0, make_group_started("a", attempt="a0"))
    [released] = fold.fold(1, make_group_started("b", attempt="b0"))
    [t] = finalize_group(released, RolloutConfig()).trajectories
    assert t.status == TrajectoryStatus.FAILED and t.failure_class == "infrastructure"


def test_a_session_failed_logged_before_classes_existed_decodes():
    logged = encode_turn_event(_failed(0, "loop")[1]).replace(b',"failure_class":"loop"', b"")
    assert b"failure_class" not in logged
    event = decode_turn_event(logged)
    assert event.type == "session_failed" and event.failure_class is None


def test_a_trajectory_record_written_before_the_column_existed_decodes():
    """An old record: today's schema without the columns added since (failure_class)."""
    t = make_trajectory(status=TrajectoryStatus.FAILED, error="boom", failure_class="loop")
    old_schema = pa.schema(
        [f for f in TRAJECTORY_SCHEMA if f.name != "failure_class"],
        metadata=TRAJECTORY_SCHEMA.metadata,
    )
    row = {k: v for k, v in trajectory_row(t).items() if k != "failure_class"}
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, old_schema) as writer:
        writer.write_batch(pa.RecordBatch.from_pylist([row], old_schema))
    batch = decode_trajectory_batch(sink.getvalue().to_pybytes())
    assert batch.schema.equals(TRAJECTORY_SCHEMA)  # the trainer concatenates it with new ones
    [old] = batch_to_trajectories(batch)
    assert old.failure_class is None and old.error == "boom" and old.key == "u_0_0"
    # and today's records keep the class through the wire
    [new] = batch_to_trajectories(decode_trajectory_batch(encode_trajectory(t)))
    assert new.failure_class == "loop"
