"""The trainer client's decode of a group (its rows kept, concatenated once where read) gives
what the previous decode gave, value for value and dtype for dtype: the group's batch, its
trajectories' fields, its keys and versions, the padded tensors and the train batch.

The previous decode is spelled out here as the reference: every record decoded, then each
group's rows concatenated into its batch as soon as it completed.
"""

from __future__ import annotations

import base64
import json
import random

import numpy as np
import pyarrow as pa
import pytest
import torch

from rolloutbus.consumers.groups import PartitionProgress, TrajectoryGroup
from rolloutbus.consumers.position import PartitionPosition
from rolloutbus.consumers.tensors import to_jagged, to_padded
from rolloutbus.consumers.training.batch import build_train_batch
from rolloutbus.schemas.routed_experts import RoutedExperts
from rolloutbus.schemas.trajectories import (
    TRAJECTORY_SCHEMA,
    Trajectory,
    TrajectoryStatus,
    batch_to_trajectories,
    decode_trajectory_batch,
)
from rolloutbus.topics import uid_of_key
from tests.builders import make_trajectory, trajectory_records
from tests.source_tree import TEST_DATA

Record = tuple[str, bytes]


def _member(rng: random.Random, uid: str, session: int, size: int, shape: str) -> list[Trajectory]:
    """One session's trajectories in one of the shapes the replay buffer releases."""
    if shape == "failed":
        return [
            make_trajectory(
                uid,
                session,
                group_size=size,
                status=TrajectoryStatus.FAILED,
                error="replica unavailable",
                failure_class="infrastructure",
            )
        ]
    outputs = 2 if shape == "multi_output" else 1
    out = []
    for index in range(outputs):
        prompt = [rng.randrange(150_000) for _ in range(rng.randrange(1, 40))]
        response = [rng.randrange(150_000) for _ in range(rng.randrange(0, 60))]
        logprobs = None if shape == "no_logprobs" else [-rng.random() for _ in response]
        scores = [0.0] * (len(response) - 1) + [1.0] if shape == "rm_scores" and response else None
        fields = {
            "rollout_log_probs": logprobs,
            "rm_scores": scores,
            "reward_score": rng.choice([None, 0.0, 1.0]),
            "min_global_steps": rng.choice([None, 3]),
            "max_global_steps": rng.choice([None, 5]),
            "num_turns": rng.randrange(1, 6),
            "extra_fields": {"turn_scores": [1.0]} if rng.random() < 0.5 else {},
            "data_source": rng.choice(["", "gsm8k"]),
            "validate": rng.random() < 0.3,
        }
        if shape == "routed_experts":
            tokens = len(prompt) + len(response)
            experts = np.array(
                [rng.randrange(64) for _ in range(tokens * 2 * 2)], np.int16
            ).reshape(tokens, 2, 2)
            fields["routed_experts"] = RoutedExperts.from_array(experts)
        status = TrajectoryStatus.TRUNCATED if rng.random() < 0.2 else TrajectoryStatus.COMPLETED
        out.append(
            make_trajectory(
                uid,
                session,
                output_index=index,
                num_outputs=outputs,
                group_size=size,
                status=status,
                prompts=prompt,
                responses=response,
                response_mask=[rng.randrange(2) for _ in response],
                **fields,
            )
        )
    return out


SHAPES = ["plain", "no_logprobs", "failed", "multi_output", "rm_scores", "routed_experts"]


def _groups(seed: int, count: int) -> list[list[Record]]:
    """``count`` groups, each of sessions in mixed shapes; group_size counts every output."""
    rng = random.Random(seed)
    groups = []
    for g in range(count):
        uid = f"g{seed}x{g}"
        shapes = [rng.choice(SHAPES) for _ in range(rng.randrange(1, 6))]
        size = sum(2 if s == "multi_output" else 1 for s in shapes)
        members = [t for s, shape in enumerate(shapes) for t in _member(rng, uid, s, size, shape)]
        groups.append(trajectory_records(members))
    return groups


def _released_samples() -> list[list[Record]]:
    """The frozen records of every release in tests/data/formats, by group."""
    groups: dict[str, list[Record]] = {}
    for path in sorted((TEST_DATA / "formats").glob("*/trajectories.jsonl")):
        release = path.parent.name
        for line in path.read_text().splitlines():
            record = json.loads(line)
            groups.setdefault(f"{release}/{uid_of_key(record['key'])}", []).append(
                (record["key"], base64.b64decode(record["value_b64"]))
            )
    return list(groups.values())


def _interleaved(groups: list[list[Record]], seed: int) -> list[Record]:
    """The groups' records as a partition may hold them: groups interleaved, each in order."""
    rng = random.Random(seed)
    queues = [list(g) for g in groups]
    out = []
    while any(queues):
        queue = rng.choice([q for q in queues if q])
        out.append(queue.pop(0))
    return out


