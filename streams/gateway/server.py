"""``rolloutbus gateway``: the OpenAI-compatible HTTP service (aiohttp).

Endpoints (docs/gateway.md):

- ``POST /v1/sessions``: open a group of n sessions; each comes with its ``base_url``
- ``POST /sessions/{id}/v1/chat/completions`` and ``.../v1/completions`` (an OpenAI SDK's
  ``base_url`` is ``.../sessions/{id}/v1``); ``/v1/chat/completions`` and
  ``/v1/completions`` with the session in the ``X-Session-Id`` header
- ``POST /sessions/{id}/v1/messages`` and ``/v1/messages``: Anthropic's Messages API (an
  Anthropic SDK's ``base_url`` is ``.../sessions/{id}``), through the same session
- ``POST /v1/sessions/{id}/finish`` (reward) and ``POST /v1/sessions/{id}/abort``
- ``GET /v1/sessions/{id}``, ``GET /v1/models``, ``GET /health``, ``GET /metrics``

Errors are OpenAI's error bodies (Anthropic's on the Messages routes): 400 for a request
the gateway cannot answer as asked (naming the field or message), 404 an unknown session,
409 a settled one, 413 an event over ``kafka.max_message_bytes``, 502/503 a replica or the
turn log unavailable (an SDK retries those; the retry is aligned with the log, so no turn is
logged twice).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ValidationError

from rolloutbus.errors import (
    AgentLoopError,
    BrokerError,
    NoReplicaAvailableError,
    ReplicaError,
    RolloutBusError,
)
from rolloutbus.metrics import exposition
from rolloutbus.streams.gateway.anthropic import (
    MessageEvents,
    MessagesRequest,
    anthropic_error,
    message_response,
    opens_thinking,
)
from rolloutbus.streams.gateway.metrics import GatewayMetrics
from rolloutbus.streams.gateway.responses import ChatChunks, chat_completion, text_completion
from rolloutbus.streams.gateway.session import GatewaySession, SessionClosedError
from rolloutbus.streams.gateway.sessions import GatewaySessions, SessionNotFoundError
from rolloutbus.streams.gateway.streaming import ReplyStream, ReplyText, SseWire
from rolloutbus.streams.gateway.wire import (
    IGNORED_HEADER,
    SESSION_HEADER,
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    FinishRequest,
    OpenedSession,
    OpenedSessions,
    OpenSessionsRequest,
    SessionStatus,
    error_body,
)
from rolloutbus.streams.sessions.turn_log import RecordTooLargeError

log = logging.getLogger(__name__)

SESSIONS_KEY = web.AppKey("sessions", GatewaySessions)
METRICS_KEY = web.AppKey("metrics", GatewayMetrics)
PUBLIC_URL_KEY = web.AppKey("public_url", str)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class BadRequestError(AgentLoopError, ValueError):
    """A request body the gateway cannot answer as asked."""


# -- sessions -----------------------------------------------------------------------------


async def open_sessions(request: web.Request) -> web.Response:
    body = await _body(request, OpenSessionsRequest)
    sessions = await request.app[SESSIONS_KEY].open_group(body)
    request.app[METRICS_KEY].sessions.labels(event="opened").inc(len(sessions))
    base = request.app[PUBLIC_URL_KEY] or f"{request.scheme}://{request.host}"
    opened = OpenedSessions(
        uid=sessions[0].group.uid,
        n=len(sessions),
        sessions=[
            OpenedSession(session_id=s.session_id, id=s.key, base_url=f"{base}/sessions/{s.key}/v1")
            for s in sessions
        ],
    )
    return _json(opened, status=201)


async def session_status(request: web.Request) -> web.Response:
    session = request.app[SESSIONS_KEY].held(request.match_info["session"])
    status = SessionStatus(
        id=session.key,
        uid=session.group.uid,
        session_id=session.session_id,
        attempt=session.attempt,
        state=session.state,
        segments=len(session.transcript.segments),
        turns=len(session.transcript.turns()),
        tokens=sum(len(seg.tokens) for seg in session.transcript.segments.values()),
    )
    return _json(status)


async def finish_session(request: web.Request) -> web.Response:
    body = await _body(request, FinishRequest)
    terminal = await _settle(request, lambda s: s.finish(body.reward, body.extra_fields))
    request.app[METRICS_KEY].sessions.labels(event="finished").inc()
    rewards = [o.reward_score for o in terminal.outputs]
    return web.json_response({"id": request.match_info["session"], "rewards": rewards})


async def abort_session(request: web.Request) -> web.Response:
    body = await _body(request, AbortRequest)
    await _settle(request, lambda s: s.abort(body.error))
    request.app[METRICS_KEY].sessions.labels(event="aborted").inc()
    return web.json_response({"id": request.match_info["session"], "state": "failed"})


async def _settle(request: web.Request, end: Callable[[GatewaySession], Awaitable[Any]]) -> Any:
    session = await _session(request)
    async with session.lock:
        try:
            return await end(session)
        finally:
            request.app[SESSIONS_KEY].settle(session)


# -- completions --------------------------------------------------------------------------


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await _body(request, ChatCompletionRequest)
    _check_supported(body)
    session = await _session(request)
    model = body.model or _model_name(request)
    headers = _ignored_header(body, session)
    if body.stream:
        wire = ChatChunks(model, session.ctx.tokenizer, body)
        return await _streamed(
            request,
            session,
            headers,
            wire,
            body.messages,
            body.tools or None,
            body.turn_max_tokens(),
            stop=body.stop_strings(),
        )
    async with session.lock:
        try:
            result = await session.chat(
                body.messages, body.tools or None, body.turn_max_tokens(), stop=body.stop_strings()
            )
        finally:
            _after_call(request, session)
    completion = chat_completion(
        result,
        model=model,
        tokenizer=session.ctx.tokenizer,
        logprobs=bool(body.logprobs),
        token_ids=body.return_token_ids,
    )
    request.app[METRICS_KEY].turns.labels(outcome=result.outcome).inc()
    return _json(completion, headers=headers)


async def completions(request: web.Request) -> web.Response:
    body = await _body(request, CompletionRequest)
    _check_supported(body)
    if body.stream:
        raise BadRequestError("stream is supported on chat completions only")
    session = await _session(request)
    async with session.lock:
        try:
            result = await session.complete(body.single_prompt(), body.turn_max_tokens())
        finally:
            _after_call(request, session)
    completion = text_completion(
        result,
        model=body.model or _model_name(request),
        tokenizer=session.ctx.tokenizer,
        logprobs=body.logprobs is not None and body.logprobs is not False,
        token_ids=body.return_token_ids,
    )
    request.app[METRICS_KEY].turns.labels(outcome=result.outcome).inc()
    return _json(completion, headers=_ignored_header(body, session))


async def messages(request: web.Request) -> web.StreamResponse:
    """Anthropic's Messages API, through the session the chat endpoint uses."""
    body = await _body(request, MessagesRequest)
    _check_supported(body)
    chat_messages, tools = body.chat_messages(), body.chat_tools()
    session = await _session(request)
    refused = body.thinking_refused(getattr(session.ctx.tokenizer, "chat_template", None))
    if refused:
        raise BadRequestError(refused)
    model = body.model or _model_name(request)
    headers = _ignored_header(body, session)
    tokenizer = session.ctx.tokenizer
    if body.stream:
        wire = MessageEvents(model, body.shows_thinking, tokenizer)
        return await _streamed(
            request,
            session,
            headers,
            wire,
            chat_messages,
            tools,
            body.max_tokens,
            wire.prompt,
            body.stop_sequences,
        )
    async with session.lock:
        try:
            result = await session.chat(
                chat_messages, tools, body.max_tokens, stop=body.stop_sequences
            )
        finally:
            _after_call(request, session)
    request.app[METRICS_KEY].turns.labels(outcome=result.outcome).inc()
    opened = body.shows_thinking and opens_thinking(tokenizer, result.prompt_ids)
    answer = message_response(result, model, body.shows_thinking, opened)
    return web.json_response(answer, headers=headers)


