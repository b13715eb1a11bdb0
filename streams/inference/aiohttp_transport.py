"""httpx's interface over aiohttp's connection pool: the session worker's replica calls.

A session worker keeps one request in flight per live session, hundreds or thousands of
them. httpx's own pool scans its connections on every request (encode/httpx#3215), so its
CPU per request grows with the requests in flight (1.0 ms at 1, 8.5 ms at 256, measured
in issue 28); aiohttp's stays flat (~0.2 ms). ``AiohttpTransport`` keeps httpx as the
client API (requests, responses, streams, timeouts and the exception types the client's
retries rely on) and sends through aiohttp.

Failures map onto httpx's exceptions, so callers see no difference: a refused or failed
connection is ``httpx.ConnectError`` (``ConnectTimeout`` when it timed out), a read that
outlived its timeout ``httpx.ReadTimeout``, a response or stream cut by the server
``httpx.RemoteProtocolError``, any other client error ``httpx.ReadError``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import httpx

# httpx decodes content-encoding itself from the headers it is given: aiohttp must not too
AUTO_DECOMPRESS = False
KEEPALIVE_S = 60.0  # seconds an idle connection is kept for the next request


@contextlib.contextmanager
def _as_httpx_errors(request: httpx.Request | None) -> Iterator[None]:
    """aiohttp's and asyncio's failures raised as the httpx exception that means the same
    (``request`` None: a POST sent without an httpx request, ``AiohttpTransport.post``)."""
    try:
        yield
    except aiohttp.ConnectionTimeoutError as exc:
        raise httpx.ConnectTimeout(str(exc) or "connect timed out", request=request) from exc
    except (aiohttp.ServerTimeoutError, aiohttp.SocketTimeoutError, TimeoutError) as exc:
        raise httpx.ReadTimeout(str(exc) or "read timed out", request=request) from exc
    except aiohttp.ClientConnectorError as exc:
        raise httpx.ConnectError(str(exc), request=request) from exc
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError) as exc:
        raise httpx.RemoteProtocolError(str(exc), request=request) from exc
    except aiohttp.ClientError as exc:
        raise httpx.ReadError(f"{type(exc).__name__}: {exc}", request=request) from exc


class _ResponseStream(httpx.AsyncByteStream):
    """An aiohttp response body as httpx reads it, chunk by chunk as it arrives."""

    def __init__(self, response: aiohttp.ClientResponse, request: httpx.Request):
        self._response, self._request = response, request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _as_httpx_errors(self._request):
            async for chunk in self._response.content.iter_any():
                yield chunk

    async def aclose(self) -> None:
        self._response.release()


class AiohttpTransport(httpx.AsyncBaseTransport):
    """An ``httpx.AsyncClient`` transport backed by one ``aiohttp.ClientSession``, made in
    the event loop of the first request (one client, one loop)."""

    def __init__(self, *, max_connections: int = 0, keepalive_s: float = KEEPALIVE_S):
        self._max_connections = max_connections  # 0: no cap (bounded upstream)
        self._keepalive_s = keepalive_s
        self._session: aiohttp.ClientSession | None = None

    def _client_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                limit=self._max_connections,
                limit_per_host=0,
                keepalive_timeout=self._keepalive_s,
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=AUTO_DECOMPRESS,
                # httpx's timeouts are applied per request (below)
                timeout=aiohttp.ClientTimeout(total=None),
                skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
            )
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        with _as_httpx_errors(request):
            response = await self._client_session().request(
                request.method,
                str(request.url),
                headers=_headers(request),
                data=body or None,
                timeout=_timeout(request.extensions.get("timeout", {})),
                allow_redirects=False,
                compress=None,
            )
        return httpx.Response(
            status_code=response.status,
            headers=_response_headers(response),
            stream=_ResponseStream(response, request),
            extensions={"http_version": b"HTTP/1.1"},
            request=request,
        )

    async def post(
        self, url: str, body: bytes, headers: dict[str, str], timeouts: dict[str, Any]
    ) -> tuple[int, bytes]:
        """POST ``body`` and read the whole answer: its status and bytes. The generate path:
        no httpx request or response is built (their headers and streams were about a tenth
        of the worker's CPU per turn, issue 28); failures are the same httpx exceptions."""
        with _as_httpx_errors(None):
            async with self._client_session().post(
                url,
                data=body,
                headers=headers,
                timeout=_timeout(timeouts),
                allow_redirects=False,
                compress=None,
            ) as response:
                content = await response.read()
                status, encoded = response.status, "Content-Encoding" in response.headers
                if encoded:  # decoded as httpx decodes it (a replica that compresses unasked)
                    content = httpx.Response(
                        status, headers=_response_headers(response), content=content
                    ).content
                return status, content

    async def aclose(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
            # the connections' sockets close on the loop's next turn (aiohttp closes their
            # transports without waiting); a server stopped right after must see them shut
            await asyncio.sleep(0)


def _headers(request: httpx.Request) -> list[tuple[str, str]]:
    """The request's headers but Host (aiohttp sets it from the URL) and Content-Length
    (aiohttp sets it from the body it sends)."""
    return [
        (k.decode("latin-1"), v.decode("latin-1"))
        for k, v in request.headers.raw
        if k.lower() not in (b"host", b"content-length", b"transfer-encoding")
    ]


def _response_headers(response: aiohttp.ClientResponse) -> list[tuple[str, str]]:
    return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in response.raw_headers]


def _timeout(timeouts: dict[str, Any]) -> aiohttp.ClientTimeout:
    """httpx's per-phase timeouts (connect, read; seconds or None) in aiohttp's terms."""
    return aiohttp.ClientTimeout(
        total=None,
        sock_connect=timeouts.get("connect"),
        sock_read=timeouts.get("read"),
    )
