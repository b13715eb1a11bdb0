"""The turn log, rollout.turns: the source of truth from which trajectories are folded.

Key ``{uid}_{session_id}`` (``{uid}`` for group events), partition ``partition_for(uid)``.
A session is a sequence of events stamped with one ``attempt`` id: a prompt redelivered
after a crash runs again under a new attempt, and the replay buffer folds exactly one
attempt per session (the first to reach a terminal event).

A session's tokens form one or more *segments*: a segment starts with its prompt ids,
then alternates generations (sampled tokens, mask 1, with logprobs) and observations
(tool, user or template-boundary tokens, mask 0, logprob 0.0). Observations are not
produced by the agent loop: the session runner derives them as the suffix of the next
generate() prompt after the tokens already logged.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, TypedDict

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from rolloutbus.schemas.agent_loop import AgentLoopMetrics
from rolloutbus.schemas.evolution import decode_json_record
from rolloutbus.schemas.routed_experts import RoutedExperts
from rolloutbus.schemas.tokens import INT32_MAX, Int32, Int64, Logprobs, Mask, TokenIds
from rolloutbus.schemas.trace import TraceSpan
from rolloutbus.schemas.version import SCHEMA_VERSION


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: int = SCHEMA_VERSION
    uid: str
    # Position of the event in its stream (a group's own events, or one session attempt's),
    # from 0. A fold ignores an event whose seq it has already applied: a producer retry or
    # a resumed session can put the same event in the log twice.
    seq: int = Field(default=0, ge=0)
    ts: float = Field(default_factory=time.time)


class _SessionEvent(_Event):
    session_id: int = Field(ge=0, le=INT32_MAX)  # the trajectory's session_id column is int32
    attempt: str


class SessionIds(TypedDict):
    """The fields that stamp every event of one session attempt (``**ids`` into each event)."""

    uid: str
    session_id: int
    attempt: str


class GroupSettings(BaseModel):
    """The session worker's settings that decide what a group's trajectories are: their
    budgets (a response that reaches ``response_length`` is ``truncated``; a prompt or
    response over its budget breaks an invariant), whether logprobs were asked for, and
    which loop and reward function made them. Recorded in ``group_started``, so the replay
    buffer and ``rolloutbus replay`` fold a group with the settings it ran under, whatever
    their own config says. (n and the sampling parameters are ``group_started``'s own fields.)
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt_length: int = Field(ge=1)  # rollout.prompt_length, tokens
    response_length: int = Field(ge=1)  # rollout.response_length, tokens
    max_model_len: int | None = None  # rollout.max_model_len
    calculate_log_probs: bool = True  # rollout.calculate_log_probs
    # rollout.agent.default_agent_loop: the loop of a row without agent_name (a row's own
    # agent_name is in the row; the loop a session ran is its session_started's agent_name)
    default_agent_loop: str = "single_turn_agent"
    # the reward function: "default_compute_score" (verl's table), or "PATH:NAME" of the
    # custom_reward_function in effect, with its reward_kwargs
    reward_function: str = "default_compute_score"
    reward_kwargs: dict[str, Any] = Field(default_factory=dict)


class GroupStarted(_Event):
    """A worker took a prompt group: the replay buffer learns n, the prompt columns and the
    settings the group runs under."""

    type: Literal["group_started"] = "group_started"
    attempt: str
    n: int = Field(ge=1, le=INT32_MAX)  # as PromptGroup.n
    row: dict[str, Any]
    validate_: bool = Field(default=False, alias="validate")
    global_steps: Int64 = 0  # as wide as PromptGroup's: every accepted group can be logged
    policy_version: Int64 = 0
    # the prompt group's sampling settings, so a worker that resumes the group from the log
    # samples as the one that started it (empty in logs written before this field existed)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    # the worker's settings that shape the group's trajectories; None in logs written before
    # this field existed (the fold then falls back to its own config's, with a warning)
    settings: GroupSettings | None = None
    # who runs the group's sessions: a session worker (taken from rollout.prompts; resumed
    # by whichever worker owns the partition) or the OpenAI gateway (an agent outside the
    # bus calls it; only the gateway resumes such a group, when the agent calls again)
    driven_by: Literal["session_worker", "gateway"] = "session_worker"

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class SessionStarted(_SessionEvent):
    type: Literal["session_started"] = "session_started"
    agent_name: str | None
    # the attempt whose logged turns this one replays before it goes on live (a session
    # resumed after a crash or a rebalance); None for a session run from its start
    resumed_from: str | None = None


class SegmentStarted(_SessionEvent):
    type: Literal["segment_started"] = "segment_started"
    segment: int = Field(ge=0)
    prompt_ids: TokenIds


class Generation(_SessionEvent):
    """Tokens exactly as the replica returned them; nothing is decoded and re-encoded."""

    type: Literal["generation"] = "generation"
    segment: int = Field(ge=0)
    turn: int = Field(ge=0)
    token_ids: TokenIds
    logprobs: Logprobs | None = None
    replica: str = ""
    engine_request_id: str = ""
    policy_version: Int64 | None = None  # the trajectory's min/max_global_steps (int64)
    stop_reason: str | None = None
    num_preempted: int | None = None
    latency_s: float = 0.0
    # the TokenOutput's extra_fields (finish reason, replica, weight version ...): a session
    # resumed from the log gets back exactly what the replica returned
    extra_fields: dict[str, Any] = Field(default_factory=dict)
    # the turn's MoE routed experts (rollout.enable_rollout_routing_replay): every token the
    # engine fed through the model, prompt included; None without routing replay (and in
    # logs written before this field existed)
    routed_experts: RoutedExperts | None = None


# The schema version a ``generation_chunk`` is written with. The event is add-only for this
# reader (no other record changes), but a reader of version 1 must not skip it: chunks take
# seq numbers, so skipping them leaves a gap that holds back the session's later events.
# Stamped 2, it is refused by every version-1 reader with a SchemaError that names version 2
# (``evolution.check_record_version``); every other record is still written as version 1.
GENERATION_CHUNK_VERSION = 2


class GenerationChunk(_SessionEvent):
    """Part of the turn in flight (``sessions.chunk_tokens``): ``token_ids`` are the turn's
    sampled tokens ``start .. start + len(token_ids)``, logged before the turn ends so that a
    session resumed after a crash continues the turn from them instead of sampling it again.
    The turn's ``generation`` event, once logged, holds every token of the turn (chunks
    included): the fold takes the tokens from it and only the policy versions from the
    chunks (``streams/assembly/session_fold.py``)."""

    schema_version: int = GENERATION_CHUNK_VERSION
    type: Literal["generation_chunk"] = "generation_chunk"
    segment: int = Field(ge=0)
    turn: int = Field(ge=0)
    index: int = Field(ge=0)  # the chunk's place in its turn, from 0
    start: int = Field(ge=0)  # the turn's tokens logged before this chunk
    token_ids: TokenIds
    logprobs: Logprobs | None = None
    policy_version: Int64 | None = None  # the version that sampled the chunk's last token
    replica: str = ""


class Observation(_SessionEvent):
    type: Literal["observation"] = "observation"
    segment: int = Field(ge=0)
    turn: int = Field(ge=0)
    token_ids: TokenIds


class OutputSummary(BaseModel):
    """Where one AgentLoopOutput lies in the session's token stream, plus its scalars."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    segment: int = Field(ge=0)
    prompt_len: int = Field(ge=0)
    response_len: int = Field(ge=0)
    mask_override: Mask | None = None  # only when the loop masked sampled tokens itself
    has_logprobs: bool = True
    reward_score: float | None = None
    num_turns: Int32 = 0  # int32 column
    metrics: AgentLoopMetrics = Field(default_factory=AgentLoopMetrics)
    extra_fields: dict[str, Any] = Field(default_factory=dict)


class SessionFinished(_SessionEvent):
    type: Literal["session_finished"] = "session_finished"
    outputs: list[OutputSummary]
    # the session's trace (the loop's run, each generate and tool call); [] in logs written
    # before this field existed
    spans: list[TraceSpan] = Field(default_factory=list)


# What a failed session is attributed to, so a trainer and a dashboard can tell an outage
# from a bad loop: "infrastructure" (a replica, the broker, a hung tool or a deadline; the
# same session may well succeed when run again), "loop" (the agent loop, its tools' answers
# or its output), "reward" (the reward function).
FailureClass = Literal["infrastructure", "loop", "reward"]
FAILURE_CLASSES: tuple[FailureClass, ...] = ("infrastructure", "loop", "reward")


class SessionFailed(_SessionEvent):
    """A session that could not produce a trajectory: an explicit record, never a gap."""

    type: Literal["session_failed"] = "session_failed"
    agent_name: str | None = None
    error: str
    retriable: bool = False
    spans: list[TraceSpan] = Field(default_factory=list)  # what ran before it failed
    # None in logs written before failure classes existed
    failure_class: FailureClass | None = None


TurnEvent = Annotated[
    GroupStarted
    | SessionStarted
    | SegmentStarted
    | Generation
    | GenerationChunk
    | Observation
    | SessionFinished
    | SessionFailed,
    Field(discriminator="type"),
]
TERMINAL_TYPES = ("session_finished", "session_failed")

_TURN_EVENT = TypeAdapter(TurnEvent)


def encode_turn_event(event: BaseModel) -> bytes:
    return event.model_dump_json(by_alias=True).encode("utf-8")


def decode_turn_event(data: bytes) -> TurnEvent:
    """Raises pydantic's ValidationError for a record that is not a turn event, SchemaError
    for one of a schema version this reader cannot read (``schemas/evolution.py``)."""
    return decode_json_record(_TURN_EVENT, data, "turn_event")
