"""The session processor as a Faust worker: rollout.prompts in, rollout.turns out.

Guarantee on this hop: at-least-once. A prompt's offset is acknowledged only after the
events of all its sessions are delivered (acks=all), so a crash re-runs the group under
a new attempt id; the replay buffer folds one attempt per session and releases each
group once, which makes the trajectory topic exactly-once downstream.
Faust's own exactly-once mode is not used: it is still experimental upstream, with open
duplicate-on-rebalance bugs (github.com/faust-streaming/faust issues #323 and #517).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

import faust
from faust.types import RecordMetadata
from pydantic import BaseModel, ValidationError

from rolloutbus.config import Config
from rolloutbus.kafka.clients import record_location
from rolloutbus.kafka.dead_letters import DeadLetterWriter
from rolloutbus.metrics import SessionMetrics, start_metrics_server
from rolloutbus.replica.models import load_tokenizer
from rolloutbus.schemas.prompts import PromptGroup
from rolloutbus.schemas.turns import SessionFailed, encode_turn_event
from rolloutbus.streams.agent_loop import registry
from rolloutbus.streams.inference.llm_client import LLMClient
from rolloutbus.streams.sessions.runner import SessionContext, run_group
from rolloutbus.topics import Topics, partition_for, session_key

log = logging.getLogger(__name__)


def _broker_url(cfg: Config) -> str:
    return ";".join(f"kafka://{hp}" for hp in cfg.kafka.bootstrap_servers.split(","))


def build_app(cfg: Config) -> faust.App:
    """A Faust app whose one agent runs prompt groups; nothing is created at import time."""
    topics = Topics.from_config(cfg.kafka)
    app = faust.App(
        cfg.sessions.app_id,
        broker=_broker_url(cfg),
        value_serializer="raw",
        key_serializer="raw",
        web_enabled=False,
        topic_disable_leader=True,
        producer_acks=-1,
        producer_max_request_size=cfg.kafka.max_message_bytes,
        consumer_max_fetch_size=cfg.kafka.max_message_bytes,
        consumer_auto_offset_reset="earliest",
        broker_commit_interval=1.0,  # seconds; bounds the re-run work after a crash
        stream_wait_empty=False,
    )
    prompts = app.topic(topics.prompts, key_type=bytes, value_type=bytes,
                        partitions=cfg.kafka.partitions)
    turns = app.topic(topics.turns, key_type=bytes, value_type=bytes,
                      partitions=cfg.kafka.partitions)
    state: dict[str, Any] = {}

    @app.task
    async def start_session_context() -> None:
        state["dlq"] = DeadLetterWriter(cfg.kafka, stage="sessions")
        state["ctx"] = _build_context(cfg, state["dlq"])
        state["metrics"] = SessionMetrics()
        if cfg.sessions.metrics_port is not None:
            start_metrics_server(cfg.sessions.metrics_port)
        state["ready"].set()

    state["ready"] = asyncio.Event()

    @app.agent(prompts, concurrency=cfg.sessions.concurrency)
    async def run_prompt_groups(stream: faust.StreamT) -> None:
        await state["ready"].wait()
        async for event in stream.events():
            group = _parse_group(event.value, state["dlq"], event)
            if group is None:
                continue
            await _run_and_deliver(state, group, turns, cfg.kafka.partitions)

    return app


async def _run_and_deliver(state: dict[str, Any], group: PromptGroup, turns: faust.TopicT,
                           partitions: int) -> None:
    pending: list[Awaitable[RecordMetadata]] = []
    partition = partition_for(group.uid, partitions)

    async def emit(event: BaseModel) -> None:
        key = getattr(event, "session_id", None)
        key_text = group.uid if key is None else session_key(group.uid, key)
        fut = await turns.send(key=key_text.encode(), value=encode_turn_event(event),
                               partition=partition, force=True)
        pending.append(fut)
        metrics.count_event(event)

    metrics: SessionMetrics = state["metrics"]
    with metrics.track_group():
        results = await run_group(state["ctx"], group, emit)
        await asyncio.gather(*pending)  # delivered before the prompt's offset is acked
    for result in results:
        metrics.count_session(failed=isinstance(result, SessionFailed))


def _parse_group(value: bytes, dlq: DeadLetterWriter, event: Any) -> PromptGroup | None:
    try:
        return PromptGroup.model_validate_json(value)
    except ValidationError as exc:
        received = event.message  # Faust's message: topic, partition, offset as attributes
        dlq.write(value, f"prompt group does not match its schema: {exc}",
                  source=record_location(received.topic, received.partition, received.offset))
        return None


def _build_context(cfg: Config, dlq: DeadLetterWriter) -> SessionContext:
    if cfg.rollout.agent.agent_loop_config_path:
        registry.load_agent_loop_config(cfg.rollout.agent.agent_loop_config_path)
    return SessionContext(config=cfg, tokenizer=load_tokenizer(cfg.model),
                          llm_client=LLMClient(cfg.replicas, cfg.rollout),
                          dead_letter=lambda original, reason: dlq.write(original, reason))


def run_session_worker(cfg: Config, loglevel: str = "info") -> None:
    """Blocking: run one session-processor worker until SIGTERM/SIGINT."""
    app = build_app(cfg)
    worker = faust.Worker(app, loglevel=loglevel, quiet=True)
    worker.execute_from_commandline()
