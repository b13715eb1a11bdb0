"""Pure tests: the session recorder derives observations; the fold rebuilds run()'s output."""

from __future__ import annotations

import pytest

from rolloutbus.errors import AgentLoopError, TokenDriftError
from rolloutbus.schemas.agent_loop import AgentLoopMetrics, AgentLoopOutput, TokenOutput
from rolloutbus.schemas.trajectories import (
    TrajectoryStatus,
    batch_to_trajectories,
    decode_trajectory_batch,
    encode_trajectory,
)
from rolloutbus.schemas.turns import (
    SessionFinished,
    decode_turn_event,
    encode_turn_event,
)
from rolloutbus.streams.assembly.partition_fold import PartitionFold
from rolloutbus.streams.assembly.session_fold import SessionFold
from rolloutbus.streams.assembly.trajectories import build_group_trajectories
from rolloutbus.streams.sessions.recorder import RecordingLLMClient
from tests.builders import make_group_started, make_session_failed, make_trajectory, session_ids


class ScriptedClient:
    """Test double for the LLM client: returns scripted tokens and logprobs in order."""

    def __init__(self, replies: list[tuple[list[int], list[float]]]):
        self.replies = list(replies)
        self.prompts: list[list[int]] = []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        self.prompts.append(list(prompt_ids))
        tokens, logprobs = self.replies.pop(0)
        return TokenOutput(
            token_ids=tokens,
            log_probs=logprobs,
            stop_reason="completed",
            extra_fields={"global_steps": 3},
        )


async def _record_two_turns():
    events = []

    async def emit(event):
        events.append(decode_turn_event(encode_turn_event(event)))  # through the wire format

    client = ScriptedClient([([10, 11], [-0.5, -0.25]), ([20, 21, 22], [-1.0, -0.5, -0.125])])
    rec = RecordingLLMClient(client, emit, uid="u1", session_id=0, attempt="a")
    P, A1, O = [1, 2, 3], [10, 11], [7, 8]  # noqa: E741 (prompt, first answer, observation)
    await rec.generate("r", prompt_ids=P, sampling_params={})
    await rec.generate("r", prompt_ids=P + A1 + O, sampling_params={})
    out = AgentLoopOutput(
        prompt_ids=P,
        response_ids=A1 + O + [20, 21, 22],
        response_mask=[1, 1, 0, 0, 1, 1, 1],
        response_logprobs=[-0.5, -0.25, 0.0, 0.0, -1.0, -0.5, -0.125],
        reward_score=1.0,
        num_turns=3,
        metrics=AgentLoopMetrics(),
    )
    return rec, events, out


async def test_recorder_logs_segment_generations_and_observation_suffix():
    rec, events, _ = await _record_two_turns()
    assert [e.type for e in events] == [
        "segment_started",
        "generation",
        "observation",
        "generation",
    ]
    assert events[0].prompt_ids == [1, 2, 3]
    assert events[2].token_ids == [7, 8]  # the suffix after the logged stream
    assert events[3].policy_version == 3


async def test_fold_equals_run_output_with_section_11_layout():
    rec, events, out = await _record_two_turns()
    [summary] = rec.summarize([out], response_length=100)
    fold = SessionFold(0, "a", agent_name="tool_agent")
    for e in events:
        fold.apply(e)
    fold.apply(SessionFinished(**session_ids("u1"), outputs=[summary]))
    group = make_group_started(
        "u1", row={"prompt": [{"role": "user", "content": "x"}], "data_source": "d"}
    )
    [t] = build_group_trajectories(group, [fold], response_length=100)
    assert t.prompts == out.prompt_ids
    assert t.responses == out.response_ids
    assert t.response_mask == [1, 1, 0, 0, 1, 1, 1] == t.loss_mask
    assert t.rollout_log_probs == pytest.approx(out.response_logprobs)
    assert t.rm_scores == [0.0] * 6 + [1.0]
    assert t.key == "u1_0_0" and t.status == TrajectoryStatus.COMPLETED
    assert (t.min_global_steps, t.max_global_steps) == (3, 3)
    again = batch_to_trajectories(decode_trajectory_batch(encode_trajectory(t)))[0]
    assert again == t  # Arrow round trip is lossless (logprobs already float32)


