"""A turn's images from ``LLMClient.generate(image_data=...)`` to the engine, over real HTTP.

- vllm_generate sends them as vLLM's ``content_parts`` (``image_url`` parts, prompt order),
  and sends them again with each resumed piece of an aborted turn;
- vllm_completions and sglang refuse them with ``ImagesNotSupportedError`` naming the
  backend, before any request; videos and audio are refused on every backend;
- the embedded replica answers a generate request with images with a 400 naming
  ``content_parts`` (it serves text models), which the client turns into
  ``ImagesNotSupportedError``: an ``AgentLoopError``, so the session runner records a failed,
  non-retriable session with that reason.

vLLM's own ``GenerateRequest`` validates these bodies in
tests/contract/test_vllm_multimodal_contract.py.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from rolloutbus.config import Config, ReplicasConfig, RolloutConfig, with_overrides
from rolloutbus.errors import AgentLoopError
from rolloutbus.replica.server import replica_in_thread
from rolloutbus.schemas.agent_loop import AgentLoopOutput
from rolloutbus.schemas.inference import TurnSamplingParams, VllmGenerateRequest
from rolloutbus.schemas.prompts import GroupSamplingParams, PromptGroup
from rolloutbus.schemas.turns import SessionFailed
from rolloutbus.streams.agent_loop.base import AgentLoopBase
from rolloutbus.streams.agent_loop.registry import register
from rolloutbus.streams.inference.backends import (
    EngineCall,
    SglangGenerateBackend,
    VllmCompletionsBackend,
    VllmGenerateBackend,
)
from rolloutbus.streams.inference.llm_client import LLMClient
from rolloutbus.streams.inference.multimodal import (
    ImagesNotSupportedError,
    MediaNotSupportedError,
)
from rolloutbus.streams.sessions.runner import SessionContext, run_session

PNG = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAE"
    "hQGAhKmMIQAAAABJRU5ErkJggg=="
)
CAT = "https://example.com/cat.jpg"
# Qwen2-VL: <|vision_start|> <|image_pad|> <|vision_end|> around each image
PROMPT = [1, 151652, 151655, 151653, 2, 151652, 151655, 151653, 3]
SAMPLING = {"temperature": 1.0, "logprobs": True}


class RecordingVllm:
    """Test double of a vision-language vLLM's ``POST /inference/v1/generate``: a real VL
    vLLM cannot run here (no VL weights offline, no GPU). It records each request body and
    answers in vLLM's generate response shape; ``abort_first`` answers the first call with
    ``finish_reason: abort`` (an engine paused for a weight update)."""

    def __init__(self, *, abort_first: bool = False) -> None:
        self.requests: list[dict[str, Any]] = []
        self.abort_first = abort_first
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> RecordingVllm:
        app = web.Application()
        app.router.add_post("/inference/v1/generate", self._generate)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        aborted = self.abort_first and len(self.requests) == 1
        tokens = [7, 8] if aborted else [9]
        return web.json_response(
            {
                "request_id": body["request_id"],
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "abort" if aborted else "stop",
                        "token_ids": tokens,
                        "logprobs": {"content": [{"token_id": t, "logprob": -0.5} for t in tokens]},
                    }
                ],
            }
        )


def _client(urls: list[str], backend: str) -> LLMClient:
    replicas = ReplicasConfig(
        urls=urls, backend=backend, health_interval_s=60.0, abort_retry_delay_s=0.0
    )
    return LLMClient(
        replicas,
        RolloutConfig(response_length=16),
        registry=CollectorRegistry(),
        rng=random.Random(0),
    )


def _call(images: tuple[str, ...]) -> EngineCall:
    return EngineCall("e-1", PROMPT, TurnSamplingParams(), max_tokens=4, image_urls=images)


def test_vllm_generate_request_carries_the_images_as_content_parts_in_order():
    body = VllmGenerateBackend().build_request(_call((PNG, CAT)))
    assert body["content_parts"] == [
        {"type": "image_url", "url": PNG},
        {"type": "image_url", "url": CAT},
    ]
    assert body["token_ids"] == PROMPT
    assert VllmGenerateRequest.model_validate(body).content_parts == body["content_parts"]
    assert "content_parts" not in VllmGenerateBackend().build_request(_call(()))  # text turn


@pytest.mark.parametrize("backend", [VllmCompletionsBackend(), SglangGenerateBackend()])
def test_token_only_backends_refuse_a_call_with_images(backend):
    with pytest.raises(ImagesNotSupportedError, match=backend.name):
        backend.build_request(_call((PNG,)))


async def test_images_reach_vllm_and_are_resent_after_an_abort():
    vllm = await RecordingVllm(abort_first=True).start()
    try:
        async with _client([vllm.url], "vllm_generate") as client:
            out = await client.generate(
                "traj", prompt_ids=PROMPT, sampling_params=SAMPLING, image_data=[PNG, CAT]
            )
    finally:
        await vllm.stop()
    expected = [{"type": "image_url", "url": PNG}, {"type": "image_url", "url": CAT}]
    first, resumed = vllm.requests
    assert first["content_parts"] == expected
    # the resumed piece: prompt + the tokens so far, with the same images (their
    # placeholders are still in the prompt)
    assert resumed["token_ids"] == PROMPT + [7, 8]
    assert resumed["content_parts"] == expected
    assert out.token_ids == [7, 8, 9] and out.extra_fields["resumed_after_abort"] == 1


async def test_a_pil_image_and_a_verl_image_dict_travel_as_data_urls():
    from PIL import Image

    vllm = await RecordingVllm().start()
    try:
        async with _client([vllm.url], "vllm_generate") as client:
            await client.generate(
                "traj",
                prompt_ids=PROMPT,
                sampling_params=SAMPLING,
                image_data=[Image.new("RGB", (2, 2)), {"image": CAT}],
            )
    finally:
        await vllm.stop()
    parts = vllm.requests[0]["content_parts"]
    assert parts[0]["url"].startswith("data:image/png;base64,") and parts[1]["url"] == CAT


@pytest.mark.parametrize("backend", ["vllm_completions", "sglang"])
async def test_token_only_backends_refuse_images_before_any_request(backend):
    vllm = await RecordingVllm().start()  # would record any request that got through
    try:
        async with _client([vllm.url], backend) as client:
            with pytest.raises(ImagesNotSupportedError, match=repr(backend)):
                await client.generate(
                    "traj", prompt_ids=PROMPT, sampling_params=SAMPLING, image_data=[PNG]
                )
    finally:
        await vllm.stop()
    assert vllm.requests == []


@pytest.mark.parametrize("media", ["video_data", "audio_data"])
async def test_videos_and_audio_are_refused_by_name_before_any_request(media):
    vllm = await RecordingVllm().start()
    try:
        async with _client([vllm.url], "vllm_generate") as client:
            with pytest.raises(MediaNotSupportedError, match=media):
                await client.generate(
                    "traj", prompt_ids=PROMPT, sampling_params=SAMPLING, **{media: [b"x"]}
                )
    finally:
        await vllm.stop()
    assert vllm.requests == []


async def test_the_embedded_replica_refuses_images_instead_of_generating_from_text():
    """The embedded replica's real HTTP server; its engine is the scripted test double, so
    the test sees whether a generation was ever started (none may be)."""
    from rolloutbus.replica.scripted import ScriptedEngine, ScriptedTurn

    engine = ScriptedEngine(lambda prompt: ScriptedTurn([5], [-0.1], finish_reason="stop"))
    cfg = Config.model_validate({"replica_server": {"port": 0}})
    with replica_in_thread(cfg, engine) as handle:
        cfg = with_overrides(
            cfg, {"replicas.urls": [handle.url], "replicas.backend": "vllm_generate"}
        )
        async with LLMClient(cfg.replicas, cfg.rollout, registry=CollectorRegistry()) as client:
            with pytest.raises(ImagesNotSupportedError) as refused:
                await client.generate(
                    "traj", prompt_ids=PROMPT, sampling_params=SAMPLING, image_data=[PNG]
                )
            text = await client.generate("traj", prompt_ids=PROMPT, sampling_params=SAMPLING)
    assert "content_parts" in str(refused.value) and "text-only" in str(refused.value)
    assert handle.url in str(refused.value)
    # an AgentLoopError: the session runner records it as a failed, non-retriable session
    assert isinstance(refused.value, AgentLoopError)
    assert len(engine.calls) == 1 and text.token_ids == [5]  # only the text turn ran


class ImageTurnLoop(AgentLoopBase):
    """A loop that sends one turn with the row's image, as a VL loop does after rendering
    its prompt (no VL processor exists offline, so the prompt ids are given)."""

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        await self.server_manager.generate(
            self.trajectory_request_id(kwargs),
            prompt_ids=PROMPT,
            sampling_params=sampling_params,
            image_data=[PNG],
        )
        raise AssertionError("generate() must refuse the image")


async def test_a_session_whose_backend_refuses_images_fails_with_that_reason():
    """The session runner records the refusal as a failed session (a failed trajectory),
    not retriable, with the reason; no request reached the replica."""
    register("image_turn_test")(ImageTurnLoop)
    vllm = await RecordingVllm().start()
    group = PromptGroup(
        uid="mm1",
        row={"prompt": [{"role": "user", "content": "<image>"}], "agent_name": "image_turn_test"},
        n=1,
        sampling_params=GroupSamplingParams(),
    )
    events: list[Any] = []

    async def emit(event: Any) -> None:
        events.append(event)

    try:
        async with _client([vllm.url], "vllm_completions") as client:
            ctx = SessionContext(config=Config(), tokenizer=None, llm_client=client)
            terminal = await run_session(ctx, group, 0, "a1", emit)
    finally:
        await vllm.stop()
    assert isinstance(terminal, SessionFailed), terminal
    assert "'vllm_completions' takes token ids only" in terminal.error
    assert terminal.retriable is False
    assert vllm.requests == []
