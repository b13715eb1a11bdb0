"""The generation routes, one path under three wire forms: parse and check the body, submit
it to the engine, answer in the route's form.

- ``POST /v1/completions``: vLLM's ``CompletionRequest`` (token ids or text; streamed by
  ``replica/streaming.py`` when asked)
- ``POST /inference/v1/generate``: vLLM's token-in/token-out ``GenerateRequest``
- ``POST /generate``: SGLang's
"""

from __future__ import annotations

import base64
import io
import time
import uuid
from typing import Any

import numpy as np
from aiohttp import web

from rolloutbus.replica.generation import (
    Engine,
    EngineSampling,
    GenerationRequest,
    GenerationResult,
)
from rolloutbus.replica.server.keys import ENGINE_KEY, METRICS_KEY
from rolloutbus.replica.server.validation import HTTPProblem, parse_body
from rolloutbus.replica.streaming import stream_completion
from rolloutbus.schemas.inference import (
    SglangGenerateRequest,
    SglangGenerateResponse,
    SglangMetaInfo,
    Usage,
    VllmCompletionChoice,
    VllmCompletionLogprobs,
    VllmCompletionRequest,
    VllmCompletionResponse,
    VllmGenerateChoice,
    VllmGenerateLogprob,
    VllmGenerateLogprobs,
    VllmGenerateRequest,
    VllmGenerateResponse,
    VllmTopLogprob,
    WeightVersionSpan,
)

__all__ = ["completions", "sglang_generate", "vllm_generate"]


# -- shared generation path -------------------------------------------------------------


async def _generate(request: web.Request, gen: GenerationRequest) -> GenerationResult:
    result = await request.app[ENGINE_KEY].submit(gen)
    request.app[METRICS_KEY].observe(result)
    return result


def _sampling(temperature: float, top_p: float, top_k: int) -> EngineSampling:
    return EngineSampling(temperature=temperature, top_p=top_p, top_k=top_k)


def _usage(result: GenerationResult) -> Usage:
    prompt, completion = len(result.prompt_ids), len(result.token_ids)
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


def _decode(engine: Engine, token_ids: list[int], skip_special: bool = True) -> str:
    if engine.tokenizer is None:
        return ""
    return engine.tokenizer.decode(token_ids, skip_special_tokens=skip_special)


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _check_model(engine: Engine, requested: str | None) -> None:
    if requested is not None and requested != engine.model_name:
        raise HTTPProblem(
            404,
            f"The model `{requested}` does not exist; this replica serves `{engine.model_name}`.",
            "model",
        )


def _max_tokens(engine: Engine, requested: int | None, prompt_len: int) -> int:
    if requested is not None:
        return requested
    room = engine.max_model_len - prompt_len
    if room < 1:
        raise HTTPProblem(
            400,
            f"prompt has {prompt_len} tokens; this model's maximum context length is "
            f"{engine.max_model_len}",
            "prompt",
        )
    return room


# -- POST /v1/completions -----------------------------------------------------------------


async def completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    body = await parse_body(request, VllmCompletionRequest)
    _check_model(engine, body.model)
    prompt_ids = _prompt_ids(engine, body.prompt)
    request_id = body.request_id or request.headers.get("X-Request-Id") or _new_id("cmpl")
    gen = _completion_generation(
        body, request_id, prompt_ids, _max_tokens(engine, body.max_tokens, len(prompt_ids))
    )
    if body.stream:
        return await stream_completion(request, engine, body, gen, request.app[METRICS_KEY].observe)
    result = await _generate(request, gen)
    return web.json_response(_completion_response(engine, body, request_id, result))


def _prompt_ids(engine: Engine, prompt: list[int] | str) -> list[int]:
    if isinstance(prompt, list):
        return prompt
    if engine.tokenizer is None:
        raise HTTPProblem(
            400, "field 'prompt': text prompts need a tokenizer; send token ids", "prompt"
        )
    if not prompt:
        raise HTTPProblem(400, "field 'prompt': must not be empty", "prompt")
    return engine.tokenizer.encode(prompt, add_special_tokens=False)


def _completion_generation(
    body: VllmCompletionRequest, request_id: str, prompt_ids: list[int], max_tokens: int
) -> GenerationRequest:
    return GenerationRequest(
        request_id=request_id,
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        sampling=_sampling(body.temperature, body.top_p, body.top_k),
        seed=body.seed,
        stop_token_ids=body.stop_token_ids or [],
        ignore_eos=body.ignore_eos,
        top_logprobs=body.logprobs or 0,
    )


def _completion_response(
    engine: Engine,
    body: VllmCompletionRequest,
    request_id: str,
    result: GenerationResult,
) -> dict[str, Any]:
    # Left out (not null) unless the request set return_weight_versions.
    versions: dict[str, Any] = (
        {"weight_versions": _version_spans(result)} if body.return_weight_versions else {}
    )
    choice = VllmCompletionChoice(
        index=0,
        text=_decode(engine, result.token_ids, body.skip_special_tokens),
        logprobs=_completion_logprobs(engine, body, result) if body.logprobs is not None else None,
        finish_reason=result.finish_reason,
        stop_reason=result.stop_reason,
        token_ids=result.token_ids if body.return_token_ids else None,
        prompt_token_ids=result.prompt_ids if body.return_token_ids else None,
        prompt_logprobs=None,
        routed_experts=_routed_experts(result),
        **versions,
    )
    return VllmCompletionResponse(
        id=request_id if request_id.startswith("cmpl") else f"cmpl-{request_id}",
        object="text_completion",
        created=int(time.time()),
        model=engine.model_name,
        choices=[choice],
        usage=_usage(result),
        system_fingerprint=None,
    ).to_json()


