"""The replica's HTTP routes: one aiohttp app over a started engine, its middlewares, and
the app's own metric registry."""

from __future__ import annotations

import time

from aiohttp import web
from prometheus_client import CollectorRegistry

from rolloutbus.replica.generation import Engine
from rolloutbus.replica.metrics import EngineCollector, RequestMetrics
from rolloutbus.replica.server.control import (
    collective_rpc,
    is_paused,
    pause,
    pause_lease_watchdog,
    resume,
    update_weight_version,
    weight_info,
)
from rolloutbus.replica.server.generate import completions, sglang_generate, vllm_generate
from rolloutbus.replica.server.health import count_errors, health, metrics, models
from rolloutbus.replica.server.keys import CREATED_KEY, ENGINE_KEY, METRICS_KEY, REGISTRY_KEY
from rolloutbus.replica.server.validation import problems_as_json

__all__ = ["build_app"]


def build_app(engine: Engine) -> web.Application:
    """The aiohttp app over a started engine; metrics live in the app's own registry."""
    app = web.Application(
        middlewares=[count_errors, problems_as_json], client_max_size=64 * 1024 * 1024
    )
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine))
    app[ENGINE_KEY] = engine
    app[METRICS_KEY] = RequestMetrics(registry, engine.model_name)
    app[REGISTRY_KEY] = registry
    app[CREATED_KEY] = int(time.time())
    app.cleanup_ctx.append(pause_lease_watchdog)
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
