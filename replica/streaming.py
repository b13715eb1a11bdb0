"""``POST /v1/completions`` with ``stream: true``: the tokens sent as the engine samples them.

The wire is vLLM's: server-sent events, one ``data: {completion chunk}`` per batch of new
tokens, then ``data: [DONE]``. Each chunk's one choice carries the new tokens' ids
(``token_ids``, with ``return_token_ids``), text, logprobs (with ``logprobs``) and, with
``return_weight_versions``, the versions that sampled them; the last one carries the
finish reason. A session worker logs a turn in flight from this stream
(``streams/sessions/chunking.py``).

The decode engine hands each token over from its thread as it samples it; an engine that
cannot (the scripted test double) sends its whole answer as one chunk. A client that goes
away cancels the request: the engine drops it at its next step.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from aiohttp import web

from rolloutbus.replica.engine import DecodeEngine
from rolloutbus.replica.generation import GenerationRequest, GenerationResult
from rolloutbus.schemas.inference import (
    VllmCompletionChoice,
    VllmCompletionLogprobs,
    VllmCompletionRequest,
    WeightVersionSpan,
)

__all__ = ["stream_completion"]

TICK_S = 0.005  # seconds between sends: a batch of the tokens sampled meanwhile

# (token id, logprob, weight version) as the engine sampled it
Sampled = tuple[int, float, "int | str"]


async def stream_completion(
    request: web.Request,
    engine: Any,
    body: VllmCompletionRequest,
    gen: GenerationRequest,
    observe: Any,
) -> web.StreamResponse:
    """Answer ``gen`` as an event stream; ``observe`` records the finished result."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    queue: asyncio.Queue[Sampled] = asyncio.Queue()
    loop = asyncio.get_running_loop()

    def on_token(token: int, logprob: float, version: int | str) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, (token, logprob, version))

    streaming = isinstance(engine, DecodeEngine)
    task = asyncio.ensure_future(engine.submit(gen, on_token) if streaming else engine.submit(gen))
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=TICK_S)  # the engine thread fills the queue
            batch = _drain(queue)
            if batch and not task.done():
                await _send(response, _chunk(engine, body, gen.request_id, batch, None))
            elif batch:  # the final event sends them with the finish reason
                _requeue(queue, batch)
        result: GenerationResult = task.result()
    finally:
        task.cancel()  # the client went away: the engine drops the request
    observe(result)
    await asyncio.sleep(0)  # tokens handed over just before the end reach the queue
    sent = len(result.token_ids) - len(_drain(queue)) if streaming else 0
    rest = list(
        zip(result.token_ids[sent:], result.logprobs[sent:], _versions(result)[sent:], strict=True)
    )
    final = _chunk(engine, body, gen.request_id, rest, result)
    await _send(response, final)
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _requeue(queue: asyncio.Queue[Sampled], batch: list[Sampled]) -> None:
    rest = _drain(queue)
    for item in batch + rest:
        queue.put_nowait(item)


def _drain(queue: asyncio.Queue[Sampled]) -> list[Sampled]:
    out = []
    while not queue.empty():
        out.append(queue.get_nowait())
    return out


def _versions(result: GenerationResult) -> list[int | str]:
    out: list[int | str] = [0] * len(result.token_ids)
    for span in result.weight_versions:
        out[span.start : span.end] = [span.version] * (span.end - span.start)
    return out


def _chunk(
    engine: Any,
    body: VllmCompletionRequest,
    request_id: str,
    sampled: list[Sampled],
    result: GenerationResult | None,
) -> dict[str, Any]:
    tokens = [t for t, _, _ in sampled]
    tokenizer = engine.tokenizer
    text = tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer and tokens else ""
    choice = VllmCompletionChoice(
        index=0,
        text=text,
        logprobs=_logprobs(sampled) if body.logprobs is not None else None,
        finish_reason=None if result is None else result.finish_reason,
        stop_reason=None if result is None else result.stop_reason,
        token_ids=tokens if body.return_token_ids else None,
        weight_versions=_spans(sampled) if body.return_weight_versions else None,
    )
    return {
        "id": request_id if request_id.startswith("cmpl") else f"cmpl-{request_id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": engine.model_name,
        "choices": [choice.to_json()],
    }


def _logprobs(sampled: list[Sampled]) -> VllmCompletionLogprobs:
    return VllmCompletionLogprobs(
        tokens=[f"token_id:{t}" for t, _, _ in sampled],
        token_logprobs=[lp for _, lp, _ in sampled],
        top_logprobs=None,
        text_offset=[0] * len(sampled),
    )


def _spans(sampled: list[Sampled]) -> list[WeightVersionSpan]:
    runs: list[list[Any]] = []  # [version, start, end]
    for i, (_, _, version) in enumerate(sampled):
        if runs and runs[-1][0] == version:
            runs[-1][2] = i + 1
        else:
            runs.append([version, i, i + 1])
    return [WeightVersionSpan(version=v, start=s, end=e) for v, s, e in runs]


async def _send(response: web.StreamResponse, chunk: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
