"""MoE routed experts (verl's R3 routing replay) from the replica to the padded batch.

The replica is the scripted engine (a test double: no MoE model runs here) behind the
replica's own HTTP server, answering as an engine started for routing replay: every token
it fed through the model gets ``scripted_expert(token, layer, k)``, a pure function of the
token id, so each row of a trajectory's routed experts can be checked against the token at
its position. Through the LLM client, the session runner and recorder (the generation
events), a resumed session, the fold, the trajectory's Arrow record and ``to_padded``.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from rolloutbus.config import Config, with_overrides
from rolloutbus.consumers.tensors import to_padded
from rolloutbus.replica.scripted import ScriptedEngine, ScriptedTurn, scripted_expert
from rolloutbus.replica.server import replica_in_thread
from rolloutbus.schemas.agent_loop import AgentLoopMetrics, AgentLoopOutput, TokenOutput
from rolloutbus.schemas.prompts import GroupSamplingParams, PromptGroup
from rolloutbus.schemas.routed_experts import RoutedExperts
from rolloutbus.schemas.trajectories import (
    TRAJECTORY_SCHEMA,
    batch_to_trajectories,
    decode_trajectory_batch,
    encode_trajectory,
    trajectories_to_batch,
)
from rolloutbus.schemas.turns import (
    Generation,
    SessionFinished,
    decode_turn_event,
    encode_turn_event,
)
from rolloutbus.streams.assembly.session_fold import SessionFold
from rolloutbus.streams.assembly.trajectories import build_group_trajectories
from rolloutbus.streams.inference.llm_client import LLMClient
from rolloutbus.streams.sessions.recorder import RecordingLLMClient
from rolloutbus.streams.sessions.runner import SessionContext, run_session
from tests.builders import make_group_started, make_trajectory

LAYERS, TOP_K = 3, 2
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "18 * 7"}}\n</tool_call>'


def expected_rows(tokens: list[int]) -> list[list[list[int]]]:
    return [
        [[scripted_expert(t, layer, k) for k in range(TOP_K)] for layer in range(LAYERS)]
        for t in tokens
    ]


def _turn(tok, text: str) -> ScriptedTurn:
    ids = tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    return ScriptedTurn(token_ids=ids, logprobs=[-0.5] * len(ids))


async def _run_tool_session(tok, tmp_path, *, routing_replay: bool):
    tools_yaml = tmp_path / "tools.yaml"
    tools_yaml.write_text(
        "tools:\n  - class_name: rolloutbus.streams.agent_loop.tools.CalculatorTool\n"
        "    config: {type: native}\n"
    )
    engine = ScriptedEngine(
        [_turn(tok, CALL), _turn(tok, "The answer is 126.")],
        tokenizer=tok,
        eos_token_ids=frozenset({tok.convert_tokens_to_ids("<|im_end|>")}),
        routed_experts=(LAYERS, TOP_K),
    )
    cfg = Config.model_validate(
        {
            "replica_server": {"port": 0},
            "model": {"name": "tiny-qwen3"},
            "rollout": {
                "enable_rollout_routing_replay": routing_replay,
                "multi_turn": {"tool_config_path": str(tools_yaml)},
            },
        }
    )
    row = {"agent_name": "tool_agent", "prompt": [{"role": "user", "content": "18 * 7?"}]}
    group = PromptGroup(uid="moe1", row=row, n=1, sampling_params=GroupSamplingParams())
    events = []

    async def emit(event):
        events.append(decode_turn_event(encode_turn_event(event)))  # through the wire format

    with replica_in_thread(cfg, engine) as replica:
        cfg = with_overrides(cfg, {"replicas.urls": [replica.url]})
        async with LLMClient(cfg.replicas, cfg.rollout) as client:
            ctx = SessionContext(config=cfg, tokenizer=tok, llm_client=client)
            terminal = await run_session(ctx, group, 0, "att", emit)
    assert isinstance(terminal, SessionFinished), terminal
    started = make_group_started("moe1", attempt="g", row=row)
    fold = SessionFold(0, "att")
    for event in events:
        fold.apply(event)
    [trajectory] = build_group_trajectories(started, [fold], cfg.rollout.response_length)
    return trajectory, events, cfg


async def test_routed_experts_reach_the_trajectory_aligned_to_its_tokens(tok, tmp_path):
    t, events, cfg = await _run_tool_session(tok, tmp_path, routing_replay=True)
    generations = [e for e in events if isinstance(e, Generation)]
    assert [g.routed_experts is not None for g in generations] == [True, True]
    # the session's trace rides on its terminal event (rollout_trace_op as data)
    [finished] = [e for e in events if isinstance(e, SessionFinished)]
    assert [s.name for s in finished.spans] == [
        "generate",
        "tool_call",
        "generate",
        "ToolAgentLoop.run",
    ]
    assert finished.spans[0].attributes["response_tokens"] == len(generations[0].token_ids)
    sequence = t.prompts + t.responses
    # verl keeps the last turn's routing: every token fed through the model, i.e. all but
    # the last sampled one
    assert t.routed_experts is not None and t.routed_experts.shape == (
        len(sequence) - 1,
        LAYERS,
        TOP_K,
    )
    assert t.routed_experts.to_lists() == expected_rows(sequence[:-1])
    # the Arrow record carries it, and the padded batch aligns it as verl's postprocess
    [again] = batch_to_trajectories(decode_trajectory_batch(encode_trajectory(t)))
    assert again.routed_experts == t.routed_experts
    batch = decode_trajectory_batch(encode_trajectory(t))
    prompt_length, response_length = len(t.prompts) + 7, len(t.responses) + 9
    padded = to_padded(
        batch, prompt_length=prompt_length, response_length=response_length, pad_token_id=0
    )
    experts = padded["routed_experts"]
    assert experts.shape == (1, prompt_length + response_length, LAYERS, TOP_K)
    assert str(experts.dtype) == "torch.int16"  # verl's dtype
    first = 7  # the prompt is left-padded
    assert (experts[0, :first] == 0).all() and (experts[0, first + len(sequence) - 1 :] == 0).all()
    ids = padded["input_ids"][0, first : first + len(sequence) - 1].tolist()
    assert experts[0, first : first + len(sequence) - 1].tolist() == expected_rows(ids)
    # a prompt kept by its end in the padded batch keeps its rows aligned to its tokens
    cut = to_padded(
        batch, prompt_length=len(t.prompts) - 3, response_length=response_length, pad_token_id=0
    )
    kept = len(sequence) - 1 - 3
    assert cut["routed_experts"][0, :kept].tolist() == expected_rows(
        cut["input_ids"][0, :kept].tolist()
    )


async def test_without_routing_replay_no_experts_are_kept(tok, tmp_path):
    t, events, _ = await _run_tool_session(tok, tmp_path, routing_replay=False)
    assert all(e.routed_experts is None for e in events if isinstance(e, Generation))
    assert t.routed_experts is None
    batch = trajectories_to_batch([t])
    assert "routed_experts" not in to_padded(
        batch, prompt_length=64, response_length=96, pad_token_id=0
    )


class ExpertClient:
    """Test double for the LLM client: scripted tokens plus routed experts per call."""

    def __init__(self, replies):
        self.replies = list(replies)

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        tokens = self.replies.pop(0)
        fed = list(prompt_ids) + tokens[:-1]
        return TokenOutput(
            token_ids=tokens,
            log_probs=[-0.5] * len(tokens),
            routed_experts=np.array(expected_rows(fed), dtype=np.int64),
            stop_reason="completed",
        )


async def test_a_resumed_session_gets_the_logged_experts_back():
    """The recorder answers a resumed loop from the log: the experts too, never resampled."""
    events = []

    async def emit(event):
        events.append(decode_turn_event(encode_turn_event(event)))

    live = RecordingLLMClient(
        ExpertClient([[10, 11]]), emit, uid="u", session_id=0, attempt="a", routing_replay=True
    )
    first = await live.generate("r", prompt_ids=[1, 2, 3], sampling_params={})
    logged = list(events)
    resumed_events = []

    async def emit_resumed(event):
        resumed_events.append(event)

    resumed = RecordingLLMClient(
        ExpertClient([]),  # nothing left to sample: the answer must come from the log
        emit_resumed,
        uid="u",
        session_id=0,
        attempt="b",
        replay=logged,
        routing_replay=True,
    )
    again = await resumed.generate("r", prompt_ids=[1, 2, 3], sampling_params={})
    assert again.token_ids == first.token_ids
    np.testing.assert_array_equal(again.routed_experts, first.routed_experts)
    assert resumed_events[-1].routed_experts == RoutedExperts.from_array(first.routed_experts)


async def test_routing_replay_off_gives_the_loop_no_experts():
    events = []

    async def emit(event):
        events.append(event)

    rec = RecordingLLMClient(ExpertClient([[10, 11]]), emit, uid="u", session_id=0, attempt="a")
    out = await rec.generate("r", prompt_ids=[1, 2, 3], sampling_params={})
    assert out.routed_experts is None and events[-1].routed_experts is None


def test_routed_experts_encode_compactly_and_check_their_shape():
    experts = RoutedExperts.from_array(np.arange(24).reshape(4, 3, 2))
    wire = experts.model_dump_json()
    assert RoutedExperts.model_validate_json(wire) == experts
    assert len(wire) < 24 * 4  # base64 int16, not a JSON number per id
    assert experts.head(2).to_lists() == np.arange(12).reshape(2, 3, 2).tolist()
    with pytest.raises(ValueError, match="3-D"):
        RoutedExperts.from_array([1, 2, 3])
    with pytest.raises(ValueError, match="need 48 bytes"):
        RoutedExperts(shape=(4, 3, 2), data=b"\0" * 10)
    with pytest.raises(ValueError, match="outside int16"):
        RoutedExperts.from_array(np.full((1, 1, 1), 70_000))


def test_a_record_written_before_the_column_existed_decodes_with_none():
    """An add-only column: a record of the first release's schema still decodes."""
    t = make_trajectory()
    batch = trajectories_to_batch([t])
    old_fields = [f for f in TRAJECTORY_SCHEMA if f.name != "routed_experts"]
    old_schema = pa.schema(old_fields, metadata=TRAJECTORY_SCHEMA.metadata)
    old_batch = pa.RecordBatch.from_arrays(
        [batch.column(f.name) for f in old_fields], schema=old_schema
    )
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, old_schema) as writer:
        writer.write_batch(old_batch)
    decoded = decode_trajectory_batch(sink.getvalue().to_pybytes())
    assert decoded.schema.equals(TRAJECTORY_SCHEMA)
    assert batch_to_trajectories(decoded) == [t]


def test_as_dict_aligns_routed_experts_as_verl():
    out = AgentLoopOutput(
        prompt_ids=[1, 2],
        response_ids=[3, 4, 5],
        response_mask=[1, 1, 1],
        routed_experts=np.arange(8).reshape(4, 1, 2),  # 4 rows of 5 positions recorded
        reward_score=1.0,
        metrics=AgentLoopMetrics(),
    )
    view = out.as_dict()
    assert view["routed_experts"].shape == (5, 1, 2)
    assert view["routed_experts"].tolist() == [[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]], [[0, 0]]]
    assert str(view["routed_experts"].dtype) == "torch.int16"