def _completion_logprobs(
    engine: Engine, body: VllmCompletionRequest, result: GenerationResult
) -> VllmCompletionLogprobs:
    as_ids = body.return_tokens_as_token_ids or engine.tokenizer is None

    def name(token_id: int) -> str:
        return f"token_id:{token_id}" if as_ids else engine.tokenizer.decode([token_id])

    tokens = [name(t) for t in result.token_ids]
    tops = result.top_logprobs or [
        {t: lp} for t, lp in zip(result.token_ids, result.logprobs, strict=True)
    ]
    offsets, offset = [], 0
    for token in tokens:  # offsets into the returned text, as vLLM reports them without echo
        offsets.append(offset)
        offset += 0 if as_ids else len(token)
    token_logprobs: list[float | None] = list(result.logprobs)
    return VllmCompletionLogprobs(
        tokens=tokens,
        token_logprobs=token_logprobs,
        top_logprobs=[{name(t): lp for t, lp in top.items()} for top in tops],
        text_offset=offsets,
    )


# -- POST /inference/v1/generate ------------------------------------------------------------


async def vllm_generate(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    body = await parse_body(request, VllmGenerateRequest)
    _check_model(engine, body.model)
    sp = body.sampling_params
    request_id = body.request_id or _new_id("gen")
    gen = GenerationRequest(
        request_id=request_id,
        prompt_ids=body.token_ids,
        max_tokens=_max_tokens(engine, sp.max_tokens, len(body.token_ids)),
        sampling=_sampling(sp.temperature, sp.top_p, sp.top_k),
        seed=sp.seed,
        stop_token_ids=sp.stop_token_ids or [],
        ignore_eos=sp.ignore_eos,
        top_logprobs=sp.logprobs or 0,
    )
    result = await _generate(request, gen)
    choice = VllmGenerateChoice(
        index=0,
        finish_reason=result.finish_reason,
        stop_reason=result.stop_reason,
        token_ids=result.token_ids,
        logprobs=_generate_logprobs(result) if sp.logprobs is not None else None,
        weight_versions=_version_spans(result),
        routed_experts=_routed_experts(result),
    )
    return web.json_response(
        VllmGenerateResponse(
            request_id=request_id,
            model=engine.model_name,
            created=int(time.time()),
            choices=[choice],
            usage=_usage(result),
            prompt_token_ids=None,
            prompt_logprobs=None,
        ).to_json()
    )


def _routed_experts(result: GenerationResult) -> str | None:
    """vLLM's wire form of routed experts: base64 of the ``.npy`` bytes of the array."""
    if result.routed_experts is None:
        return None
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(result.routed_experts, dtype=np.int16), allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _version_spans(result: GenerationResult) -> list[WeightVersionSpan]:
    return [
        WeightVersionSpan(version=span.version, start=span.start, end=span.end)
        for span in result.weight_versions
    ]


def _generate_logprobs(result: GenerationResult) -> VllmGenerateLogprobs:
    content = []
    for i, (token, logprob) in enumerate(zip(result.token_ids, result.logprobs, strict=True)):
        top = result.top_logprobs[i] if result.top_logprobs else {}
        content.append(
            VllmGenerateLogprob(
                token_id=token,
                logprob=logprob,
                top_logprobs=[VllmTopLogprob(token_id=t, logprob=lp) for t, lp in top.items()],
            )
        )
    return VllmGenerateLogprobs(content=content)


# -- POST /generate (SGLang) ------------------------------------------------------------------


async def sglang_generate(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    body = await parse_body(request, SglangGenerateRequest)
    sp = body.sampling_params
    rid = body.rid or uuid.uuid4().hex
    gen = GenerationRequest(
        request_id=rid,
        prompt_ids=body.input_ids,
        max_tokens=_max_tokens(engine, sp.max_new_tokens, len(body.input_ids)),
        sampling=_sampling(sp.temperature, sp.top_p, sp.top_k if sp.top_k != 0 else -1),
        seed=sp.sampling_seed,
        stop_token_ids=sp.stop_token_ids or [],
        ignore_eos=sp.ignore_eos,
        top_logprobs=body.top_logprobs_num if body.return_logprob else 0,
    )
    result = await _generate(request, gen)
    logprobs: dict[str, Any] = {}
    if body.return_logprob:
        logprobs = {
            "output_token_logprobs": [
                [lp, t, None] for t, lp in zip(result.token_ids, result.logprobs, strict=True)
            ],
            "input_token_logprobs": None,
        }
    meta = SglangMetaInfo(
        id=rid,
        finish_reason=_sglang_finish_reason(result),
        prompt_tokens=len(result.prompt_ids),
        completion_tokens=len(result.token_ids),
        cached_tokens=0,
        e2e_latency=result.timings.e2e_s,
        # SGLang reports one version per request: the one that sampled the last token.
        weight_version=(
            result.weight_versions[-1].version if result.weight_versions else engine.weight_version
        ),
        **logprobs,
    )
    response = SglangGenerateResponse(
        text=_decode(engine, result.token_ids), output_ids=result.token_ids, meta_info=meta
    )
    return web.json_response(response.to_json())


def _sglang_finish_reason(result: GenerationResult) -> dict[str, Any]:
    if result.finish_reason == "stop":
        return {"type": "stop", "matched": result.token_ids[-1] if result.token_ids else None}
    if result.finish_reason == "length":
        return {"type": "length", "length": len(result.token_ids)}
    return {"type": "abort", "message": "aborted"}