async def _streamed(
    request: web.Request,
    session: GatewaySession,
    headers: dict[str, str],
    wire: SseWire,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    max_tokens: int | None,
    on_prompt: Callable[[list[int]], None] | None = None,
    stop: list[str] | None = None,
) -> web.StreamResponse:
    """A turn streamed as it is sampled (``streaming.py``). An error before the first event
    is an HTTP error; after it, an error event ends the stream."""
    rollout = session.ctx.config.rollout
    text = ReplyText(session.ctx.tokenizer, rollout.multi_turn.format, stop)
    stream = ReplyStream(request, headers, wire, text)
    async with session.lock:
        try:
            result = await session.chat(
                messages, tools, max_tokens, stream.on_tokens, on_prompt, stop
            )
        except (RolloutBusError, ValueError) as exc:
            if not stream.started:
                raise
            status, _ = _status_of(exc)
            log.warning("%s %s: %s (after the stream started)", request.method, request.path, exc)
            return await stream.fail(str(exc), status)
        finally:
            _after_call(request, session)
    request.app[METRICS_KEY].turns.labels(outcome=result.outcome).inc()
    return await stream.finish(result)


def _check_supported(body: ChatCompletionRequest | CompletionRequest | MessagesRequest) -> None:
    problem = body.unsupported()
    if problem:
        raise BadRequestError(problem)


