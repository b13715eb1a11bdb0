"""What a client may send the replica, and what it gets back when it may not: a request body
as the engine can honour it, or an ``HTTPProblem`` answered as vLLM's JSON error (a 400 that
names the field, a 404, a 409 or a 500)."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web
from pydantic import ValidationError

from rolloutbus.errors import ReplicaError
from rolloutbus.replica.generation import (
    MAX_TOP_LOGPROBS,
    EngineNotPausedError,
    RequestRejectedError,
    WeightsRejectedError,
)
from rolloutbus.schemas.inference import (
    SglangGenerateRequest,
    VllmCompletionRequest,
    VllmGenerateRequest,
    VllmSamplingFields,
    WireModel,
)

__all__ = [
    "Body",
    "HTTPProblem",
    "Handler",
    "parse_body",
    "problems_as_json",
    "validate_request_body",
]

log = logging.getLogger(__name__)


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
async def problems_as_json(request: web.Request, handler: Handler) -> web.StreamResponse:
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


async def parse_body(request: web.Request, model: type[Body]) -> Body:
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
    if not isinstance(body, VllmCompletionRequest):  # /v1/completions streams (streaming.py)
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
