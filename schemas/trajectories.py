"""What leaves: one trajectory per key ``{uid}_{session_id}_{output_index}``.

A trajectory carries what verl V1 stores for it (``AgentLoopOutput.as_dict()`` plus the
prompt columns, ``loss_mask = response_mask`` and the status tags). On Kafka a record's
value is an Arrow IPC stream holding one row of ``TRAJECTORY_SCHEMA``; the trainer client
concatenates a group's rows into one RecordBatch. Token columns are ragged
(``large_list``): nothing is padded until the trainer asks for padding.
``input_ids`` (= prompts ‖ responses) and ``position_ids`` are derived, not stored.

``routed_experts`` (verl's R3 routing replay, ``rollout.enable_rollout_routing_replay``):
rows ``[token][layer][k]`` of int16 for the tokens the engine fed through the model, from
the first prompt token (verl aligns them to the whole sequence when it pads: the trainer
client's padded batch does the same). Null without routing replay. The column was added
after the first release: a record written before it decodes with the column null
(``decode_trajectory_batch``), so the topic's old records stay readable.
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from rolloutbus.errors import SchemaError
from rolloutbus.schemas.agent_loop import AgentLoopMetrics
from rolloutbus.schemas.routed_experts import RoutedExperts
from rolloutbus.schemas.turns import FailureClass
from rolloutbus.schemas.version import SCHEMA_VERSION


class TrajectoryStatus(StrEnum):
    COMPLETED = "completed"  # the loop ended on its own
    TRUNCATED = "truncated"  # cut at response_length
    FAILED = "failed"  # the session failed: no tokens, see `error`


class Trajectory(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: int = SCHEMA_VERSION
    key: str
    uid: str
    session_id: int
    output_index: int
    num_outputs: int  # outputs of this session
    group_size: int  # trajectory records in this group: the trainer waits for all of them
    status: TrajectoryStatus
    error: str | None = None
    agent_name: str | None = None
    attempt: str = ""
    prompts: list[int] = Field(default_factory=list)
    responses: list[int] = Field(default_factory=list)
    response_mask: list[int] = Field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rm_scores: list[float] | None = None
    reward_score: float | None = None
    num_turns: int = 0
    metrics: AgentLoopMetrics = Field(default_factory=AgentLoopMetrics)
    extra_fields: dict[str, Any] = Field(default_factory=dict)
    data_source: str = ""
    raw_prompt: list[dict[str, Any]] = Field(default_factory=list)
    reward_model: dict[str, Any] | None = None
    extra_info: dict[str, Any] | None = None
    # the row's other columns (index, ability, tools_kwargs, images, a dataset's own ...),
    # kept as verl's non_tensor_batch keeps every column
    extra_columns: dict[str, Any] = Field(default_factory=dict)
    # what the reward function returned besides the score (verl's reward_extra_info)
    reward_extra_info: dict[str, Any] | None = None
    validate_: bool = Field(default=False, alias="validate")
    global_steps: int = 0
    min_global_steps: int | None = None  # policy version at the first generation
    max_global_steps: int | None = None  # policy version at the last generation
    routed_experts: RoutedExperts | None = None  # MoE routing replay (R3); see above
    # a failed record's cause (turns.FailureClass); None for other statuses, and in records
    # written before the column existed
    failure_class: FailureClass | None = None

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @property
    def loss_mask(self) -> list[int]:
        return self.response_mask

    @property
    def prompt_len(self) -> int:
        return len(self.prompts)

    @property
    def response_len(self) -> int:
        return len(self.responses)


# [token][layer][k]: token rows ragged per trajectory, layers and top-k fixed per model
_ROUTED_EXPERTS_TYPE = pa.large_list(pa.list_(pa.list_(pa.int16())))

TRAJECTORY_SCHEMA = pa.schema(
    [
        ("schema_version", pa.int16()),
        ("key", pa.string()),
        ("uid", pa.string()),
        ("session_id", pa.int32()),
        ("output_index", pa.int32()),
        ("num_outputs", pa.int32()),
        ("group_size", pa.int32()),
        ("status", pa.string()),
        ("error", pa.string()),
        ("agent_name", pa.string()),
        ("attempt", pa.string()),
        ("prompts", pa.large_list(pa.int32())),
        ("responses", pa.large_list(pa.int32())),
        ("response_mask", pa.large_list(pa.int8())),
        ("loss_mask", pa.large_list(pa.int8())),
        ("rollout_log_probs", pa.large_list(pa.float32())),
        ("rm_scores", pa.large_list(pa.float32())),
        ("reward_score", pa.float64()),
        ("num_turns", pa.int32()),
        ("generate_sequences", pa.float64()),
        ("tool_calls", pa.float64()),
        ("compute_score", pa.float64()),
        ("num_preempted", pa.int32()),
        ("extra_fields", pa.string()),  # JSON
        ("data_source", pa.string()),
        ("raw_prompt", pa.string()),  # JSON: the chat messages
        ("reward_model", pa.string()),  # JSON
        ("extra_info", pa.string()),  # JSON
        ("extra_columns", pa.string()),  # JSON: the row's other columns
        ("reward_extra_info", pa.string()),  # JSON
        ("validate", pa.bool_()),
        ("global_steps", pa.int64()),
        ("min_global_steps", pa.int64()),
        ("max_global_steps", pa.int64()),
        ("prompt_len", pa.int32()),
        ("response_len", pa.int32()),
        ("seq_len", pa.int32()),
        # columns added since the first release, always at the end and nullable, oldest
        # first (ADDED_COLUMNS)
        ("routed_experts", _ROUTED_EXPERTS_TYPE),
        ("failure_class", pa.string()),
    ],
    metadata={"rolloutbus.schema_version": str(SCHEMA_VERSION)},
)
# Columns added to TRAJECTORY_SCHEMA after records were already released, oldest first. A
# record written before one of them lacks it (and every later one): it decodes with them
# null, and the model fields take their defaults. Topics are never rewritten.
ADDED_COLUMNS = ("routed_experts", "failure_class")
_FIRST_RELEASE_SCHEMA = pa.schema(
    [f for f in TRAJECTORY_SCHEMA if f.name not in ADDED_COLUMNS],
    metadata=TRAJECTORY_SCHEMA.metadata,
)

_JSON_COLUMNS = (
    "extra_fields",
    "raw_prompt",
    "reward_model",
    "extra_info",
    "extra_columns",
    "reward_extra_info",
)
_METRIC_COLUMNS = ("generate_sequences", "tool_calls", "compute_score", "num_preempted")


def trajectory_row(t: Trajectory) -> dict[str, Any]:
    """The Arrow row of ``t``, ``routed_experts`` aside (built as a column: see below)."""
    row = t.model_dump(by_alias=True, exclude={"metrics", "routed_experts"})
    for name in _JSON_COLUMNS:
        row[name] = None if row[name] is None else json.dumps(row[name], sort_keys=True)
    for name in _METRIC_COLUMNS:
        row[name] = getattr(t.metrics, name)
    row["status"] = t.status.value
    row["loss_mask"] = t.response_mask
    row["prompt_len"] = t.prompt_len
    row["response_len"] = t.response_len
    row["seq_len"] = t.prompt_len + t.response_len
    return row


def trajectories_to_batch(trajectories: list[Trajectory]) -> pa.RecordBatch:
    rows = [trajectory_row(t) for t in trajectories]
    base = pa.RecordBatch.from_pylist(rows, _FIRST_RELEASE_SCHEMA)
    routed = _routed_experts_column([t.routed_experts for t in trajectories])
    failure = pa.array([t.failure_class for t in trajectories], pa.string())
    return pa.RecordBatch.from_arrays([*base.columns, routed, failure], schema=TRAJECTORY_SCHEMA)


def _routed_experts_column(values: list[RoutedExperts | None]) -> pa.Array:
    """The nested column from each trajectory's int16 bytes, without Python lists (an array
    holds tokens x layers x top_k numbers)."""
    present = [v for v in values if v is not None]
    if not present:
        return pa.nulls(len(values), _ROUTED_EXPERTS_TYPE)
    flat = np.concatenate([v.to_numpy().reshape(-1) for v in present]).astype(np.int16)
    shapes = [v.shape if v is not None else (0, 0, 0) for v in values]
    # list lengths at each level, then offsets as their running sums
    k_lengths = np.concatenate([np.full(r * n_layers, k, np.int64) for r, n_layers, k in shapes])
    layer_lengths = np.concatenate([np.full(r, n_layers, np.int64) for r, n_layers, _ in shapes])
    k_offsets = np.concatenate([[0], np.cumsum(k_lengths)])
    layer_offsets = np.concatenate([[0], np.cumsum(layer_lengths)])
    token_offsets = np.concatenate([[0], np.cumsum([r for r, _, _ in shapes])])
    inner = pa.ListArray.from_arrays(pa.array(k_offsets, pa.int32()), pa.array(flat))
    middle = pa.ListArray.from_arrays(pa.array(layer_offsets, pa.int32()), inner)
    mask = pa.array([v is None for v in values])
    return pa.LargeListArray.from_arrays(pa.array(token_offsets, pa.int64()), middle, mask=mask)


def routed_experts_of_row(column: pa.Array, row: int) -> RoutedExperts | None:
    """Row ``row`` of a ``routed_experts`` column as ``RoutedExperts`` (None when null)."""
    value = column[row]
    if not value.is_valid:
        return None
    tokens = value.values  # list<list<int16>>, one per token
    if len(tokens) == 0:
        return RoutedExperts(shape=(0, 0, 0), data=b"")
    layers = len(tokens[0])
    flat = tokens.flatten()
    top_k = len(flat[0]) if len(flat) else 0
    numbers = flat.flatten().to_numpy(zero_copy_only=False)
    if numbers.size != len(tokens) * layers * top_k:
        raise SchemaError("routed_experts rows must all have the same layers and top_k")
    return RoutedExperts.from_array(numbers.reshape(len(tokens), layers, top_k))


def batch_to_trajectories(batch: pa.RecordBatch | pa.Table) -> list[Trajectory]:
    out = []
    routed = batch.column("routed_experts") if "routed_experts" in batch.schema.names else None
    if isinstance(routed, pa.ChunkedArray):
        routed = routed.combine_chunks()
    for i, row in enumerate(batch.to_pylist()):
        row.pop("routed_experts", None)
        if routed is not None:
            row["routed_experts"] = routed_experts_of_row(routed, i)
        for name in _JSON_COLUMNS:
            row[name] = None if row[name] is None else json.loads(row[name])
        row["metrics"] = {name: row.pop(name) for name in _METRIC_COLUMNS}
        for derived in ("loss_mask", "prompt_len", "response_len", "seq_len"):
            row.pop(derived)
        if row["raw_prompt"] is None:
            row["raw_prompt"] = []
        for name in ("extra_fields", "extra_columns"):
            if row[name] is None:
                row[name] = {}
        out.append(Trajectory.model_validate(row))
    return out


def encode_trajectory(t: Trajectory) -> bytes:
    """One Kafka record value: an Arrow IPC stream with one row."""
    return encode_trajectories([t])[0]


def encode_trajectories(trajectories: list[Trajectory]) -> list[bytes]:
    """One record value per trajectory; the Arrow batch is built once for all of them
    (per-call overhead dominates one-row batches) and each row is written as a slice."""
    batch = trajectories_to_batch(trajectories)
    out = []
    for i in range(batch.num_rows):
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, TRAJECTORY_SCHEMA, options=_IPC_OPTIONS) as writer:
            writer.write_batch(batch.slice(i, 1))
        out.append(sink.getvalue().to_pybytes())
    return out


_IPC_OPTIONS = pa.ipc.IpcWriteOptions(use_legacy_format=False)


def decode_trajectory_batch(data: bytes) -> pa.RecordBatch:
    """One trajectory record's value: an Arrow IPC stream of one row of TRAJECTORY_SCHEMA.

    Anything else (not bytes, not Arrow, another schema, no row or several) raises
    SchemaError, never pyarrow's ArrowInvalid/OSError or a TypeError.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise SchemaError(f"a trajectory record must be bytes, got {type(data).__name__}")
    try:
        reader = pa.ipc.open_stream(pa.py_buffer(data))
        batches = list(reader)
    except (pa.ArrowException, OSError, ValueError) as exc:  # ArrowInvalid is all three
        raise SchemaError(f"a trajectory record is not an Arrow IPC stream: {exc}") from exc
    missing = _missing_added_columns(reader.schema)
    if missing is None:
        raise SchemaError(
            "a trajectory record's Arrow schema is not TRAJECTORY_SCHEMA "
            f"(schema version {SCHEMA_VERSION})"
        )
    rows = sum(batch.num_rows for batch in batches)
    if len(batches) != 1 or rows != 1:
        raise SchemaError(
            f"a trajectory record must be one Arrow record batch of one row, "
            f"got {len(batches)} batches of {rows} rows"
        )
    return _with_added_columns(batches[0], missing)


def _missing_added_columns(schema: pa.Schema) -> int | None:
    """How many of the last ``ADDED_COLUMNS`` a record's schema lacks (0: today's), or None
    when it is no schema this code ever wrote."""
    if schema.metadata is None:
        return None
    for missing in range(len(ADDED_COLUMNS) + 1):
        kept = len(TRAJECTORY_SCHEMA) - missing
        older = pa.schema(list(TRAJECTORY_SCHEMA)[:kept], metadata=TRAJECTORY_SCHEMA.metadata)
        if schema.equals(older):
            return missing
    return None


def _with_added_columns(batch: pa.RecordBatch, missing: int) -> pa.RecordBatch:
    """An older record's row with the columns added since, null: today's schema."""
    if not missing:
        return batch
    columns = list(batch.columns)
    for field in list(TRAJECTORY_SCHEMA)[len(TRAJECTORY_SCHEMA) - missing :]:
        columns.append(pa.nulls(batch.num_rows, field.type))
    return pa.RecordBatch.from_arrays(columns, schema=TRAJECTORY_SCHEMA)
