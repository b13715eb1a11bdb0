"""The replica's HTTP server: vLLM's and SGLang's token-in/token-out subset over an engine.

Endpoints:
- ``POST /v1/completions`` (vLLM ``CompletionRequest`` with ``prompt`` as token ids)
- ``POST /inference/v1/generate`` (vLLM's token-in/token-out ``GenerateRequest``)
- ``POST /generate`` (SGLang)
- ``GET /health``, ``GET /v1/models``, ``GET /metrics`` (Prometheus, ``rolloutbus_replica_*``)
- vLLM's RL control surface (what ``vllm serve`` offers with ``VLLM_SERVER_DEV_MODE=1``):
  ``POST /pause?mode=abort|wait|keep``, ``POST /resume``, ``GET /is_paused``,
  ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}``
  and ``POST /update_weight_version {"new_version": ...}``; plus a lease on a pause
  (``/pause?lease_s=``, renewed by pausing again in the same mode: see ``pause_gate``), and
  ``/health`` says whether the replica is paused, since when, and its weights' label

Requests and responses are the wire models of ``rolloutbus.schemas.inference``, the same
ones the LLM client builds and reads. A client mistake is an HTTP 400 whose JSON
``error.message`` names the field: an unknown field, an invalid value, or a value the engine
cannot honour (``n > 1``, ``stream``, stop strings, images...), so a client never
silently gets something other than it asked for. An engine failure is a 500; a dead engine
makes ``/health`` answer 503.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import logging
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from pydantic import Field, ValidationError

from rolloutbus.config import Config
from rolloutbus.errors import ReplicaError
from rolloutbus.metrics import exposition
from rolloutbus.replica.generation import (
    MAX_TOP_LOGPROBS,
    Engine,
    EngineNotPausedError,
    EngineSampling,
    GenerationRequest,
    GenerationResult,
    RequestRejectedError,
    WeightsRejectedError,
)
from rolloutbus.replica.pause_gate import PAUSE_MODES, watch_pause_lease
from rolloutbus.runtime import serve_until_signalled
from rolloutbus.schemas.inference import (
    SglangGenerateRequest,
    SglangGenerateResponse,
    SglangMetaInfo,
    UpdateWeightVersionRequest,
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
    VllmSamplingFields,
    VllmTopLogprob,
    WeightVersionSpan,
    WireModel,
)

__all__ = [
    "ReplicaHandle",
    "build_app",
    "replica_in_thread",
    "serve_replica",
    "start_replica",
    "validate_request_body",
]

log = logging.getLogger(__name__)

METRIC_PREFIX = "rolloutbus_replica"
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# seconds; CPU decoding: a 16-token tiny-model reply takes ~0.05 s, a 512-token SmolLM2 one ~60 s
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
# seconds; a prefill on CPU: ~10 ms for a short prompt, seconds behind a long queue
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # rows per decode step

ENGINE_KEY = web.AppKey("engine", Engine)
METRICS_KEY: web.AppKey[_RequestMetrics] = web.AppKey("metrics")
REGISTRY_KEY = web.AppKey("registry", CollectorRegistry)
CREATED_KEY = web.AppKey("created", int)


# The collective_rpc methods the embedded replica runs (vLLM's worker has many more).
RPC_METHODS = ("reload_weights",)


class CollectiveRpcRequest(WireModel):
    """vLLM's dev-mode ``POST /collective_rpc`` body (its ``serve/dev/rpc/api_router``)."""

    method: str
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout: float | None = None  # seconds; accepted, unused: a reload takes well under one


# -- errors -----------------------------------------------------------------------------


