"""Run a prompt group: fan it out into n sessions, each one agent-loop run, every turn logged.

This module is the session processor's algorithm, free of Faust: ``run_group`` takes an
``emit`` coroutine that puts one event on rollout.turns. ``streams/sessions/worker.py``
binds it to a Faust agent and resumes groups from the log (``run_sessions`` with ``resume``).

A session that fails is logged as ``SessionFailed`` with its class (``failure_class_of``):
``infrastructure`` (a replica, the broker, a hung tool, a deadline: retriable),
``reward`` (the reward function) or ``loop`` (anything else the loop did).
"""

from __future__ import annotations

import asyncio
import builtins
import itertools
import logging
import traceback
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from pydantic import BaseModel

from rolloutbus.config import Config
from rolloutbus.errors import (
    AgentLoopError,
    BrokerError,
    ReplicaError,
    RolloutBusError,
    SchemaError,
    SessionDivergedError,
    UnknownAgentLoopError,
)
from rolloutbus.schemas.agent_loop import AgentLoopOutput
from rolloutbus.schemas.prompts import GroupSamplingParams, PromptGroup
from rolloutbus.schemas.trace import TraceSpan
from rolloutbus.schemas.turns import (
    FailureClass,
    GroupSettings,
    GroupStarted,
    SessionFailed,
    SessionFinished,
    SessionIds,
    SessionStarted,
)
from rolloutbus.streams.agent_loop import registry
from rolloutbus.streams.agent_loop.base import DictConfigWrap, ToolListWrap
from rolloutbus.streams.agent_loop.tools import load_tool_catalog
from rolloutbus.streams.agent_loop.tracing import collect_spans, trace_span
from rolloutbus.streams.inference.llm_client import ReplicaRequestError
from rolloutbus.streams.reward import reward_fn_from_config, score_outputs_async
from rolloutbus.streams.sessions.chunking import ChunkSettings
from rolloutbus.streams.sessions.recorder import Emit, RecordingLLMClient
from rolloutbus.streams.sessions.recovery import LoggedAttempt

log = logging.getLogger(__name__)


class EmitError(RolloutBusError):
    """The turn log could not be written: the worker must stop, not record a failure."""


class SessionDeadlineError(AgentLoopError):
    """A session ran past ``deadlines.session_s``: it is recorded as failed."""


class RewardFailedError(AgentLoopError):
    """The reward function failed on a session's outputs: the session fails as "reward"."""


# What fails a session from outside its loop: retrying it elsewhere or later may work.
# TimeoutError and ConnectionError are the builtins (a tool's I/O), not pydantic's.
_INFRASTRUCTURE_ERRORS = (
    ReplicaError,
    BrokerError,
    SessionDeadlineError,
    httpx.HTTPError,
    builtins.ConnectionError,
    builtins.TimeoutError,
)


def failure_class_of(exc: BaseException) -> FailureClass:
    """Which class a session failure belongs to (``schemas.turns.FailureClass``)."""
    if isinstance(exc, RewardFailedError):
        return "reward"
    if isinstance(exc, ReplicaRequestError) and exc.outcome == "bad_request":
        return "loop"  # the replica refused the request itself (a 4xx): the loop's doing
    if isinstance(exc, _INFRASTRUCTURE_ERRORS):
        return "infrastructure"
    return "loop"


@dataclass
class SessionContext:
    """What every session of a worker shares: config, tokenizer, LLM client."""

    config: Config
    tokenizer: Any
    llm_client: Any
    # verl's `processor` for the loops; None: the one ``model.name`` has (None for a text
    # model, whose loops then refuse images), so a worker built with config and tokenizer
    # gets a VL model's processor too
    processor: Any = None
    # called with (original bytes, reason) for a session whose row names no usable agent
    dead_letter: Callable[[bytes, str], None] | None = None
    stats: SessionStats = field(default_factory=lambda: SessionStats())
    # the tool catalog, loaded on first use and then kept: once per worker, as verl's
    # AgentLoopWorker loads it (a load builds new YAML tool instances)
    tools: list[Any] | None = None

    def __post_init__(self) -> None:
        if self.processor is None:
            from rolloutbus.models.tokenizers import load_processor

            self.processor = load_processor(self.config.model)

    def tool_catalog(self) -> list[Any]:
        if self.tools is None:
            multi_turn = self.config.rollout.multi_turn
            self.tools = load_tool_catalog(
                multi_turn.tool_config_path, multi_turn.function_tool_path
            )
        return self.tools


def new_attempt_id() -> str:
    return uuid.uuid4().hex[:12]


@dataclass
class SessionStats:
    """Counts of what resuming from the log did, for the worker's metrics and the tests."""

    resumed_sessions: int = 0
    replayed_generations: int = 0  # turns answered from the log instead of the replica
    diverged_sessions: int = 0  # resumed loops that did not match their log: re-run


