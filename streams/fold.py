"""Fold a session's turn events into trajectories (pure; no Kafka here).

The replay buffer calls ``fold_session`` for each settled session and
``build_group_trajectories`` when every session of a group has settled. Replaying the
same events always yields byte-identical trajectories: nothing here reads a clock or a
random source.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rolloutbus.errors import SchemaError
from rolloutbus.schemas.trajectories import Trajectory, TrajectoryStatus
from rolloutbus.schemas.turns import (
    Generation,
    GroupStarted,
    Observation,
    OutputSummary,
    SegmentStarted,
    SessionFailed,
    SessionFinished,
    SessionStarted,
)
from rolloutbus.topics import trajectory_key


@dataclass
class SegmentStream:
    """One token stream: its prompt, then generations (mask 1) and observations (mask 0)."""

    prompt_len: int
    tokens: list[int]
    mask: list[int] = field(default_factory=list)  # aligned to tokens; prompt positions 0
    logprobs: list[float] = field(default_factory=list)  # aligned to tokens; 0.0 off-policy
    versions: list[tuple[int, int | None]] = field(default_factory=list)  # (end, version)

    @classmethod
    def start(cls, prompt_ids: list[int]) -> SegmentStream:
        n = len(prompt_ids)
        return cls(prompt_len=n, tokens=list(prompt_ids), mask=[0] * n, logprobs=[0.0] * n)

    def add_generation(self, token_ids: list[int], logprobs: list[float] | None,
                       version: int | None) -> None:
        self.tokens.extend(token_ids)
        self.mask.extend([1] * len(token_ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(token_ids))
        self.versions.append((len(self.tokens), version))

    def add_observation(self, token_ids: list[int]) -> None:
        self.tokens.extend(token_ids)
        self.mask.extend([0] * len(token_ids))
        self.logprobs.extend([0.0] * len(token_ids))

    def versions_until(self, end: int) -> list[int]:
        return [v for stop, v in self.versions if v is not None and stop - 1 < end]


@dataclass
class SessionFold:
    """The events of one attempt of one session, in log order."""

    session_id: int
    attempt: str
    agent_name: str | None = None
    segments: dict[int, SegmentStream] = field(default_factory=dict)
    terminal: SessionFinished | SessionFailed | None = None

    def apply(self, event: Any) -> None:
        if isinstance(event, SessionStarted):
            self.agent_name = event.agent_name
        elif isinstance(event, SegmentStarted):
            self.segments[event.segment] = SegmentStream.start(event.prompt_ids)
        elif isinstance(event, Generation):
            self._segment(event).add_generation(event.token_ids, event.logprobs, event.policy_version)
        elif isinstance(event, Observation):
            self._segment(event).add_observation(event.token_ids)
        elif isinstance(event, SessionFinished | SessionFailed):
            self.terminal = event
        else:
            raise SchemaError(f"unexpected event type {type(event).__name__} in session fold")

    def _segment(self, event: Generation | Observation) -> SegmentStream:
        try:
            return self.segments[event.segment]
        except KeyError:
            raise SchemaError(
                f"session {event.uid}_{event.session_id} attempt {event.attempt}: "
                f"{event.type} for segment {event.segment} before its segment_started"
            ) from None

    @property
    def num_records(self) -> int:
        """Trajectory records this session contributes (a failure is one explicit record)."""
        if isinstance(self.terminal, SessionFinished):
            return len(self.terminal.outputs)
        return 1


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
            out.append(_failed_trajectory(group, fold, fold.terminal, group_size))
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


def _failed_trajectory(group: GroupStarted, fold: SessionFold, failed: SessionFailed,
                       group_size: int) -> Trajectory:
    return Trajectory(
        key=trajectory_key(group.uid, fold.session_id, 0),
        uid=group.uid,
        session_id=fold.session_id,
        output_index=0,
        num_outputs=1,
        group_size=group_size,
        status=TrajectoryStatus.FAILED,
        error=failed.error,
        agent_name=failed.agent_name or fold.agent_name,
        attempt=fold.attempt,
        **_prompt_columns(group),
    )
