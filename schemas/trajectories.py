"""What leaves: one trajectory per key ``{uid}_{session_id}_{output_index}``.

A trajectory carries what verl V1 stores for it (``AgentLoopOutput.as_dict()`` plus the
prompt columns, ``loss_mask = response_mask`` and the status tags). On Kafka a record's
value is an Arrow IPC stream holding one row of ``TRAJECTORY_SCHEMA``; the trainer client
concatenates a group's rows into one RecordBatch. Token columns are ragged
(``large_list``): nothing is padded until the trainer asks for padding.
``input_ids`` (= prompts ‖ responses) and ``position_ids`` are derived, not stored.

``TRAJECTORY_SCHEMA`` is derived from the ``Trajectory`` model (``arrow_layout``): a new
field is a new column, never written twice. How records of other versions are read (by
column name, defaults for what they lack) is ``decode_trajectory_batch``'s and
``docs/schema-evolution.md``'s.

``routed_experts`` (verl's R3 routing replay, ``rollout.enable_rollout_routing_replay``):
rows ``[token][layer][k]`` of int16 for the tokens the engine fed through the model, from
the first prompt token (verl aligns them to the whole sequence when it pads: the trainer
client's padded batch does the same). Null without routing replay (and in records written
before the column existed).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from rolloutbus.errors import SchemaError
from rolloutbus.schemas import version
from rolloutbus.schemas.agent_loop import AgentLoopMetrics
from rolloutbus.schemas.arrow_layout import Arrow, ArrowLayout, ColumnCodec, Derived, Flatten
from rolloutbus.schemas.evolution import check_record_version, upcast, warn_ignored
from rolloutbus.schemas.routed_experts import RoutedExperts
from rolloutbus.schemas.turns import FailureClass
from rolloutbus.schemas.version import SCHEMA_VERSION, SCHEMA_VERSION_KEY


class TrajectoryStatus(StrEnum):
    COMPLETED = "completed"  # the loop ended on its own
    TRUNCATED = "truncated"  # cut at response_length
    FAILED = "failed"  # the session failed: no tokens, see `error`


# [token][layer][k]: token rows ragged per trajectory, layers and top-k fixed per model
_ROUTED_EXPERTS_TYPE = pa.large_list(pa.list_(pa.list_(pa.int16())))


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


# Arrow widths of the fields whose Python type does not say it (see arrow_layout)
_INT16 = Arrow(pa.int16())
_INT32 = Arrow(pa.int32())
_TOKENS = Arrow(pa.large_list(pa.int32()))
_MASK = Arrow(pa.large_list(pa.int8()))
_FLOATS = Arrow(pa.large_list(pa.float32()))
_ROUTED_EXPERTS = Arrow(
    _ROUTED_EXPERTS_TYPE, ColumnCodec(_routed_experts_column, routed_experts_of_row)
)


class Trajectory(BaseModel):
    """One trajectory record, and (through ``TRAJECTORY_LAYOUT``) its Arrow columns: each
    field is a column named by its alias, in field order; ``metrics`` is flattened into its
    own columns; ``loss_mask`` and the lengths are derived columns (``_DERIVED``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    schema_version: Annotated[int, _INT16] = SCHEMA_VERSION
    key: str
    uid: str
    session_id: Annotated[int, _INT32]
    output_index: Annotated[int, _INT32]
    num_outputs: Annotated[int, _INT32]  # outputs of this session
    # trajectory records in this group: the trainer waits for all of them
    group_size: Annotated[int, _INT32]
    status: TrajectoryStatus
    error: str | None = None
    agent_name: str | None = None
    attempt: str = ""
    prompts: Annotated[list[int], _TOKENS] = Field(default_factory=list)
    responses: Annotated[list[int], _TOKENS] = Field(default_factory=list)
    response_mask: Annotated[list[int], _MASK] = Field(default_factory=list)
    rollout_log_probs: Annotated[list[float] | None, _FLOATS] = None
    rm_scores: Annotated[list[float] | None, _FLOATS] = None
    reward_score: float | None = None
    num_turns: Annotated[int, _INT32] = 0
    metrics: Annotated[AgentLoopMetrics, Flatten()] = Field(default_factory=AgentLoopMetrics)
    extra_fields: dict[str, Any] = Field(default_factory=dict)  # JSON column
    data_source: str = ""
    raw_prompt: list[dict[str, Any]] = Field(default_factory=list)  # JSON: the chat messages
    reward_model: dict[str, Any] | None = None  # JSON
    extra_info: dict[str, Any] | None = None  # JSON
    # the row's other columns (index, ability, tools_kwargs, images, a dataset's own ...),
    # kept as verl's non_tensor_batch keeps every column (JSON)
    extra_columns: dict[str, Any] = Field(default_factory=dict)
    # what the reward function returned besides the score (verl's reward_extra_info; JSON)
    reward_extra_info: dict[str, Any] | None = None
    validate_: bool = Field(default=False, alias="validate")
    global_steps: int = 0
    min_global_steps: int | None = None  # policy version at the first generation
    max_global_steps: int | None = None  # policy version at the last generation
    # MoE routing replay (R3), see the module docstring
    routed_experts: Annotated[RoutedExperts | None, _ROUTED_EXPERTS] = None
    # a failed record's cause (turns.FailureClass); None for other statuses, and in records
    # written before the column existed
    failure_class: FailureClass | None = None

    @property
    def loss_mask(self) -> list[int]:
        return self.response_mask

    @property
    def prompt_len(self) -> int:
        return len(self.prompts)

    @property
    def response_len(self) -> int:
        return len(self.responses)


# columns computed from the record (verl's names), written for the trainer, never read back
_DERIVED = (
    Derived("loss_mask", _MASK.type, "response_mask", lambda t: t.loss_mask),
    Derived("prompt_len", pa.int32(), "max_global_steps", lambda t: t.prompt_len),
    Derived("response_len", pa.int32(), "prompt_len", lambda t: t.response_len),
    Derived("seq_len", pa.int32(), "response_len", lambda t: t.prompt_len + t.response_len),
)
TRAJECTORY_LAYOUT = ArrowLayout(
    Trajectory, _DERIVED, metadata={SCHEMA_VERSION_KEY: str(SCHEMA_VERSION)}
)
TRAJECTORY_SCHEMA = TRAJECTORY_LAYOUT.schema


def trajectory_row(t: Trajectory) -> dict[str, Any]:
    """The Arrow row of ``t``, ``routed_experts`` aside (built as a column)."""
    return TRAJECTORY_LAYOUT.row(t)


def trajectories_to_batch(trajectories: list[Trajectory]) -> pa.RecordBatch:
    return TRAJECTORY_LAYOUT.batch(trajectories)


def batch_to_trajectories(batch: pa.RecordBatch | pa.Table) -> list[Trajectory]:
    """The rows as trajectories, read by column name: a column the batch lacks takes its
    field's default, one the layout does not know is not read."""
    return TRAJECTORY_LAYOUT.records(batch)


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
    return encode_batch(trajectories_to_batch(trajectories))


def encode_batch(batch: pa.RecordBatch) -> list[bytes]:
    """One record value per row of a ``TRAJECTORY_SCHEMA`` batch (``encode_trajectories``)."""
    return [
        b"".join((_SCHEMA_MESSAGE, batch.slice(i, 1).serialize().to_pybytes(), _END_OF_STREAM))
        for i in range(batch.num_rows)
    ]


def record_bytes_bound(batch: pa.RecordBatch) -> int:
    """At least the length of every record ``encode_batch(batch)`` makes, in one IPC call:
    the whole batch as one record. A row's message has the same metadata (its nodes and
    buffers are fixed-size structs) and each of its buffers is a part of the batch's, or a
    rebased copy of fewer offsets, so no record is longer
    (``tests/assembly/test_columnar_fold.py``)."""
    return len(_SCHEMA_MESSAGE) + int(batch.serialize().size) + len(_END_OF_STREAM)


_SCHEMA_MESSAGE = TRAJECTORY_SCHEMA.serialize().to_pybytes()
_END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # continuation marker, length 0


def decode_trajectory_batch(data: bytes) -> pa.RecordBatch:
    """One trajectory record's value as one row of TRAJECTORY_SCHEMA, whatever version of
    the format wrote it (``docs/schema-evolution.md``): a record of the current layout is
    returned as written; another one of the same ``SCHEMA_VERSION`` is read by column name
    (a column it lacks takes its field's default, one this reader does not know is skipped
    with a warning) and laid out again; an older ``SCHEMA_VERSION`` is upcast first.

    Anything else (not bytes, not Arrow, no schema version, a newer one, no row or several,
    a required column missing, a value its field rejects) raises SchemaError, never
    pyarrow's ArrowInvalid/OSError or a TypeError.
    """
    if isinstance(data, bytes | bytearray | memoryview):
        written = _as_written(data)  # this release's own records: no schema parsed again
        if written is not None:
            return written
    batch = _one_row(data)
    record_version = _record_version(batch.schema)
    if record_version == version.SCHEMA_VERSION and batch.schema.equals(TRAJECTORY_SCHEMA):
        return batch
    return _relaid(upcast("trajectory", batch, record_version))


def _as_written(data: bytes | bytearray | memoryview) -> pa.RecordBatch | None:
    """The row of a record as this release writes it (``_SCHEMA_MESSAGE``, one record-batch
    message, the end of stream), read without parsing the schema again; None for anything
    else (another version or layout, or junk), which takes the general path."""
    buffer = pa.py_buffer(data)
    head, end = len(_SCHEMA_MESSAGE), len(buffer) - len(_END_OF_STREAM)
    # compared as bytes: a sliced pa.Buffer compared with bytes cost ~1 us per record
    raw = data if isinstance(data, bytes) else bytes(data)
    if end <= head or not raw.startswith(_SCHEMA_MESSAGE) or not raw.endswith(_END_OF_STREAM):
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


def _one_row(data: bytes) -> pa.RecordBatch:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise SchemaError(f"a trajectory record must be bytes, got {type(data).__name__}")
    try:
        reader = pa.ipc.open_stream(pa.py_buffer(data))
        batches = list(reader)
    except (pa.ArrowException, OSError, ValueError) as exc:  # ArrowInvalid is all three
        raise SchemaError(f"a trajectory record is not an Arrow IPC stream: {exc}") from exc
    rows = sum(batch.num_rows for batch in batches)
    if len(batches) != 1 or rows != 1:
        raise SchemaError(
            f"a trajectory record must be one Arrow record batch of one row, "
            f"got {len(batches)} batches of {rows} rows"
        )
    return batches[0]


def _record_version(schema: pa.Schema) -> int:
    raw = (schema.metadata or {}).get(SCHEMA_VERSION_KEY.encode())
    if raw is None:
        raise SchemaError(
            f"a trajectory record's Arrow schema has no {SCHEMA_VERSION_KEY} metadata: "
            "it was not written by Rollout Bus"
        )
    try:
        number = int(raw)
    except ValueError:
        raise SchemaError(f"a trajectory record's {SCHEMA_VERSION_KEY} is {raw!r}") from None
    return check_record_version("trajectory", number)


def _relaid(batch: pa.RecordBatch) -> pa.RecordBatch:
    """A record of another layout, read by column name and written in the current one."""
    names = batch.schema.names
    missing = [name for name in TRAJECTORY_LAYOUT.required if name not in names]
    if missing:
        raise SchemaError(f"a trajectory record lacks the required columns {', '.join(missing)}")
    unknown = [name for name in names if name not in TRAJECTORY_LAYOUT.names]
    if unknown:
        warn_ignored("trajectory", unknown)
    try:
        return trajectories_to_batch(batch_to_trajectories(batch))
    except (ValueError, TypeError, LookupError, SchemaError, pa.ArrowException) as exc:
        # ValueError covers pydantic's ValidationError and a JSON column that is not JSON
        text = " ".join(str(exc).split())[:500]
        raise SchemaError(f"a trajectory record of columns {names} cannot be read: {text}") from exc
