"""One generate call sent straight to the HTTP transport (``streams/inference/replica_call.py``):
the body on the wire is the backend's request as JSON, the answer is parsed from the bytes,
and the transport's failures are still the retriable errors the fault table relies on.

The replica is an ``httpx.MockTransport`` TEST DOUBLE with a vLLM-shaped completions answer
(scripted token ids and logprobs); it records what it was sent. The default transport
(aiohttp's pool, which a generate call uses without an httpx request) is checked against
``WireReplica``, a TEST DOUBLE too: a real aiohttp server on 127.0.0.1 with the same scripted
answer, which records the raw requests and can compress its answer or cut it short.
"""

from __future__ import annotations

import gzip
import json
import random
from typing import Any

import httpx
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from rolloutbus.config import ReplicasConfig, RolloutConfig
from rolloutbus.schemas.inference import TurnSamplingParams
from rolloutbus.streams.inference.backends import EngineCall, backend_for
from rolloutbus.streams.inference.llm_client import LLMClient, ReplicaRequestError

URL = "http://vllm:8000"
ANSWER = {
    "choices": [
        {
            "text": "",
            "token_ids": [7, 8, 9],
            "logprobs": {"tokens": ["a", "b", "c"], "token_logprobs": [-0.5, -0.25, -1.0]},
            "finish_reason": "length",
            "weight_versions": [{"version": 3, "start": 0}],
        }
    ]
}


def _client(handler: Any, url: str = URL, **replicas: Any) -> LLMClient:
    """A client over ``handler`` (a MockTransport's); None: the default transport."""
    config = ReplicasConfig(urls=[url], **{"max_retries": 0, **replicas})
    return LLMClient(
        config,
        RolloutConfig(),
        registry=CollectorRegistry(),
        rng=random.Random(0),
        transport=None if handler is None else httpx.MockTransport(handler),
    )


class WireReplica:
    """TEST DOUBLE: a real HTTP server with ``ANSWER`` scripted (see the module doc)."""

    def __init__(self, answer: str = "plain"):
        self.answer = answer  # plain | gzip | cut
        self.requests: list[tuple[str, str | None, bytes]] = []  # path, content-type, body
        self._runner: web.AppRunner | None = None

    async def __aenter__(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(
            (request.path, request.headers.get("Content-Type"), await request.read())
        )
        body = json.dumps(ANSWER).encode()
        if self.answer == "gzip":
            return web.Response(body=gzip.compress(body), headers={"Content-Encoding": "gzip"})
        if self.answer == "cut":  # headers promise more bytes than come, then the socket closes
            response = web.StreamResponse(headers={"Content-Length": str(len(body))})
            await response.prepare(request)
            await response.write(body[:10])
            assert request.transport is not None
            request.transport.close()
            return response
        return web.Response(body=body, content_type="application/json")


def _without_engine_id(body: bytes) -> dict[str, Any]:
    sent = json.loads(body)
    sent.pop("request_id")  # a new uuid every call
    return dict(sent)


async def test_the_body_is_the_backends_request_and_the_answer_is_parsed():
    sent: list[httpx.Request] = []

    def replica(request: httpx.Request) -> httpx.Response:
        if request.url.path != "/v1/completions":
            return httpx.Response(200)  # health probes
        sent.append(request)
        return httpx.Response(200, json=ANSWER)

    async with _client(replica) as client:
        await client.check_health()
        out = await client.generate(
            "traj-1", prompt_ids=[1, 2, 3], sampling_params={"temperature": 0.5, "logprobs": True}
        )
    assert out.token_ids == [7, 8, 9]
    assert out.log_probs == [-0.5, -0.25, -1.0]
    assert out.extra_fields["replica_id"] == URL
    (request,) = sent
    assert request.method == "POST" and str(request.url) == URL + "/v1/completions"
    assert request.headers["content-type"] == "application/json"
    body = json.loads(request.content)
    engine_id = body["request_id"]
    call = EngineCall(
        engine_id, [1, 2, 3], TurnSamplingParams(temperature=0.5, logprobs=True), body["max_tokens"]
    )
    assert body == backend_for("vllm_completions").build_request(call)


@pytest.mark.parametrize(
    ("failure", "outcome"),
    [
        (httpx.ConnectError("refused"), "connection_error"),
        (httpx.ReadTimeout("slow"), "timeout"),
        (httpx.RemoteProtocolError("cut"), "connection_error"),
    ],
)
async def test_a_transport_failure_is_a_retriable_replica_error(failure, outcome):
    def replica(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/completions":
            raise failure
        return httpx.Response(200)

    async with _client(replica) as client:
        await client.check_health()
        with pytest.raises(ReplicaRequestError) as caught:
            await client.generate("traj-1", prompt_ids=[1], sampling_params={})
    assert caught.value.retriable and caught.value.outcome == outcome
    assert caught.value.replica == URL


async def test_an_unparseable_answer_is_a_bad_response_not_retried():
    def replica(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/completions":
            return httpx.Response(200, content=b"{not json")
        return httpx.Response(200)

    async with _client(replica) as client:
        await client.check_health()
        with pytest.raises(ReplicaRequestError) as caught:
            await client.generate("traj-1", prompt_ids=[1], sampling_params={})
    assert not caught.value.retriable and caught.value.outcome == "bad_response"


async def test_the_default_pool_sends_what_an_httpx_transport_sends():
    """aiohttp's pool, sent to without an httpx request: the same path, content type and
    body (but the fresh engine id) as through an httpx transport, and the same answer."""
    through_httpx: list[httpx.Request] = []

    def replica(request: httpx.Request) -> httpx.Response:
        through_httpx.append(request)
        return httpx.Response(200, json=ANSWER)

    params = {"temperature": 0.5, "logprobs": True}
    async with _client(replica) as client:
        expected = await client.generate("traj-1", prompt_ids=[1, 2, 3], sampling_params=params)
    wire = WireReplica()
    async with wire as url, _client(None, url) as client:
        out = await client.generate("traj-1", prompt_ids=[1, 2, 3], sampling_params=params)
    (request,) = through_httpx
    ((path, content_type, body),) = wire.requests
    assert (path, content_type) == (request.url.path, request.headers["content-type"])
    assert _without_engine_id(body) == _without_engine_id(request.content)
    assert (out.token_ids, out.log_probs, out.stop_reason) == (
        expected.token_ids,
        expected.log_probs,
        expected.stop_reason,
    )


async def test_a_compressed_answer_is_decoded_as_httpx_decodes_it():
    async with WireReplica("gzip") as url, _client(None, url) as client:
        out = await client.generate("traj-1", prompt_ids=[1], sampling_params={})
    assert out.token_ids == [7, 8, 9]


async def test_an_answer_cut_short_is_a_retriable_connection_error():
    async with WireReplica("cut") as url, _client(None, url) as client:
        with pytest.raises(ReplicaRequestError) as caught:
            await client.generate("traj-1", prompt_ids=[1], sampling_params={})
    assert caught.value.retriable and caught.value.outcome == "connection_error"
    assert caught.value.replica == url
