"""The trainer client's position, without a broker: how a partition's groups are assembled,
where a checkpoint resumes when groups interleave, and how the position stays bounded."""

from __future__ import annotations

import json

import pytest

from rolloutbus.config import TrainerConfig
from rolloutbus.consumers.groups import PartitionProgress
from rolloutbus.consumers.position import (
    COMMIT_METADATA_MAX_BYTES,
    PartitionPosition,
    TrainerPosition,
    checked_position,
    later_position,
)
from rolloutbus.errors import SchemaError
from tests.builders import make_group, trajectory_records

GROUP_SIZE = 2


def records(uid: str, size: int = GROUP_SIZE) -> list[tuple[str, bytes]]:
    """(key, value) of every trajectory of one group, as the replay buffer writes them."""
    return trajectory_records(make_group(uid, size, rollout_log_probs=[-0.5]))


def feed(
    progress: PartitionProgress, log: list[tuple[str, bytes]], first_offset: int = 0
) -> list[str]:
    """Offer ``log`` from ``first_offset`` on; the uids of the groups completed, in order."""
    done = []
    for offset, (key, value) in enumerate(log):
        if offset < first_offset:
            continue
        group = progress.add(offset, key, value)
        if group is not None:
            done.append(key.split("_")[0])
    return done


def interleaved_log() -> list[tuple[str, bytes]]:
    """a0 b0 b1 a1 c0 c1: b completes while a is still incomplete."""
    a, b, c = records("a"), records("b"), records("c")
    return [a[0], b[0], b[1], a[1], c[0], c[1]]


def test_position_holds_back_at_an_incomplete_group_and_lists_the_groups_yielded_past_it():
    progress = PartitionProgress(PartitionPosition(offset=0), max_interleaved=8)
    log = interleaved_log()
    assert feed(progress, log[:3]) == ["b"]
    assert progress.snapshot() == PartitionPosition(offset=0, yielded={"b": 2})
    assert feed(progress, log[:4], first_offset=3) == ["a"]
    # a done: the offset moves past b too, which leaves the list
    assert progress.snapshot() == PartitionPosition(offset=4)


def test_resuming_from_a_position_yields_exactly_the_groups_not_yet_yielded():
    log = interleaved_log()
    first = PartitionProgress(PartitionPosition(offset=0), max_interleaved=8)
    assert feed(first, log[:3]) == ["b"]
    checkpoint = TrainerPosition.model_validate(
        json.loads(
            json.dumps(
                TrainerPosition(topic="t", partitions={0: first.snapshot()}).model_dump(mode="json")
            )
        )
    )
    resumed = PartitionProgress(checkpoint.partitions[0], max_interleaved=8)
    assert feed(resumed, log, first_offset=checkpoint.offsets[0]) == ["a", "c"]


def test_a_group_that_never_completes_is_given_up_past_the_bound():
    progress = PartitionProgress(PartitionPosition(offset=0), max_interleaved=2)
    stuck = records("stuck")[0]
    log = [stuck, *records("b"), *records("c"), *records("d")]
    assert feed(progress, log) == ["b", "c", "d"]
    assert progress.pending == {}
    assert progress.snapshot() == PartitionPosition(offset=len(log))


def test_the_bound_also_keeps_the_commit_metadata_under_the_brokers_limit():
    long_uids = [f"{i:03d}" + "x" * 400 for i in range(20)]
    progress = PartitionProgress(PartitionPosition(offset=0), max_interleaved=1000)
    log = [records("stuck")[0]] + [r for uid in long_uids for r in records(uid)]
    feed(progress, log)
    assert len(progress.snapshot().commit_metadata()) <= COMMIT_METADATA_MAX_BYTES
    assert "stuck" not in progress.pending


def test_default_bound_fits_the_commit_metadata_of_hex_uids():
    bound = TrainerConfig().max_interleaved_groups
    position = PartitionPosition(offset=0, yielded={f"{i:032x}": 10**12 + i for i in range(bound)})
    assert len(position.commit_metadata()) <= COMMIT_METADATA_MAX_BYTES


def test_a_duplicate_record_within_a_group_is_kept_once():
    progress = PartitionProgress(PartitionPosition(offset=0), max_interleaved=8)
    a = records("a")
    assert feed(progress, [a[0], a[0], a[1]]) == ["a"]


def test_commit_metadata_round_trip_and_foreign_metadata():
    position = PartitionPosition(offset=7, yielded={"b": 9})
    assert PartitionPosition.from_commit(7, position.commit_metadata()) == position
    assert PartitionPosition.from_commit(7, "") == PartitionPosition(offset=7)
    assert PartitionPosition.from_commit(7, "not json") == PartitionPosition(offset=7)
    assert PartitionPosition.from_commit(7, '{"other": 1}') == PartitionPosition(offset=7)


def test_a_reassigned_partition_never_moves_back():
    older, newer = PartitionPosition(offset=3), PartitionPosition(offset=5, yielded={"x": 6})
    assert later_position(older, newer) == newer and later_position(newer, older) == newer
    assert later_position(None, older) == older
    same = later_position(PartitionPosition(offset=5, yielded={"y": 8}), newer)
    assert same == PartitionPosition(offset=5, yielded={"x": 6, "y": 8})


def test_position_json_is_plain_and_checked():
    position = TrainerPosition(topic="t.trajectories", partitions={1: PartitionPosition(offset=4)})
    data = json.loads(json.dumps(position.model_dump(mode="json")))
    assert data == {"topic": "t.trajectories", "partitions": {"1": {"offset": 4, "yielded": {}}}}
    assert TrainerPosition.model_validate(data) == position and position.offsets == {1: 4}

    with pytest.raises(SchemaError, match="this client reads 'other'"):
        checked_position(data, "other")
    with pytest.raises(SchemaError, match="not a trainer position"):
        checked_position({"topic": "t", "partitions": {"0": {"offset": -1}}}, "t")
