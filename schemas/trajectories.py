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

import itertools
import json
from enum import StrEnum
from typing import Any

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from rolloutbus.errors import SchemaError
from rolloutbus.schemas.agent_loop import AgentLoopMetrics
from rolloutbus.schemas.routed_experts import RoutedExperts
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
        # added after the first release (decoders fill it with nulls for older records)
        ("routed_experts", _ROUTED_EXPERTS_TYPE),
    ],
    metadata={"rolloutbus.schema_version": str(SCHEMA_VERSION)},
)
# columns added after the first release, with the value an older record reads as
_ADDED_COLUMNS = ("routed_experts",)
_FIRST_RELEASE_SCHEMA = pa.schema(
    [f for f in TRAJECTORY_SCHEMA if f.name not in _ADDED_COLUMNS],
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


# Trajectory fields that are Arrow list columns (loss_mask repeats response_mask), with the
# numpy type of their items
_LIST_COLUMNS = {
    "prompts": ("prompts", np.int32),
    "responses": ("responses", np.int32),
    "response_mask": ("response_mask", np.int8),
    "loss_mask": ("response_mask", np.int8),
    "rollout_log_probs": ("rollout_log_probs", np.float32),
    "rm_scores": ("rm_scores", np.float32),
}
_DERIVED_COLUMNS = {
    "status": lambda t: t.status.value,
    "validate": lambda t: t.validate_,
    "prompt_len": lambda t: t.prompt_len,
    "response_len": lambda t: t.response_len,
    "seq_len": lambda t: t.prompt_len + t.response_len,
}


def trajectories_to_batch(trajectories: list[Trajectory]) -> pa.RecordBatch:
    """One Arrow row per trajectory, built column by column: token lists are flattened
    into one numpy array per column (a row-wise ``from_pylist`` converted every token
    through a Python dict and was most of the replay buffer's time)."""
    dumped = [t.model_dump(include=set(_JSON_COLUMNS)) for t in trajectories]
    columns: list[pa.Array] = []
    built: dict[str, pa.Array] = {}  # by attribute: loss_mask is response_mask's array again
    for field in TRAJECTORY_SCHEMA:
        name = field.name
        if name in _LIST_COLUMNS:
            attr, dtype = _LIST_COLUMNS[name]
            if attr not in built:
                built[attr] = _list_column([getattr(t, attr) for t in trajectories], dtype)
            columns.append(built[attr])
        elif name == "routed_experts":
            columns.append(_routed_experts_column([t.routed_experts for t in trajectories]))
        else:
            columns.append(pa.array(_scalars(name, trajectories, dumped), field.type))
    return pa.RecordBatch.from_arrays(columns, schema=TRAJECTORY_SCHEMA)


def _scalars(name: str, trajectories: list[Trajectory], dumped: list[dict[str, Any]]) -> list:
    if name in _JSON_COLUMNS:  # as model_dump gives them: nested models as dicts
        return [None if d[name] is None else json.dumps(d[name], sort_keys=True) for d in dumped]
    if name in _METRIC_COLUMNS:
        return [getattr(t.metrics, name) for t in trajectories]
    if name in _DERIVED_COLUMNS:
        return [_DERIVED_COLUMNS[name](t) for t in trajectories]
    return [getattr(t, name) for t in trajectories]


def _list_column(values: list[list[Any] | None], dtype: type) -> pa.Array:
    """A ``large_list`` column of ``dtype`` items; None is a null list. An item outside the
    type raises OverflowError (a float beyond float32 becomes inf, as Arrow's own
    conversion does)."""
    nulls = [v is None for v in values]
    if all(nulls):  # e.g. rm_scores of a group without rewards: no mask to invert
        return pa.nulls(len(values), pa.large_list(pa.from_numpy_dtype(dtype)))
    lengths = np.fromiter((0 if v is None else len(v) for v in values), np.int64, len(values))
    offsets = np.zeros(len(values) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    with np.errstate(over="ignore"):
        flat: np.ndarray = np.fromiter(
            itertools.chain.from_iterable(v for v in values if v is not None),
            dtype,
            int(offsets[-1]),
        )
    return pa.LargeListArray.from_arrays(
        pa.array(offsets), pa.array(flat), mask=pa.array(nulls) if any(nulls) else None
    )


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
    (per-call overhead dominates one-row batches) and each row is written as a slice.

    A record is an Arrow IPC stream: the schema message (the same bytes for every record,
    serialized once), the row's record-batch message, the end-of-stream marker; byte for
    byte what ``pa.ipc.new_stream`` writes.
    """
    batch = trajectories_to_batch(trajectories)
    return [
        b"".join((_SCHEMA_MESSAGE, batch.slice(i, 1).serialize().to_pybytes(), _END_OF_STREAM))
        for i in range(batch.num_rows)
    ]


_SCHEMA_MESSAGE = TRAJECTORY_SCHEMA.serialize().to_pybytes()
_END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # continuation marker, length 0


def decode_trajectory_batch(data: bytes) -> pa.RecordBatch:
    """One trajectory record's value: an Arrow IPC stream of one row of TRAJECTORY_SCHEMA.

    Anything else (not bytes, not Arrow, another schema, no row or several) raises
    SchemaError, never pyarrow's ArrowInvalid/OSError or a TypeError.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise SchemaError(f"a trajectory record must be bytes, got {type(data).__name__}")
    batch = _as_written(data)
    if batch is not None:
        return batch
    try:
        reader = pa.ipc.open_stream(pa.py_buffer(data))
        batches = list(reader)
    except (pa.ArrowException, OSError, ValueError) as exc:  # ArrowInvalid is all three
        raise SchemaError(f"a trajectory record is not an Arrow IPC stream: {exc}") from exc
    if reader.schema.metadata is None or not (
        reader.schema.equals(TRAJECTORY_SCHEMA) or reader.schema.equals(_FIRST_RELEASE_SCHEMA)
    ):
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
    return _with_added_columns(batches[0])


def _as_written(data: bytes | bytearray | memoryview) -> pa.RecordBatch | None:
    """The row of a record as this release writes it (``_SCHEMA_MESSAGE``, one record-batch
    message, the end of stream), read without parsing the schema again; None for anything
    else (an older record, or junk), which takes the general path."""
    buffer = pa.py_buffer(data)
    head, end = len(_SCHEMA_MESSAGE), len(buffer) - len(_END_OF_STREAM)
    if end <= head or buffer[:head] != _SCHEMA_MESSAGE or buffer[end:] != _END_OF_STREAM:
        return None
    stream = pa.BufferReader(buffer)
    stream.seek(head)
    try:
        message = pa.ipc.read_message(stream)
        if message.type != "record batch" or stream.tell() != end:
            return None
        batch = pa.ipc.read_record_batch(message, TRAJECTORY_SCHEMA)
        batch.validate()
    except (pa.ArrowException, OSError, ValueError):
        return None  # the general path raises the SchemaError
    return batch if batch.num_rows == 1 else None


def _with_added_columns(batch: pa.RecordBatch) -> pa.RecordBatch:
    """A record from before a column was added, with that column null (its default)."""
    if batch.schema.equals(TRAJECTORY_SCHEMA):
        return batch
    columns = [
        batch.column(f.name) if f.name in batch.schema.names else pa.nulls(batch.num_rows, f.type)
        for f in TRAJECTORY_SCHEMA
    ]
    return pa.RecordBatch.from_arrays(columns, schema=TRAJECTORY_SCHEMA)
