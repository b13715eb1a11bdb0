"""Stop sequences on the gateway (``streams/gateway/stops.py``): Anthropic's
``stop_sequences`` and OpenAI's chat ``stop``.

The replica is the embedded replica's HTTP server with the scripted engine (a TEST DOUBLE:
scripted token ids and logprobs, no model), called by the real LLM client, which streams
the turn; the gateway finds the stop string in the streamed tokens and cuts the request.
Checked, plain and streamed: the turn ends at the token completing the stop string (logged
as sampled: ids, logprobs, mask 1), the text ends before it, ``stop_reason`` is
``stop_sequence`` with the string matched; a stop string spelled over two tokens; no match
is ``end_turn`` as before; the next request's history (the text without the stop string)
extends the logged tokens in the same segment. With the real Anthropic SDK over Kafka
(the gateway in a thread): the same, streamed and plain.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import pytest

from rolloutbus.config import Config
from rolloutbus.replica.scripted import ScriptedEngine, ScriptedTurn
from rolloutbus.replica.server import replica_in_thread
from rolloutbus.schemas.turns import Generation
from rolloutbus.streams.gateway.anthropic import MessageEvents, MessagesRequest, message_response
from rolloutbus.streams.gateway.session import GatewaySession
from rolloutbus.streams.gateway.stops import StopWatch, cut_at_stop, partial_stop_end
from rolloutbus.streams.gateway.streaming import ReplyText
from rolloutbus.streams.inference.llm_client import LLMClient
from tests.builders import make_group_started
from tests.gateway.contexts import gateway_context
from tests.gateway.processes import gateway_config, gateway_stack

REPLY = "The sea is wide. END of the poem, and more words after it."
QUESTION = [{"role": "user", "content": "Write a short poem about the sea."}]


class _Log:
    """A session's events in a list (no broker)."""

    def __init__(self) -> None:
        self.events: list = []

    async def emit(self, event) -> None:
        self.events.append(event)


def _scripted(tok, replies: list[str]) -> tuple[ScriptedEngine, list[ScriptedTurn]]:
    """The scripted engine (a test double) sampling ``replies`` in order, each ended by
    ``<|im_end|>``, each token's logprob distinct."""
    end = tok.convert_tokens_to_ids("<|im_end|>")
    turns = []
    for reply in replies:
        ids = [*tok.encode(reply, add_special_tokens=False), end]
        turns.append(ScriptedTurn(ids, [-0.01 * (i + 1) for i in range(len(ids))]))
    engine = ScriptedEngine(turns, tokenizer=tok, eos_token_ids=frozenset({end}))
    return engine, turns


@dataclass
class Stack:
    engine: ScriptedEngine
    turns: list[ScriptedTurn]
    session: GatewaySession
    log: _Log


@contextlib.asynccontextmanager
async def _stack(tok, replies: list[str]) -> AsyncIterator[Stack]:
    """A gateway session over the real LLM client and the scripted replica's server."""
    engine, turns = _scripted(tok, replies)
    cfg = Config.model_validate({"replica_server": {"port": 0}})
    with replica_in_thread(cfg, engine) as replica:
        client_cfg = Config.model_validate(
            {"model": {"name": "tiny-qwen3"}, "replicas": {"urls": [replica.url]}}
        )
        async with LLMClient(client_cfg.replicas, client_cfg.rollout) as client:
            log = _Log()
            ctx = gateway_context(tok, client_cfg, client, log.emit)
            group = make_group_started("g1", attempt="ga", row={}, sampling_params={})
            session = GatewaySession(ctx, group, 0)
            await session.begin()
            yield Stack(engine, turns, session, log)


@pytest.fixture
async def stack(tok) -> AsyncIterator[Stack]:
    async with _stack(tok, [REPLY, "Waves."]) as made:
        yield made


