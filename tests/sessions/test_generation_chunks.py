"""Pure tests of chunked turns (``sessions.chunk_tokens``): the recorder logs a turn's
chunks as they are sampled, a resumed session goes on from them, and the fold of a chunked
turn gives the record bytes of an unchunked one."""

from __future__ import annotations

from typing import Annotated, Any

import pytest
from pydantic import Field, TypeAdapter

from rolloutbus.config import RolloutConfig
from rolloutbus.errors import SchemaError
from rolloutbus.schemas.agent_loop import AgentLoopMetrics, AgentLoopOutput, TokenOutput
from rolloutbus.schemas.evolution import decode_json_record
from rolloutbus.schemas.trajectories import (
    batch_to_trajectories,
    decode_trajectory_batch,
    encode_trajectory,
)
from rolloutbus.schemas.turns import (
    Generation,
    GenerationChunk,
    GroupStarted,
    Observation,
    SegmentStarted,
    SessionFailed,
    SessionFinished,
    SessionStarted,
    decode_turn_event,
    encode_turn_event,
)
from rolloutbus.streams.assembly.session_fold import SessionFold
from rolloutbus.streams.assembly.trajectories import build_group_trajectories
from rolloutbus.streams.sessions.chunking import ChunkSettings
from rolloutbus.streams.sessions.recorder import RecordingLLMClient
from tests.builders import make_group_started, numbered, session_ids

PROMPT = [1, 2, 3]
TURN = list(range(100, 110))  # the turn the scripted model samples: 10 tokens
ROLLOUT = RolloutConfig(prompt_length=8, response_length=64)


class ContinuingModel:
    """Test double for the LLM client (no model runs here): it samples the scripted turn
    ``TURN`` after ``PROMPT``, from wherever the prompt it is sent leaves off, at most
    ``max_tokens`` at a time, each token with logprob ``-(position + 1) / 100`` and the
    client's current ``version`` (a weight sync is a new value)."""

    def __init__(self, version: int = 3) -> None:
        self.version = version
        self.calls: list[tuple[list[int], int]] = []  # (prompt, max_tokens)

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        done = len(prompt_ids) - len(PROMPT)
        assert prompt_ids == PROMPT + TURN[:done], "a continuation of something else"
        asked = int(sampling_params.get("max_tokens", len(TURN)))
        self.calls.append((list(prompt_ids), asked))
        tokens = TURN[done : done + asked]
        ended = done + len(tokens) >= len(TURN)
        return TokenOutput(
            token_ids=tokens,
            log_probs=[-(done + i + 1) / 100 for i in range(len(tokens))],
            stop_reason="completed",
            extra_fields={
                "finish_reason": "stop" if ended else "length",
                "min_global_steps": self.version,
                "max_global_steps": self.version,
            },
        )

    @property
    def sampled(self) -> int:
        return sum(min(asked, len(TURN) - (len(p) - len(PROMPT))) for p, asked in self.calls)


def _recorder(client: Any, events: list[Any], chunk_tokens: int, **kw: Any) -> RecordingLLMClient:
    async def emit(event: Any) -> None:
        events.append(decode_turn_event(encode_turn_event(event)))  # through the wire

    return RecordingLLMClient(
        client,
        emit,
        **session_ids(kw.pop("uid", "g")),
        chunks=ChunkSettings(chunk_tokens, kw.pop("rollout", ROLLOUT)),
        **kw,
    )


async def _one_turn(chunk_tokens: int, client: Any = None) -> tuple[list[Any], TokenOutput]:
    events: list[Any] = []
    out = await _recorder(client or ContinuingModel(), events, chunk_tokens).generate(
        "r", prompt_ids=PROMPT, sampling_params={}
    )
    return events, out


