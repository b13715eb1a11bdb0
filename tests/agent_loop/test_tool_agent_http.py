"""tool_agent over real HTTP: the scripted replica (a test double — the small models cannot
emit tool calls) behind the replica's own server, our LLM client, the session runner, and
the fold of the logged turn events. Checks the two-turn tool layout: prompt P, then response
A1 ‖ O ‖ A2 with mask 1 on the answers A1, A2 and mask 0, logprob 0.0 on the tool observation O."""

from __future__ import annotations

import json

from rolloutbus.config import Config, with_overrides
from rolloutbus.replica.scripted import ScriptedEngine, ScriptedTurn
from rolloutbus.replica.server import replica_in_thread
from rolloutbus.schemas.prompts import GroupSamplingParams, PromptGroup
from rolloutbus.schemas.turns import (
    SessionFinished,
    decode_turn_event,
    encode_turn_event,
)
from rolloutbus.streams.assembly.session_fold import SessionFold
from rolloutbus.streams.assembly.trajectories import build_group_trajectories
from rolloutbus.streams.inference.llm_client import LLMClient
from rolloutbus.streams.sessions.runner import SessionContext, run_session
from tests.builders import make_group_started

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "18 * 7"}}\n</tool_call>'
ANSWER = "The answer is 126."
LP1, LP2 = -0.25, -0.75


def _turn(tok, text: str, logprob: float) -> ScriptedTurn:
    ids = tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    return ScriptedTurn(token_ids=ids, logprobs=[logprob] * len(ids))


async def test_tool_agent_section_11_layout_over_http_and_through_the_fold(tok, tmp_path):
    tools_yaml = tmp_path / "tools.yaml"
    tools_yaml.write_text(
        "tools:\n  - class_name: rolloutbus.streams.agent_loop.tools.CalculatorTool\n    "
        "config: {}\n"
    )
    engine = ScriptedEngine(
        [_turn(tok, CALL, LP1), _turn(tok, ANSWER, LP2)],
        tokenizer=tok,
        eos_token_ids=frozenset({tok.convert_tokens_to_ids("<|im_end|>")}),
    )
    cfg = Config.model_validate(
        {
            "replica_server": {"port": 0},
            "model": {"name": "tiny-qwen3"},
            "rollout": {"multi_turn": {"tool_config_path": str(tools_yaml)}},
        }
    )
    row = {
        "data_source": "rolloutbus/arithmetic",  # the arithmetic scorer (last number)
        "agent_name": "tool_agent",
        "prompt": [{"role": "user", "content": "计算 18 * 7"}],
        "reward_model": {"style": "rule", "ground_truth": "126"},
        "extra_info": {"index": 42},
    }
    group = PromptGroup(uid="u42", row=row, n=1, sampling_params=GroupSamplingParams())
    events = []

    async def emit(event):
        events.append(decode_turn_event(encode_turn_event(event)))

    with replica_in_thread(cfg, engine) as replica:
        cfg = with_overrides(cfg, {"replicas.urls": [replica.url]})
        async with LLMClient(cfg.replicas, cfg.rollout) as client:
            ctx = SessionContext(config=cfg, tokenizer=tok, llm_client=client)
            terminal = await run_session(ctx, group, 0, "att", emit)
    assert isinstance(terminal, SessionFinished), terminal

    # the replica saw the exact stream: turn 2's prompt = P ‖ A1 ‖ O
    first, second = engine.calls
    a1 = _turn(tok, CALL, LP1).token_ids
    a2 = _turn(tok, ANSWER, LP2).token_ids
    assert second.prompt_ids[: len(first.prompt_ids) + len(a1)] == first.prompt_ids + a1
    obs = second.prompt_ids[len(first.prompt_ids) + len(a1) :]
    assert tok.decode(obs) == (
        "\n<|im_start|>user\n<tool_response>\n126\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )

    assert [e.type for e in events] == [
        "session_started",
        "segment_started",
        "generation",
        "observation",
        "generation",
        "session_finished",
    ]
    fold = SessionFold(0, "att")
    for e in events:
        fold.apply(e)
    started = make_group_started("u42", attempt="att", row=row)
    [t] = build_group_trajectories(started, [fold], cfg.rollout.response_length)
    assert t.prompts == first.prompt_ids
    assert t.responses == a1 + obs + a2
    assert t.response_mask == [1] * len(a1) + [0] * len(obs) + [1] * len(a2)
    assert t.rollout_log_probs == [LP1] * len(a1) + [0.0] * len(obs) + [LP2] * len(a2)
    assert t.num_turns == 4 and t.agent_name == "tool_agent"
    assert t.reward_score == 1.0 and t.rm_scores[-1] == 1.0 and sum(t.rm_scores) == 1.0
    assert t.metrics.num_preempted == -1 and t.metrics.tool_calls > 0
    assert json.loads(json.dumps(t.extra_fields))["tool_rewards"] == []
    # verl's LLMServerClient fills these from the turn's version; so does the recorder
    version = t.extra_fields["weight_version"]
    assert t.extra_fields["global_steps"] == version
    assert t.extra_fields["min_global_steps"] == t.extra_fields["max_global_steps"] == version
