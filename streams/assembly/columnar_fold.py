"""A released group's records built column by column (issue 28 item 2, a first part).

The pydantic build of a group (``trajectories.finalize_group``) makes one ``Trajectory`` per
output with its token lists, which pydantic checks, then flattens those lists into the
batch's token columns. Here the common shape of a group (released complete, every session
finished with a foldable log, no mask override, no routed experts, every output within its
budgets and the topic's record size) is built as:

* one ``Trajectory`` per output with its token fields *empty*, so pydantic checks only the
  scalars and the prompt columns, as before;
* its batch from those (``ArrowLayout.batch``), given the token columns and the lengths
  derived from them as columns made from each segment's tokens in numpy: the chunks the
  fold kept (``token_stream.FoldSegment``: the wire decoder's arrays, or pydantic's lists),
  concatenated once per segment.

``finalize_group`` (``columnar=True``, the default) tries this path first. Its records
are byte-identical to the pydantic build's (``tests/assembly/test_columnar_fold.py``
compares both over random turn logs), and so are the trajectories returned (their token
fields are set afterwards, unchecked: they come from events pydantic decoded). Any other
shape, or any data error, returns None and the pydantic build runs, with its failed records
and dead letters as they always were.
"""

from __future__ import annotations

import array
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from rolloutbus.schemas.trajectories import (
    TRAJECTORY_LAYOUT,
    TRAJECTORY_SCHEMA,
    Trajectory,
    TrajectoryStatus,
    encode_batch,
    record_bytes_bound,
)
from rolloutbus.schemas.turns import GroupStarted, OutputSummary, SessionFinished
from rolloutbus.streams.assembly.partition_fold import ReleasedGroup
from rolloutbus.streams.assembly.session_fold import SessionFold
from rolloutbus.streams.token_stream import FoldSegment, SegmentStream
from rolloutbus.topics import trajectory_key

# the token columns replaced, with their item dtype, and the lengths derived from them
_LIST_COLUMNS = {
    "prompts": np.int32,
    "responses": np.int32,
    "response_mask": np.int8,
    "loss_mask": np.int8,
    "rollout_log_probs": np.float32,
    "rm_scores": np.float32,
}


class _Budgets(NamedTuple):
    prompt_length: int  # tokens
    response_length: int  # tokens


class _Wanted(NamedTuple):
    token_lists: bool  # the trajectories with their token fields
    records: bool  # the encoded records (else only the batch, and the check that they fit)


def columnar_group(
    released: ReleasedGroup,
    columns: dict[str, Any],
    *,
    prompt_length: int,
    response_length: int,
    max_record_bytes: int | None = None,
    token_lists: bool = True,
    records: bool = True,
) -> tuple[list[Trajectory], list[bytes], pa.RecordBatch] | None:
    """A group released complete, as (trajectories, records, batch); None for a shape this
    path leaves to the pydantic build. ``columns``: its prompt columns, already checked
    (``_checked_prompt_columns``); the lengths: the group's budgets (``budgets_of``), tokens.
    ``token_lists=False``: the trajectories without their token fields (empty lists; the
    batch holds the tokens and lengths), which spares a Python int per token.
    ``records=False``: no records (an empty list); each row is encoded only where the whole
    batch's bound does not show that it fits ``max_record_bytes``.
    Raises what bad data raises; ``finalize_group`` then takes the pydantic build."""
    budgets = _Budgets(prompt_length, response_length)
    folds = sorted(released.sessions, key=lambda s: s.session_id)
    if not all(_plain_session(fold) for fold in folds):
        return None
    wanted = _Wanted(token_lists, records)
    return _build(released.group, folds, budgets, columns, max_record_bytes, wanted)


def _plain_session(fold: SessionFold) -> bool:
    terminal = fold.terminal
    return (
        fold.error is None
        and isinstance(terminal, SessionFinished)
        and all(o.mask_override is None for o in terminal.outputs)
        and not any(seg.routed for seg in fold.segments.values())
    )


class _Output:
    """One output's place in its segment, and its record's scalar trajectory."""

    def __init__(self, seg: SegmentStream | FoldSegment, summary: OutputSummary, t: Trajectory):
        self.seg, self.summary, self.t = seg, summary, t
        self.start = summary.prompt_len
        self.end = summary.prompt_len + summary.response_len