def _record_bytes(events: list[Any], out: TokenOutput) -> bytes:
    """The trajectory record the replay buffer's fold makes of one attempt's events."""
    output = AgentLoopOutput(
        prompt_ids=PROMPT,
        response_ids=out.token_ids,
        response_mask=[1] * len(out.token_ids),
        response_logprobs=out.log_probs,
        reward_score=1.0,
        num_turns=2,
        metrics=AgentLoopMetrics(),
    )
    rec = _recorder(ContinuingModel(), [], 0)
    for event in events:  # the recorder's streams as the live one had them
        if isinstance(event, SegmentStarted):
            rec.segments[event.segment] = _segment(events, event.segment)
    [summary] = rec.summarize([output], response_length=ROLLOUT.response_length)
    fold = SessionFold(0, "a", agent_name="single_turn_agent")
    for event in numbered([SessionStarted(**session_ids(), agent_name="single_turn_agent")]):
        fold.apply(event)
    for seq, event in enumerate(events, start=1):
        assert fold.apply(event.model_copy(update={"seq": seq, "attempt": "a"}))
    fold.apply(SessionFinished(**session_ids(), seq=len(events) + 1, outputs=[summary]))
    [t] = build_group_trajectories(_group(), [fold], response_length=ROLLOUT.response_length)
    return encode_trajectory(t)


def _segment(events: list[Any], segment: int) -> Any:
    fold = SessionFold(0, "x")
    for event in events:
        fold._fold_tokens(event)
    return fold.segments[segment]


def _group() -> GroupStarted:
    return make_group_started("g", row={"prompt": [{"role": "user", "content": "x"}]})


async def test_a_chunked_turn_is_logged_chunk_by_chunk_then_whole() -> None:
    client = ContinuingModel()
    events, out = await _one_turn(4, client)
    assert [e.type for e in events] == [
        "segment_started",
        "generation_chunk",
        "generation_chunk",
        "generation",
    ]
    chunks = [e for e in events if isinstance(e, GenerationChunk)]
    assert [(c.index, c.start, c.token_ids) for c in chunks] == [
        (0, 0, TURN[:4]),
        (1, 4, TURN[4:8]),
    ]
    assert chunks[0].schema_version == 2 and chunks[0].policy_version == 3
    assert events[-1].token_ids == TURN == out.token_ids  # the generation holds the whole turn
    assert out.log_probs == pytest.approx([-(i + 1) / 100 for i in range(10)])
    # each request continues from prompt || the turn so far, asking for one chunk at most
    assert [(len(p), asked) for p, asked in client.calls] == [(3, 4), (7, 4), (11, 4)]


async def test_chunking_off_is_one_request_and_no_chunk() -> None:
    client = ContinuingModel()
    events, out = await _one_turn(0, client)
    assert [e.type for e in events] == ["segment_started", "generation"]
    assert out.token_ids == TURN and len(client.calls) == 1


async def test_a_chunked_turn_folds_to_the_record_bytes_of_an_unchunked_one() -> None:
    chunked, chunked_out = await _one_turn(4)
    plain, plain_out = await _one_turn(0)
    assert chunked_out.token_ids == plain_out.token_ids
    assert _record_bytes(chunked, chunked_out) == _record_bytes(plain, plain_out)


async def test_a_resumed_turn_samples_only_what_its_chunks_do_not_hold() -> None:
    """Killed after two chunks of 4 were logged, under version 3; resumed under version 4:
    the replica continues after the logged tokens (2 are left), the logged tokens and
    logprobs are kept, and the record spans both versions."""
    live, _ = await _one_turn(4)
    killed = live[:3]  # segment_started and two chunks: the worker died mid-turn
    resumed_model = ContinuingModel(version=4)
    events: list[Any] = []
    rec = _recorder(resumed_model, events, 4, replay=killed)
    out = await rec.generate("r", prompt_ids=PROMPT, sampling_params={})
    rec.check_replayed()
    # one request, from prompt || the 8 logged tokens; the model samples the 2 left
    assert resumed_model.calls == [(PROMPT + TURN[:8], 4)]
    assert resumed_model.sampled == 2 <= 4
    assert rec.replayed_chunks == 2
    assert out.token_ids == TURN
    assert out.log_probs == pytest.approx([-(i + 1) / 100 for i in range(10)])
    assert [e.type for e in events] == [
        "segment_started",
        "generation_chunk",
        "generation_chunk",
        "generation",
    ]
    # the logged chunks were sampled by version 3, the rest by 4
    assert (out.extra_fields["min_global_steps"], out.extra_fields["max_global_steps"]) == (3, 4)
    [t] = batch_to_trajectories(decode_trajectory_batch(_record_bytes(events, out)))
    assert (t.min_global_steps, t.max_global_steps) == (3, 4)
    segment = _segment(events, 0)
    base = len(PROMPT)  # per-chunk spans: tokens 1-4 and 5-8 by version 3, 9-10 by 4
    assert (base + 4, 3) in segment.versions and (base + 8, 3) in segment.versions
    assert segment.versions[-1] == (base + 10, 4)