class HTTPProblem(Exception):
    """An error answer with a vLLM-style JSON body."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def response(self) -> web.Response:
        kind = {400: "BadRequestError", 404: "NotFoundError", 409: "ConflictError"}.get(
            self.status, "InternalServerError"
        )
        body = {
            "error": {
                "message": self.message,
                "type": kind,
                "param": self.param,
                "code": self.status,
            }
        }
        return web.json_response(body, status=self.status)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _problems_as_json(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except HTTPProblem as problem:
        return problem.response()
    except (RequestRejectedError, WeightsRejectedError) as exc:
        return HTTPProblem(400, str(exc)).response()
    except EngineNotPausedError as exc:
        return HTTPProblem(409, str(exc)).response()
    except ReplicaError as exc:
        log.error("%s %s failed: %s", request.method, request.path, exc)
        return HTTPProblem(500, str(exc)).response()


Body = TypeVar("Body", bound=WireModel)
GenerateBody = VllmCompletionRequest | VllmGenerateRequest | SglangGenerateRequest


async def _parse(request: web.Request, model: type[Body]) -> Body:
    try:
        raw = await request.json()
    except json.JSONDecodeError as exc:
        raise HTTPProblem(400, f"request body is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise HTTPProblem(400, f"request body must be a JSON object, got {type(raw).__name__}")
    return validate_request_body(model, raw)


def validate_request_body(model: type[Body], raw: dict[str, Any]) -> Body:
    """A request body as this replica accepts it, or an ``HTTPProblem`` (400) naming the field.

    As vLLM does, a field the wire model does not declare is ignored with a warning that
    names it (vLLM clients send fields such as ``user`` or ``stream_options``); a declared
    field with a bad value, or a value the engine cannot honour, is refused.
    """
    try:
        body = model.model_validate(raw)
    except ValidationError as exc:
        unknown = _unknown_fields(exc)
        if unknown is None:
            message, param = _describe_validation_error(exc)
            raise HTTPProblem(400, message, param) from exc
        log.warning("ignoring request fields this replica does not know: %s", ", ".join(unknown))
        body = model.model_validate(raw, extra="ignore")
    if isinstance(body, GenerateBody):
        _refuse_unsupported(body)
    return body


def _unknown_fields(exc: ValidationError) -> list[str] | None:
    """The undeclared fields, when they are the only thing wrong with a body; else None."""
    errors = exc.errors()
    if not errors or any(e["type"] != "extra_forbidden" for e in errors):
        return None
    return [".".join(str(part) for part in e["loc"]) for e in errors]


def _refuse_unsupported(body: GenerateBody) -> None:
    """Values the engine cannot honour: one sample, no streaming, stop token ids only."""
    # /v1/completions carries its sampling fields at the top level; the others nest them.
    sampling = body if isinstance(body, VllmCompletionRequest) else body.sampling_params
    at = "" if sampling is body else "sampling_params."
    _only(f"{at}n", sampling.n, 1, "; send n requests")
    _only("stream", body.stream, False)
    if sampling.stop:
        raise HTTPProblem(
            400,
            "stop strings are not supported by the embedded replica; use stop_token_ids",
            f"{at}stop",
        )
    if isinstance(sampling, VllmSamplingFields):
        _only(f"{at}prompt_logprobs", sampling.prompt_logprobs, None)
        _at_most(f"{at}logprobs", sampling.logprobs, MAX_TOP_LOGPROBS)
    if isinstance(body, VllmCompletionRequest):
        _only("best_of", body.best_of, 1)
        _only("echo", body.echo, False)
        _only("use_beam_search", body.use_beam_search, False)
    if isinstance(body, SglangGenerateRequest):
        _at_most("top_logprobs_num", body.top_logprobs_num, MAX_TOP_LOGPROBS)
    if isinstance(body, VllmGenerateRequest) and body.content_parts:
        # ignoring them would sample from the text alone, as if the images had been seen
        raise HTTPProblem(
            400,
            f"field 'content_parts': the embedded replica serves text-only models and cannot "
            f"read the request's {len(body.content_parts)} image/video/audio part(s); serve "
            "a vision-language model with vLLM for multimodal rows",
            "content_parts",
        )


def _only(field: str, value: Any, honoured: Any, hint: str = "") -> None:
    if value not in (None, honoured):
        raise HTTPProblem(
            400, f"{field}={value!r} is not supported by the embedded replica{hint}", field
        )


def _at_most(field: str, value: int | None, limit: int) -> None:
    if value is not None and value > limit:
        raise HTTPProblem(
            400,
            f"field '{field}': at most {limit} alternatives per token (vLLM's --max-logprobs "
            f"default), got {value}",
            field,
        )


def _describe_validation_error(exc: ValidationError) -> tuple[str, str | None]:
    """('field 'x': problem; ...', first field name) for an HTTP 400 body."""
    parts, first = [], None
    for err in exc.errors():
        loc = _drop_union_tags(err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        parts.append(f"field '{loc}': {message}" if loc else message)
        first = first or loc or None
    return "; ".join(dict.fromkeys(parts)), first


def _drop_union_tags(loc: tuple[Any, ...]) -> str:
    # pydantic adds the union member ("list[int]") to the location; the client never wrote it.
    keep = [str(p) for p in loc if not (isinstance(p, str) and ("[" in p or p in {"str", "int"}))]
    return ".".join(keep)


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


# -- metrics ----------------------------------------------------------------------------


class _EngineCollector:
    """Engine-side gauges, counters and the batch-size histogram, read at scrape time."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self):
        stats, model = self.engine.stats, [self.engine.model_name]
        yield _gauge("requests_running", "Requests in the decode batch.", stats.running, model)
        yield _gauge("requests_waiting", "Requests queued for a batch slot.", stats.waiting, model)
        yield _counter("prompt_tokens", "Prefilled prompt tokens.", stats.prompt_tokens, model)
        yield _counter("generation_tokens", "Sampled tokens.", stats.generation_tokens, model)
        yield _counter(
            "num_preemptions",
            "Preemptions (always 0: the engine never preempts).",
            stats.preemptions,
            model,
        )
        yield _counter("decode_steps", "Decode steps run.", stats.steps, model)
        gate = self.engine.pause_gate
        yield _gauge("paused", "1 while paused (POST /pause), else 0.", int(gate.is_paused), model)
        yield _counter(
            "pause_lease_expiries",
            "Pauses ended by their lease: the weight sync that paused stopped renewing it.",
            gate.lease_expiries,
            model,
        )
        # dict() copies under the GIL: the decode thread may add a key meanwhile.
        yield self._batch_histogram(dict(stats.batch_sizes), model)

    @staticmethod
    def _batch_histogram(sizes: dict[int, int], model: list[str]) -> HistogramMetricFamily:
        family = HistogramMetricFamily(
            f"{METRIC_PREFIX}_batch_size", "Rows per decode step.", labels=["model_name"]
        )
        buckets = [
            (str(float(b)), sum(n for s, n in sizes.items() if s <= b)) for b in BATCH_BUCKETS
        ]
        buckets.append(("+Inf", sum(sizes.values())))
        family.add_metric(model, buckets, sum_value=float(sum(s * n for s, n in sizes.items())))
        return family


