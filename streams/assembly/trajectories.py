"""A settled group's trajectories: built from its session folds, checked, encoded, ready
to release.

Pure and deterministic (nothing reads a clock or a random source), so the live replay
buffer and the offline replay (``consumers/log_replay.py``) produce byte-identical records
from the same turn events. Nothing a group's events hold can make :func:`finalize_group`
raise: whatever cannot become a trajectory becomes an explicit failed record plus a
:class:`Letter` (a dead letter for the caller to write), so a group is never silently
short and bad input never stops a worker. In particular:

* a trajectory that breaks an invariant (``violations``: mask and logprob lengths equal the
  response's, mask 0/1, logprob 0.0 on mask-0 tokens, prompt and response within their
  budgets) is released with status ``failed`` and the violations as its error;
* a session whose log cannot be folded or built (a fold error, an output naming tokens the
  log does not hold) is one failed record;
* a row whose prompt columns cannot be carried (``prompt`` a string, say) fails every
  session of the group, the records carrying no prompt columns;
* a record that cannot be encoded, or is larger than ``max_record_bytes``, is replaced by
  a failed record without tokens.

The budgets a group is checked against (``prompt_length``, ``response_length``: what makes
a trajectory ``truncated``, or breaks an invariant) are the ones its ``group_started``
recorded (``GroupSettings``), never the folding process's own config: the log alone decides.
Only a group logged before groups recorded their settings is folded with the ``rollout``
config it is given, and the first such group per process logs a warning.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import pyarrow as pa

from rolloutbus.config import KafkaConfig, RolloutConfig
from rolloutbus.errors import RolloutBusError, SchemaError
from rolloutbus.schemas.trajectories import (
    Trajectory,
    TrajectoryStatus,
    encode_batch,
    encode_trajectories,
    trajectories_to_batch,
)
from rolloutbus.schemas.turns import (
    FailureClass,
    GroupStarted,
    OutputSummary,
    SessionFailed,
    SessionFinished,
    encode_turn_event,
)
from rolloutbus.streams.assembly.columnar_fold import columnar_group
from rolloutbus.streams.assembly.invariants import Budgets, as_failed, budgets_of, violations
from rolloutbus.streams.assembly.partition_fold import ReleasedGroup
from rolloutbus.streams.assembly.session_fold import SessionFold, short_error
from rolloutbus.topics import trajectory_key

# What bad data can raise while a group is built, checked and encoded (pydantic's
# ValidationError is a ValueError; pyarrow's errors are ArrowException). Anything else is
# a bug in this code and is not caught.
DATA_ERRORS = (
    RolloutBusError,
    ValueError,
    TypeError,
    LookupError,
    ArithmeticError,
    pa.ArrowException,
)
# bytes a record of kafka.max_message_bytes leaves for Kafka's record and batch headers
RECORD_HEADROOM_BYTES = 1024
log = logging.getLogger(__name__)


def max_record_bytes(kafka: KafkaConfig) -> int:
    """The largest record value (plus key) the replay buffer writes to a topic."""
    return kafka.max_message_bytes - RECORD_HEADROOM_BYTES


class Letter(NamedTuple):
    """A dead letter to write for a released group: key, reason, the original bytes."""

    key: str
    reason: str
    original: bytes


class FinalizedGroup(NamedTuple):
    # ordered by session, then output index; see finalize_group's token_lists
    trajectories: list[Trajectory]
    records: list[bytes]  # one Arrow record per trajectory, exactly as released
    letters: list[Letter]
    batch: pa.RecordBatch  # the records' rows as one batch (what an offline replay writes)


def finalize_group(
    released: ReleasedGroup,
    rollout: RolloutConfig,
    *,
    max_record_bytes: int | None = None,
    columnar: bool = True,
    token_lists: bool = True,
    records: bool = True,
) -> FinalizedGroup:
    """Build, check and encode a released group's trajectories; never raises on bad data.

    ``rollout``: the budgets of a group whose ``group_started`` recorded none (a log written
    before it did); a group's recorded settings always win. ``columnar`` (the default): build
    the common shape of a group column by column, the same bytes (``columnar_fold.py``);
    ``columnar=False``: the pydantic build alone (the baseline). ``token_lists=False``: a
    group built column by column returns its trajectories without token lists (their token
    fields empty, the tokens and lengths in ``batch``), for a caller that reads only their
    scalars (the replay buffer; ``benchmarks/fold_cpu.py``, path ``buffer``). ``records=False``:
    no records (an empty list), for a caller that keeps only the batch (``replay --out``);
    each trajectory is still released as failed where its record would not fit the topic."""
    if columnar:
        done = _columnar(released, rollout, max_record_bytes, token_lists, records)
        if done is not None:
            return done
    done = _pydantic_build(released, rollout, max_record_bytes)
    return done if records else done._replace(records=[])


def _pydantic_build(
    released: ReleasedGroup, rollout: RolloutConfig, max_record_bytes: int | None
) -> FinalizedGroup:
    group = released.group
    if released.rejected:
        return FinalizedGroup(
            [],
            [],
            [Letter(group.uid, released.reason or "rejected", _original(released))],
            trajectories_to_batch([]),
        )
    letters = []
    if released.reason is not None:
        letters.append(
            Letter(
                group.uid,
                f"group {group.uid} released unfinished: {released.reason}",
                _original(released),
            )
        )
    budgets = rollout if released.kind == "head_missing" else budgets_of(group, rollout)
    try:
        trajectories = _build(released, budgets, letters)
        records, batch = _encode(trajectories, max_record_bytes, letters)
    except DATA_ERRORS as exc:  # not expected: every step above contains its own failures
        reason = f"the group cannot be released as built: {short_error(exc)}"
        letters.append(Letter(group.uid, f"group {group.uid}: {reason}", _original(released)))
        trajectories = _all_failed(released, reason)
        batch = trajectories_to_batch(trajectories)
        records = encode_batch(batch)
    return FinalizedGroup(trajectories, records, letters, batch)


def _columnar(
    released: ReleasedGroup,
    rollout: RolloutConfig,
    max_record_bytes: int | None,
    token_lists: bool = True,
    records: bool = True,
) -> FinalizedGroup | None:
    """The group built column by column, or None for a shape (or bad data) left to the
    pydantic build, which then writes the records and letters it always did."""
    if released.kind != "completed" or released.reason is not None or released.failed:
        return None
    columns, problem = _checked_prompt_columns(released.group)
    if problem is not None:
        return None
    budgets = budgets_of(released.group, rollout)
    try:
        built = columnar_group(
            released,
            columns,
            prompt_length=budgets.prompt_length,
            response_length=budgets.response_length,
            max_record_bytes=max_record_bytes,
            token_lists=token_lists,
            records=records,
        )
    except DATA_ERRORS:
        return None
    return None if built is None else FinalizedGroup(built[0], built[1], [], built[2])


def _build(released: ReleasedGroup, budgets: Budgets, letters: list[Letter]) -> list[Trajectory]:
    group = released.group
    columns, problem = _checked_prompt_columns(group)
    reason = ""
    if problem is not None:
        reason = f"the group's row cannot be carried into trajectories: {problem}"
        letters.append(
            Letter(
                group.uid,
                f"group {group.uid}: {reason}; its sessions are released as failed",
                _original(released),
            )
        )
    per_session = []
    for fold in sorted(released.sessions, key=lambda s: s.session_id):
        failure = reason if problem is not None else released.failed.get(fold.session_id)
        # a row that cannot be carried is the data's (the loop's side); an early release (a
        # deadline, too many open groups, a lost head) of sessions that never settled is
        # the pipeline's
        cause: FailureClass = "loop" if problem is not None else "infrastructure"
        per_session.append(
            _session_trajectories(group, fold, columns, (failure, cause), budgets, letters)
        )
    group_size = sum(len(ts) for ts in per_session)
    out = []
    for ts in per_session:
        for t in ts:
            t = t.model_copy(update={"group_size": group_size})
            problems = violations(t, budgets)
            if problems:
                letters.append(
                    Letter(
                        t.key,
                        f"trajectory {t.key} released as failed: " + "; ".join(problems),
                        _encoded_or_empty(t),
                    )
                )
                t = as_failed(t, problems)
            out.append(t)
    return out


def _session_trajectories(
    group: GroupStarted,
    fold: SessionFold,
    columns: dict[str, Any],
    imposed: tuple[str | None, FailureClass],
    budgets: Budgets,
    letters: list[Letter],
) -> list[Trajectory]:
    """The records of one session, group_size 0 (set once every session is built);
    ``imposed``: a failure the whole release imposes on it, and its class."""
    failure, cause = imposed
    if failure is None and fold.error is not None:
        failure, cause = f"turn log of the session cannot be folded: {fold.error}", "loop"
        letters.append(
            Letter(
                trajectory_key(group.uid, fold.session_id, 0),
                f"session {group.uid}_{fold.session_id} released as failed: {failure}",
                _event_or_empty(fold.terminal),
            )
        )
    if failure is not None:
        return [_failed(group, fold, failure, columns, failure_class=cause)]
    if isinstance(fold.terminal, SessionFailed):
        return [_failed_session(group, fold, columns)]
    if not isinstance(fold.terminal, SessionFinished):
        return [
            _failed(
                group, fold, "the session has not settled", columns, failure_class="infrastructure"
            )
        ]
    outputs = fold.terminal.outputs
    try:
        return [
            _output_trajectory(
                group, fold, i, len(outputs), summary, 0, budgets.response_length, columns
            )
            for i, summary in enumerate(outputs)
        ]
    except DATA_ERRORS as exc:
        failure = f"turn log of the session cannot be folded: {short_error(exc)}"
        letters.append(
            Letter(
                trajectory_key(group.uid, fold.session_id, 0),
                f"session {group.uid}_{fold.session_id} released as failed: {failure}",
                _event_or_empty(fold.terminal),
            )
        )
        return [_failed(group, fold, failure, columns, failure_class="loop")]


def _failed_session(group: GroupStarted, fold: SessionFold, columns: dict[str, Any]) -> Trajectory:
    """The record of a session that logged its own failure, with the class it gave."""
    assert isinstance(fold.terminal, SessionFailed)
    terminal = fold.terminal
    return _failed(
        group,
        fold,
        terminal.error,
        columns,
        agent_name=terminal.agent_name,
        failure_class=terminal.failure_class,
    )


def _encode(
    trajectories: list[Trajectory], max_record_bytes: int | None, letters: list[Letter]
) -> tuple[list[bytes], pa.RecordBatch]:
    """One record per trajectory, and their rows as one batch; a trajectory that cannot be
    encoded or is too large for the topic becomes a failed record without tokens."""
    batch: pa.RecordBatch | None = None
    try:
        batch = trajectories_to_batch(trajectories)
        records = encode_batch(batch)
    except DATA_ERRORS:
        records = [_encoded_or_empty(t) for t in trajectories]  # find the one that fails
    for i, (t, record) in enumerate(zip(trajectories, records, strict=True)):
        too_large = (
            max_record_bytes is not None and len(record) + len(t.key.encode()) > max_record_bytes
        )
        if record and not too_large:
            continue
        reason = (
            (
                f"its record is {len(record)} bytes, over {max_record_bytes} "
                "(kafka.max_message_bytes "
                "less headers)"
            )
            if too_large
            else "its record cannot be encoded"
        )
        letters.append(Letter(t.key, f"trajectory {t.key} released as failed: {reason}", b""))
        trajectories[i] = _stripped_failure(t, reason)
        records[i] = encode_trajectories([trajectories[i]])[0]
        batch = None  # a row was replaced
    return records, batch if batch is not None else trajectories_to_batch(trajectories)


def build_group_trajectories(
    group: GroupStarted, sessions: list[SessionFold], response_length: int | None = None
) -> list[Trajectory]:
    """Every trajectory of a settled group, ordered by session then output index.

    Strict (raises SchemaError where the log cannot be built); :func:`finalize_group` is the
    path that turns such a failure into records.
    """
    group_size = sum(s.num_records for s in sessions)
    columns = _prompt_columns(group)
    out: list[Trajectory] = []
    for fold in sorted(sessions, key=lambda s: s.session_id):
        if fold.error is not None:
            raise SchemaError(fold.error)
        if isinstance(fold.terminal, SessionFinished):
            outputs = fold.terminal.outputs
            for i, summary in enumerate(outputs):
                out.append(
                    _output_trajectory(
                        group, fold, i, len(outputs), summary, group_size, response_length, columns
                    )
                )
        elif isinstance(fold.terminal, SessionFailed):
            out.append(
                failed_trajectory(
                    group,
                    fold,
                    fold.terminal.error,
                    group_size,
                    agent_name=fold.terminal.agent_name,
                    failure_class=fold.terminal.failure_class,
                )
            )
        else:
            raise SchemaError(f"session {group.uid}_{fold.session_id} has not settled")
    return out


# row columns that have a trajectory column of their own (or none: uid is the key's, the
# agent name is the session's); every other column goes to extra_columns
_ROW_COLUMNS_WITH_A_PLACE = frozenset(
    {"data_source", "prompt", "reward_model", "extra_info", "agent_name", "uid"}
)


def _prompt_columns(group: GroupStarted) -> dict[str, Any]:
    row = group.row
    return {
        "data_source": row.get("data_source") or "",
        "raw_prompt": list(row.get("prompt") or []),
        "reward_model": row.get("reward_model"),
        "extra_info": row.get("extra_info"),
        "extra_columns": {k: v for k, v in row.items() if k not in _ROW_COLUMNS_WITH_A_PLACE},
        "validate": group.validate_,
        "global_steps": group.global_steps,
    }


def _checked_prompt_columns(group: GroupStarted) -> tuple[dict[str, Any], str | None]:
    """The prompt columns, or, when the row cannot fill them, the columns every group can
    carry (validate, global_steps) and why."""
    prompt = group.row.get("prompt")
    if prompt is not None and not isinstance(prompt, list):
        return _scalar_columns(group), (
            f"row.prompt must be a list of chat messages, got {type(prompt).__name__}"
        )
    try:
        columns = _prompt_columns(group)
        Trajectory(
            key="",
            uid="",
            session_id=0,
            output_index=0,
            num_outputs=1,
            group_size=0,
            status=TrajectoryStatus.FAILED,
            **columns,
        )
    except DATA_ERRORS as exc:
        return _scalar_columns(group), short_error(exc)
    return columns, None


def _scalar_columns(group: GroupStarted) -> dict[str, Any]:
    return {"validate": group.validate_, "global_steps": group.global_steps}


def _output_trajectory(
    group: GroupStarted,
    fold: SessionFold,
    index: int,
    num_outputs: int,
    summary: OutputSummary,
    group_size: int,
    response_length: int | None,
    columns: dict[str, Any] | None = None,
) -> Trajectory:
    seg = fold.segments.get(summary.segment)
    if seg is None:
        raise SchemaError(
            f"session {group.uid}_{fold.session_id}: output {index} names "
            f"segment {summary.segment}, which was never started"
        )
    start, end = summary.prompt_len, summary.prompt_len + summary.response_len
    if end > len(seg.tokens):
        raise SchemaError(
            f"session {group.uid}_{fold.session_id}: output {index} ends at "
            f"{end} but segment {summary.segment} holds {len(seg.tokens)} tokens"
        )
    responses = seg.tokens[start:end]
    mask = list(summary.mask_override) if summary.mask_override is not None else seg.mask[start:end]
    versions = seg.versions_until(end)
    truncated = response_length is not None and len(responses) >= response_length
    reward = summary.reward_score
    rm_scores = None
    if reward is not None:
        rm_scores = [0.0] * len(responses)
        if rm_scores:
            rm_scores[-1] = float(reward)
    return Trajectory(
        key=trajectory_key(group.uid, fold.session_id, index),
        uid=group.uid,
        session_id=fold.session_id,
        output_index=index,
        num_outputs=num_outputs,
        group_size=group_size,
        status=TrajectoryStatus.TRUNCATED if truncated else TrajectoryStatus.COMPLETED,
        agent_name=fold.agent_name,
        attempt=fold.attempt,
        prompts=seg.tokens[:start],
        responses=responses,
        response_mask=mask,
        rollout_log_probs=seg.logprobs[start:end] if summary.has_logprobs else None,
        rm_scores=rm_scores,
        reward_score=reward,
        num_turns=summary.num_turns,
        metrics=summary.metrics,
        extra_fields=summary.extra_fields,
        reward_extra_info=summary.extra_fields.get("reward_extra_info"),
        min_global_steps=min(versions) if versions else None,
        max_global_steps=max(versions) if versions else None,
        # routing replay: the last generation's routing within the output, as verl keeps it
        routed_experts=seg.routed_experts_until(end),
        **(_prompt_columns(group) if columns is None else columns),
    )


def failed_trajectory(
    group: GroupStarted,
    fold: SessionFold,
    reason: str,
    group_size: int,
    *,
    agent_name: str | None = None,
    failure_class: FailureClass | None = None,
) -> Trajectory:
    """The one explicit record a failed session contributes to its group."""
    return _failed(
        group,
        fold,
        reason,
        _prompt_columns(group),
        agent_name=agent_name,
        group_size=group_size,
        failure_class=failure_class,
    )


def _failed(
    group: GroupStarted,
    fold: SessionFold,
    reason: str,
    columns: dict[str, Any],
    *,
    agent_name: str | None = None,
    group_size: int = 0,
    failure_class: FailureClass | None = None,
) -> Trajectory:
    return Trajectory(
        key=trajectory_key(group.uid, fold.session_id, 0),
        uid=group.uid,
        session_id=fold.session_id,
        output_index=0,
        num_outputs=1,
        group_size=group_size,
        status=TrajectoryStatus.FAILED,
        error=reason,
        agent_name=agent_name or fold.agent_name,
        attempt=fold.attempt,
        failure_class=failure_class,
        **columns,
    )


def _stripped_failure(t: Trajectory, reason: str) -> Trajectory:
    """``t`` as a failed record that keeps its key and counts but no tokens or row columns."""
    return Trajectory(
        key=t.key,
        uid=t.uid,
        session_id=t.session_id,
        output_index=t.output_index,
        num_outputs=t.num_outputs,
        group_size=t.group_size,
        status=TrajectoryStatus.FAILED,
        error=reason,
        agent_name=t.agent_name,
        attempt=t.attempt,
        validate=t.validate_,
        global_steps=t.global_steps,
        failure_class=t.failure_class or "loop",  # a record the topic cannot take
    )


def _all_failed(released: ReleasedGroup, reason: str) -> list[Trajectory]:
    group = released.group
    sessions = sorted(released.sessions, key=lambda s: s.session_id)
    return [
        _failed(
            group,
            fold,
            reason,
            _scalar_columns(group),
            group_size=len(sessions),
            failure_class="loop",
        )
        for fold in sessions
    ]


def _original(released: ReleasedGroup) -> bytes:
    """What a group's dead letter carries: its group_started as logged (re-encoded)."""
    return b"" if released.kind == "head_missing" else encode_turn_event(released.group)


def _event_or_empty(event: Any) -> bytes:
    return b"" if event is None else encode_turn_event(event)


def _encoded_or_empty(t: Trajectory) -> bytes:
    try:
        return encode_trajectories([t])[0]
    except DATA_ERRORS:
        return b""