def _build(
    group: GroupStarted,
    folds: list[SessionFold],
    budgets: _Budgets,
    columns: dict[str, Any],
    max_record_bytes: int | None,
    wanted: _Wanted,
) -> tuple[list[Trajectory], list[bytes], pa.RecordBatch] | None:
    outputs = []
    # the fields every output's record shares: the prompt columns and the group's size
    shared = {**columns, "group_size": sum(f.num_records for f in folds)}
    for fold in folds:
        assert isinstance(fold.terminal, SessionFinished)
        for i, summary in enumerate(fold.terminal.outputs):
            out = _output(group, fold, i, summary, budgets, shared)
            if out is None:
                return None
            outputs.append(out)
    segments: dict[int, _SegmentArrays] = {}
    given = {**_token_columns(outputs, segments), **_lengths(outputs)}
    batch = TRAJECTORY_LAYOUT.batch([o.t for o in outputs], given)
    records = _fitting_records(batch, [o.t.key for o in outputs], max_record_bytes, wanted)
    if records is None:
        return None
    if not wanted.token_lists:
        return [o.t for o in outputs], records, batch
    return [_with_tokens(o, segments) for o in outputs], records, batch


def _fitting_records(
    batch: pa.RecordBatch, keys: list[str], max_record_bytes: int | None, wanted: _Wanted
) -> list[bytes] | None:
    """The batch's records ([] unless wanted); None if one is over ``max_record_bytes``
    with its key (the pydantic build then fails it). Records not wanted are not encoded
    where the whole batch shows that each fits: one IPC call, not one per row."""
    longest_key = max((len(k.encode()) for k in keys), default=0)
    if not wanted.records and (
        max_record_bytes is None or record_bytes_bound(batch) + longest_key <= max_record_bytes
    ):
        return []
    records = encode_batch(batch)
    if max_record_bytes is not None and any(
        len(r) + len(k.encode()) > max_record_bytes for r, k in zip(records, keys, strict=True)
    ):
        return None
    return records if wanted.records else []


def _output(
    group: GroupStarted,
    fold: SessionFold,
    index: int,
    summary: OutputSummary,
    budgets: _Budgets,
    shared: dict[str, Any],
) -> _Output | None:
    """The scalar record of one output (``trajectories._output_trajectory`` without the
    token lists); None where that path would fail the record or find a violation.
    ``shared``: the fields of every record of the group (prompt columns, group_size)."""
    seg = fold.segments.get(summary.segment)
    start, end = summary.prompt_len, summary.prompt_len + summary.response_len
    if seg is None or end > _length(seg):
        return None
    n = end - start
    if start > budgets.prompt_length or n > budgets.response_length:
        return None  # an invariant violated: a failed record, built by finalize_group
    versions = seg.versions_until(end)
    reward = summary.reward_score
    assert isinstance(fold.terminal, SessionFinished)
    t = Trajectory(
        key=trajectory_key(group.uid, fold.session_id, index),
        uid=group.uid,
        session_id=fold.session_id,
        output_index=index,
        num_outputs=len(fold.terminal.outputs),
        status=(
            TrajectoryStatus.TRUNCATED
            if n >= budgets.response_length
            else TrajectoryStatus.COMPLETED
        ),
        agent_name=fold.agent_name,
        attempt=fold.attempt,
        rollout_log_probs=[] if summary.has_logprobs else None,
        rm_scores=None if reward is None else [],
        reward_score=reward,
        num_turns=summary.num_turns,
        metrics=summary.metrics,
        extra_fields=summary.extra_fields,
        reward_extra_info=summary.extra_fields.get("reward_extra_info"),
        min_global_steps=min(versions) if versions else None,
        max_global_steps=max(versions) if versions else None,
        **shared,
    )
    return _Output(seg, summary, t)


def _length(seg: SegmentStream | FoldSegment) -> int:
    return seg.length if isinstance(seg, FoldSegment) else len(seg.tokens)


