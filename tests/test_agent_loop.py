"""AgentLoopBase, the registry / routing, single_turn_agent and the public API."""

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))
from fixtures.scripted_server import (  # noqa: E402
    ScriptedServerManager,
    make_config,
    qwen3_tokenizer,
    scripted_turn,
)

import rolloutbus.streams.agent_loop as agent_loop  # noqa: E402
from rolloutbus.errors import AgentLoopError, PromptTooLongError, UnknownAgentLoopError  # noqa: E402
from rolloutbus.schemas.agent_loop import AgentLoopMetrics, AgentLoopOutput, TokenOutput  # noqa: E402
from rolloutbus.streams.agent_loop import (  # noqa: E402
    AgentLoopBase,
    DictConfigWrap,
    SingleTurnAgentLoop,
    _agent_loop_registry,
    create_agent_loop,
    load_agent_loop_config,
    register,
    resolve_agent_name,
    simple_timer,
)

ROW = {"prompt": [{"role": "user", "content": "计算 18 * 7"}], "data_source": "my/math"}


@pytest.fixture(scope="module")
def tok():
    return qwen3_tokenizer()


def loop_kwargs(tok, server, **rollout):
    return dict(
        trainer_config=DictConfigWrap(make_config(**rollout)),
        server_manager=server,
        tokenizer=tok,
        processor=None,
    )


class EchoLoop(AgentLoopBase):
    async def run(self, sampling_params, **kwargs):
        raise NotImplementedError


# ---- public API ----------------------------------------------------------------------


def test_public_api_is_complete():
    for name in [
        "AgentLoopBase",
        "register",
        "SingleTurnAgentLoop",
        "ToolAgentLoop",
        "AgentLoopOutput",
        "AgentLoopMetrics",
        "simple_timer",
        "DictConfigWrap",
    ]:
        assert name in agent_loop.__all__
    for name in agent_loop.__all__:
        assert hasattr(agent_loop, name), name
    assert agent_loop.AgentLoopOutput is AgentLoopOutput
    from rolloutbus.streams.agent_loop.agent_loop import AgentLoopBase as verl_path_base

    assert verl_path_base is AgentLoopBase


def test_schema_fields_and_defaults():
    assert list(AgentLoopMetrics.model_fields) == [
        "generate_sequences",
        "tool_calls",
        "compute_score",
        "num_preempted",
    ]
    assert AgentLoopMetrics().num_preempted == -1
    assert list(AgentLoopOutput.model_fields) == [
        "prompt_ids",
        "response_ids",
        "response_mask",
        "response_logprobs",
        "routed_experts",
        "multi_modal_data",
        "reward_score",
        "num_turns",
        "metrics",
        "extra_fields",
        "mm_processor_kwargs",
    ]


def test_base_constructor_shape(tok):
    loop = EchoLoop(
        **loop_kwargs(tok, "client"), dataset_cls=dict, data_config={"x": 1}, hf_model_type="qwen3"
    )
    assert loop.config.rollout is loop.rollout_config
    assert (loop.server_manager, loop.tokenizer, loop.processor) == ("client", tok, None)
    assert (loop.dataset_cls, loop.data_config, loop.hf_model_type) == (dict, {"x": 1}, "qwen3")
    with pytest.raises(TypeError):
        AgentLoopBase(**loop_kwargs(tok, None))  # run() is abstract


def test_simple_timer_accumulates():
    timings = {}
    for _ in range(2):
        with simple_timer("generate_sequences", timings):
            pass
    assert timings["generate_sequences"] >= 0


# ---- prompts -------------------------------------------------------------------------


async def test_prompt_renders_with_generation_prompt(tok):
    loop = EchoLoop(**loop_kwargs(tok, None))
    ids = await loop.apply_chat_template(ROW["prompt"])
    assert tok.decode(ids) == "<|im_start|>user\n计算 18 * 7<|im_end|>\n<|im_start|>assistant\n"