def _received(records: list[Record]) -> list[TrajectoryGroup]:
    """What the trainer client yields now: each complete group with its rows."""
    progress = PartitionProgress(PartitionPosition(offset=0), max_interleaved=1_000)
    out = []
    for offset, (key, value) in enumerate(records):
        pending = progress.add(offset, key, value)
        if pending is not None:
            out.append(TrajectoryGroup(uid_of_key(key), pending.rows, 0, offset))
    return out


def _reference(records: list[Record]) -> dict[str, pa.RecordBatch]:
    """The previous decode: each record decoded, a group's rows concatenated on completion."""
    rows: dict[str, list[pa.RecordBatch]] = {}
    done = {}
    for key, value in records:
        uid = uid_of_key(key)
        if uid in done:
            continue
        row = decode_trajectory_batch(value)
        rows.setdefault(uid, []).append(row)
        if len(rows[uid]) >= row.column("group_size")[0].as_py():
            done[uid] = pa.concat_batches(rows.pop(uid))
    return done


def _same_tensors(new: dict[str, torch.Tensor], old: dict[str, torch.Tensor]) -> None:
    assert new.keys() == old.keys()
    for name, tensor in old.items():
        assert new[name].dtype == tensor.dtype, name
        assert new[name].shape == tensor.shape, name
        assert torch.equal(new[name], tensor), name


def _assert_same_group(new: TrajectoryGroup, old: pa.RecordBatch) -> None:
    reference = TrajectoryGroup(new.uid, old, 0, 0)
    # what the client reads before the batch: keys, members, versions
    assert new.keys == reference.keys
    assert new.successful == reference.successful
    assert len(new) == len(reference) == old.num_rows
    assert new.min_policy_version == reference.min_policy_version
    assert new.max_policy_version == reference.max_policy_version
    # the trainer's view: the batch, its trajectories, its tensors
    assert new.batch.schema.equals(old.schema, check_metadata=True)
    assert new.batch.schema.equals(TRAJECTORY_SCHEMA, check_metadata=True)
    assert new.batch.equals(old)
    assert batch_to_trajectories(new.batch) == batch_to_trajectories(old)
    widths = {"prompt_length": 48, "response_length": 64, "pad_token_id": 0}
    _same_tensors(to_padded(new.batch, **widths), to_padded(old, **widths))
    for column in ("prompts", "responses"):
        jagged_new, jagged_old = to_jagged(new.batch, column), to_jagged(old, column)
        assert torch.equal(jagged_new.values(), jagged_old.values())
        assert torch.equal(jagged_new.offsets(), jagged_old.offsets())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_groups_decoded_as_before(seed: int) -> None:
    groups = _groups(seed, 40)
    records = _interleaved(groups, seed)
    received = _received(records)
    reference = _reference(records)
    assert [g.uid for g in received] == list(reference)
    assert len(received) == len(groups)
    for group in received:
        _assert_same_group(group, reference[group.uid])


def test_records_of_previous_releases_decoded_as_before() -> None:
    for group_records in _released_samples():
        received = _received(group_records)
        reference = _reference(group_records)
        assert len(received) == len(reference) == 1
        _assert_same_group(received[0], reference[received[0].uid])


def test_train_batch_as_before() -> None:
    """build_train_batch over groups as received (rows) and as before (batches), and over
    groups whose batch was read first: the same tensors and fields."""
    rng = random.Random(7)
    groups = []
    for g in range(12):
        members = [
            t.model_copy(update={"reward_score": rng.choice([0.0, 1.0])})  # GRPO needs one
            for s in range(4)
            for t in _member(rng, f"t{g}", s, 4, rng.choice(["plain", "no_logprobs", "failed"]))
        ]
        groups.append(trajectory_records(members))
    records = _interleaved(groups, 7)
    received = _received(records)
    reference = _reference(records)
    assert len(received) == len(groups)
    old = build_train_batch(
        [TrajectoryGroup(g.uid, reference[g.uid], 0, 0) for g in received], pad_token_id=0
    )
    new = build_train_batch(received, pad_token_id=0)
    for g in received[::2]:
        assert g.batch.num_rows == len(g)  # read first: its parts are the one batch
    mixed = build_train_batch(received, pad_token_id=0)
    for batch in (new, mixed):
        _same_tensors(batch.tensors, old.tensors)
        for name in ("scores", "has_rollout_log_probs", "loss_weights"):
            assert torch.equal(getattr(batch, name), getattr(old, name)), name
            assert getattr(batch, name).dtype == getattr(old, name).dtype, name
        assert batch.uids == old.uids
        assert batch.data_sources == old.data_sources
        assert batch.min_versions == old.min_versions
        assert batch.max_versions == old.max_versions
        assert batch.group_uids == old.group_uids
        assert batch.dropped_failed == old.dropped_failed