def _gauge(name: str, doc: str, value: float, labels: list[str]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(f"{METRIC_PREFIX}_{name}", doc, labels=["model_name"])
    family.add_metric(labels, value)
    return family


def _counter(name: str, doc: str, value: float, labels: list[str]) -> CounterMetricFamily:
    family = CounterMetricFamily(f"{METRIC_PREFIX}_{name}", doc, labels=["model_name"])
    family.add_metric(labels, value)
    return family


class _RequestMetrics:
    """Per-request metrics, observed when a request finishes."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        p = METRIC_PREFIX
        self.success = Counter(
            f"{p}_request_success",
            "Finished requests.",
            ["model_name", "finished_reason"],
            registry=registry,
        )
        self.errors = Counter(
            f"{p}_request_errors",
            "Requests answered with an HTTP error.",
            ["model_name", "code"],
            registry=registry,
        )
        self.e2e = Histogram(
            f"{p}_e2e_request_latency_seconds",
            "Submit to last token.",
            ["model_name"],
            buckets=E2E_BUCKETS,
            registry=registry,
        )
        self.ttft = Histogram(
            f"{p}_time_to_first_token_seconds",
            "Submit to first token.",
            ["model_name"],
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.queue = Histogram(
            f"{p}_request_queue_time_seconds",
            "Submit to prefill.",
            ["model_name"],
            buckets=TTFT_BUCKETS,
            registry=registry,
        )

    def observe(self, result: GenerationResult) -> None:
        m = self.model_name
        self.success.labels(m, result.finish_reason).inc()
        self.e2e.labels(m).observe(result.timings.e2e_s)
        self.ttft.labels(m).observe(result.timings.ttft_s)
        self.queue.labels(m).observe(result.timings.queue_s)


@web.middleware
async def _count_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    response = await handler(request)
    if response.status >= 400 and request.path != "/health":
        request.app[METRICS_KEY].errors.labels(
            request.app[ENGINE_KEY].model_name, str(response.status)
        ).inc()
    return response


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


# -- POST /v1/completions -----------------------------------------------------------------


async def completions(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    body = await _parse(request, VllmCompletionRequest)
    _check_model(engine, body.model)
    prompt_ids = _prompt_ids(engine, body.prompt)
    request_id = body.request_id or request.headers.get("X-Request-Id") or _new_id("cmpl")
    gen = _completion_generation(
        body, request_id, prompt_ids, _max_tokens(engine, body.max_tokens, len(prompt_ids))
    )
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
    body = await _parse(request, VllmGenerateRequest)
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
    body = await _parse(request, SglangGenerateRequest)
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


# -- GET endpoints ----------------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    """200 while the engine runs (vLLM answers an empty 200); the body says more: whether it
    is paused, since when (seconds since the epoch) and under what lease, and the label of
    the weights it serves, so a client needs no second call to judge it."""
    engine = request.app[ENGINE_KEY]
    if not engine.healthy:
        return web.json_response({"status": "unhealthy"}, status=503)
    return web.json_response({"status": "ok", **_pause_state(engine)})


def _pause_state(engine: Engine) -> dict[str, Any]:
    gate = engine.pause_gate
    return {
        "is_paused": gate.is_paused,
        "paused_since": gate.paused_since,
        "pause_lease_s": gate.lease_s,
        "weight_version": str(engine.weight_version),
    }


async def models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    entry = {
        "id": engine.model_name,
        "object": "model",
        "created": request.app[CREATED_KEY],
        "owned_by": engine.owned_by,
        "root": engine.model_name,
        "parent": None,
        "max_model_len": engine.max_model_len,
    }
    return web.json_response({"object": "list", "data": [entry]})


# -- RL control surface (vLLM dev mode) --------------------------------------------------


async def update_weight_version(request: web.Request) -> web.Response:
    """Label the weights: every token sampled from now on carries ``new_version``."""
    body = await _parse(request, UpdateWeightVersionRequest)
    engine = request.app[ENGINE_KEY]
    engine.weight_version = body.new_version
    engine.pause_gate.labelled()  # the weights a reload brought now have their label
    # vLLM answers {"success", "new_version"}; "weight_version" is this replica's older key.
    return web.json_response(
        {"success": True, "new_version": body.new_version, "weight_version": body.new_version}
    )


async def weight_info(request: web.Request) -> web.Response:
    """vLLM's ``GET /weight_info``: the label of the served weights, as a string. The weight
    sync compares it with what it applied, so a replica restarted between two health probes
    (back on its initial label) is synced again."""
    return web.json_response({"weight_version": str(request.app[ENGINE_KEY].weight_version)})


async def pause(request: web.Request) -> web.Response:
    """vLLM's ``POST /pause?mode=abort|wait|keep``: answers once the mode's work is done.

    ``lease_s`` (ours): the pause ends by itself that many seconds after this call unless
    renewed; a pause in the mode the replica is already paused in only renews the lease
    (at once, even during a reload). The answer names the lease, so a caller that gets
    none back (vLLM) knows nobody will end its pause but itself.
    """
    engine = request.app[ENGINE_KEY]
    mode = request.query.get("mode", "abort")
    if mode not in PAUSE_MODES:
        raise HTTPProblem(
            400, f"query 'mode': must be one of {', '.join(PAUSE_MODES)}; got {mode!r}", "mode"
        )
    lease_s = _lease_seconds(request.query.get("lease_s"))
    # clear_cache is accepted and ignored: the engine keeps no prefix cache across requests.
    if lease_s is None or not engine.pause_gate.renew(mode, lease_s):
        await engine.pause(mode, lease_s)  # narrowed to PauseMode by the check above
        if lease_s is not None:
            log.info("paused (mode %s) under a lease of %g s", mode, lease_s)
    lease = {} if lease_s is None else _pause_state(engine)  # else vLLM's answer, as is
    return web.json_response({"status": "paused", **lease})


def _lease_seconds(raw: str | None) -> float | None:
    if raw is None:
        return None
    try:
        lease_s = float(raw)
    except ValueError:
        lease_s = float("nan")
    if not 0 < lease_s < float("inf"):
        raise HTTPProblem(
            400, f"query 'lease_s': must be a positive number of seconds; got {raw!r}", "lease_s"
        )
    return lease_s


async def resume(request: web.Request) -> web.Response:
    await request.app[ENGINE_KEY].resume()
    return web.json_response({"status": "resumed"})


async def is_paused(request: web.Request) -> web.Response:
    return web.json_response({"is_paused": request.app[ENGINE_KEY].is_paused})


async def collective_rpc(request: web.Request) -> web.Response:
    """vLLM's dev-mode ``POST /collective_rpc``; only ``reload_weights`` is served.

    The answer has vLLM's shape: one result per worker (one here), ``null`` for a reload.
    """
    body = await _parse(request, CollectiveRpcRequest)
    if body.method not in RPC_METHODS:
        raise HTTPProblem(
            400,
            f"field 'method': {body.method!r} is not a collective_rpc method of the embedded "
            f"replica; it serves {', '.join(RPC_METHODS)}",
            "method",
        )
    kwargs = dict(body.kwargs)
    weights_path = kwargs.pop("weights_path", None)
    if body.args:  # vLLM's positional form: reload_weights(weights_iterator, weights_path)
        raise HTTPProblem(
            400, "field 'args': pass weights_path in kwargs, not as a positional arg", "args"
        )
    if not isinstance(weights_path, str) or not weights_path:
        raise HTTPProblem(
            400,
            "field 'kwargs.weights_path': reload_weights needs the folder of the new weights",
            "kwargs.weights_path",
        )
    if str(kwargs.pop("is_checkpoint_format", True)).lower() not in ("true", "1"):
        raise HTTPProblem(
            400,
            "field 'kwargs.is_checkpoint_format': only checkpoint-format folders are loaded",
            "kwargs.is_checkpoint_format",
        )
    if kwargs:
        raise HTTPProblem(
            400,
            f"field 'kwargs': reload_weights takes weights_path only; got {sorted(kwargs)}",
            "kwargs",
        )
    await request.app[ENGINE_KEY].reload_weights(weights_path)
    return web.json_response({"results": [None]})


async def metrics(request: web.Request) -> web.Response:
    text = exposition(request.app[REGISTRY_KEY])  # without _created series
    return web.Response(body=text, headers={"Content-Type": PROMETHEUS_CONTENT_TYPE})


# -- app and lifecycle ------------------------------------------------------------------------


def build_app(engine: Engine) -> web.Application:
    """The aiohttp app over a started engine; metrics live in the app's own registry."""
    app = web.Application(
        middlewares=[_count_errors, _problems_as_json], client_max_size=64 * 1024 * 1024
    )
    registry = CollectorRegistry()
    registry.register(_EngineCollector(engine))
    app[ENGINE_KEY] = engine
    app[METRICS_KEY] = _RequestMetrics(registry, engine.model_name)
    app[REGISTRY_KEY] = registry
    app[CREATED_KEY] = int(time.time())
    app.cleanup_ctx.append(_pause_lease_watchdog)
    app.router.add_post("/update_weight_version", update_weight_version)
    app.router.add_post("/pause", pause)
    app.router.add_post("/resume", resume)
    app.router.add_get("/is_paused", is_paused)
    app.router.add_get("/weight_info", weight_info)
    app.router.add_post("/collective_rpc", collective_rpc)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/inference/v1/generate", vllm_generate)
    app.router.add_post("/generate", sglang_generate)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    return app


async def _pause_lease_watchdog(app: web.Application) -> AsyncIterator[None]:
    """While the app runs: a pause whose lease ran out is resumed (``pause_gate``)."""
    task = asyncio.create_task(
        watch_pause_lease(app[ENGINE_KEY]), name="rolloutbus-replica-pause-lease"
    )
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


@dataclass
class ReplicaHandle:
    """A running replica in this process: its base URL, engine, and ``await stop()``."""

    url: str
    engine: Engine
    runner: web.AppRunner

    async def stop(self) -> None:
        await self.runner.cleanup()
        await asyncio.to_thread(self.engine.stop)

    async def __aenter__(self) -> ReplicaHandle:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()


async def start_replica(cfg: Config, engine: Engine | None = None) -> ReplicaHandle:
    """Start a replica on ``cfg.replica_server.host:port`` (port 0: any free port).

    Without ``engine``, loads ``cfg.model`` into a ``DecodeEngine``.
    """
    if engine is None:
        from rolloutbus.replica.engine import DecodeEngine

        engine = await asyncio.to_thread(DecodeEngine.from_config, cfg)
    engine.start()
    # handler_cancellation: a client that hangs up aborts its request in the engine.
    runner = web.AppRunner(build_app(engine), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.replica_server.host, cfg.replica_server.port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        engine.stop()
        raise ReplicaError(
            f"cannot listen on {cfg.replica_server.host}:{cfg.replica_server.port}: {exc}"
        ) from exc
    host, port = runner.addresses[0][:2]
    return ReplicaHandle(url=f"http://{host}:{port}", engine=engine, runner=runner)


@contextlib.contextmanager
def replica_in_thread(cfg: Config, engine: Engine | None = None) -> Iterator[ReplicaHandle]:
    """A replica on its own event loop in a background thread, for synchronous callers
    (tests, scripts): ``with replica_in_thread(cfg) as handle: httpx.get(handle.url)``."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="rolloutbus-replica-http", daemon=True)
    thread.start()
    try:
        handle = asyncio.run_coroutine_threadsafe(start_replica(cfg, engine), loop).result()
        try:
            yield handle
        finally:
            asyncio.run_coroutine_threadsafe(handle.stop(), loop).result()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def serve_replica(cfg: Config) -> None:
    """Serve until SIGTERM or SIGINT (blocking); for ``rolloutbus replica serve``."""
    if not logging.getLogger().handlers:
        logging.basicConfig(
            stream=sys.stderr,
            level=logging.INFO,
            format="%(asctime)s %(name)s %(levelname)s %(message)s",
        )
    asyncio.run(
        serve_until_signalled(
            "replica",
            lambda: start_replica(cfg),
            lambda handle: log.info(
                "replica ready on %s model=%s", handle.url, handle.engine.model_name
            ),
        )
    )