def _with_tokens(out: _Output, arrays: dict[int, _SegmentArrays]) -> Trajectory:
    """The trajectory ``finalize_group`` returns: the scalar one with its token lists (from
    the segment's numpy arrays where those hold the very values its lists would)."""
    seg, start, end = out.seg, out.start, out.end
    update: dict[str, Any] = {}
    if isinstance(seg, FoldSegment) and not seg.list_logprobs:
        a = arrays[id(seg)]
        update["prompts"] = a.tokens[:start].tolist()
        update["responses"] = a.tokens[start:end].tolist()
        update["response_mask"] = a.mask[start:end].tolist()
        if out.summary.has_logprobs:
            update["rollout_log_probs"] = a.logprobs[start:end].tolist()
    else:
        update["prompts"] = seg.tokens[:start]
        update["responses"] = seg.tokens[start:end]
        update["response_mask"] = seg.mask[start:end]
        if out.summary.has_logprobs:
            update["rollout_log_probs"] = seg.logprobs[start:end]
    if out.summary.reward_score is not None:
        rm_scores = [0.0] * (end - start)
        if rm_scores:
            rm_scores[-1] = float(out.summary.reward_score)
        update["rm_scores"] = rm_scores
    return out.t.model_copy(update=update)


class _SegmentArrays:
    """A segment's tokens, mask and logprobs as numpy, converted once per segment (a
    ``FoldSegment`` concatenates the chunks it kept)."""

    def __init__(self, seg: SegmentStream | FoldSegment):
        if isinstance(seg, FoldSegment):
            self.tokens, self.mask, self.logprobs = seg.arrays()
            return
        self.tokens = np.array(seg.tokens, np.int32)  # ids were checked int32 when decoded
        self.mask = np.frombuffer(bytes(seg.mask), np.int8)  # the fold writes 0s and 1s only
        logprobs = array.array("f")
        logprobs.fromlist(seg.logprobs)  # a float beyond float32: inf, as in arrow_layout
        self.logprobs = np.frombuffer(logprobs, np.float32)


def _pieces(
    outputs: list[_Output], arrays: dict[int, _SegmentArrays]
) -> dict[str, list[np.ndarray | None]]:
    pieces: dict[str, list[np.ndarray | None]] = {name: [] for name in _LIST_COLUMNS}
    for out in outputs:
        seg = arrays.get(id(out.seg))
        if seg is None:
            seg = arrays[id(out.seg)] = _SegmentArrays(out.seg)
        start, end = out.start, out.end
        pieces["prompts"].append(seg.tokens[:start])
        pieces["responses"].append(seg.tokens[start:end])
        pieces["response_mask"].append(seg.mask[start:end])
        logprobs = seg.logprobs[start:end] if out.summary.has_logprobs else None
        pieces["rollout_log_probs"].append(logprobs)
        pieces["rm_scores"].append(_rm_scores(out.summary.reward_score, end - start))
    return pieces


def _rm_scores(reward: float | None, n: int) -> np.ndarray | None:
    if reward is None:
        return None
    scores = np.zeros(n, np.float64)
    if n:
        scores[-1] = float(reward)
    with np.errstate(over="ignore"):
        return scores.astype(np.float32)  # beyond float32: inf, as Arrow's conversion makes it


def _token_columns(
    outputs: list[_Output], segments: dict[int, _SegmentArrays]
) -> dict[str, pa.Array]:
    """The token columns, by name, from the segments' numpy arrays (loss_mask is
    response_mask's array again, as ``ArrowLayout.batch`` makes it)."""
    out = {}
    for name, values in _pieces(outputs, segments).items():
        if name != "loss_mask":
            out[name] = _list_column(values, TRAJECTORY_SCHEMA.field(name).type)
    out["loss_mask"] = out["response_mask"]
    return out


def _lengths(outputs: list[_Output]) -> dict[str, pa.Array]:
    """The length columns, by name, of the token columns (the trajectories' are 0)."""
    prompt = np.array([o.start for o in outputs], np.int32)
    response = np.array([o.end - o.start for o in outputs], np.int32)
    return {
        "prompt_len": pa.array(prompt, pa.int32()),
        "response_len": pa.array(response, pa.int32()),
        "seq_len": pa.array(prompt + response, pa.int32()),
    }


def _list_column(values: list[np.ndarray | None], arrow_type: pa.DataType) -> pa.Array:
    """``arrow_layout.numeric_list_column`` from numpy pieces (None: a null list)."""
    nulls = [v is None for v in values]
    if all(nulls):
        return pa.nulls(len(values), arrow_type)
    lengths = np.fromiter((0 if v is None else len(v) for v in values), np.int64, len(values))
    offsets = np.zeros(len(values) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    dtype = arrow_type.value_type.to_pandas_dtype()
    present = [v for v in values if v is not None]
    flat = np.concatenate(present).astype(dtype, copy=False)
    return pa.LargeListArray.from_arrays(
        pa.array(offsets), pa.array(flat), mask=pa.array(nulls) if any(nulls) else None
    )
