"""A loop whose run() returns a list: each output is its own trajectory keyed
{uid}_{session_id}_{i}, and (as in verl) the last output's score is copied to the earlier ones."""

from __future__ import annotations

from rolloutbus.config import Config
from rolloutbus.schemas.prompts import GroupSamplingParams, PromptGroup
from rolloutbus.schemas.turns import (
    SessionFinished,
    decode_turn_event,
    encode_turn_event,
)
from rolloutbus.streams.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register
from rolloutbus.streams.assembly.session_fold import SessionFold
from rolloutbus.streams.assembly.trajectories import build_group_trajectories
from rolloutbus.streams.sessions.runner import SessionContext, run_session
from tests.builders import make_group_started
from tests.scripted_server import ScriptedServerManager, qwen3_tokenizer, scripted_turn


@register("two_drafts_test")
class TwoDraftsLoop(AgentLoopBase):
    """Draft, then revise with the draft in context: output 0 = draft, output 1 = both turns."""

    async def run(self, sampling_params, **kwargs):
        prompt = await self.apply_chat_template(kwargs["raw_prompt"])
        draft = await self.server_manager.generate(
            "req", prompt_ids=prompt, sampling_params=sampling_params
        )
        hint = self.tokenizer.encode("\nRevise:", add_special_tokens=False)
        final = await self.server_manager.generate(
            "req", prompt_ids=prompt + draft.token_ids + hint, sampling_params=sampling_params
        )
        metrics = AgentLoopMetrics()
        return [
            AgentLoopOutput(
                prompt_ids=prompt,
                response_ids=draft.token_ids,
                response_mask=[1] * len(draft.token_ids),
                response_logprobs=draft.log_probs,
                num_turns=2,
                metrics=metrics,
            ),
            AgentLoopOutput(
                prompt_ids=prompt,
                response_ids=draft.token_ids + hint + final.token_ids,
                response_mask=[1] * len(draft.token_ids)
                + [0] * len(hint)
                + [1] * len(final.token_ids),
                response_logprobs=draft.log_probs + [0.0] * len(hint) + final.log_probs,
                num_turns=3,
                metrics=metrics,
            ),
        ]


async def test_multi_output_keys_and_copied_reward():
    tok = qwen3_tokenizer()
    wrong = tok.encode("It is 120.", add_special_tokens=False)
    right = tok.encode("It is 126.", add_special_tokens=False)
    client = ScriptedServerManager([scripted_turn(wrong), scripted_turn(right)])
    row = {
        "agent_name": "two_drafts_test",
        "data_source": "rolloutbus/arithmetic",  # the arithmetic scorer (last number)
        "prompt": [{"role": "user", "content": "计算 18 * 7"}],
        "reward_model": {"style": "rule", "ground_truth": "126"},
    }
    group = PromptGroup(uid="m1", row=row, n=1, sampling_params=GroupSamplingParams())
    events = []

    async def emit(event):
        events.append(decode_turn_event(encode_turn_event(event)))

    ctx = SessionContext(config=Config(), tokenizer=tok, llm_client=client)
    terminal = await run_session(ctx, group, 0, "a1", emit)
    assert isinstance(terminal, SessionFinished), terminal
    fold = SessionFold(0, "a1")
    for e in events:
        fold.apply(e)
    draft, final = build_group_trajectories(make_group_started("m1", attempt="a1", row=row), [fold])
    assert (draft.key, final.key) == ("m1_0_0", "m1_0_1")
    assert draft.group_size == final.group_size == 2 and draft.num_outputs == 2
    assert draft.responses == wrong and final.responses[: len(wrong)] == wrong
    assert final.response_mask.count(0) == len(tok.encode("\nRevise:", add_special_tokens=False))
    assert final.reward_score == 1.0  # the last output is scored ...
    assert draft.reward_score == 1.0  # ... and its score copied to the earlier one (verl)
