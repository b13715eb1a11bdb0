"""What every handler finds on the replica's app: the engine, the request metrics, the
metric registry, and when the app was made (``/v1/models``' ``created``)."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CollectorRegistry

from rolloutbus.replica.generation import Engine
from rolloutbus.replica.metrics import RequestMetrics

__all__ = ["CREATED_KEY", "ENGINE_KEY", "METRICS_KEY", "REGISTRY_KEY"]

ENGINE_KEY = web.AppKey("engine", Engine)
METRICS_KEY: web.AppKey[RequestMetrics] = web.AppKey("metrics")
REGISTRY_KEY = web.AppKey("registry", CollectorRegistry)
CREATED_KEY = web.AppKey("created", int)
