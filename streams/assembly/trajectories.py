"""A settled group's trajectories: built from its session folds, checked, ready to release.

Pure and deterministic (nothing reads a clock or a random source), so the live replay
buffer and the offline replay (``consumers/log_replay.py``) produce byte-identical records
from the same turn events. A trajectory that breaks an invariant (``violations``: mask and
logprob lengths equal the response's, mask 0/1, logprob 0.0 on mask-0 tokens, prompt and
response within their budgets) is not dropped: it is released with status ``failed`` and the violations as its error, so its
group is never silently short, and the caller writes a dead letter naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from rolloutbus.config import RolloutConfig
from rolloutbus.errors import SchemaError
from rolloutbus.schemas.trajectories import Trajectory, TrajectoryStatus
from rolloutbus.schemas.turns import GroupStarted, OutputSummary, SessionFailed, SessionFinished
from rolloutbus.streams.assembly.partition_fold import ReleasedGroup
from rolloutbus.streams.assembly.session_fold import SessionFold
from rolloutbus.topics import trajectory_key


@dataclass(frozen=True)
class Violation:
    trajectory: Trajectory  # as folded, before it was marked failed
    problems: list[str]


def finalize_group(released: ReleasedGroup, rollout: RolloutConfig
                   ) -> tuple[list[Trajectory], list[Violation]]:
    """Fold, then check the invariants; a broken trajectory is released as failed."""
    try:
        trajectories = build_group_trajectories(released.group, released.sessions,
                                                rollout.response_length)
    except SchemaError as exc:
        reason = f"turn log of the group cannot be folded: {exc}"
        trajectories = [failed_trajectory(released.group, s, reason, len(released.sessions))
                        for s in released.sessions]
    found = []
    for i, t in enumerate(trajectories):
        problems = violations(t, rollout)
        if problems:
            found.append(Violation(t, problems))
            trajectories[i] = as_failed(t, problems)
    return trajectories, found


def build_group_trajectories(group: GroupStarted, sessions: list[SessionFold],
                             response_length: int | None = None) -> list[Trajectory]:
    """Every trajectory of a settled group, ordered by session then output index."""
    group_size = sum(s.num_records for s in sessions)
    out: list[Trajectory] = []
    for fold in sorted(sessions, key=lambda s: s.session_id):
        if isinstance(fold.terminal, SessionFinished):
            outputs = fold.terminal.outputs
            for i, summary in enumerate(outputs):
                out.append(_output_trajectory(group, fold, i, len(outputs), summary, group_size,
                                              response_length))
        elif isinstance(fold.terminal, SessionFailed):
            out.append(failed_trajectory(group, fold, fold.terminal.error, group_size,
                                         agent_name=fold.terminal.agent_name))
        else:
            raise SchemaError(f"session {group.uid}_{fold.session_id} has not settled")
    return out


def _prompt_columns(group: GroupStarted) -> dict[str, Any]:
    row = group.row
    return {
        "data_source": row.get("data_source") or "",
        "raw_prompt": list(row.get("prompt") or []),
        "reward_model": row.get("reward_model"),
        "extra_info": row.get("extra_info"),
        "validate": group.validate_,
        "global_steps": group.global_steps,
    }


def _output_trajectory(group: GroupStarted, fold: SessionFold, index: int, num_outputs: int,
                       summary: OutputSummary, group_size: int,
                       response_length: int | None) -> Trajectory:
    seg = fold.segments.get(summary.segment)
    if seg is None:
        raise SchemaError(f"session {group.uid}_{fold.session_id}: output {index} names "
                          f"segment {summary.segment}, which was never started")
    start, end = summary.prompt_len, summary.prompt_len + summary.response_len
    if end > len(seg.tokens):
        raise SchemaError(f"session {group.uid}_{fold.session_id}: output {index} ends at "
                          f"{end} but segment {summary.segment} holds {len(seg.tokens)} tokens")
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
        min_global_steps=min(versions) if versions else None,
        max_global_steps=max(versions) if versions else None,
        **_prompt_columns(group),
    )


def failed_trajectory(group: GroupStarted, fold: SessionFold, reason: str, group_size: int,
                      *, agent_name: str | None = None) -> Trajectory:
    """The one explicit record a failed session contributes to its group."""
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
        **_prompt_columns(group),
    )


def violations(t: Trajectory, rollout: RolloutConfig) -> list[str]:
    """Every invariant ``t`` breaks, as sentences that name the numbers."""
    if t.status == TrajectoryStatus.FAILED:
        return []
    found = []
    n = len(t.responses)
    if len(t.response_mask) != n:
        found.append(f"response_mask has {len(t.response_mask)} entries for {n} response tokens")
    if t.rollout_log_probs is not None and len(t.rollout_log_probs) != n:
        found.append(f"rollout_log_probs has {len(t.rollout_log_probs)} entries for {n} response tokens")
    mask = np.asarray(t.response_mask, dtype=np.int64)
    if ((mask != 0) & (mask != 1)).any():
        found.append("response_mask holds values other than 0 and 1")
    if t.rollout_log_probs is not None:
        logprobs = np.asarray(t.rollout_log_probs, dtype=np.float64)
        k = min(len(logprobs), len(mask))  # a length mismatch is reported above
        if (logprobs[:k][mask[:k] == 0] != 0.0).any():
            found.append("a mask-0 token (observation or boundary) has a non-zero logprob")
    if len(t.prompts) > rollout.prompt_length:
        found.append(f"prompt has {len(t.prompts)} tokens, over prompt_length {rollout.prompt_length}")
    if n > rollout.response_length:
        found.append(f"response has {n} tokens, over response_length {rollout.response_length}")
    return found


def as_failed(t: Trajectory, problems: list[str]) -> Trajectory:
    return t.model_copy(update={"status": TrajectoryStatus.FAILED,
                                "error": "invariant violated: " + "; ".join(problems)})