def _stop_index(tok, token_ids: list[int], stop: str) -> int:
    """How many of ``token_ids`` it takes for their text to hold ``stop``."""
    for n in range(1, len(token_ids) + 1):
        if stop in tok.decode(token_ids[:n], skip_special_tokens=False):
            return n
    raise AssertionError(f"{stop!r} not in the tokens")


def _generations(stack: Any) -> list[Generation]:
    return [e for e in stack.log.events if isinstance(e, Generation)]


async def _ask(stack: Any, history: list[dict], **fields: Any) -> Any:
    request = MessagesRequest(model="policy", max_tokens=64, messages=history, **fields)
    assert request.unsupported() is None
    return await stack.session.chat(request.chat_messages(), None, 64, stop=request.stop_sequences)


async def test_a_reply_ends_at_its_stop_sequence_and_logs_the_tokens_sampled_to_it(stack, tok):
    result = await _ask(stack, QUESTION, stop_sequences=["nothing like it", "END"])
    sampled = stack.turns[0]
    kept = _stop_index(tok, sampled.token_ids, "END")
    assert kept < len(sampled.token_ids) - 1  # the script went on after it
    assert result.token_ids == sampled.token_ids[:kept]
    assert result.logprobs == pytest.approx(sampled.logprobs[:kept])
    message = message_response(result, "policy")
    assert message["stop_reason"] == "stop_sequence" and message["stop_sequence"] == "END"
    assert message["content"] == [{"type": "text", "text": "The sea is wide."}]
    [generation] = _generations(stack)
    assert generation.token_ids == sampled.token_ids[:kept]
    assert generation.extra_fields["stop_sequence"] == "END"
    [output] = stack.session.outputs()
    assert output.response_ids == sampled.token_ids[:kept]
    assert output.response_mask == [1] * kept


async def test_a_stop_string_spelled_over_two_tokens(stack, tok):
    ids = tok.encode(REPLY, add_special_tokens=False)
    first, second = tok.decode(ids[2:3]), tok.decode(ids[3:4])
    stop = first[-2:] + second[:2]  # the end of one token and the start of the next
    assert stop not in first and stop not in second
    result = await _ask(stack, QUESTION, stop_sequences=[stop])
    assert result.token_ids == ids[:4] and result.stop_sequence == stop
    assert result.reply.content == cut_at_stop(tok.decode(ids[:4]), stop)
    assert message_response(result, "policy")["stop_reason"] == "stop_sequence"


async def test_no_stop_sequence_sampled_is_end_turn_as_before(stack):
    result = await _ask(stack, QUESTION, stop_sequences=["never sampled"])
    assert result.token_ids == stack.turns[0].token_ids  # the whole turn, its stop token too
    message = message_response(result, "policy")
    assert message["stop_reason"] == "end_turn" and message["stop_sequence"] is None
    assert message["content"][0]["text"] == REPLY


async def test_the_next_request_extends_the_turn_cut_at_its_stop_sequence(stack, tok):
    first = await _ask(stack, QUESTION, stop_sequences=["END"])
    text = message_response(first, "policy")["content"][0]["text"]
    history = [*QUESTION, {"role": "assistant", "content": text}]
    history.append({"role": "user", "content": "Another."})
    retried = await _ask(stack, QUESTION, stop_sequences=["END"])  # a retry: from the log
    assert retried.outcome == "repeated" and retried.stop_sequence == "END"
    assert retried.reply.content == text
    second = await _ask(stack, history, stop_sequences=["END"])
    assert second.prompt_ids[: len(first.prompt_ids) + len(first.token_ids)] == (
        first.prompt_ids + first.token_ids
    )
    assert len(stack.session.transcript.segments) == 1 and len(_generations(stack)) == 2
    assert message_response(second, "policy")["stop_reason"] == "end_turn"