async def test_text_prompt_is_left_truncated(tok, caplog):
    loop = EchoLoop(**loop_kwargs(tok, None, prompt_length=8))
    messages = [{"role": "user", "content": "one two three four five six seven eight nine ten"}]
    full = await EchoLoop(**loop_kwargs(tok, None)).apply_chat_template(messages)
    with caplog.at_level("WARNING"):
        ids = await loop.apply_chat_template(messages)
    assert ids == full[-8:]  # keeps the last tokens, so the generation prompt survives
    assert "keeping the last 8" in caplog.text


class FakeProcessor:
    """Test double for a VL processor: 100 tokens per image."""

    def apply_chat_template(
        self, messages, tools=None, add_generation_prompt=True, tokenize=False, **kw
    ):
        return "text"

    def __call__(self, text, images=None, videos=None, return_tensors=None):
        return {"input_ids": [[7] * (10 + 100 * len(images or []))]}


async def test_multimodal_prompt_over_budget_raises(tok):
    loop = EchoLoop(**{**loop_kwargs(tok, None, prompt_length=50), "processor": FakeProcessor()})
    assert len(await loop.apply_chat_template([], images=[])) == 10
    with pytest.raises(PromptTooLongError, match="multimodal prompt has 110 tokens"):
        await loop.apply_chat_template([{"role": "user", "content": "x"}], images=["img"])
    assert issubclass(PromptTooLongError, ValueError)


async def test_multimodal_without_processor_raises(tok):
    loop = EchoLoop(**loop_kwargs(tok, None))
    with pytest.raises(AgentLoopError, match="no processor"):
        await loop.apply_chat_template(ROW["prompt"], images=["img"])


async def test_remove_system_prompt(tok):
    loop = EchoLoop(**loop_kwargs(tok, None))
    ids = await loop.apply_chat_template(
        [{"role": "tool", "content": "126"}], remove_system_prompt=True
    )
    assert tok.decode(ids).startswith("<|im_start|>user\n<tool_response>")


# ---- registry and routing ------------------------------------------------------------


def test_builtins_registered():
    assert _agent_loop_registry["single_turn_agent"]["_target_"].endswith(
        "single_turn.SingleTurnAgentLoop"
    )
    assert _agent_loop_registry["tool_agent"]["_target_"].endswith("tool_agent.ToolAgentLoop")


def test_register_decorator_stores_target():
    @register("echo_test_loop")
    class Local(EchoLoop):
        pass

    assert _agent_loop_registry["echo_test_loop"] == {
        "_target_": f"{__name__}.{Local.__qualname__}"
    }


def test_resolve_agent_name_default_only_when_absent():
    assert resolve_agent_name({"agent_name": "tool_agent"}, "single_turn_agent") == "tool_agent"
    assert resolve_agent_name({}, "single_turn_agent") == "single_turn_agent"
    assert resolve_agent_name({"agent_name": None}, "single_turn_agent") is None


@pytest.mark.parametrize("name", [None, "no_such_agent"])
def test_null_or_unknown_agent_name_fails_naming_it(tok, name):
    with pytest.raises(UnknownAgentLoopError) as err:
        create_agent_loop(
            resolve_agent_name({"agent_name": name}, "single_turn_agent"), **loop_kwargs(tok, None)
        )
    named = "agent_name is null" if name is None else repr(name)
    assert named in str(err.value) and "single_turn_agent" in str(err.value)


def test_fresh_instance_per_trajectory(tok):
    a = create_agent_loop("single_turn_agent", **loop_kwargs(tok, None))
    b = create_agent_loop("single_turn_agent", **loop_kwargs(tok, None))
    assert isinstance(a, SingleTurnAgentLoop) and a is not b


def test_yaml_registration_of_the_seed_loop(tok, tmp_path, monkeypatch):
    """A custom loop written for verl's API (fixtures/my_agent_loop.py), registered from YAML
    by a relative path."""
    monkeypatch.syspath_prepend(str(TESTS / "fixtures"))
    (tmp_path / "my_agent_loops.yaml").write_text(
        "- name: my_single_turn\n  _target_: my_agent_loop.MySingleTurnLoop\n"
    )
    monkeypatch.chdir(tmp_path)
    assert load_agent_loop_config("my_agent_loops.yaml") == ["my_single_turn"]
    loop = create_agent_loop("my_single_turn", **loop_kwargs(tok, ScriptedServerManager([])))
    assert type(loop).__name__ == "MySingleTurnLoop"


