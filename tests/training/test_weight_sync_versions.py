"""Pure tests: the policy versions a replica reports reach the trajectory. A turn whose
tokens span two versions (a weight sync under partial_rollout) counts both: the recorder
logs the newest as the generation's policy_version and verl's min_global_steps in its
extra_fields, and the fold gives the trajectory min/max_global_steps over every turn."""

from __future__ import annotations

from rolloutbus.schemas.agent_loop import AgentLoopMetrics, AgentLoopOutput, TokenOutput
from rolloutbus.schemas.turns import (
    SessionFinished,
    decode_turn_event,
    encode_turn_event,
)
from rolloutbus.streams.assembly.session_fold import SessionFold
from rolloutbus.streams.assembly.trajectories import build_group_trajectories
from rolloutbus.streams.sessions.recorder import RecordingLLMClient
from rolloutbus.streams.token_stream import SegmentStream, turn_version
from tests.builders import make_group_started, session_ids


class VersionedClient:
    """Test double for the LLM client: scripted turns with the extra_fields our vLLM backend
    derives from ``weight_versions`` spans (the embedded replica's are tested for real in
    test_weight_sync.py)."""

    def __init__(self, replies: list[tuple[list[int], dict]]):
        self.replies = list(replies)

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        tokens, extra = self.replies.pop(0)
        return TokenOutput(
            token_ids=tokens,
            log_probs=[-0.5] * len(tokens),
            stop_reason="completed",
            extra_fields=extra,
        )


def _spanning(low: int, high: int) -> dict:
    return {"weight_version": str(high), "min_global_steps": low, "max_global_steps": high}


async def test_a_turn_spanning_versions_gives_the_trajectory_both_ends():
    events = []

    async def emit(event):
        events.append(decode_turn_event(encode_turn_event(event)))  # through the wire format

    client = VersionedClient([([10, 11, 12], _spanning(1, 2)), ([20, 21], _spanning(2, 2))])
    rec = RecordingLLMClient(client, emit, uid="u1", session_id=0, attempt="a")
    P, A1, O = [1, 2, 3], [10, 11, 12], [7]  # noqa: E741 (prompt, first answer, observation)
    await rec.generate("r", prompt_ids=P, sampling_params={})
    await rec.generate("r", prompt_ids=P + A1 + O, sampling_params={})
    generations = [e for e in events if e.type == "generation"]
    assert [g.policy_version for g in generations] == [2, 2]  # the newest of each turn

    out = AgentLoopOutput(
        prompt_ids=P,
        response_ids=A1 + O + [20, 21],
        response_mask=[1, 1, 1, 0, 1, 1],
        response_logprobs=[-0.5, -0.5, -0.5, 0.0, -0.5, -0.5],
        reward_score=1.0,
        num_turns=3,
        metrics=AgentLoopMetrics(),
        extra_fields=_spanning(1, 2),
    )
    [summary] = rec.summarize([out], response_length=100)
    fold = SessionFold(0, "a", agent_name="tool_agent")
    for e in events:
        fold.apply(e)
    fold.apply(SessionFinished(**session_ids("u1"), outputs=[summary]))
    group = make_group_started("u1")
    [t] = build_group_trajectories(group, [fold], response_length=100)
    assert (t.min_global_steps, t.max_global_steps) == (1, 2)
    # verl's extra_fields keys agree with the columns
    assert (t.extra_fields["min_global_steps"], t.extra_fields["max_global_steps"]) == (1, 2)


def test_versions_of_one_turn_and_of_engines_that_report_labels():
    stream = SegmentStream.start([1, 2])
    stream.add_generation([5, 6, 7], None, 4, first_version=3)
    stream.add_generation([8], None, 4)
    assert stream.versions_until(len(stream.tokens)) == [3, 4, 4]
    # a version label as a string (vLLM's) is a version; a non-numeric label is none
    assert turn_version({"weight_version": "7"}) == 7
    assert turn_version({"max_global_steps": 5, "weight_version": "7"}) == 5
    assert turn_version({"weight_version": "step-1"}) is None
    assert turn_version({"weight_version": "default"}) == 0  # vLLM before any update
