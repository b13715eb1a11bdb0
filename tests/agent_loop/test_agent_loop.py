"""AgentLoopBase, the registry / routing, single_turn_agent and the public API."""

import pytest

import rolloutbus.streams.agent_loop as agent_loop
from rolloutbus.errors import AgentLoopError, PromptTooLongError, UnknownAgentLoopError
from rolloutbus.schemas.agent_loop import AgentLoopMetrics, AgentLoopOutput, TokenOutput
from rolloutbus.streams.agent_loop import (
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
from tests.scripted_server import (
    ScriptedServerManager,
    make_config,
    scripted_turn,
)
from tests.source_tree import PLUGINS

ROW = {"prompt": [{"role": "user", "content": "计算 18 * 7"}], "data_source": "my/math"}


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
        "mm_processor_output",  # verl 0.9.1 (tests/verl_compat/test_verl_parity.py checks them all)
    ]


async def test_base_constructor_shape(tok):
    # async: a loop is built inside the session's coroutine (its self.loop is the running
    # loop); built outside any loop it would make a loop of its own that nobody closes
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
async def test_null_or_unknown_agent_name_fails_naming_it(tok, name):
    with pytest.raises(UnknownAgentLoopError) as err:
        create_agent_loop(
            resolve_agent_name({"agent_name": name}, "single_turn_agent"), **loop_kwargs(tok, None)
        )
    named = "agent_name is null" if name is None else repr(name)
    assert named in str(err.value) and "single_turn_agent" in str(err.value)


async def test_fresh_instance_per_trajectory(tok):
    a = create_agent_loop("single_turn_agent", **loop_kwargs(tok, None))
    b = create_agent_loop("single_turn_agent", **loop_kwargs(tok, None))
    assert isinstance(a, SingleTurnAgentLoop) and a is not b


async def test_yaml_registration_of_the_seed_loop(tok, tmp_path, monkeypatch):
    """A custom loop written for verl's API (plugins/my_agent_loop.py), registered from YAML
    by a relative path."""
    monkeypatch.syspath_prepend(str(PLUGINS))
    (tmp_path / "my_agent_loops.yaml").write_text(
        "- name: my_single_turn\n  _target_: my_agent_loop.MySingleTurnLoop\n"
    )
    monkeypatch.chdir(tmp_path)
    assert load_agent_loop_config("my_agent_loops.yaml") == ["my_single_turn"]
    loop = create_agent_loop("my_single_turn", **loop_kwargs(tok, ScriptedServerManager([])))
    assert type(loop).__name__ == "MySingleTurnLoop"


async def test_seed_loop_runs_and_meets_the_output_contract(tok, monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGINS))
    from my_agent_loop import MySingleTurnLoop

    server = ScriptedServerManager([TokenOutput(token_ids=[1, 2, 3, 4], log_probs=[-0.1] * 4)])
    loop = MySingleTurnLoop(**loop_kwargs(tok, server, response_length=3))
    out = await loop.run({"temperature": 1.0}, raw_prompt=ROW["prompt"], uid="u1", session_id=0)
    assert out.response_ids == [1, 2, 3] and out.response_mask == [1, 1, 1]
    assert out.metrics.num_preempted == -1 and out.metrics.generate_sequences >= 0


async def test_yaml_extra_keys_become_constructor_kwargs(tok, tmp_path):
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


async def test_unimportable_target_is_an_error(tok, tmp_path):
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


# ---- verl's current AgentLoopBase surface (Continuous Token API) --------------------------


