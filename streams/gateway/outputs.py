"""What a finished gateway session returns: one ``AgentLoopOutput`` per segment, as an
agent loop would have returned it (pure).

A segment's output is its prompt, then everything logged after it up to the end of its
last generation (a trailing observation that no generation followed is left out, as
``tool_agent`` drops an observation that ends the trajectory), cut at
``rollout.response_length``. Mask 1 and the replica's logprobs on sampled tokens, mask 0
and logprob 0.0 on observations: the recorder's stream, so the fold of the log equals it.
A session whose agent edited its history has several segments, hence several outputs, as
a context-compressing verl loop returns several (verl V1 scores the last one and copies
its reward to the earlier ones; so does the gateway).
"""

from __future__ import annotations

from typing import Any

from rolloutbus.schemas.agent_loop import AgentLoopMetrics, AgentLoopOutput, TokenOutput
from rolloutbus.streams.agent_loop.tool_calls import merge_turn_fields
from rolloutbus.streams.gateway.alignment import SegmentTranscript
from rolloutbus.streams.token_stream import SegmentStream


def segment_output(
    transcript: SegmentTranscript, stream: SegmentStream, response_length: int
) -> AgentLoopOutput | None:
    """The output of one segment; None for a segment without a generation."""
    if not transcript.turns:
        return None
    start, end = stream.prompt_len, transcript.turns[-1].end
    stop = min(end, start + response_length)
    generations = [turn.generation for turn in transcript.turns]
    has_logprobs = all(g.logprobs is not None for g in generations)
    return AgentLoopOutput(
        prompt_ids=stream.tokens[:start],
        response_ids=stream.tokens[start:stop],
        response_mask=stream.mask[start:stop],
        response_logprobs=stream.logprobs[start:stop] if has_logprobs else None,
        num_turns=_num_turns(transcript),
        metrics=_metrics(generations),
        extra_fields=_extra_fields(generations),
    )


def _num_turns(transcript: SegmentTranscript) -> int:
    """verl's count: the prompt, each assistant turn, each observation between them."""
    turns = transcript.turns
    observations = sum(1 for a, b in zip(turns, turns[1:], strict=False) if b.start > a.end)
    return 1 + len(turns) + observations


def _metrics(generations: list[Any]) -> AgentLoopMetrics:
    preempted = [g.num_preempted for g in generations if g.num_preempted is not None]
    return AgentLoopMetrics(
        generate_sequences=sum(g.latency_s for g in generations),
        tool_calls=0.0,  # the agent runs its tools; the gateway does not see them
        num_preempted=sum(preempted) if preempted else -1,
    )


def _extra_fields(generations: list[Any]) -> dict[str, Any]:
    """As ``tool_agent``'s: the first turn's engine fields, later turns' newest
    ``max_global_steps`` and summed speculative-decoding counters."""
    metrics: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for g in generations:
        turn = TokenOutput(
            token_ids=[], num_preempted=g.num_preempted, extra_fields=dict(g.extra_fields)
        )
        merge_turn_fields(metrics, extra, turn)
    extra.update({"turn_scores": [], "tool_rewards": []})
    return extra