def _after_call(request: web.Request, session: GatewaySession) -> None:
    session.touch()
    request.app[SESSIONS_KEY].settle(session)  # a broken one's next call resumes from the log


def _ignored_header(
    body: ChatCompletionRequest | CompletionRequest | MessagesRequest, session: GatewaySession
) -> dict[str, str]:
    ignored = body.ignored_sampling(session.sampling)
    if not ignored:
        return {}
    log.debug("session %s: request sampling fields not applied: %s", session.key, ignored)
    return {IGNORED_HEADER: ",".join(ignored)}


# -- misc ---------------------------------------------------------------------------------


async def models(request: web.Request) -> web.Response:
    name = _model_name(request)
    return web.json_response(
        {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "rolloutbus"}]}
    )


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", **request.app[SESSIONS_KEY].status()})


async def metrics(request: web.Request) -> web.Response:
    request.app[METRICS_KEY].open_sessions.set(len(request.app[SESSIONS_KEY].open))
    return web.Response(body=exposition(), headers={"Content-Type": "text/plain; version=0.0.4"})


def _model_name(request: web.Request) -> str:
    cfg = request.app[SESSIONS_KEY].ctx.config
    return cfg.replicas.model or cfg.model.name


async def _session(request: web.Request) -> GatewaySession:
    key = request.match_info.get("session") or request.headers.get(SESSION_HEADER)
    if not key:
        raise BadRequestError(
            f"no session: use /sessions/{{id}}/v1/... (the base_url POST /v1/sessions "
            f"returns) or the {SESSION_HEADER} header"
        )
    session = await request.app[SESSIONS_KEY].get(key)
    if session.state == "open" and session.key in request.app[SESSIONS_KEY].open:
        return session
    raise SessionClosedError(f"session {key} has {session.state}")


async def _body(request: web.Request, model: type[Any]) -> Any:
    try:
        return model.model_validate(await request.json())
    except json.JSONDecodeError as exc:
        raise BadRequestError(f"the body is not JSON: {exc}") from exc
    except ValidationError as exc:
        raise BadRequestError(_validation_message(exc)) from exc


def _validation_message(exc: ValidationError) -> str:
    problems = [f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()]
    return "; ".join(problems)


