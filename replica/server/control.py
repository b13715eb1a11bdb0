"""vLLM's RL control surface (what ``vllm serve`` offers with ``VLLM_SERVER_DEV_MODE=1``):
weights and pause.

- ``POST /pause?mode=abort|wait|keep``, ``POST /resume``, ``GET /is_paused``, plus a lease
  on a pause (``/pause?lease_s=``, renewed by pausing again in the same mode), ended by the
  app's watchdog when it runs out (``pause_gate``)
- ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}``,
  ``POST /update_weight_version {"new_version": ...}`` and ``GET /weight_info``
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web
from pydantic import Field

from rolloutbus.replica.pause_gate import PAUSE_MODES, watch_pause_lease
from rolloutbus.replica.server.health import pause_state
from rolloutbus.replica.server.keys import ENGINE_KEY
from rolloutbus.replica.server.validation import HTTPProblem, parse_body
from rolloutbus.schemas.inference import UpdateWeightVersionRequest, WireModel

__all__ = [
    "CollectiveRpcRequest",
    "collective_rpc",
    "is_paused",
    "pause",
    "pause_lease_watchdog",
    "resume",
    "update_weight_version",
    "weight_info",
]

log = logging.getLogger(__name__)

# The collective_rpc methods the embedded replica runs (vLLM's worker has many more).
RPC_METHODS = ("reload_weights",)


class CollectiveRpcRequest(WireModel):
    """vLLM's dev-mode ``POST /collective_rpc`` body (its ``serve/dev/rpc/api_router``)."""

    method: str
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout: float | None = None  # seconds; accepted, unused: a reload takes well under one


async def update_weight_version(request: web.Request) -> web.Response:
    """Label the weights: every token sampled from now on carries ``new_version``."""
    body = await parse_body(request, UpdateWeightVersionRequest)
    engine = request.app[ENGINE_KEY]
    engine.weight_version = body.new_version
    engine.pause_gate.labelled()  # the weights a reload brought now have their label
    # vLLM answers {"success", "new_version"}; "weight_version" is this replica's older key.
    return web.json_response(
        {"success": True, "new_version": body.new_version, "weight_version": body.new_version}
    )


async def weight_info(request: web.Request) -> web.Response:
    """vLLM's ``GET /weight_info``: the label of the served weights, as a string. The weight
    sync compares it with what it applied, so a replica restarted between two health probes
    (back on its initial label) is synced again."""
    return web.json_response({"weight_version": str(request.app[ENGINE_KEY].weight_version)})


async def pause(request: web.Request) -> web.Response:
    """vLLM's ``POST /pause?mode=abort|wait|keep``: answers once the mode's work is done.

    ``lease_s`` (ours): the pause ends by itself that many seconds after this call unless
    renewed; a pause in the mode the replica is already paused in only renews the lease
    (at once, even during a reload). The answer names the lease, so a caller that gets
    none back (vLLM) knows nobody will end its pause but itself.
    """
    engine = request.app[ENGINE_KEY]
    mode = request.query.get("mode", "abort")
    if mode not in PAUSE_MODES:
        raise HTTPProblem(
            400, f"query 'mode': must be one of {', '.join(PAUSE_MODES)}; got {mode!r}", "mode"
        )
    lease_s = _lease_seconds(request.query.get("lease_s"))
    # clear_cache is accepted and ignored: the engine keeps no prefix cache across requests.
    if lease_s is None or not engine.pause_gate.renew(mode, lease_s):
        await engine.pause(mode, lease_s)  # narrowed to PauseMode by the check above
        if lease_s is not None:
            log.info("paused (mode %s) under a lease of %g s", mode, lease_s)
    lease = {} if lease_s is None else pause_state(engine)  # else vLLM's answer, as is
    return web.json_response({"status": "paused", **lease})


def _lease_seconds(raw: str | None) -> float | None:
    if raw is None:
        return None
    try:
        lease_s = float(raw)
    except ValueError:
        lease_s = float("nan")
    if not 0 < lease_s < float("inf"):
        raise HTTPProblem(
            400, f"query 'lease_s': must be a positive number of seconds; got {raw!r}", "lease_s"
        )
    return lease_s


async def resume(request: web.Request) -> web.Response:
    await request.app[ENGINE_KEY].resume()
    return web.json_response({"status": "resumed"})


async def is_paused(request: web.Request) -> web.Response:
    return web.json_response({"is_paused": request.app[ENGINE_KEY].is_paused})


async def collective_rpc(request: web.Request) -> web.Response:
    """vLLM's dev-mode ``POST /collective_rpc``; only ``reload_weights`` is served.

    The answer has vLLM's shape: one result per worker (one here), ``null`` for a reload.
    """
    body = await parse_body(request, CollectiveRpcRequest)
    if body.method not in RPC_METHODS:
        raise HTTPProblem(
            400,
            f"field 'method': {body.method!r} is not a collective_rpc method of the embedded "
            f"replica; it serves {', '.join(RPC_METHODS)}",
            "method",
        )
    kwargs = dict(body.kwargs)
    weights_path = kwargs.pop("weights_path", None)
    if body.args:  # vLLM's positional form: reload_weights(weights_iterator, weights_path)
        raise HTTPProblem(
            400, "field 'args': pass weights_path in kwargs, not as a positional arg", "args"
        )
    if not isinstance(weights_path, str) or not weights_path:
        raise HTTPProblem(
            400,
            "field 'kwargs.weights_path': reload_weights needs the folder of the new weights",
            "kwargs.weights_path",
        )
    if str(kwargs.pop("is_checkpoint_format", True)).lower() not in ("true", "1"):
        raise HTTPProblem(
            400,
            "field 'kwargs.is_checkpoint_format': only checkpoint-format folders are loaded",
            "kwargs.is_checkpoint_format",
        )
    if kwargs:
        raise HTTPProblem(
            400,
            f"field 'kwargs': reload_weights takes weights_path only; got {sorted(kwargs)}",
            "kwargs",
        )
    await request.app[ENGINE_KEY].reload_weights(weights_path)
    return web.json_response({"results": [None]})


async def pause_lease_watchdog(app: web.Application) -> AsyncIterator[None]:
    """While the app runs: a pause whose lease ran out is resumed (``pause_gate``)."""
    task = asyncio.create_task(
        watch_pause_lease(app[ENGINE_KEY]), name="rolloutbus-replica-pause-lease"
    )
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