async def test_streamed_the_text_stops_before_the_stop_sequence(stack, tok):
    text = ReplyText(tok, "hermes", ["END"])
    wire = MessageEvents("policy")
    sent = [*wire.opening()]

    async def on_tokens(token_ids: list[int]) -> None:
        sent.extend(wire.text(text.add(token_ids)))

    request = MessagesRequest(
        model="policy", max_tokens=64, messages=QUESTION, stop_sequences=["END"]
    )
    result = await stack.session.chat(
        request.chat_messages(), None, 64, on_tokens, stop=request.stop_sequences
    )
    sent += wire.closing(result, text.rest(result.reply.content))
    bodies = [json.loads(e.decode().split("\n", 2)[1].removeprefix("data: ")) for e in sent]
    streamed = "".join(b["delta"]["text"] for b in bodies if b["type"] == "content_block_delta")
    assert streamed == "The sea is wide."
    [final] = [b for b in bodies if b["type"] == "message_delta"]
    assert final["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}


def test_the_stop_watch_and_the_streamed_text_token_by_token(tok):
    ids = tok.encode(REPLY, add_special_tokens=False)
    watch = StopWatch(tok, ["END", "sea is"])
    kept = [watch.scan([token]) for token in ids]
    found = next(i for i, k in enumerate(kept) if k is not None)
    assert watch.matched == "sea is" and "sea is" in tok.decode(ids[: found + 1])
    assert "sea is" not in tok.decode(ids[:found])
    # a many-token piece: only the tokens up to the completing one are kept
    assert StopWatch(tok, ["END"]).scan(ids) == _stop_index(tok, ids, "END")
    text = ReplyText(tok, "hermes", ["END"])
    shown = "".join(text.add([token]) for token in ids)
    assert shown == "The sea is wide."
    assert partial_stop_end("wide. EN", ["END"]) == "wide. "
    assert partial_stop_end("a END b", ["b", "END"]) == "a "


def test_stop_strings_refused_where_the_gateway_cannot_find_them(tok):
    from rolloutbus.streams.gateway.wire import ChatCompletionRequest, CompletionRequest

    chat = ChatCompletionRequest(messages=QUESTION, stop="END")
    assert chat.unsupported() is None and chat.stop_strings() == ["END"]
    problem = CompletionRequest(prompt="x", stop=["END"]).unsupported()
    assert problem is not None and "chat completions" in problem


def test_anthropic_sdk_stop_sequences_plain_and_streamed(kafka_bootstrap, tok):
    """The real Anthropic SDK, the gateway in a thread, the scripted engine (a test double)
    behind the embedded replica's server: a plain call and a streamed one that extends it."""
    engine, turns = _scripted(tok, [REPLY, "Waves END here."])
    make_config = functools.partial(gateway_config, kafka_bootstrap, topic_prefix="gwstop")
    with gateway_stack(engine, make_config) as (_, running):
        body = {"n": 1, "sampling_params": {"temperature": 1.0, "seed": 7}}
        opened = httpx.post(f"{running.url}/v1/sessions", json=body, timeout=60)
        [session] = opened.json()["sessions"]
        root = f"{running.url}/sessions/{session['id']}"
        with anthropic.Anthropic(base_url=root, api_key="x", max_retries=0) as client:
            plain = client.messages.create(
                model="policy", max_tokens=64, messages=QUESTION, stop_sequences=["END"]
            )
            echoed = {"role": "assistant", "content": [b.model_dump() for b in plain.content]}
            history = [*QUESTION, echoed, {"role": "user", "content": "Another."}]
            request = {"model": "policy", "max_tokens": 64, "messages": history}
            with client.messages.stream(**request, stop_sequences=["END"]) as stream:
                streamed = "".join(stream.text_stream)
                final = stream.get_final_message()
    assert plain.stop_reason == "stop_sequence" and plain.stop_sequence == "END"
    assert plain.content[0].text == "The sea is wide."
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "END"
    assert streamed == final.content[0].text == "Waves"
    first, second = (call.prompt_ids for call in engine.calls)
    kept = _stop_index(tok, turns[0].token_ids, "END")
    assert second[: len(first) + kept] == first + turns[0].token_ids[:kept]