def _json(
    model: BaseModel, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.json_response(
        model.model_dump(mode="json", exclude_none=True), status=status, headers=headers
    )


# -- errors -------------------------------------------------------------------------------

_STATUS: list[tuple[type[BaseException], int, str]] = [
    (SessionNotFoundError, 404, "not_found_error"),
    (SessionClosedError, 409, "conflict_error"),
    (RecordTooLargeError, 413, "invalid_request_error"),
    (NoReplicaAvailableError, 503, "service_unavailable"),
    (ReplicaError, 502, "bad_gateway"),
    (BrokerError, 503, "service_unavailable"),
    (AgentLoopError, 400, "invalid_request_error"),
    (ValueError, 400, "invalid_request_error"),
]


def _status_of(exc: BaseException) -> tuple[int, str]:
    for kind, status, name in _STATUS:
        if isinstance(exc, kind):
            return status, name
    return 500, "internal_error"


@web.middleware
async def errors_as_api_bodies(request: web.Request, handler: Handler) -> web.StreamResponse:
    route = (
        request.match_info.route.resource.canonical if request.match_info.route.resource else "-"
    )
    try:
        response = await handler(request)
    except web.HTTPException as exc:
        _count(request, route, exc.status)
        return _error(request, exc.reason, "invalid_request_error", exc.status)
    except (RolloutBusError, ValueError) as exc:
        status, kind = _status_of(exc)
        if status >= 500:
            log.warning("%s %s: %s", request.method, request.path, exc)
        _count(request, route, status)
        return _error(request, str(exc), kind, status)
    except Exception as exc:
        log.exception("%s %s failed", request.method, request.path)
        _count(request, route, 500)
        return _error(request, f"{type(exc).__name__}: {exc}", "internal_error", 500)
    _count(request, route, response.status)
    return response


def _error(request: web.Request, message: str, kind: str, status: int) -> web.Response:
    """The error in the shape of the API the route speaks."""
    if request.path.endswith("/v1/messages"):
        return web.json_response(anthropic_error(message, status), status=status)
    return web.json_response(error_body(message, kind), status=status)


def _count(request: web.Request, route: str, status: int) -> None:
    request.app[METRICS_KEY].requests.labels(route=route, status=str(status)).inc()


def build_app(sessions: GatewaySessions, public_url: str | None = None) -> web.Application:
    app = web.Application(
        middlewares=[errors_as_api_bodies],
        client_max_size=sessions.ctx.config.gateway.max_request_bytes,
    )
    app[SESSIONS_KEY] = sessions
    app[METRICS_KEY] = GatewayMetrics()
    app[PUBLIC_URL_KEY] = (public_url or "").rstrip("/")
    app.router.add_post("/v1/sessions", open_sessions)
    app.router.add_get("/v1/sessions/{session}", session_status)
    app.router.add_post("/v1/sessions/{session}/finish", finish_session)
    app.router.add_post("/v1/sessions/{session}/abort", abort_session)
    for prefix in ("/sessions/{session}/v1", "/v1"):
        app.router.add_post(f"{prefix}/chat/completions", chat_completions)
        app.router.add_post(f"{prefix}/completions", completions)
        app.router.add_post(f"{prefix}/messages", messages)
        app.router.add_get(f"{prefix}/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


async def expire_idle_forever(sessions: GatewaySessions, timeout_s: float) -> None:
    """Fail idle sessions every few seconds, so their groups can be released."""
    interval = min(IDLE_SWEEP_S, timeout_s / 4)
    metrics = GatewayMetrics()
    while True:
        await asyncio.sleep(interval)
        try:
            expired = await sessions.expire_idle(timeout_s)
        except RolloutBusError as exc:
            log.warning("idle sessions could not be failed yet: %s", exc)
            continue
        for key in expired:
            log.info("session %s failed: no call for %g s", key, timeout_s)
        metrics.sessions.labels(event="idle").inc(len(expired))


IDLE_SWEEP_S = 5.0  # seconds between idle checks; a session's deadline is minutes