class CurrentVerlLoop(AgentLoopBase):
    """Written the way a loop for current verl is: CT helpers, self.loop, data_config, tools."""

    def __init__(self, *args, tools=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.tool_list = tools.tools if tools else []

    async def run(self, sampling_params, **kwargs):
        messages = list(kwargs["raw_prompt"])
        media = await self.process_multi_modal_info(messages)
        self._assert_mm_supported(bool(media))
        prompt_ids = await self.ct_build_initial_tokens(messages)
        out = await self.server_manager.generate(
            "r", prompt_ids=prompt_ids, sampling_params=sampling_params
        )
        merge, mask, logprobs = await self.ct_merge_assistant_token(
            prompt_ids, out.token_ids, [], [], assistant_logprobs=out.log_probs
        )
        previous = list(messages)
        messages += [
            {"role": "assistant", "content": "x"},
            {"role": "user", "content": "Check it."},
        ]
        # older verl's name, the same merge
        merge, mask, logprobs = await self.ct_merge_non_assistant_msg(
            previous + [messages[-2]], messages, merge.token_ids, mask, logprobs
        )
        final = await self.server_manager.generate(
            "r", prompt_ids=merge.token_ids, sampling_params=sampling_params
        )
        merge, mask, logprobs = await self.ct_merge_assistant_token(
            merge.token_ids, final.token_ids, mask, logprobs, assistant_logprobs=final.log_probs
        )
        token_ids = merge.token_ids
        await self.loop.run_in_executor(None, lambda: None)  # verl's loops use self.loop
        return AgentLoopOutput(
            prompt_ids=token_ids[: len(token_ids) - len(mask)],
            response_ids=token_ids[len(token_ids) - len(mask) :],
            response_mask=mask,
            response_logprobs=logprobs,
            num_turns=4,
            metrics=AgentLoopMetrics(),
        )


async def test_a_loop_written_for_current_verl_runs(tok):
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    first = tok.encode("It is 120.", add_special_tokens=False) + [im_end]
    second = tok.encode("It is 126.", add_special_tokens=False) + [im_end]
    server = ScriptedServerManager([scripted_turn(first), scripted_turn(second)])
    from rolloutbus.streams.agent_loop import ToolListWrap

    loop = CurrentVerlLoop(
        **loop_kwargs(tok, server),
        dataset_cls=None,
        data_config=DictConfigWrap({"apply_chat_template_kwargs": {"enable_thinking": False}}),
        tools=ToolListWrap(["t"]),
    )
    assert loop.data_config == {"apply_chat_template_kwargs": {"enable_thinking": False}}
    assert loop.apply_chat_template_kwargs == {"enable_thinking": False}
    assert loop.tool_list == ["t"]
    assert loop.continuous_token_builder.chat_template_kwargs == {"enable_thinking": False}
    out = await loop.run({}, raw_prompt=ROW["prompt"])
    n_obs = len(out.response_ids) - len(first) - len(second)
    assert out.response_mask == [1] * len(first) + [0] * n_obs + [1] * len(second)
    assert out.response_logprobs == [-0.5] * len(first) + [0.0] * n_obs + [-0.5] * len(second)
    obs = tok.decode(out.response_ids[len(first) : len(first) + n_obs])
    assert obs.startswith("\n<|im_start|>user\nCheck it.<|im_end|>\n<|im_start|>assistant\n")
    assert server.calls[1].prompt_ids == out.prompt_ids + out.response_ids[: len(first) + n_obs]


async def test_ct_merge_rejects_edited_history(tok):
    loop = EchoLoop(**loop_kwargs(tok, None))
    history = [{"role": "user", "content": "a"}]
    with pytest.raises(ValueError, match="append-only"):
        await loop.ct_merge_context_msg(
            history, [{"role": "user", "content": "b"}, {"role": "tool", "content": "c"}], [], []
        )
    with pytest.raises(ValueError, match="cannot end with assistant"):  # verl's message
        await loop.ct_merge_context_msg(
            history, [*history, {"role": "assistant", "content": "x"}], [], []
        )
    with pytest.raises(ValueError, match="only supports appending roles .* got 'robot'"):
        await loop.ct_merge_context_msg(
            history, [*history, {"role": "robot", "content": "x"}], [], []
        )


async def test_multimodal_info_without_processor_is_empty_and_media_raise(tok):
    loop = EchoLoop(**loop_kwargs(tok, None))
    image_message = [{"role": "user", "content": [{"type": "image", "image": "a.png"}]}]
    assert await loop.process_multi_modal_info(image_message) == {}  # verl: no processor, {}
    with pytest.raises(ValueError, match="no processor"):
        loop._assert_mm_supported(True)
    with_processor = EchoLoop(**{**loop_kwargs(tok, None), "processor": FakeProcessor()})
    assert await with_processor.process_vision_info(image_message) == {"images": ["a.png"]}


class CompressingLoop(AgentLoopBase):
    """Answers, then compresses its context (the first answer replaced by a summary) and
    answers again: the second prompt is a re-render, as a context manager produces it."""

    async def run(self, sampling_params, **kwargs):
        messages = list(kwargs["raw_prompt"])
        prompt = await self.ct_build_initial_tokens(messages)
        first = await self.server_manager.generate(
            "r", prompt_ids=prompt, sampling_params=sampling_params
        )
        summary = [*messages, {"role": "assistant", "content": "(summary)"}]
        summary.append({"role": "user", "content": "Go on."})
        compressed = await self.ct_build_initial_tokens(summary)
        second = await self.server_manager.generate(
            "r", prompt_ids=compressed, sampling_params=sampling_params
        )
        metrics = AgentLoopMetrics()
        one = len(first.token_ids)
        return [
            AgentLoopOutput(
                prompt_ids=prompt,
                response_ids=first.token_ids,
                response_mask=[1] * one,
                response_logprobs=first.log_probs,
                num_turns=2,
                metrics=metrics,
            ),
            AgentLoopOutput(
                prompt_ids=compressed,
                response_ids=second.token_ids,
                response_mask=[1] * len(second.token_ids),
                response_logprobs=second.log_probs,
                num_turns=4,
                metrics=metrics,
            ),
        ]


async def test_a_context_compressing_loop_runs_and_is_recorded_as_returned(tok):
    """verl does not stop a loop that edits its history; its outputs are recorded as it
    returns them, each in its own logged segment."""
    from rolloutbus.config import Config
    from rolloutbus.schemas.prompts import GroupSamplingParams, PromptGroup
    from rolloutbus.schemas.turns import SessionFinished
    from rolloutbus.streams.sessions.runner import SessionContext, run_session

    register("compressing_test")(CompressingLoop)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    answer = tok.encode("It is 126.", add_special_tokens=False) + [im_end]
    client = ScriptedServerManager([scripted_turn(answer), scripted_turn(answer)])
    row = {**ROW, "agent_name": "compressing_test"}
    group = PromptGroup(uid="c1", row=row, n=1, sampling_params=GroupSamplingParams())
    events = []

    async def emit(event):
        events.append(event)

    ctx = SessionContext(config=Config(), tokenizer=tok, llm_client=client)
    terminal = await run_session(ctx, group, 0, "a1", emit)
    assert isinstance(terminal, SessionFinished), terminal
    assert [e.type for e in events].count("segment_started") == 2
    assert [o.segment for o in terminal.outputs] == [0, 1]


async def test_a_retokenized_history_is_still_token_drift(tok):
    """The same text in other tokens rewrites sampled tokens: that stays an error."""
    from rolloutbus.errors import TokenDriftError
    from rolloutbus.streams.sessions.recorder import RecordingLLMClient

    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    prompt = tok.encode("<|im_start|>user\nhi<|im_end|>\n", add_special_tokens=False)
    sampled = tok.encode(" ab", add_special_tokens=False)  # one token, " ab"
    client = ScriptedServerManager([scripted_turn(sampled + [im_end]), scripted_turn([1])])

    async def emit(event):
        pass

    rec = RecordingLLMClient(client, emit, uid="u", session_id=0, attempt="a", tokenizer=tok)
    await rec.generate("r", prompt_ids=prompt, sampling_params={})
    split = tok.encode(" a", add_special_tokens=False) + tok.encode("b", add_special_tokens=False)
    assert split != sampled and tok.decode(split) == tok.decode(sampled)
    with pytest.raises(TokenDriftError, match="re-rendered"):
        await rec.generate("r", prompt_ids=prompt + split + [im_end], sampling_params={})