def group_started(group: PromptGroup, config: Config) -> GroupStarted:
    """The first event of a group in the turn log; once written, the group belongs to the log,
    with the settings (``config``'s, the worker's) that shape its trajectories."""
    return GroupStarted(
        uid=group.uid,
        attempt=new_attempt_id(),
        n=group.n,
        row=group.row,
        validate=group.validate_,
        global_steps=group.global_steps,
        policy_version=group.policy_version,
        sampling_params=group.sampling_params.model_dump(),
        settings=group_settings(config),
    )


def group_settings(config: Config) -> GroupSettings:
    """What ``config`` decides about a group's trajectories, as the turn log records it."""
    rollout = config.rollout
    reward = config.reward_function
    return GroupSettings(
        prompt_length=rollout.prompt_length,
        response_length=rollout.response_length,
        max_model_len=rollout.max_model_len,
        calculate_log_probs=rollout.calculate_log_probs,
        default_agent_loop=rollout.agent.default_agent_loop,
        # as reward_fn_for chooses: the custom function when a path is set
        reward_function=f"{reward.path}:{reward.name}" if reward.path else "default_compute_score",
        reward_kwargs=dict(reward.reward_kwargs) if reward.path else {},
    )


def prompt_group_of(started: GroupStarted) -> PromptGroup:
    """The prompt group a logged ``group_started`` describes (to resume it from the log)."""
    return PromptGroup(
        uid=started.uid,
        row=started.row,
        n=started.n,
        validate=started.validate_,
        sampling_params=GroupSamplingParams(**started.sampling_params),
        global_steps=started.global_steps,
        policy_version=started.policy_version,
    )


async def run_group(ctx: SessionContext, group: PromptGroup, emit: Emit) -> list[BaseModel]:
    """Log GroupStarted, run n sessions concurrently; siblings survive a failed session."""
    started = group_started(group, ctx.config)
    await emit(started)
    return await run_sessions(ctx, group, started.attempt, emit)


async def run_sessions(
    ctx: SessionContext,
    group: PromptGroup,
    attempt: str,
    emit: Emit,
    resume: Mapping[int, LoggedAttempt | None] | None = None,
) -> list[BaseModel]:
    """Run the group's sessions (all n, or the unsettled ones of ``resume``) concurrently.

    ``resume`` maps a session id to the logged attempt to continue, or to None for a
    session that never started; such sessions run under new attempt ids.
    """
    if resume is None:
        runs = [run_session(ctx, group, sid, attempt, emit) for sid in range(group.n)]
    else:
        runs = [
            run_session(ctx, group, sid, new_attempt_id(), emit, resume=logged)
            for sid, logged in sorted(resume.items())
        ]
    results = await asyncio.gather(*runs, return_exceptions=True)
    terminals: list[BaseModel] = []
    for result in results:
        if isinstance(result, BaseException):
            raise result  # only EmitError and cancellation get here: the log is broken
        terminals.append(result)
    return terminals


async def run_session(
    ctx: SessionContext,
    group: PromptGroup,
    session_id: int,
    attempt: str,
    emit: Emit,
    *,
    resume: LoggedAttempt | None = None,
) -> BaseModel:
    """One session; with ``resume``, it first replays that attempt's logged turns."""
    if resume is not None:
        ctx.stats.resumed_sessions += 1
        try:
            return await _run_attempt(ctx, group, session_id, attempt, emit, resume)
        except SessionDivergedError as exc:
            ctx.stats.diverged_sessions += 1
            log.warning("%s", exc)
            attempt = new_attempt_id()
    return await _run_attempt(ctx, group, session_id, attempt, emit, None)


async def _run_attempt(
    ctx: SessionContext,
    group: PromptGroup,
    session_id: int,
    attempt: str,
    emit: Emit,
    resume: LoggedAttempt | None,
) -> BaseModel:
    ids = SessionIds(uid=group.uid, session_id=session_id, attempt=attempt)
    agent_name: str | None = None
    spans: list[TraceSpan] = []  # the trace of the agent loop's run, into the terminal event
    seq = itertools.count()  # this attempt's event sequence numbers

    async def checked_emit(event: BaseModel) -> None:
        try:
            await emit(event.model_copy(update={"seq": next(seq)}))
        except SchemaError:
            raise  # this event can never be logged (too large): the session fails, not the log
        except Exception as exc:  # a broken turn log is fatal for the worker
            raise EmitError(
                f"could not log {type(event).__name__} of {group.uid}_{session_id}: {exc}"
            ) from exc

    try:
        agent_name = registry.resolve_agent_name(
            group.row, ctx.config.rollout.agent.default_agent_loop
        )
        await checked_emit(
            SessionStarted(
                **ids, agent_name=agent_name, resumed_from=resume.attempt if resume else None
            )
        )
        recorder = RecordingLLMClient(
            ctx.llm_client,
            checked_emit,
            **ids,
            replay=resume.history() if resume else (),
            tokenizer=ctx.tokenizer,
            routing_replay=ctx.config.rollout.enable_rollout_routing_replay,
            chunks=ChunkSettings(
                ctx.config.sessions.chunk_tokens,
                ctx.config.rollout,
                ctx.config.sessions.chunk_s,
            ),
        )
        try:
            with collect_spans() as spans:
                outputs = await _within_deadline(
                    _run_agent_loop(ctx, group, session_id, agent_name, recorder),
                    ctx.config.deadlines.session_s,
                )
            recorder.check_replayed()
        finally:
            ctx.stats.replayed_generations += recorder.replayed_generations
        summaries = recorder.summarize(outputs, ctx.config.rollout.response_length)
        terminal: BaseModel = SessionFinished(**ids, outputs=summaries, spans=spans)
    except (EmitError, SessionDivergedError):
        raise
    except Exception as exc:  # the loop failed: an explicit record, siblings go on
        terminal = _failed(ids, agent_name, exc, spans)
        if isinstance(exc, UnknownAgentLoopError) and ctx.dead_letter is not None:
            ctx.dead_letter(
                group.model_dump_json(by_alias=True).encode(),
                f"session {group.uid}_{session_id}: {exc}",
            )
    try:
        await checked_emit(terminal)
    except SchemaError as exc:
        terminal = SessionFailed(
            **ids,
            agent_name=agent_name,
            error=f"the session's result cannot be logged: {exc}",
            failure_class="loop",
        )
        await checked_emit(terminal)
    return terminal