async def test_the_turn_budget_counts_the_logged_chunks() -> None:
    """response_length 6: a chunk of 4, then the 2 tokens left; the turn ends at 6."""
    client = ContinuingModel()
    events: list[Any] = []
    rollout = RolloutConfig(prompt_length=8, response_length=6)
    out = await _recorder(client, events, 4, rollout=rollout).generate(
        "r", prompt_ids=PROMPT, sampling_params={}
    )
    assert [asked for _, asked in client.calls] == [4, 2]
    assert out.token_ids == TURN[:6]
    assert [e.type for e in events].count("generation_chunk") == 1


async def test_a_loop_max_tokens_counts_the_logged_chunks_on_resume() -> None:
    live: list[Any] = []
    await _recorder(ContinuingModel(), live, 3).generate(
        "r", prompt_ids=PROMPT, sampling_params={"max_tokens": 7}
    )
    assert [e.type for e in live].count("generation_chunk") == 2  # 3 + 3, then 1
    client = ContinuingModel()
    out = await _recorder(client, [], 3, replay=live[:3]).generate(
        "r", prompt_ids=PROMPT, sampling_params={"max_tokens": 7}
    )
    assert client.calls == [(PROMPT + TURN[:6], 1)] and out.token_ids == TURN[:7]


async def test_a_turn_that_stops_inside_a_chunk_logs_no_chunk_for_it() -> None:
    events, out = await _one_turn(5)  # 5 + 5: the second piece ends the turn (stop)
    assert [e.type for e in events].count("generation_chunk") == 1
    assert out.token_ids == TURN


async def test_a_logged_whole_turn_replays_with_its_chunks_and_samples_nothing() -> None:
    live, _ = await _one_turn(4)
    client = ContinuingModel()
    events: list[Any] = []
    rec = _recorder(client, events, 4, replay=live)
    out = await rec.generate("r", prompt_ids=PROMPT, sampling_params={})
    assert client.calls == [] and out.token_ids == TURN
    assert [e.type for e in events] == [e.type for e in live]


def test_the_fold_ignores_chunks_of_a_turn_that_never_ended() -> None:
    ids = session_ids()
    events = numbered(
        [
            SessionStarted(**ids, agent_name="x"),
            SegmentStarted(**ids, segment=0, prompt_ids=PROMPT),
            GenerationChunk(**ids, segment=0, turn=0, index=0, start=0, token_ids=[5, 6]),
            SessionFailed(**ids, error="killed"),
        ]
    )
    fold = SessionFold(0, "a")
    for event in events:
        fold.apply(event)
    assert fold.segments[0].tokens == PROMPT and fold.failed and fold.error is None


def test_a_chunk_before_its_segment_breaks_the_attempt() -> None:
    ids = session_ids()
    fold = SessionFold(0, "a")
    for event in numbered(
        [
            SessionStarted(**ids, agent_name="x"),
            GenerationChunk(**ids, segment=0, turn=0, index=0, start=0, token_ids=[5]),
        ]
    ):
        fold.apply(event)
    assert fold.error is not None and "generation_chunk" in fold.error


# a reader from before generation_chunk existed: the previous release's TurnEvent union
_OLD_TURN_EVENT: TypeAdapter[Any] = TypeAdapter(
    Annotated[
        GroupStarted
        | SessionStarted
        | SegmentStarted
        | Generation
        | Observation
        | SessionFinished
        | SessionFailed,
        Field(discriminator="type"),
    ]
)


def test_a_reader_that_predates_chunks_refuses_them_naming_type_and_version() -> None:
    chunk = GenerationChunk(**session_ids(), segment=0, turn=0, index=0, start=0, token_ids=[5])
    data = encode_turn_event(chunk)
    assert decode_turn_event(data) == chunk  # this reader reads it
    with pytest.raises(SchemaError, match=r"type 'generation_chunk'.*schema version 2, newer"):
        decode_json_record(_OLD_TURN_EVENT, data, "turn_event")
    # every other event is still written as version 1: an old reader reads it as before
    generation = Generation(**session_ids(), segment=0, turn=0, token_ids=[5])
    assert decode_json_record(_OLD_TURN_EVENT, encode_turn_event(generation), "turn_event")
