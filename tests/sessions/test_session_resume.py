"""Resuming a session from its logged turns (pure: the real runner, recorder and folds).

The LLM client here is a test double that counts calls and answers with scripted tokens;
the agent loop is a small deterministic two-turn loop with a tool-like observation.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rolloutbus.config import Config
from rolloutbus.schemas.agent_loop import AgentLoopMetrics, AgentLoopOutput, TokenOutput
from rolloutbus.schemas.prompts import GroupSamplingParams, PromptGroup
from rolloutbus.schemas.turns import decode_turn_event, encode_turn_event
from rolloutbus.streams.agent_loop import AgentLoopBase, register
from rolloutbus.streams.assembly.partition_fold import PartitionFold
from rolloutbus.streams.assembly.trajectories import finalize_group
from rolloutbus.streams.sessions.recovery import TurnLogScan
from rolloutbus.streams.sessions.runner import (
    SessionContext,
    prompt_group_of,
    run_group,
    run_sessions,
)

PROMPT = [1, 2, 3]
OBSERVATION = [7, 8]  # what the "tool" answers (a test changes it to force divergence)


class CountingClient:
    """Test double for the LLM client: each call returns the next scripted reply."""

    def __init__(self) -> None:
        self.calls = 0

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        self.calls += 1
        base = 100 * self.calls
        return TokenOutput(
            token_ids=[base, base + 1],
            log_probs=[-0.5, -0.25],
            stop_reason="completed",
            extra_fields={"weight_version": 4, "replica_id": "r0"},
        )


@register("two_turn_test")
class TwoTurnLoop(AgentLoopBase):
    observation = OBSERVATION

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        first = await self.server_manager.generate(
            "r", prompt_ids=PROMPT, sampling_params=sampling_params
        )
        obs = list(type(self).observation)
        second = await self.server_manager.generate(
            "r", prompt_ids=PROMPT + first.token_ids + obs, sampling_params=sampling_params
        )
        response = first.token_ids + obs + second.token_ids
        return AgentLoopOutput(
            prompt_ids=PROMPT,
            response_ids=response,
            response_mask=[1, 1] + [0] * len(obs) + [1, 1],
            response_logprobs=first.log_probs + [0.0] * len(obs) + second.log_probs,
            num_turns=3,
            metrics=AgentLoopMetrics(),
            extra_fields=dict(second.extra_fields),
        )


def _group(uid: str = "g1", n: int = 2) -> PromptGroup:
    return PromptGroup(
        uid=uid,
        n=n,
        sampling_params=GroupSamplingParams(),
        row={"prompt": [{"role": "user", "content": "hi"}], "agent_name": "two_turn_test"},
    )


class Log:
    """The turn log of one partition, in memory: events through their wire format."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    async def emit(self, event) -> None:
        self.events.append(decode_turn_event(encode_turn_event(event)))


def _released(events: list[Any]):
    fold = PartitionFold(0, 0)
    out = []
    for offset, event in enumerate(events):
        released = fold.apply(offset, event)
        if released is not None:
            out.extend(finalize_group(released, Config().rollout)[0])
    return out


def _columns(trajectories) -> list[tuple]:
    return [
        (t.key, t.status.value, t.responses, t.response_mask, t.rollout_log_probs, t.extra_fields)
        for t in trajectories
    ]


def _crash_after(events: list[Any], generations: int) -> list[Any]:
    """The log as a crashed worker left it: everything up to the n-th generation."""
    kept, seen = [], 0
    for event in events:
        if event.type in ("session_finished", "session_failed"):
            continue
        kept.append(event)
        seen += event.type == "generation"
        if seen == generations:
            break
    return kept


async def _resume(log: Log, client: CountingClient) -> SessionContext:
    scan = TurnLogScan()
    for offset, event in enumerate(log.events):
        scan.apply(offset, event)
    ctx = SessionContext(config=Config(), tokenizer=None, llm_client=client)
    for unfinished in scan.unfinished():
        await run_sessions(
            ctx,
            prompt_group_of(unfinished.group),
            unfinished.group.attempt,
            log.emit,
            resume=unfinished.sessions,
        )
    return ctx


async def _fault_free() -> list[tuple]:
    log = Log()
    await run_group(
        SessionContext(config=Config(), tokenizer=None, llm_client=CountingClient()),
        _group(),
        log.emit,
    )
    return _columns(_released(log.events))


async def test_resumed_sessions_replay_their_log_and_sample_nothing_twice():
    reference = await _fault_free()
    full = Log()
    ctx = SessionContext(config=Config(), tokenizer=None, llm_client=CountingClient())
    await run_group(ctx, _group(), full.emit)
    crashed = Log()
    crashed.events = _crash_after(full.events, generations=3)  # session 0 done, 1 half-way

    client = CountingClient()
    client.calls = 3  # the replica's next replies continue where the crashed run left off
    resumed = await _resume(crashed, client)

    assert client.calls == 4, "only the one turn that was never logged is sampled again"
    assert resumed.stats.resumed_sessions == 2
    assert resumed.stats.replayed_generations == 3
    assert resumed.stats.diverged_sessions == 0
    assert _columns(_released(crashed.events)) == reference
    starts = [e for e in crashed.events if e.type == "session_started" and e.resumed_from]
    assert len(starts) == 2  # both sessions continue under new attempts