def _failed(
    ids: SessionIds, agent_name: str | None, exc: Exception, spans: list[TraceSpan]
) -> SessionFailed:
    failure_class = failure_class_of(exc)
    log.warning(
        "session %s_%s (agent %r) failed (%s): %s",
        ids["uid"],
        ids["session_id"],
        agent_name,
        failure_class,
        exc,
        exc_info=not isinstance(exc, RolloutBusError) and failure_class != "infrastructure",
    )
    return SessionFailed(
        **ids,
        agent_name=agent_name,
        error=_describe(exc),
        retriable=failure_class == "infrastructure"
        or not isinstance(exc, AgentLoopError | ValueError),
        failure_class=failure_class,
        spans=spans,
    )


async def _run_agent_loop(
    ctx: SessionContext,
    group: PromptGroup,
    session_id: int,
    agent_name: str | None,
    recorder: RecordingLLMClient,
) -> list[AgentLoopOutput]:
    # what verl's AgentLoopWorker hands every loop; the tools are loaded once per worker
    tools = ctx.tool_catalog()
    loop = registry.create_agent_loop(
        agent_name,
        trainer_config=DictConfigWrap(ctx.config),
        server_manager=recorder,
        tokenizer=ctx.tokenizer,
        processor=ctx.processor,
        dataset_cls=None,
        data_config=DictConfigWrap(ctx.config.data),
        tools=ToolListWrap(tools),
    )
    result = await loop.run(group.sampling_params.model_dump(), **_loop_kwargs(group, session_id))
    outputs = result if isinstance(result, list) else [result]
    if not outputs:
        log.warning("agent loop %r returned no output for %s_%s", agent_name, group.uid, session_id)
    if outputs and group.row.get("reward_model") is not None:
        try:
            scorer = reward_fn_from_config(ctx.config)  # custom_reward_function, or verl's
            with trace_span("compute_score", data_source=str(group.row.get("data_source", ""))):
                await score_outputs_async(outputs, group.row, ctx.tokenizer, scorer)
        except Exception as exc:
            raise RewardFailedError(f"scoring failed: {exc}") from exc
    return outputs


async def _within_deadline(
    run: Awaitable[list[AgentLoopOutput]], seconds: float
) -> list[AgentLoopOutput]:
    # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the result when a
    # cancellation (a revoked partition) arrives as the loop finishes, and the session
    # would go on logging beside its new owner's attempt
    try:
        async with asyncio.timeout(seconds):
            return await run
    except TimeoutError:
        raise SessionDeadlineError(
            f"the agent loop ran past deadlines.session_s ({seconds:g} s) and was cancelled"
        ) from None


def _loop_kwargs(group: PromptGroup, session_id: int) -> dict[str, Any]:
    """verl V1 passes the row's columns plus framework fields; messages as ``raw_prompt``."""
    row = dict(group.row)
    kwargs: dict[str, Any] = {k: v for k, v in row.items() if k != "prompt"}
    kwargs["raw_prompt"] = list(row["prompt"])
    extra_info = row.get("extra_info") or {}
    kwargs.setdefault("tools_kwargs", extra_info.get("tools_kwargs", {}))
    kwargs.setdefault("index", extra_info.get("index", 0))
    kwargs.update(
        uid=group.uid,
        session_id=session_id,
        global_steps=group.global_steps,
        validate=group.validate_,
    )
    return kwargs


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    if not isinstance(exc, RolloutBusError):
        frame = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
        where = f" at {frame[0].filename}:{frame[0].lineno}" if frame else ""
        text = f"{type(exc).__name__}: {text}{where}"
    return text