async def test_seed_loop_runs_and_meets_the_output_contract(tok, monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS / "fixtures"))
    from my_agent_loop import MySingleTurnLoop

    server = ScriptedServerManager([TokenOutput(token_ids=[1, 2, 3, 4], log_probs=[-0.1] * 4)])
    loop = MySingleTurnLoop(**loop_kwargs(tok, server, response_length=3))
    out = await loop.run({"temperature": 1.0}, raw_prompt=ROW["prompt"], uid="u1", session_id=0)
    assert out.response_ids == [1, 2, 3] and out.response_mask == [1, 1, 1]
    assert out.metrics.num_preempted == -1 and out.metrics.generate_sequences >= 0


def test_yaml_extra_keys_become_constructor_kwargs(tok, tmp_path):
    path = tmp_path / "loops.yaml"
    path.write_text(
        f"- name: echo_with_kwargs\n  _target_: {__name__}.EchoLoop\n  "
        "apply_chat_template_kwargs:\n"
        "    enable_thinking: false\n"
    )
    load_agent_loop_config(path)
    loop = create_agent_loop("echo_with_kwargs", **loop_kwargs(tok, None))
    assert loop.apply_chat_template_kwargs == {"enable_thinking": False}


@pytest.mark.parametrize("content", ["{not: [yaml", "- name: x\n", "name: x\n"])
def test_bad_yaml_config_is_an_error(tmp_path, content):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    with pytest.raises(AgentLoopError):
        load_agent_loop_config(path)


def test_unimportable_target_is_an_error(tok, tmp_path):
    path = tmp_path / "loops.yaml"
    path.write_text("- name: ghost\n  _target_: no_such_pkg.Ghost\n")
    load_agent_loop_config(path)
    with pytest.raises(AgentLoopError, match="ghost"):
        create_agent_loop("ghost", **loop_kwargs(tok, None))


# ---- single_turn_agent ---------------------------------------------------------------


async def test_single_turn_output(tok):
    server = ScriptedServerManager(
        [
            scripted_turn(
                [11, 12, 13, 14, 15],
                num_preempted=2,
                extra_fields={"global_steps": 3},
                routed_experts=list(range(100)),
            )
        ]
    )
    loop = create_agent_loop("single_turn_agent", **loop_kwargs(tok, server, response_length=4))
    out = await loop.run(
        {"temperature": 1.0, "logprobs": True}, raw_prompt=ROW["prompt"], uid="u", session_id=0
    )
    call = server.calls[0]
    assert out.prompt_ids == call.prompt_ids
    assert out.response_ids == [11, 12, 13, 14] and out.response_mask == [1] * 4
    assert out.response_logprobs == [-0.5] * 4
    assert (
        out.num_turns == 2 and out.metrics.num_preempted == 2 and out.metrics.generate_sequences > 0
    )
    assert out.extra_fields == {"global_steps": 3, "turn_scores": [], "tool_rewards": []}
    assert out.routed_experts == list(range(len(out.prompt_ids) + 4))
    assert len(call.request_id) == 32  # a uuid hex


async def test_single_turn_unknown_preemption_and_no_logprobs(tok):
    server = ScriptedServerManager([TokenOutput(token_ids=[5])])
    out = await SingleTurnAgentLoop(**loop_kwargs(tok, server)).run({}, raw_prompt=ROW["prompt"])
    assert out.metrics.num_preempted == -1 and out.response_logprobs is None


async def test_single_turn_deterministic_request_id(tok):
    server = ScriptedServerManager([TokenOutput(token_ids=[5])])
    loop = SingleTurnAgentLoop(**loop_kwargs(tok, server, full_determinism=True))
    await loop.run({}, raw_prompt=ROW["prompt"], priority=7)
    assert server.calls[0].request_id == "det-7" and server.calls[0].kwargs == {"priority": 7}