async def test_reencoded_history_is_token_drift():
    rec, _, _ = await _record_two_turns()
    with pytest.raises(TokenDriftError, match="diverges"):
        await rec.generate("r", prompt_ids=[1, 2, 3, 10, 99], sampling_params={})


async def test_output_with_tokens_never_logged_is_rejected():
    rec, _, out = await _record_two_turns()
    forged = out.model_copy(update={"response_ids": [10, 11, 7, 8, 20, 21, 23]})
    with pytest.raises(AgentLoopError, match="does not match any logged token stream"):
        rec.summarize([forged], response_length=100)


async def test_mask_one_on_observation_is_rejected():
    rec, _, out = await _record_two_turns()
    bad = out.model_copy(update={"response_mask": [1, 1, 1, 0, 1, 1, 1]})
    with pytest.raises(AgentLoopError, match="did not sample"):
        rec.summarize([bad], response_length=100)


def _group_events(uid: str, n: int, attempt: str = "a"):
    failed = [make_session_failed(uid, s, attempt=attempt, error="boom") for s in range(n)]
    return [make_group_started(uid, n, attempt=attempt), *failed]


def test_partition_fold_releases_once_and_tracks_watermark():
    fold = PartitionFold(next_offset=0, traj_next_offset=0)
    a = _group_events("ga", 2)
    b = _group_events("gb", 1)
    assert fold.apply(0, a[0]) is None
    assert fold.apply(1, b[0]) is None
    assert fold.low_watermark() == 0
    released_b = fold.apply(2, b[1])
    assert released_b is not None and released_b.group.uid == "gb"
    assert fold.low_watermark() == 0  # ga still open
    assert fold.apply(3, a[1]) is None
    released_a = fold.apply(4, a[2])
    assert released_a is not None
    assert fold.low_watermark() == 5
    # a re-run of an already released group (new attempt) is ignored
    for offset, event in enumerate(_group_events("ga", 2, attempt="b"), start=5):
        assert fold.apply(offset, event) is None
    assert fold.ignored == 3


def test_first_terminal_attempt_wins():
    fold = PartitionFold(0, 0)
    fold.apply(0, make_group_started("g"))
    fold.apply(1, make_session_failed(attempt="b", error="second attempt finished first"))
    # released on the first terminal; the older attempt's late events are ignored
    assert fold.open == {}
    assert fold.apply(2, make_session_failed(error="late")) is None


def test_failed_session_is_an_explicit_record():
    events = _group_events("g", 2)
    fold = PartitionFold(0, 0)
    released = None
    for offset, e in enumerate(events):
        released = fold.apply(offset, e) or released
    trajectories = build_group_trajectories(released.group, released.sessions)
    assert [t.status for t in trajectories] == [TrajectoryStatus.FAILED] * 2
    assert [t.key for t in trajectories] == ["g_0_0", "g_1_0"]
    assert all(t.group_size == 2 and t.error == "boom" for t in trajectories)


def test_invariant_violations_are_named():
    from rolloutbus.config import RolloutConfig
    from rolloutbus.streams.assembly.trajectories import as_failed, violations

    rollout = RolloutConfig(prompt_length=4, response_length=3)
    good = make_trajectory(
        responses=[3, 4, 5], response_mask=[1, 0, 1], rollout_log_probs=[-0.5, 0.0, -0.1]
    )
    assert violations(good, rollout) == []
    bad = good.model_copy(
        update={
            "prompts": [1] * 5,
            "responses": [3, 4, 5, 6],
            "response_mask": [1, 0, 1, 1],
            "rollout_log_probs": [-0.5, -0.3, -0.1],
        }
    )
    problems = violations(bad, rollout)
    assert any("rollout_log_probs has 3 entries for 4" in p for p in problems)
    assert any("over prompt_length 4" in p for p in problems)
    assert any("over response_length 3" in p for p in problems)
    assert any("non-zero logprob" in p for p in problems)
    failed = as_failed(bad, problems)
    assert failed.status == TrajectoryStatus.FAILED and "invariant violated" in failed.error
