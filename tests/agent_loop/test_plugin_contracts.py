"""One contract per plug-in kind, run over every registered plug-in of that kind: what it
must accept, return and raise. A new agent loop, tool parser, scorer or backend is covered
by registering it; its own tests cover what is particular to it.

- agent loops (the package's; a test's own loops are tested where they are defined): an
  ``AgentLoopOutput`` whose masks and logprobs line up with its response,
  the prompt the server was asked, the response budget kept (scripted server: a test
  double for the replica);
- tool parsers: text without a call comes back as text and no call; broken call markup
  never raises;
- scorers (verl's ``default_compute_score`` table and the registered ones): verl's return
  types, a right answer above a wrong one, the same score twice; the sources verl has
  and we do not, and unknown ones, raise ``NotImplementedError`` with what to do;
- backends: each against the real embedded replica over HTTP (tiny-qwen3): greedy decoding
  gives every backend the same tokens, with one logprob per token.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from rolloutbus.config import Config
from rolloutbus.replica.server import replica_in_thread
from rolloutbus.schemas.agent_loop import AgentLoopOutput
from rolloutbus.schemas.inference import TurnSamplingParams
from rolloutbus.streams.agent_loop import DictConfigWrap, create_agent_loop
from rolloutbus.streams.agent_loop.registry import _agent_loop_registry, registered_agent_loops
from rolloutbus.streams.agent_loop.tool_parser import FunctionCall, ToolParser
from rolloutbus.streams.inference.backends import BACKENDS, EngineCall
from rolloutbus.streams.reward import default as scorers
from tests.scripted_server import ScriptedServerManager, make_config, scripted_turn

QUESTION = [{"role": "user", "content": "What is 18 * 7?"}]
RESPONSE_LENGTH = 6

# ---- agent loops ----------------------------------------------------------------------


def _package_loops() -> list[str]:
    """The loops the package registers (tests register their own as they are imported)."""
    return [
        name
        for name in registered_agent_loops()
        if str(_agent_loop_registry[name]["_target_"]).startswith("rolloutbus.")
    ]


@pytest.mark.parametrize("name", _package_loops())
async def test_every_agent_loop_meets_the_output_contract(name, tok):
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    answer = tok.encode("18 * 7 is 126, as the table says.", add_special_tokens=False)
    assert len(answer) > RESPONSE_LENGTH  # so the budget has to cut it
    server = ScriptedServerManager([scripted_turn([*answer, im_end])])
    config = make_config(response_length=RESPONSE_LENGTH, multi_turn={"format": "hermes"})
    loop = create_agent_loop(
        name,
        trainer_config=DictConfigWrap(config),
        server_manager=server,
        tokenizer=tok,
        processor=None,
    )
    out = await loop.run({"logprobs": True}, raw_prompt=QUESTION, uid="u", session_id=0)
    assert isinstance(out, AgentLoopOutput)
    assert out.prompt_ids == server.calls[0].prompt_ids
    assert 0 < len(out.response_ids) <= RESPONSE_LENGTH
    assert out.response_ids == answer[: len(out.response_ids)]
    assert len(out.response_mask) == len(out.response_ids)
    assert set(out.response_mask) <= {0, 1} and out.response_mask[0] == 1
    assert out.response_logprobs is not None
    assert len(out.response_logprobs) == len(out.response_ids)
    assert out.num_turns >= 2 and out.metrics.generate_sequences >= 0


# ---- tool parsers ---------------------------------------------------------------------

BROKEN_MARKUP = (
    '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>'
    "<|tool_call_begin|>calculator<|tool_call_argument_begin|>{oops"
    '<function=calculator><parameter=expression>18 *</function> {"name": }'
)


@pytest.mark.parametrize("name", sorted(ToolParser._registry))
async def test_every_tool_parser_leaves_plain_text_alone(name, tok):
    parser = ToolParser.get_tool_parser(name, tok)
    assert all(isinstance(t, int) for t in parser.stop_token_ids)
    text = "18 * 7 is 126. No tool is needed: {braces} and <angles> are just text."
    content, calls = await parser.extract_tool_calls(tok.encode(text, add_special_tokens=False))
    assert calls == [] and content.strip() == text


@pytest.mark.parametrize("name", sorted(ToolParser._registry))
async def test_every_tool_parser_survives_broken_call_markup(name, tok):
    parser = ToolParser.get_tool_parser(name, tok)
    ids = tok.encode(BROKEN_MARKUP, add_special_tokens=False)
    content, calls = await parser.extract_tool_calls(ids)  # verl's parsers log and go on
    assert isinstance(content, str)
    assert all(isinstance(c, FunctionCall) and c.name for c in calls)


# ---- scorers --------------------------------------------------------------------------

# one (right, wrong) answer to "72" per family of verl's table, in that family's format
ANSWERS = {
    "openai/gsm8k": ("so the total is 72.\n#### 72", "so the total is 71.\n#### 71"),
    **dict.fromkeys(scorers.MATH_SOURCES, ("the answer is $\\boxed{72}$", "$\\boxed{71}$")),
    **dict.fromkeys(scorers.DAPO_SOURCES, ("Answer: 72", "Answer: 71")),
    **dict.fromkeys(scorers.SEARCH_R1_SOURCES, ("<answer>72</answer>", "<answer>seventy</answer>")),
    "rolloutbus/arithmetic": ("18 * 4 = 72", "18 * 4 = 71"),
}
GROUND_TRUTH = {source: "72" for source in ANSWERS} | {
    source: {"target": ["72"]} for source in scorers.SEARCH_R1_SOURCES
}


def _score(result: float | dict) -> float:
    if isinstance(result, dict):
        assert isinstance(result["score"], int | float)
        return float(result["score"])
    assert isinstance(result, float)
    return result


def test_the_contract_covers_every_scorer_the_package_registers():
    package = {
        source
        for source, fn in scorers._registry.items()
        if getattr(fn, "__module__", "").startswith("rolloutbus.")  # not a test's own
    }
    assert package and package <= set(ANSWERS)


@pytest.mark.parametrize("source", sorted(ANSWERS))
def test_every_scorer_ranks_a_right_answer_above_a_wrong_one(source):
    right, wrong = ANSWERS[source]
    truth = GROUND_TRUTH[source]
    first = _score(scorers.default_compute_score(source, right, truth))
    assert _score(scorers.default_compute_score(source, right, truth)) == first
    assert first > _score(scorers.default_compute_score(source, wrong, truth))


def test_a_source_no_scorer_knows_raises_as_verl_does():
    not_ported = sorted(scorers._NOT_PORTED)[0]
    with pytest.raises(NotImplementedError, match="custom_reward_function"):
        scorers.default_compute_score(not_ported, "x", "72")
    if scorers.DEFAULT_REWARD not in scorers._registry:
        with pytest.raises(NotImplementedError, match="data_source='nobody/knows'"):
            scorers.default_compute_score("nobody/knows", "x", "72")


# ---- backends -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def replica_url():
    cfg = Config.model_validate({"replica_server": {"port": 0}, "model": {"name": "tiny-qwen3"}})
    with replica_in_thread(cfg) as replica:
        yield replica.url


async def _generate(url: str, backend_name: str, prompt_ids: list[int]):
    backend = BACKENDS[backend_name]()
    call = EngineCall(
        engine_request_id=f"contract-{backend_name}",
        prompt_ids=prompt_ids,
        sampling=TurnSamplingParams.model_validate({"temperature": 0.0, "logprobs": True}),
        max_tokens=8,
    )
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        response = await client.post(backend.path, json=backend.build_request(call))
    response.raise_for_status()
    return backend.parse_response(response.json())


def test_every_backend_gets_the_same_greedy_tokens_from_the_replica(replica_url, tok):
    text = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    prompt = tok.encode(text, add_special_tokens=False)
    outputs = {name: asyncio.run(_generate(replica_url, name, prompt)) for name in sorted(BACKENDS)}
    tokens = {name: out.token_ids for name, out in outputs.items()}
    first = next(iter(tokens.values()))
    assert 0 < len(first) <= 8
    assert all(t == first for t in tokens.values()), tokens
    for out in outputs.values():
        assert out.log_probs is not None and len(out.log_probs) == len(out.token_ids)
        assert all(lp <= 0.0 for lp in out.log_probs)
