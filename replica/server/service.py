"""Starting and stopping the replica: the engine (a ``DecodeEngine`` loaded from the config
unless one is given) and its HTTP listener.

``serve_replica`` runs until SIGTERM/SIGINT (``rolloutbus replica serve``); ``start_replica``
returns a handle inside a running event loop; ``replica_in_thread`` runs one in a background
thread for synchronous callers (tests, scripts).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from contextlib import AbstractContextManager
from dataclasses import dataclass

from aiohttp import web

from rolloutbus.config import Config
from rolloutbus.errors import ReplicaError
from rolloutbus.models.catalog import model_note
from rolloutbus.replica.generation import Engine
from rolloutbus.replica.server.app import build_app
from rolloutbus.runtime import serve_in_thread, serve_until_signalled

__all__ = ["ReplicaHandle", "replica_in_thread", "serve_replica", "start_replica"]

log = logging.getLogger(__name__)


@dataclass
class ReplicaHandle:
    """A running replica in this process: its base URL, engine, and ``await stop()``."""

    url: str
    engine: Engine
    runner: web.AppRunner

    async def stop(self) -> None:
        await self.runner.cleanup()
        await asyncio.to_thread(self.engine.stop)

    async def __aenter__(self) -> ReplicaHandle:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()


async def start_replica(cfg: Config, engine: Engine | None = None) -> ReplicaHandle:
    """Start a replica on ``cfg.replica_server.host:port`` (port 0: any free port).

    Without ``engine``, loads ``cfg.model`` into a ``DecodeEngine``.
    """
    if engine is None:
        from rolloutbus.replica.engine import DecodeEngine

        engine = await asyncio.to_thread(DecodeEngine.from_config, cfg)
    engine.start()
    # handler_cancellation: a client that hangs up aborts its request in the engine.
    runner = web.AppRunner(build_app(engine), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.replica_server.host, cfg.replica_server.port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        engine.stop()
        raise ReplicaError(
            f"cannot listen on {cfg.replica_server.host}:{cfg.replica_server.port}: {exc}"
        ) from exc
    host, port = runner.addresses[0][:2]
    return ReplicaHandle(url=f"http://{host}:{port}", engine=engine, runner=runner)


def replica_in_thread(
    cfg: Config, engine: Engine | None = None
) -> AbstractContextManager[ReplicaHandle]:
    """A replica on its own event loop in a background thread, for synchronous callers
    (tests, scripts): ``with replica_in_thread(cfg) as handle: httpx.get(handle.url)``."""
    return serve_in_thread("rolloutbus-replica-http", lambda: start_replica(cfg, engine))


def serve_replica(cfg: Config) -> None:
    """Serve until SIGTERM or SIGINT (blocking); for ``rolloutbus replica serve``."""
    if not logging.getLogger().handlers:
        logging.basicConfig(
            stream=sys.stderr,
            level=logging.INFO,
            format="%(asctime)s %(name)s %(levelname)s %(message)s",
        )
    asyncio.run(
        serve_until_signalled(
            "replica",
            lambda: start_replica(cfg),
            lambda handle: log.info(
                "replica ready on %s model=%s%s",
                handle.url,
                handle.engine.model_name,
                f" ({note})" if (note := model_note(handle.engine.model_name)) else "",
            ),
        )
    )