async def test_a_duplicated_event_in_the_log_does_not_change_the_result():
    reference = await _fault_free()
    log = Log()
    await run_group(
        SessionContext(config=Config(), tokenizer=None, llm_client=CountingClient()),
        _group(),
        log.emit,
    )
    generation = next(e for e in log.events if e.type == "generation")
    at = log.events.index(generation)
    log.events.insert(at + 1, generation)  # a producer retry wrote it twice
    assert _columns(_released(log.events)) == reference


async def test_a_loop_that_diverges_from_its_log_restarts_as_a_new_attempt(monkeypatch):
    full = Log()
    await run_group(
        SessionContext(config=Config(), tokenizer=None, llm_client=CountingClient()),
        _group(n=1),
        full.emit,
    )
    crashed = Log()
    crashed.events = _crash_after(full.events, generations=2)[:-1]  # the observation is logged
    monkeypatch.setattr(TwoTurnLoop, "observation", [9, 9, 9])  # the tool answers differently

    client = CountingClient()
    resumed = await _resume(crashed, client)

    assert resumed.stats.diverged_sessions == 1
    assert client.calls == 2, "the new attempt samples every turn itself"
    [t] = _released(crashed.events)
    assert t.status.value == "completed"
    assert t.responses == [100, 101, 9, 9, 9, 200, 201]  # one run, never a mix of two
    attempts = {e.attempt for e in crashed.events if e.type == "session_started"}
    assert len(attempts) == 3  # the crashed one, the diverged resume, the fresh re-run


@pytest.mark.parametrize("generations", [0, 1, 2, 3])
async def test_any_crash_point_resumes_to_the_fault_free_result(generations):
    reference = await _fault_free()
    full = Log()
    await run_group(
        SessionContext(config=Config(), tokenizer=None, llm_client=CountingClient()),
        _group(),
        full.emit,
    )
    crashed = Log()
    crashed.events = _crash_after(full.events, generations) if generations else full.events[:1]
    client = CountingClient()
    client.calls = generations
    await _resume(crashed, client)
    assert _columns(_released(crashed.events)) == reference


async def test_an_event_too_large_for_the_log_fails_its_session_not_the_worker():
    from rolloutbus.streams.sessions.worker import RecordTooLargeError

    log = Log()

    async def emit(event) -> None:
        if event.type == "generation" and event.session_id == 1:
            raise RecordTooLargeError("generation of g1_1 is 99 bytes, over 10")
        await log.emit(event)

    ctx = SessionContext(config=Config(), tokenizer=None, llm_client=CountingClient())
    results = await run_group(ctx, _group(), emit)
    assert [r.type for r in results] == ["session_finished", "session_failed"]
    assert "over 10" in results[1].error
    statuses = [t.status.value for t in _released(log.events)]
    assert statuses == ["completed", "failed"]  # the group is released, never left open


@register("hangs_test")
class HangingLoop(AgentLoopBase):
    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        await self.server_manager.generate("r", prompt_ids=PROMPT, sampling_params=sampling_params)
        await asyncio.sleep(3600)  # a tool that never answers
        raise AssertionError("unreachable")


async def test_a_session_past_its_deadline_is_recorded_as_failed():
    from rolloutbus.config import with_overrides

    log = Log()
    cfg = with_overrides(Config(), {"deadlines.session_s": 0.2})
    group = PromptGroup(
        uid="g9",
        n=1,
        sampling_params=GroupSamplingParams(),
        row={"prompt": [{"role": "user", "content": "hi"}], "agent_name": "hangs_test"},
    )
    [result] = await run_group(
        SessionContext(config=cfg, tokenizer=None, llm_client=CountingClient()), group, log.emit
    )
    assert result.type == "session_failed" and "deadlines.session_s" in result.error
    [t] = _released(log.events)
    assert t.status.value == "failed"


async def test_a_resume_stopped_part_way_through_its_replay_is_resumed_from_the_whole_log():
    """A worker resumed the sessions, re-logged the first of their logged turns under the new
    attempts, and was killed (the rebalance fault row: resumed at a rebalance, SIGKILLed
    seconds later). The next worker's resume must still answer every turn the first attempt
    logged from the log: none is sampled again."""
    reference = await _fault_free()
    full = Log()
    await run_group(
        SessionContext(config=Config(), tokenizer=None, llm_client=CountingClient()),
        _group(),
        full.emit,
    )
    crashed = Log()
    crashed.events = _crash_after(full.events, generations=4)  # every turn logged, none done
    first_resume = Log()
    first_resume.events = list(crashed.events)
    await _resume(first_resume, CountingClient())
    resumed_part = first_resume.events[len(crashed.events) :]
    first_replayed = next(i for i, e in enumerate(resumed_part) if e.type == "generation")
    killed = Log()  # the log as the killed worker left it: its resume cut after one turn
    killed.events = crashed.events + resumed_part[: first_replayed + 1]
    assert any(e.type == "session_started" and e.resumed_from for e in killed.events)

    client = CountingClient()
    client.calls = 4
    ctx = await _resume(killed, client)

    assert client.calls == 4, "every turn was logged: none may be sampled again"
    assert ctx.stats.replayed_generations == 4
    assert _columns(_released(killed.events)) == reference
