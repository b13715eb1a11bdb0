"""Synthetic turn logs made by the real session recorder, driven by an instant scripted
replica (a test double: no model, fixed tokens). Used by tests and the throughput benchmark."""

from __future__ import annotations

import asyncio
import random
import uuid
from dataclasses import dataclass

from rolloutbus.schemas.agent_loop import AgentLoopMetrics, AgentLoopOutput, TokenOutput
from rolloutbus.schemas.turns import (
    GroupSettings,
    GroupStarted,
    SessionFinished,
    SessionStarted,
    encode_turn_event,
)
from rolloutbus.streams.sessions.recorder import RecordingLLMClient
from rolloutbus.topics import session_key

N, TURNS, GEN_TOKENS, OBS_TOKENS, PROMPT_TOKENS = 4, 3, 128, 32, 256
# what a worker records with every group since groups record their settings (the rollout
# config's default budgets: these groups fit them)
SETTINGS = GroupSettings(prompt_length=1024, response_length=512)


@dataclass
class VariedTokens:
    """Sampled turns that compress like a model's: windows of ``pool`` (real text's token
    ids, e.g. a tokenizer run over documents) at seeded offsets, and seeded logprobs mostly
    near 0 with a tail."""

    pool: list[int]
    rng: random.Random

    def turn(self, tokens: int) -> TokenOutput:
        start = self.rng.randrange(max(1, len(self.pool) - tokens))
        ids = (self.pool[start : start + tokens] * (tokens // max(1, len(self.pool)) + 1))[:tokens]
        logprobs = [-self.rng.expovariate(3.0) for _ in range(tokens)]
        return TokenOutput(token_ids=ids, log_probs=logprobs, stop_reason="completed")


class InstantReplica:
    """Test double for a replica: answers at once with fixed tokens and logprobs, or with
    ``varied`` ones (:class:`VariedTokens`)."""

    def __init__(self, gen_tokens: int = GEN_TOKENS, varied: VariedTokens | None = None):
        self.gen_tokens = gen_tokens
        self.varied = varied

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kw):
        if self.varied is not None:
            return self.varied.turn(self.gen_tokens)
        return TokenOutput(
            token_ids=list(range(1000, 1000 + self.gen_tokens)),
            log_probs=[-0.5] * self.gen_tokens,
            stop_reason="completed",
        )


def settings_for(gen_tokens: int) -> GroupSettings:
    """SETTINGS, with a response budget that holds TURNS turns of ``gen_tokens``."""
    response = TURNS * gen_tokens + (TURNS - 1) * OBS_TOKENS
    return SETTINGS.model_copy(update={"response_length": max(SETTINGS.response_length, response)})


async def _session_events(
    uid: str,
    session_id: int,
    attempt: str,
    gen_tokens: int = GEN_TOKENS,
    varied: VariedTokens | None = None,
) -> list[tuple[str, bytes]]:
    events: list = []

    async def emit(e):
        events.append(e)

    ids = {"uid": uid, "session_id": session_id, "attempt": attempt}
    events.append(SessionStarted(**ids, agent_name="tool_agent"))
    rec = RecordingLLMClient(InstantReplica(gen_tokens, varied), emit, **ids)
    stream = list(range(PROMPT_TOKENS))
    mask: list[int] = []
    for turn in range(TURNS):
        out = await rec.generate("r", prompt_ids=stream, sampling_params={})
        stream += out.token_ids
        mask += [1] * len(out.token_ids)
        if turn < TURNS - 1:
            stream += [7] * OBS_TOKENS
            mask += [0] * OBS_TOKENS
    output = AgentLoopOutput(
        prompt_ids=stream[:PROMPT_TOKENS],
        response_ids=stream[PROMPT_TOKENS:],
        response_mask=mask,
        response_logprobs=None,
        num_turns=2 * TURNS,
        metrics=AgentLoopMetrics(),
    )
    events.append(SessionFinished(**ids, outputs=rec.summarize([output], 10_000)))
    # numbered within the attempt, as the session runner numbers what it logs
    return [
        (session_key(uid, session_id), encode_turn_event(e.model_copy(update={"seq": seq})))
        for seq, e in enumerate(events)
    ]


def group_events(
    uid: str,
    attempt: str = "a",
    gen_tokens: int = GEN_TOKENS,
    varied: VariedTokens | None = None,
) -> list[tuple[str, str, bytes]]:
    """(uid, key, value) for every event of one group of N sessions, in log order;
    ``gen_tokens`` sampled tokens per turn (varied ones drawn from ``varied``)."""
    started = GroupStarted(
        uid=uid,
        attempt=attempt,
        n=N,
        row={"prompt": [{"role": "user", "content": "q"}]},
        settings=settings_for(gen_tokens),
    )
    out = [(uid, uid, encode_turn_event(started))]
    for s in range(N):
        session = asyncio.run(_session_events(uid, s, attempt, gen_tokens, varied))
        out.extend((uid, k, v) for k, v in session)
    return out


def make_events(
    groups: int, gen_tokens: int = GEN_TOKENS, *, varied: VariedTokens | None = None
) -> list[tuple[str, str, bytes]]:
    """``groups`` groups' events; with ``varied``, its tokens and logprobs."""
    out = []
    for _ in range(groups):
        out.extend(group_events(uuid.uuid4().hex, gen_tokens=gen_tokens, varied=varied))
    return out
