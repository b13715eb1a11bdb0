"""What the replica says about itself: ``GET /health`` (is the engine alive, is it paused,
since when, which weights), ``GET /v1/models``, ``GET /metrics`` (Prometheus,
``rolloutbus_replica_*``) and the count of error answers that ``/metrics`` reports."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from rolloutbus.metrics import exposition
from rolloutbus.replica.generation import Engine
from rolloutbus.replica.server.keys import CREATED_KEY, ENGINE_KEY, METRICS_KEY, REGISTRY_KEY
from rolloutbus.replica.server.validation import Handler

__all__ = ["count_errors", "health", "metrics", "models", "pause_state"]

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


async def health(request: web.Request) -> web.Response:
    """200 while the engine runs (vLLM answers an empty 200); the body says more: whether it
    is paused, since when (seconds since the epoch) and under what lease, and the label of
    the weights it serves, so a client needs no second call to judge it."""
    engine = request.app[ENGINE_KEY]
    if not engine.healthy:
        return web.json_response({"status": "unhealthy"}, status=503)
    return web.json_response({"status": "ok", **pause_state(engine)})


def pause_state(engine: Engine) -> dict[str, Any]:
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


async def metrics(request: web.Request) -> web.Response:
    text = exposition(request.app[REGISTRY_KEY])  # without _created series
    return web.Response(body=text, headers={"Content-Type": PROMETHEUS_CONTENT_TYPE})


@web.middleware
async def count_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    response = await handler(request)
    if response.status >= 400 and request.path != "/health":
        request.app[METRICS_KEY].errors.labels(
            request.app[ENGINE_KEY].model_name, str(response.status)
        ).inc()
    return response
