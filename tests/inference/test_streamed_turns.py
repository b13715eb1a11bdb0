"""Turns streamed from the embedded replica (tiny-qwen3 over HTTP, ``stream: true`` on
/v1/completions) and logged in chunks as they stream (``sessions.chunk_tokens``/``chunk_s``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from rolloutbus.config import Config, with_overrides
from rolloutbus.replica.server import replica_in_thread
from rolloutbus.schemas.turns import GenerationChunk
from rolloutbus.streams.inference.backends import VllmCompletionsBackend
from rolloutbus.streams.inference.llm_client import LLMClient
from rolloutbus.streams.sessions.chunking import ChunkSettings
from rolloutbus.streams.sessions.recorder import RecordingLLMClient

PROMPT = [151644, 872, 198, 3838, 374, 220, 17, 10, 17, 30, 151645, 198, 151644, 77091, 198]
TOKENS = 24
PARAMS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "logprobs": True,
    "max_tokens": TOKENS,
    "seed": 7,
    "ignore_eos": True,
}


@pytest.fixture(scope="module")
def replica():
    cfg = Config.model_validate({"model": {"name": "tiny-qwen3"}, "replica_server": {"port": 0}})
    with replica_in_thread(cfg) as handle:
        yield with_overrides(cfg, {"replicas.urls": [handle.url]}), handle


async def _turn(cfg: Config, chunk_tokens: int, chunk_s: float | None = None, **kw: Any):
    events: list[Any] = []

    async def emit(event: Any) -> None:
        events.append(event)

    async with LLMClient(cfg.replicas, cfg.rollout, registry=CollectorRegistry()) as client:
        chunks = ChunkSettings(chunk_tokens, cfg.rollout, chunk_s) if chunk_tokens else None
        rec = RecordingLLMClient(client, emit, uid="u", session_id=0, attempt="a", chunks=chunks)
        out = await rec.generate("t", prompt_ids=PROMPT, sampling_params=PARAMS, **kw)
        sent = sum(
            sample.value
            for metric in client.metrics.requests.collect()
            for sample in metric.samples
            if sample.name.endswith("_total")
        )
    return out, events, sent


def test_the_replica_streams_token_ids_and_logprobs_as_server_sent_events(replica):
    cfg, handle = replica
    body = {"prompt": PROMPT, **PARAMS, "logprobs": 0, "return_token_ids": True, "stream": True}
    with httpx.stream("POST", f"{handle.url}/v1/completions", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[5:]) for line in lines[:-1]]
    assert len(events) > 2  # token by token, not one answer at the end
    backend = VllmCompletionsBackend()
    deltas = [backend.parse_stream_event(e) for e in events]
    assert [d.stop_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
    assert deltas[-1].extra_fields["finish_reason"] == "length"
    assert sum(len(d.token_ids) for d in deltas) == TOKENS
    assert all(len(d.log_probs or []) == len(d.token_ids) for d in deltas)


async def test_a_streamed_chunked_turn_is_the_unchunked_turn(replica):
    """Seeded: one streamed request draws what one plain request draws, and its chunks are
    logged every chunk_tokens tokens as they stream."""
    cfg, _ = replica
    plain, plain_events, _ = await _turn(cfg, 0)
    streamed, events, requests = await _turn(cfg, 10)
    assert requests == 1  # one streamed request, not one per chunk
    chunks = [e for e in events if isinstance(e, GenerationChunk)]
    assert [len(c.token_ids) for c in chunks] == [10, 10]  # the last 4 end the turn
    assert [c.start for c in chunks] == [0, 10]
    assert streamed.token_ids == plain.token_ids and len(plain.token_ids) == TOKENS
    assert streamed.log_probs == pytest.approx(plain.log_probs, abs=1e-5)
    assert sum((c.token_ids for c in chunks), []) == plain.token_ids[:20]
    generation = [e for e in events if e.type == "generation"][0]
    plain_generation = [e for e in plain_events if e.type == "generation"][0]
    assert generation.token_ids == plain_generation.token_ids


async def test_chunk_s_logs_chunks_on_time_alone(replica):
    """chunk_tokens larger than the turn: only the timer logs chunks (a replica slowed
    down by a wait between its decode steps is not needed: tiny-qwen3 on CPU takes ms per
    token, so a 1 ms timer fires between the streamed events)."""
    cfg, _ = replica
    out, events, requests = await _turn(cfg, 10_000, chunk_s=0.001)
    assert requests == 1
    chunks = [e for e in events if isinstance(e, GenerationChunk)]
    assert len(chunks) >= 2
    starts = [c.start for c in chunks]
    assert starts == sorted(starts) and starts[0] == 0
    assert (
        sum((c.token_ids for c in chunks), [])
        == out.token_ids[: len(sum((c.token_ids for c in chunks), []))]
    )


async def test_a_cut_stream_is_retried_from_the_logged_chunks(replica):
    """A replica whose stream is cut mid-way: the turn is retried, as a failed request is, from
    prompt ‖ the chunks logged before the cut; only the unlogged tokens are sampled again."""
    cfg, handle = replica
    cut = _CuttingProxy(handle.url, after_tokens=14)
    await cut.start()
    try:
        # the one replica is taken out at the cut and routed to again once its probe passes
        cfg2 = with_overrides(
            cfg,
            {
                "replicas.urls": [cut.url],
                "replicas.max_retries": 2,
                "replicas.health_interval_s": 0.2,
            },
        )
        plain, _, _ = await _turn(cfg, 0)
        out, events, requests = await _turn(cfg2, 10)
    finally:
        await cut.stop()
    chunks = [e for e in events if isinstance(e, GenerationChunk)]
    assert cut.cut == 1 and requests == 2  # the cut stream, then its continuation
    assert [c.start for c in chunks][:1] == [0]
    assert len(out.token_ids) == TOKENS
    # the first chunk came from the cut stream; the rest continued from it (seed + start)
    assert out.token_ids[:10] == plain.token_ids[:10]


class _CuttingProxy:
    """A replica URL whose first stream dies once ``after_tokens`` tokens went through, and
    before its last event (the replica sends one event per batch of new tokens, so the
    number of events falls when the machine is loaded: counting them, a CI run never cut)."""

    def __init__(self, upstream: str, after_tokens: int) -> None:
        self.upstream, self.after, self.cut = upstream, after_tokens, 0
        self.url = ""
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._forward(reader, writer)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(
            next(
                (
                    line.split(b":")[1]
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                ),
                b"0",
            )
        )
        body = await reader.readexactly(length)
        path = head.split(b" ")[1].decode()
        async with httpx.AsyncClient(timeout=60) as http:
            if not path.startswith("/v1/completions"):
                r = await http.request(head.split(b" ")[0].decode(), self.upstream + path)
                writer.write(
                    b"HTTP/1.1 %d OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                    b"Connection: close\r\n\r\n" % (r.status_code, len(r.content)) + r.content
                )
                await writer.drain()
                writer.close()
                return
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n"
            )
            sent = 0
            async with http.stream(
                "POST",
                self.upstream + path,
                content=body,
                headers={"Content-Type": "application/json"},
            ) as r:
                async for line in r.aiter_lines():
                    if not line:
                        continue
                    choice = _choice(line)
                    if self.cut == 0 and choice.get("finish_reason") is not None:
                        self.cut += 1  # the last event: cut before it, the turn unfinished
                        writer.transport.abort()
                        return
                    data = (line + "\n\n").encode()
                    writer.write(b"%x\r\n%s\r\n" % (len(data), data))
                    await writer.drain()
                    sent += len(choice.get("token_ids") or ())
                    if sent >= self.after and self.cut == 0:
                        self.cut += 1
                        writer.transport.abort()  # the replica dies mid-stream
                        return
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            writer.close()


def _choice(line: str) -> dict[str, Any]:
    """The one choice of a ``data: {...}`` event; {} for ``data: [DONE]``."""
    payload = line.removeprefix("data:").strip()
    return {} if payload == "[DONE]" else json.loads(payload)["choices"][0]


async def test_a_resumed_streamed_turn_keeps_its_chunks_and_spans_both_versions(replica):
    """Killed after two chunks of 10 were streamed and logged under version 3, resumed
    under version 4: one streamed request continues after the 20 logged tokens, the logged
    tokens and logprobs are kept and the turn spans versions 3 and 4."""
    cfg, handle = replica
    httpx.post(f"{handle.url}/update_weight_version", json={"new_version": 3}).raise_for_status()
    live, live_events, _ = await _turn(cfg, 10)
    killed = live_events[:3]  # segment_started and two chunks: the worker died mid-turn
    assert [e.type for e in killed] == ["segment_started", "generation_chunk", "generation_chunk"]
    httpx.post(f"{handle.url}/update_weight_version", json={"new_version": 4}).raise_for_status()
    events: list[Any] = []

    async def emit(event: Any) -> None:
        events.append(event)

    async with LLMClient(cfg.replicas, cfg.rollout, registry=CollectorRegistry()) as client:
        rec = RecordingLLMClient(
            client,
            emit,
            uid="u",
            session_id=0,
            attempt="b",
            replay=killed,
            chunks=ChunkSettings(10, cfg.rollout),
        )
        out = await rec.generate("t", prompt_ids=PROMPT, sampling_params=PARAMS)
        rec.check_replayed()
    assert rec.replayed_chunks == 2 and len(out.token_ids) == TOKENS
    assert out.token_ids[:20] == live.token_ids[:20]  # kept as logged, not sampled again
    assert out.log_probs[:20] == pytest.approx(live.log_probs[:20])
    assert [c.policy_version for c in events if isinstance(c, GenerationChunk)] == [3, 3]
    generation = [e for e in events if e.type == "generation"][0]
    assert generation.policy_version == 4
    assert (out.extra_fields["min_global_steps"], out.extra_fields["max_global_steps"]) == (3, 4)
    assert rec.segments[0].versions_until(10_000) == [3, 4]


async def test_an_aborted_stream_logs_what_it_sampled_and_goes_on_after_it():
    """Partial rollout, streamed: the scripted replica (a test double) aborts the first
    request, as an engine paused for a weight update does; its tokens are logged as a chunk
    and the next request continues from prompt ‖ them."""
    from rolloutbus.replica.scripted import ScriptedEngine, ScriptedTurn

    engine = ScriptedEngine(
        [
            ScriptedTurn([5, 6], [-0.1, -0.2], finish_reason="abort"),
            ScriptedTurn([7, 8, 9], [-0.3, -0.4, -0.5], finish_reason="stop"),
        ]
    )
    cfg = Config.model_validate(
        {
            "replica_server": {"port": 0},
            "rollout": {"response_length": 10},
            "replicas": {"abort_retry_delay_s": 0.0},
        }
    )
    events: list[Any] = []

    async def emit(event: Any) -> None:
        events.append(event)

    with replica_in_thread(cfg, engine) as handle:
        cfg = with_overrides(cfg, {"replicas.urls": [handle.url]})
        async with LLMClient(cfg.replicas, cfg.rollout, registry=CollectorRegistry()) as client:
            chunks = ChunkSettings(100, cfg.rollout)
            rec = RecordingLLMClient(
                client, emit, uid="u", session_id=0, attempt="a", chunks=chunks
            )
            out = await rec.generate("t", prompt_ids=[1, 2, 3], sampling_params={"logprobs": True})
    first, second = engine.calls
    assert second.prompt_ids == [1, 2, 3, 5, 6] and second.max_tokens == first.max_tokens - 2
    assert [c.token_ids for c in events if isinstance(c, GenerationChunk)] == [[5, 6]]
    assert out.token_ids == [5, 6, 7, 8, 9] and out.stop_reason == "completed"
    assert out.log_probs == pytest.approx([-0.1, -0.2, -0.3, -0.4, -0.5])
