"""Calls to a replica's HTTP API that several test areas make (replica control, pause
leases, weight sync): each asserts a 200 and returns the answer."""

from __future__ import annotations

import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import httpx

from rolloutbus.schemas.inference import TurnSamplingParams
from rolloutbus.streams.inference.backends import EngineCall, VllmCompletionsBackend

# a chat-formatted "What is 2+2?" in Qwen3's token ids
PROMPT = [151644, 872, 198, 3838, 374, 220, 17, 10, 17, 30, 151645, 198, 151644, 77091, 198]


async def ok(call: Awaitable[httpx.Response]) -> Any:
    """The JSON answer of a request that must succeed."""
    response = await call
    assert response.status_code == 200, response.text
    return response.json()


def reload_request(folder: Path) -> dict[str, Any]:
    """The ``/collective_rpc`` body that reloads the weights saved in ``folder``."""
    return {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}}


async def greedy_turn(http: httpx.AsyncClient, max_tokens: int, *, url: str = "") -> Any:
    """One greedy turn of ``PROMPT`` through the client's vLLM completions backend (request
    and parse), ``max_tokens`` long: EOS is ignored, since a random model may sample it at
    once and a test needs the length. ``url``: the replica, for a client without a base."""
    backend = VllmCompletionsBackend()
    body = backend.build_request(
        EngineCall(
            engine_request_id=f"t{time.monotonic_ns()}",
            prompt_ids=PROMPT,
            sampling=TurnSamplingParams(temperature=0.0, logprobs=True),
            max_tokens=max_tokens,
        )
    )
    body["ignore_eos"] = True
    return backend.parse_response(await ok(http.post(url + backend.path, json=body)))


def greedy_reference(model: Any, n: int, prompt: list[int] = PROMPT) -> list[int]:
    """The ``n`` tokens a greedy decode of ``prompt`` by ``model`` (a torch causal LM) gives,
    computed without the replica: what a replica serving these weights must answer."""
    import torch

    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]
