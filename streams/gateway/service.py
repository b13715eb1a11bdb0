"""Starting and stopping the gateway: the turn log, the tokenizer and the LLM client it shares
with the session workers, its HTTP listener, and the idle-session sweep.

``serve_gateway`` runs until SIGTERM/SIGINT (``rolloutbus gateway``); ``start_gateway``
returns a handle inside a running event loop; ``gateway_in_thread`` runs one in a
background thread for synchronous callers (tests, examples).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from rolloutbus.config import Config
from rolloutbus.errors import ConfigError
from rolloutbus.kafka.admin import check_partition_counts
from rolloutbus.kafka.async_producer import AsyncProducer
from rolloutbus.kafka.control import latest_policy_version
from rolloutbus.models.tokenizers import load_tokenizer
from rolloutbus.runtime import serve_in_thread, serve_until_signalled
from rolloutbus.streams.agent_loop.continuous_token import get_builder
from rolloutbus.streams.agent_loop.tool_parser import ToolParser
from rolloutbus.streams.gateway.server import build_app, expire_idle_forever
from rolloutbus.streams.gateway.session import GatewayContext
from rolloutbus.streams.gateway.sessions import GatewaySessions
from rolloutbus.streams.inference.llm_client import LLMClient
from rolloutbus.streams.reward import reward_fn_from_config
from rolloutbus.streams.sessions.metrics import SessionMetrics
from rolloutbus.streams.sessions.turn_log import TurnLog, scan_turn_log

__all__ = ["GatewayHandle", "gateway_in_thread", "serve_gateway", "start_gateway"]

log = logging.getLogger(__name__)


@dataclass
class GatewayHandle:
    """A running gateway: its URL, its sessions, and ``await stop()``."""

    url: str
    sessions: GatewaySessions
    runner: web.AppRunner
    producer: AsyncProducer
    llm_client: LLMClient
    sweeper: asyncio.Task[None]

    async def stop(self) -> None:
        self.sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.sweeper
        await self.runner.cleanup()
        await self.llm_client.close()
        await asyncio.to_thread(self.producer.close)


def _current_version(cfg: Config) -> tuple[int, int]:
    event = latest_policy_version(cfg)
    return (0, 0) if event is None else (event.policy_version, event.global_step)


def build_context(cfg: Config, producer: AsyncProducer, llm_client: Any) -> GatewayContext:
    """What the sessions share: the same tokenizer, template kwargs, tool parser and scorer
    as a session worker under ``cfg``."""
    tokenizer = load_tokenizer(cfg.model)
    builder = get_builder(
        tokenizer,
        None,
        mm_processor_kwargs=cfg.data.mm_processor_kwargs,
        **cfg.data.apply_chat_template_kwargs,
    )
    turn_log = TurnLog(cfg, producer, SessionMetrics())
    return GatewayContext(
        config=cfg,
        tokenizer=tokenizer,
        llm_client=llm_client,
        emit=turn_log.emit,
        builder=builder,
        parser=ToolParser.get_tool_parser(cfg.rollout.multi_turn.format, tokenizer),
        scorer=reward_fn_from_config(cfg),
    )


async def start_gateway(cfg: Config) -> GatewayHandle:
    """Listen on ``gateway.host:port`` (port 0: any free port)."""
    await asyncio.to_thread(check_partition_counts, cfg.kafka)
    producer = AsyncProducer(cfg.kafka)
    llm_client = LLMClient(cfg.replicas, cfg.rollout)
    ctx = await asyncio.to_thread(build_context, cfg, producer, llm_client)
    sessions = GatewaySessions(
        ctx,
        scan=lambda partition: scan_turn_log(cfg, partition),
        current_version=lambda: _current_version(cfg),
    )
    runner = web.AppRunner(build_app(sessions, cfg.gateway.public_url), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.gateway.host, cfg.gateway.port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        await llm_client.close()
        producer.close()
        raise ConfigError(f"cannot listen on {cfg.gateway.host}:{cfg.gateway.port}: {exc}") from exc
    host, port = runner.addresses[0][:2]
    sweeper = asyncio.ensure_future(
        expire_idle_forever(sessions, cfg.gateway.session_idle_timeout_s)
    )
    return GatewayHandle(f"http://{host}:{port}", sessions, runner, producer, llm_client, sweeper)


def serve_gateway(cfg: Config) -> None:
    """Serve until SIGTERM or SIGINT (blocking); prints the URL on stdout once listening."""
    asyncio.run(serve_until_signalled("gateway", lambda: start_gateway(cfg), _announce(cfg)))


def _announce(cfg: Config) -> Callable[[GatewayHandle], None]:
    def ready(handle: GatewayHandle) -> None:
        print(handle.url, flush=True)  # data on stdout: where agents point their base_url
        log.info("gateway ready on %s (model %s)", handle.url, cfg.model.name)

    return ready


def gateway_in_thread(cfg: Config) -> contextlib.AbstractContextManager[GatewayHandle]:
    """A gateway on its own event loop in a background thread."""
    return serve_in_thread("rolloutbus-gateway", lambda: start_gateway(cfg))
