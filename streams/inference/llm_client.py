"""The agent loops' ``generate()``: token-in/token-out over HTTP to inference replicas.

verl's ``LLMServerClient.generate`` is a Ray actor call; here it is an HTTP call to a
vLLM (or SGLang, or the embedded) replica, with the same signature and the same
``TokenOutput``. One call, step by step:

1. acquire a replica for the trajectory's ``request_id`` (sticky, least in-flight) from the
   fleet (``replica_health.ReplicaFleet``: which replicas are healthy and admitted; a turn
   that finds none waits at most ``replicas.unavailable_wait_s``);
2. POST the prompt tokens with a fresh engine request id (a new uuid every turn: the
   trajectory id only drives stickiness, as in verl);
3. release the replica in ``finally``, however the call ended.

A replica that times out, refuses the connection or answers 5xx is taken out of routing
and the turn is sent again, with the same prompt tokens, to another replica (at most
``replicas.max_retries`` times). A 4xx is the request's fault, not the replica's: it is
raised at once. A background task probes the replicas and brings them back.

This module is the request path; one call to one replica is ``replica_call``'s, health,
admission and pauses are ``replica_health``'s, routing is ``routing``'s, the wire formats
are ``backends``'.
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, Protocol

import httpx
from prometheus_client import CollectorRegistry

from rolloutbus.config import ReplicasConfig, RolloutConfig
from rolloutbus.errors import ReplicaError
from rolloutbus.schemas.agent_loop import TokenOutput
from rolloutbus.schemas.inference import TurnSamplingParams
from rolloutbus.streams.inference.admission import VersionSource
from rolloutbus.streams.inference.aiohttp_transport import AiohttpTransport
from rolloutbus.streams.inference.backends import (
    Backend,
    EngineCall,
    backend_for,
)
from rolloutbus.streams.inference.client_metrics import ClientMetrics
from rolloutbus.streams.inference.multimodal import (
    check_backend_takes_images,
    image_urls,
    refuse_video_and_audio,
)
from rolloutbus.streams.inference.replica_call import DeltaSink, ReplicaCaller, ReplicaRequestError
from rolloutbus.streams.inference.replica_health import ReplicaFleet, ReplicaProber, TurnWait
from rolloutbus.streams.inference.routing import LoadBalancer, load_balancer

__all__ = [
    "ClientMetrics",
    "DeltaSink",
    "LLMClient",
    "ReplicaRequestError",
    "StreamedTurn",
    "per_turn_max_tokens",
]

log = logging.getLogger(__name__)

# seconds; a connection that is not up by then is a dead or unreachable replica, even
# when the whole request may take many minutes of decoding.
CONNECT_TIMEOUT_S = 10.0


class StreamedTurn(Protocol):
    """A turn sampled as a stream (``streams/sessions/chunking.py``)."""

    def request(self) -> tuple[list[int], dict[str, Any]]:
        """The prompt and sampling params of the next try (what is not yet kept)."""
        ...

    async def take(self, delta: TokenOutput) -> None: ...

    async def aborted(self) -> bool:
        """The engine aborted the try: keep what it sampled; False when no budget is left."""
        ...


def per_turn_max_tokens(
    prompt_len: int, rollout: RolloutConfig, requested: int | None = None
) -> int:
    """verl's per-turn budget: what is left of the trajectory's response_length.

    ``min(response_length, prompt_length + response_length - len(prompt_ids))``,
    clamped to ``[1, max_model_len - len(prompt_ids)]``; an explicit smaller
    ``max_tokens`` in sampling_params wins. ``max_model_len`` defaults to
    prompt_length + response_length, as in verl.
    """
    total = rollout.prompt_length + rollout.response_length
    max_model_len = rollout.max_model_len or total
    budget = min(rollout.response_length, total - prompt_len)
    if requested is not None:
        budget = min(budget, requested)
    return max(1, min(budget, max_model_len - prompt_len))


class LLMClient:
    """verl's ``generate()`` over HTTP, routed over a changing set of replicas.

    Use one client per worker process (its load balancer's in-flight counts are per
    process; see ``streams/routing.py``), as ``async with LLMClient(...) as client``
    or with an explicit ``await client.close()``. ``versions``: where the current policy
    version comes from (the session worker follows ``rollout.control``); with one, a
    replica that (re)starts is routed to once it serves that version
    (``admission.py``); without, as soon as it is healthy.
    """

    def __init__(
        self,
        replicas: ReplicasConfig,
        rollout: RolloutConfig,
        *,
        registry: CollectorRegistry | None = None,
        rng: random.Random | None = None,
        health_timeout_s: float | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        versions: VersionSource | None = None,
    ) -> None:
        self._config = replicas
        self._rollout = rollout
        self._backend: Backend = backend_for(replicas.backend)
        self._metrics = ClientMetrics(registry)
        transport = transport or AiohttpTransport()
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(
                replicas.request_timeout_s,
                connect=min(CONNECT_TIMEOUT_S, replicas.request_timeout_s),
            ),
            # No pool cap: concurrency is bounded upstream (sessions.concurrency x n).
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            # aiohttp's pool: a request's cost does not grow with the requests in flight
            transport=transport,
        )
        balancer = load_balancer(
            (_normalize(url) for url in replicas.urls),
            router_config_path=rollout.router_config_path,
            sticky_cache_size=replicas.sticky_cache_size,
            full_determinism=rollout.full_determinism,
            rng=rng,
        )
        # seconds; a probe slower than the probe interval counts as a failed probe.
        prober = ReplicaProber(
            self._http,
            health_timeout_s or replicas.health_interval_s,
            replicas.backend,
            versions=versions is not None,
        )
        self._fleet = ReplicaFleet(replicas, balancer, prober, self._metrics, versions)
        self._caller = ReplicaCaller(
            self._http, self._backend, self._metrics, replicas.request_timeout_s, transport
        )
        self._versions = versions
        self._health_task: asyncio.Task[None] | None = None
        self._closed = False

    # -- verl's API ----------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        image_data: Any = None,
        video_data: Any = None,
        audio_data: Any = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> TokenOutput:
        """Sample one turn for trajectory ``request_id``; returns the tokens as sampled.

        ``kwargs`` takes verl's extras: ``priority`` is sent to vLLM when non-zero;
        others (``global_steps`` ...) are accepted and ignored here.
        ``extra_fields`` of the result carries ``finish_reason`` (the engine's own
        word), ``replica_id``, ``engine_request_id`` and ``weight_version`` when the
        engine reports one.

        ``image_data`` (in prompt order) is sent as vLLM's ``content_parts`` by the
        ``vllm_generate`` backend, with every piece of an aborted turn; any other backend
        raises ``ImagesNotSupportedError`` before a request is sent. ``video_data`` and
        ``audio_data`` raise ``MediaNotSupportedError``. ``mm_processor_kwargs`` is not
        sent: vLLM's generate request has no such field (the server's processor settings
        apply).
        """
        # before any request: a backend that cannot take the media fails the session by
        # name instead of sampling from the text alone
        refuse_video_and_audio(video_data, audio_data)
        check_backend_takes_images(self._backend.name, image_data)
        images = image_urls(image_data)  # resolved once; a resumed piece resends the same
        self._ensure_started()
        params = TurnSamplingParams.model_validate(sampling_params)
        max_tokens = per_turn_max_tokens(len(prompt_ids), self._rollout, params.max_tokens)
        priority = int(kwargs.get("priority") or 0)
        if not self._backend.name.startswith("vllm"):
            priority = 0
        # the turn's one wait for a routable replica, over its retries and resumed pieces
        wait = TurnWait(self._config.unavailable_wait_s)
        out = await self._generate_once(
            request_id, prompt_ids, params, max_tokens, priority, images, wait
        )
        if out.stop_reason == "aborted" and self._config.resume_aborted:
            out = await self._resume_aborted(
                request_id, prompt_ids, params, max_tokens, priority, out, images, wait
            )
        return out

    async def _resume_aborted(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: TurnSamplingParams,
        max_tokens: int,
        priority: int,
        out: TokenOutput,
        images: tuple[str, ...] = (),
        wait: TurnWait | None = None,
    ) -> TokenOutput:
        """Partial rollout: continue an aborted turn from prompt + tokens so far.

        The pieces are concatenated (tokens, logprobs), preemptions summed, and the
        remaining budget shrinks; an exhausted budget ends the turn as "length". Each
        piece sends the turn's images again: the prompt still holds their placeholders.
        """
        tokens, logprobs = list(out.token_ids), list(out.log_probs or [])
        preempted, resumes = out.num_preempted, 0
        first_version = out.extra_fields.get("weight_version")
        pieces = [out.extra_fields]  # each piece's min/max_global_steps make the turn's
        while out.stop_reason == "aborted" and resumes < self._config.max_abort_resumes:
            remaining = max_tokens - len(tokens)
            if remaining <= 0:
                out = out.model_copy(update={"stop_reason": "completed"})
                out.extra_fields["finish_reason"] = "length"
                break
            await asyncio.sleep(self._config.abort_retry_delay_s)
            resumes += 1
            out = await self._generate_once(
                request_id, prompt_ids + tokens, params, remaining, priority, images, wait
            )
            tokens += out.token_ids
            logprobs += out.log_probs or []
            pieces.append(out.extra_fields)
            if out.num_preempted is not None:
                preempted = (preempted or 0) + out.num_preempted
        extra = {**out.extra_fields, "resumed_after_abort": resumes}
        if first_version is not None:
            extra["first_weight_version"] = first_version
        extra.update(_version_range(pieces))
        return TokenOutput(
            token_ids=tokens,
            log_probs=logprobs if out.log_probs is not None else None,
            routed_experts=out.routed_experts,
            stop_reason=out.stop_reason,
            num_preempted=preempted,
            extra_fields=extra,
        )

    async def _generate_once(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: TurnSamplingParams,
        max_tokens: int,
        priority: int,
        images: tuple[str, ...] = (),
        wait: TurnWait | None = None,
    ) -> TokenOutput:
        """One turn on one replica, retried on others when a replica fails; waiting for a
        routable replica at most ``replicas.unavailable_wait_s`` over all its tries (and,
        with the turn's ``wait``, over all its pieces)."""

        async def send(replica: str) -> TokenOutput:
            call = self._call(request_id, prompt_ids, params, max_tokens, priority)
            return await self._caller.call(replica, replace(call, image_urls=images))

        return await with_retries(self._fleet, self._config, self._metrics, request_id, wait, send)

    @property
    def streams(self) -> bool:
        """Whether this client's backend streams a turn (``stream_turn``)."""
        return hasattr(self._backend, "build_stream_request")

    async def stream_turn(self, request_id: str, turn: StreamedTurn, **kwargs: Any) -> TokenOutput:
        """Sample one turn as a stream, retried on another replica as ``generate`` is. Each
        try asks ``turn.request()`` what to send (a cut stream goes on from what the turn
        kept) and hands ``turn.take`` every event; returns the last event of the last try."""
        self._ensure_started()
        priority = int(kwargs.get("priority") or 0)

        async def send(replica: str) -> TokenOutput:
            prompt_ids, sampling_params = turn.request()
            params = TurnSamplingParams.model_validate(sampling_params)
            budget = per_turn_max_tokens(len(prompt_ids), self._rollout, params.max_tokens)
            call = self._call(request_id, prompt_ids, params, budget, priority)
            return await self._caller.stream(replica, call, turn.take)

        for resumes in range(self._config.max_abort_resumes + 1):
            last = await with_retries(
                self._fleet, self._config, self._metrics, request_id, None, send
            )
            if last.stop_reason != "aborted" or not self._config.resume_aborted:
                break
            if resumes == self._config.max_abort_resumes or not await turn.aborted():
                break  # partial rollout as ``generate`` does it: go on after what was sampled
            await asyncio.sleep(self._config.abort_retry_delay_s)
        return last

    def _call(
        self, request_id: str, prompt: list[int], params: TurnSamplingParams, budget: int, pri: int
    ) -> EngineCall:
        engine_id = self._engine_request_id(request_id)
        return EngineCall(engine_id, prompt, params, budget, self._config.model, pri)

    def _engine_request_id(self, request_id: str) -> str:
        # verl keeps the caller's id under full determinism, a fresh uuid otherwise.
        return request_id if self._rollout.full_determinism else uuid.uuid4().hex

    # -- replicas at run time --------------------------------------------------------

    def add_replica(self, url: str) -> None:
        """Route to one more replica from now on (once healthy, and admitted when this
        client follows policy versions)."""
        self._fleet.add(_normalize(url))

    def remove_replica(self, url: str) -> None:
        """Stop routing to a replica; its trajectories move elsewhere on their next turn."""
        self._fleet.remove(_normalize(url))

    @property
    def balancer(self) -> LoadBalancer:
        return self._fleet.balancer

    @property
    def fleet(self) -> ReplicaFleet:
        return self._fleet

    @property
    def replicas(self) -> tuple[str, ...]:
        return self.balancer.replicas

    @property
    def metrics(self) -> ClientMetrics:
        return self._metrics

    async def check_health(self) -> dict[str, bool]:
        """Probe every replica once; mark each healthy or not. Returns what it saw."""
        return await self._fleet.check_health()

    async def probe_replicas(self) -> dict[str, str | None]:
        """Probe every replica and log by name each one that cannot be reached, and why (a
        worker calls this at start). Returns url -> the problem, None for a healthy one."""
        self._start_versions()
        return await self._fleet.probe_at_start()

    # -- lifecycle -----------------------------------------------------------------

    def _ensure_started(self) -> None:
        if self._closed:
            raise ReplicaError("LLMClient is closed")
        self._start_versions()
        if self._health_task is None:
            self._health_task = asyncio.get_running_loop().create_task(
                self._fleet.run_forever(), name="rolloutbus-replica-health"
            )

    def _start_versions(self) -> None:
        if self._versions is not None and not self._closed:
            self._versions.start()

    async def start(self) -> LLMClient:
        """Start the health checker (``generate()`` also starts it on first use)."""
        self._ensure_started()
        return self

    async def close(self) -> None:
        """Stop the health checker and close connections. Idempotent."""
        self._closed = True
        if self._health_task is not None:
            self._health_task.cancel()
            try:
                await self._health_task
            except asyncio.CancelledError:
                pass
            self._health_task = None
        if self._versions is not None:
            await self._versions.close()
        await self._http.aclose()

    async def __aenter__(self) -> LLMClient:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


async def with_retries(
    fleet: ReplicaFleet,
    config: ReplicasConfig,
    metrics: ClientMetrics,
    request_id: str,
    wait: TurnWait | None,
    send: Callable[[str], Awaitable[TokenOutput]],
) -> TokenOutput:
    """``send`` to one replica, and to another when that one fails (a retriable error), at
    most ``replicas.max_retries`` times; waiting for a routable replica at most
    ``replicas.unavailable_wait_s`` over all tries (or the turn's ``wait``)."""
    last_error: ReplicaRequestError | None = None
    wait = wait or TurnWait(config.unavailable_wait_s)
    for attempt in range(config.max_retries + 1):
        replica = await fleet.acquire(request_id, wait, last_error)
        try:
            return await send(replica)
        except ReplicaRequestError as exc:
            if not exc.retriable:
                raise
            fleet.take_out(replica, exc)
            last_error = exc
            if attempt < config.max_retries:
                metrics.retries.inc()
        finally:
            fleet.release(replica)
    assert last_error is not None
    raise last_error


def _normalize(url: str) -> str:
    return url.rstrip("/")


def _version_range(pieces: list[dict[str, Any]]) -> dict[str, int]:
    """verl's ``min_global_steps``/``max_global_steps`` of a turn resumed after aborts:
    the oldest and newest version over all its pieces (a weight sync came in between)."""
    lows = [p["min_global_steps"] for p in pieces if p.get("min_global_steps") is not None]
    highs = [p["max_global_steps"] for p in pieces if p.get("max_global_steps") is not None]
    if not lows or not highs:
        return {}
    return {"min_global_steps": min(lows), "max_global_steps": max(highs)}
