"""One generate call to one replica over HTTP (``ReplicaCaller``): the backend's request
sent, the answer parsed, and every failure translated, at one boundary, into a
``ReplicaRequestError``. ``llm_client.LLMClient`` routes, retries and resumes around it.

A generate call goes straight to aiohttp's pool (``AiohttpTransport.post``: no httpx request
or response is built), with its body encoded and decoded by orjson: httpx's client layer
(URL merging, cookies, redirects, auth), its request and response objects and stdlib JSON
cost more CPU per turn than the pool itself (issue 28). Any other transport (a test's
``httpx.MockTransport``, httpx's own pool) gets an httpx request. Streams and health probes
still go through the httpx client.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import orjson
from pydantic import ValidationError

from rolloutbus.errors import ReplicaError
from rolloutbus.schemas.agent_loop import TokenOutput
from rolloutbus.streams.inference.aiohttp_transport import AiohttpTransport
from rolloutbus.streams.inference.backends import Backend, EngineCall, error_message
from rolloutbus.streams.inference.client_metrics import ClientMetrics
from rolloutbus.streams.inference.multimodal import ImagesNotSupportedError

__all__ = ["DeltaSink", "ReplicaCaller", "ReplicaRequestError"]

JSON_HEADERS = {"content-type": "application/json"}  # a generate body, as httpx's json= sets

# takes each streamed event's new tokens (a TokenOutput whose stop_reason is None until the last)
DeltaSink = Callable[[TokenOutput], Awaitable[None]]


class ReplicaRequestError(ReplicaError):
    """One generate call to one replica failed; says which replica and whether to retry."""

    def __init__(
        self,
        replica: str,
        message: str,
        *,
        outcome: str,
        retriable: bool,
        status_code: int | None = None,
    ) -> None:
        super().__init__(f"replica {replica}: {message}")
        self.replica = replica
        self.outcome = outcome  # the requests_total label: timeout, server_error, ...
        self.retriable = retriable
        self.status_code = status_code


class ReplicaCaller:
    """One generate call to one replica over HTTP: the backend's request, the answer
    parsed, and every failure translated here, at one boundary, into a
    ``ReplicaRequestError`` that names the replica and says whether to try another."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        backend: Backend,
        metrics: ClientMetrics,
        timeout_s: float,
        transport: httpx.AsyncBaseTransport,
    ):
        self._http, self._backend, self._metrics = http, backend, metrics
        self._timeout_s = timeout_s  # seconds for the whole call, not per read
        # a generate call goes straight to the client's transport: httpx's client layer
        # (merging, cookies, redirects, auth) cost more CPU per turn than the pool under it
        self._transport = transport
        self._timeouts = http.timeout.as_dict()

    async def call(self, replica: str, call: EngineCall) -> TokenOutput:
        body = self._backend.build_request(call)
        started = time.monotonic()
        status, content = await self._post(replica, orjson.dumps(body))
        if status >= 400:
            self._raise_for_status(replica, httpx.Response(status, content=content), call)
        try:
            output = self._backend.parse_response(orjson.loads(content))
        except (ValueError, ValidationError) as exc:
            raise self._unparseable(replica, "response", exc, status) from exc
        return self._finished(replica, call, output, started)

    def _finished(
        self, replica: str, call: EngineCall, output: TokenOutput, started: float
    ) -> TokenOutput:
        """Count a call that answered (its latency, its outcome) and stamp its output."""
        self._metrics.latency.labels(replica).observe(time.monotonic() - started)
        self._count(replica, "aborted" if output.stop_reason == "aborted" else "completed")
        output.extra_fields.update(replica_id=replica, engine_request_id=call.engine_request_id)
        return output

    async def _post(self, replica: str, content: bytes) -> tuple[int, bytes]:
        """POST a JSON body to the replica's endpoint: its answer's status and bytes."""
        url = replica + self._backend.path
        async with self._transport_errors(replica, f"POST {self._backend.path}", "failed"):
            if isinstance(self._transport, AiohttpTransport):  # the default: aiohttp, directly
                answer = await self._transport.post(url, content, JSON_HEADERS, self._timeouts)
            else:
                answer = await self._post_via_httpx(url, content)
        return answer

    async def _post_via_httpx(self, url: str, content: bytes) -> tuple[int, bytes]:
        """Through any other httpx transport (a test's MockTransport, httpx's own pool)."""
        request = httpx.Request(
            "POST",
            url,
            headers=JSON_HEADERS,
            content=content,
            extensions={"timeout": self._timeouts},
        )
        response = await self._transport.handle_async_request(request)
        response.request = request
        try:
            await response.aread()
        finally:
            await response.aclose()
        return response.status_code, response.content

    @contextlib.asynccontextmanager
    async def _transport_errors(self, replica: str, what: str, cut: str) -> AsyncIterator[None]:
        """The block within the request timeout (total, not per read); a timeout or a
        transport error is a retriable ``ReplicaRequestError``, counted by outcome."""
        try:
            async with asyncio.timeout(self._timeout_s):
                yield
        except (TimeoutError, httpx.TransportError) as exc:  # httpx's timeouts included
            if isinstance(exc, (TimeoutError, httpx.TimeoutException)):
                outcome, message = "timeout", f"{what} timed out after {self._timeout_s} s"
            else:
                outcome, message = "connection_error", f"{what} {cut}: {type(exc).__name__}: {exc}"
            self._count(replica, outcome)
            raise ReplicaRequestError(replica, message, outcome=outcome, retriable=True) from exc

    async def stream(self, replica: str, call: EngineCall, on_delta: DeltaSink) -> TokenOutput:
        """One streamed call: ``on_delta`` gets each event's new tokens as they come; returns
        the last event (its finish reason and versions). A stream cut before its last event
        is a retriable ``connection_error``, as a failed request is."""
        backend: Any = self._backend
        body = backend.build_stream_request(call)
        started = time.monotonic()
        async with self._transport_errors(replica, f"stream of {self._backend.path}", "cut"):
            last = await self._read_stream(replica, call, body, on_delta)
        return self._finished(replica, call, last, started)

    async def _read_stream(
        self, replica: str, call: EngineCall, body: dict[str, Any], on_delta: DeltaSink
    ) -> TokenOutput:
        backend: Any = self._backend
        async with self._http.stream("POST", replica + self._backend.path, json=body) as response:
            if response.status_code >= 400:
                await response.aread()
                self._raise_for_status(replica, response, call)
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                try:
                    delta: TokenOutput = backend.parse_stream_event(orjson.loads(line[5:]))
                except (ValueError, ValidationError) as exc:
                    raise self._unparseable(replica, "stream event", exc) from exc
                delta.extra_fields["replica_id"] = replica
                await on_delta(delta)
                if delta.stop_reason is not None:
                    return delta
        raise httpx.RemoteProtocolError("the stream ended before its last event")

    def _raise_for_status(self, replica: str, response: httpx.Response, call: EngineCall) -> None:
        server_side = response.status_code >= 500
        outcome = "server_error" if server_side else "bad_request"
        self._count(replica, outcome)
        if (
            call.image_urls
            and response.status_code == 400
            and _error_param(response) == "content_parts"
        ):
            # a replica that cannot read images (the embedded one serves text models): the
            # session fails for that reason, not as a retriable replica error
            raise ImagesNotSupportedError(
                f"replica {replica} refused the turn's {len(call.image_urls)} image(s): "
                f"{error_message(response.text)}"
            )
        raise ReplicaRequestError(
            replica,
            f"POST {self._backend.path} answered {response.status_code}: "
            f"{error_message(response.text)}",
            outcome=outcome,
            retriable=server_side,
            status_code=response.status_code,
        )

    def _unparseable(
        self, replica: str, what: str, exc: Exception, status_code: int | None = None
    ) -> ReplicaRequestError:
        """A body the backend cannot read: counted, and not retried on another replica."""
        self._count(replica, "bad_response")
        return ReplicaRequestError(
            replica,
            f"unparseable {self._backend.name} {what}: {exc}",
            outcome="bad_response",
            retriable=False,
            status_code=status_code,
        )

    def _count(self, replica: str, outcome: str) -> None:
        self._metrics.requests.labels(replica, outcome).inc()


def _error_param(response: httpx.Response) -> str | None:
    """The field an OpenAI-style error body names (``error.param``), if any."""
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return None
    return error.get("param") if isinstance(error, dict) else None
