"""``stream: true``: the reply's text sent as the replica samples it (the tokens come from
``streamed_turns.py``), the turn logged whole.

- ``ReplyText``: the tokens decoded incrementally (never half a UTF-8 character), and the
  part of the text the reply's content will surely start with: text from a tool-call
  marker on (``<tool_call>``; any ``<`` for other formats, whose parsers reshape more) and
  trailing whitespace wait for the end, where the parsed reply says what is left; so does a
  part of a stop string, and nothing from a whole one on is sent (``stops.py``).
- ``ReplyStream``: the server-sent events of one answer, in the shapes of the API the route
  speaks (``SseWire``). The response starts with the first text an agent may see; before
  that an error is still an HTTP error. A client that goes away stops the writes, not the
  turn: it is sampled to its end and logged, and the client's retry is answered from the
  log.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Protocol

from aiohttp import web

from rolloutbus.streams.gateway.session import TurnResult
from rolloutbus.streams.gateway.stops import partial_stop_end

__all__ = ["ReplyStream", "ReplyText", "SseWire"]

log = logging.getLogger(__name__)

# where a format's tool calls begin; other formats hold back from any "<"
TOOL_CALL_MARKERS = {"hermes": "<tool_call>", "qwen3_coder": "<tool_call>"}


class ReplyText:
    """The sampled tokens decoded as they come (vLLM's incremental detokenization: a window
    of tokens decoded again, new text only once it is whole characters)."""

    def __init__(self, tokenizer: Any, tool_format: str, stops: list[str] | None = None):
        self._tokenizer = tokenizer
        self._stops = [s for s in stops or () if s]
        self._marker = TOOL_CALL_MARKERS.get(tool_format, "<")
        self._specials = [s for s in getattr(tokenizer, "all_special_tokens", ()) if s]
        self._tokens: list[int] = []
        self._prefix = self._read = 0  # the window: tokens[prefix:read] are decoded already
        self.text = ""  # all text decoded so far, special tokens kept (as the parsers read it)
        self.sent = ""  # what the agent was given

    def add(self, token_ids: list[int]) -> str:
        """The text the agent may be shown now, past what it was shown."""
        self._tokens += token_ids
        window = self._tokens[self._prefix :]
        before = self._decode(self._tokens[self._prefix : self._read])
        now = self._decode(window)
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.text += now[len(before) :]
            self._prefix, self._read = self._read, len(self._tokens)
        shown = self._settled()
        if not shown.startswith(self.sent):
            return ""
        delta, self.sent = shown[len(self.sent) :], shown
        return delta

    def rest(self, content: str) -> str:
        """What the parsed reply's content adds to the text sent."""
        if content.startswith(self.sent):
            return content[len(self.sent) :]
        log.warning("a streamed reply's text %r is not how its content begins", self.sent[:80])
        return ""

    def _settled(self) -> str:
        """The text up to a tool-call marker, or a part of one, without trailing whitespace
        and special tokens: what the parsed content will begin with."""
        text = partial_stop_end(self.text, self._stops) if self._stops else self.text
        cut = text.find(self._marker)
        if cut >= 0:
            text = text[:cut]
        for size in range(min(len(self._marker) - 1, len(text)), 0, -1):
            if self._marker.startswith(text[-size:]):
                text = text[:-size]
                break
        for special in self._specials:
            text = text.replace(special, "")
        return text.strip()

    def _decode(self, tokens: list[int]) -> str:
        return str(self._tokenizer.decode(tokens, skip_special_tokens=False))


class SseWire(Protocol):
    """The events of one API's streamed answer."""

    def opening(self) -> Iterable[bytes]: ...

    def text(self, delta: str) -> Iterable[bytes]: ...

    def closing(self, result: TurnResult, rest: str) -> Iterable[bytes]: ...

    def error(self, message: str, status: int) -> Iterable[bytes]: ...


class ReplyStream:
    """One answer as server-sent events; ``on_tokens`` is the session's token sink."""

    def __init__(
        self,
        request: web.Request,
        headers: dict[str, str],
        wire: SseWire,
        text: ReplyText,
    ):
        self._request, self._wire, self.reply_text = request, wire, text
        self.response = web.StreamResponse(headers={"Content-Type": "text/event-stream", **headers})
        self.gone = False  # the client went away: the turn goes on, unsent

    @property
    def started(self) -> bool:
        return self.response.prepared

    async def on_tokens(self, token_ids: list[int]) -> None:
        delta = self.reply_text.add(token_ids)
        if delta:
            await self._send(self._wire.text(delta))

    async def finish(self, result: TurnResult) -> web.StreamResponse:
        await self._send(self._wire.closing(result, self.reply_text.rest(result.reply.content)))
        if not self.gone:
            await self._write_eof()
        return self.response

    async def fail(self, message: str, status: int) -> web.StreamResponse:
        """An error after the answer started: an error event, then the end of the stream."""
        await self._send(self._wire.error(message, status))
        if not self.gone:
            await self._write_eof()
        return self.response

    async def _send(self, events: Iterable[bytes]) -> None:
        if self.gone:
            return
        try:
            if not self.response.prepared:
                await self.response.prepare(self._request)
                for event in self._wire.opening():
                    await self.response.write(event)
            for event in events:
                await self.response.write(event)
        except ConnectionResetError:
            log.info("%s: the client went away mid-stream; the turn goes on", self._request.path)
            self.gone = True

    async def _write_eof(self) -> None:
        try:
            await self.response.write_eof()
        except ConnectionResetError:
            self.gone = True
