"""What the LLM client knows about its replicas (``streams/inference/replica_health.py``):
dead replicas named at start, turns that wait at most ``replicas.unavailable_wait_s`` and
fail as an infrastructure failure, warnings while no replica can take a turn, replicas
paused too long, and the gate that holds back a (re)started replica until it serves the
current policy version.

Replicas are the real HTTP server over the ``ScriptedEngine`` TEST DOUBLE (scripted tokens,
no model), so its ``/health`` and label are the embedded replica's. A vLLM-shaped replica
(empty ``/health``, ``/is_paused``) is an ``httpx.MockTransport`` TEST DOUBLE. The version
source is a TEST DOUBLE standing in for the follower of ``rollout.control``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from rolloutbus.config import (
    Config,
    KafkaConfig,
    ModelConfig,
    ReplicasConfig,
    ReplicaServerConfig,
    RolloutConfig,
)
from rolloutbus.errors import NoReplicaAvailableError
from rolloutbus.kafka.admin import ensure_topics
from rolloutbus.models.tokenizers import load_tokenizer
from rolloutbus.replica.scripted import ScriptedEngine
from rolloutbus.replica.server import start_replica
from rolloutbus.schemas.agent_loop import AgentLoopMetrics, AgentLoopOutput
from rolloutbus.schemas.prompts import GroupSamplingParams, PromptGroup
from rolloutbus.streams.agent_loop import AgentLoopBase, register
from rolloutbus.streams.inference.llm_client import LLMClient
from rolloutbus.streams.sessions.runner import SessionContext, run_group
from tests.helpers import free_port, unique_name
from tests.pipeline import spawn, stop, write_config

SAMPLING = {"temperature": 1.0, "logprobs": True}
WAIT_S = 30.0  # seconds; generous deadline for conditions a test waits on
SLACK_S = 10.0  # seconds past unavailable_wait_s a failing turn may take on a busy machine


class FixedVersions:
    """TEST DOUBLE for the rollout.control follower: the current policy version is set by
    the test."""

    def __init__(self, current: int | None, known: bool = True):
        self.current, self.known = current, known

    def current_version(self) -> int | None:
        return self.current

    def start(self) -> None:
        pass

    async def close(self) -> None:
        pass


def _client(urls: list[str], *, versions=None, transport=None, **replicas: Any) -> LLMClient:
    config = ReplicasConfig(urls=urls, **{"health_interval_s": 0.2, **replicas})
    return LLMClient(
        config,
        RolloutConfig(),
        registry=CollectorRegistry(),
        rng=random.Random(0),
        versions=versions,
        transport=transport,
    )


def _dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


def _sample(client: LLMClient, name: str, labels: dict[str, str] | None = None) -> float | None:
    return client.metrics.registry.get_sample_value(name, labels or {})


async def _scripted_replica(**kwargs: Any):
    engine = ScriptedEngine(lambda prompt: [11, 12], **kwargs)
    return await start_replica(Config(replica_server=ReplicaServerConfig(port=0)), engine)


# -- nothing hangs silently ----------------------------------------------------------------


async def test_a_dead_replica_is_named_at_start(caplog):
    live, dead = await _scripted_replica(), _dead_url()
    client = _client([live.url, dead])
    try:
        with caplog.at_level(logging.INFO):
            problems = await client.probe_replicas()
    finally:
        await client.close()
        await live.stop()
    assert problems[live.url] is None
    assert problems[dead].startswith("cannot connect")
    assert f"replica {dead} is unreachable: cannot connect" in caplog.text
    assert "1 of 2 replicas reachable" in caplog.text
    assert not client.balancer.is_healthy(dead) and client.balancer.is_healthy(live.url)


def test_sessions_run_names_a_dead_replica_as_it_starts(kafka_config: KafkaConfig, tmp_path):
    """``rolloutbus sessions run`` with a replica URL that is down: the worker says so, by
    name, before any prompt arrives (it used to start without complaint)."""
    dead = _dead_url()
    cfg = Config.model_validate(
        {
            "kafka": kafka_config.model_dump(),
            "model": {"name": "tiny-qwen3"},
            "replicas": {"urls": [dead]},
            "sessions": {"app_id": unique_name("s"), "data_dir": str(tmp_path / "faust")},
        }
    )
    ensure_topics(cfg.kafka)
    log_path = tmp_path / "sessions.log"
    worker = spawn(["sessions", "run"], write_config(cfg, tmp_path / "config.yaml"), log_path)
    try:
        deadline = time.monotonic() + 120  # seconds: a Faust worker's start on a busy machine
        while f"replica {dead} is unreachable" not in log_path.read_text(errors="replace"):
            assert worker.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
    finally:
        stop(worker)
    text = log_path.read_text(errors="replace")
    assert "cannot connect" in text and "no replica is reachable (1 configured" in text


async def test_no_reachable_replica_at_start_says_what_will_happen(caplog):
    client = _client([_dead_url()], unavailable_wait_s=7)
    try:
        with caplog.at_level(logging.INFO):
            await client.probe_replicas()
    finally:
        await client.close()
    assert "no replica is reachable (1 configured in replicas.urls)" in caplog.text
    assert "unavailable_wait_s = 7 s" in caplog.text


async def test_waiting_turns_are_reported_then_fail_within_unavailable_wait_s(caplog):
    """Three turns against a dead replica: while they wait, a warning every
    health_interval_s counts them and their wait; each gives up after unavailable_wait_s
    (not after the 600 s request timeout), naming the replica and why it is out."""
    dead = _dead_url()
    client = _client([dead], unavailable_wait_s=1.5, request_timeout_s=600)
    started = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING):
            outcomes = await asyncio.gather(
                *(
                    client.generate(f"t{i}", prompt_ids=[1, 2], sampling_params=SAMPLING)
                    for i in range(3)
                ),
                return_exceptions=True,
            )
    finally:
        await client.close()
    elapsed = time.monotonic() - started
    assert all(isinstance(o, NoReplicaAvailableError) for o in outcomes), outcomes
    assert 1.5 <= elapsed < 1.5 + SLACK_S
    assert "replicas.unavailable_wait_s = 1.5" in str(outcomes[0])
    assert f"{dead}: cannot connect" in str(outcomes[0])
    waiting = [r.message for r in caplog.records if "no replica can take a turn" in r.message]
    assert waiting and "3 sessions waiting for one" in waiting[-1]
    assert _sample(client, "rolloutbus_client_unavailable_total") == 3
    assert _sample(client, "rolloutbus_client_turns_waiting") == 0


async def test_a_dead_replica_with_nothing_waiting_is_reported_once_not_every_probe(caplog):
    """A dead replica URL and no turn: the start line, then nothing (it used to log "no
    replica can take a turn ... 0 sessions waiting" every health_interval_s forever); a turn
    that starts waiting is reported at once."""
    client = _client([_dead_url()], unavailable_wait_s=30)
    try:
        with caplog.at_level(logging.INFO):
            await client.probe_replicas()
            for _ in range(3):
                await client.check_health()
                client.fleet.warn_if_unavailable()
            quiet = [r for r in caplog.records if r.levelno >= logging.WARNING]
            turn = asyncio.ensure_future(
                client.generate("t", prompt_ids=[1], sampling_params=SAMPLING)
            )
            await _until(lambda: "1 sessions waiting" in caplog.text)
            turn.cancel()
    finally:
        await client.close()
    assert len(quiet) == 1 and "no replica is reachable" in quiet[0].getMessage(), quiet


async def test_a_replica_that_comes_up_after_the_worker_is_up_not_back(caplog):
    """A first start: the replica is still loading when the worker probes it. Its coming up
    is an INFO line, not "unhealthy" then "is back" warnings (it was never away)."""
    port = free_port()
    client = _client(
        [f"http://127.0.0.1:{port}"], versions=FixedVersions(current=None), admit_stale_s=600
    )
    replica = None
    try:
        with caplog.at_level(logging.INFO):
            await client.probe_replicas()
            await client.check_health()
            engine = ScriptedEngine(lambda prompt: [11, 12])
            replica = await start_replica(
                Config(replica_server=ReplicaServerConfig(port=port)), engine
            )
            await client.check_health()
        assert client.balancer.is_healthy(replica.url)
    finally:
        await client.close()
        if replica is not None:
            await replica.stop()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [], warnings
    assert f"replica {replica.url} is up" in caplog.text
    assert f"replica {replica.url} is routable" in caplog.text


@register("one_turn_health_test")
class OneTurnLoop(AgentLoopBase):
    """One generate() call through the real LLM client, its tokens as the response."""

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        out = await self.server_manager.generate(
            "r", prompt_ids=[1, 2, 3], sampling_params=sampling_params
        )
        return AgentLoopOutput(
            prompt_ids=[1, 2, 3],
            response_ids=out.token_ids,
            response_mask=[1] * len(out.token_ids),
            response_logprobs=out.log_probs,
            num_turns=2,
            metrics=AgentLoopMetrics(),
        )


@register("broken_health_test")
class BrokenLoop(AgentLoopBase):
    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        raise ValueError("the loop's own bug")


def _group(agent: str, **row: Any) -> PromptGroup:
    return PromptGroup(
        uid="g1",
        n=1,
        sampling_params=GroupSamplingParams(),
        row={"prompt": [{"role": "user", "content": "hi"}], "agent_name": agent, **row},
    )


async def _run_one(client: LLMClient, group: PromptGroup, tokenizer: Any = None):
    events: list[Any] = []

    async def emit(event) -> None:
        events.append(event)

    ctx = SessionContext(config=Config(), tokenizer=tokenizer, llm_client=client)
    [terminal] = await run_group(ctx, group, emit)
    return terminal


async def test_a_session_waiting_on_a_dead_replica_fails_as_an_infrastructure_failure():
    client = _client([_dead_url()], unavailable_wait_s=1.0, request_timeout_s=600)
    started = time.monotonic()
    try:
        terminal = await _run_one(client, _group("one_turn_health_test"))
    finally:
        await client.close()
    assert time.monotonic() - started < 1.0 + SLACK_S
    assert terminal.type == "session_failed"
    assert (terminal.failure_class, terminal.retriable) == ("infrastructure", True)
    assert "replicas.unavailable_wait_s = 1" in terminal.error


async def test_a_failing_reward_and_a_failing_loop_have_their_own_classes():
    replica = await _scripted_replica()
    client = _client([replica.url])
    try:
        # verl's table has no scorer for this data_source: the reward fails, not the loop
        unscored = _group(
            "one_turn_health_test", data_source="no-such-source", reward_model={"ground_truth": "1"}
        )
        tokenizer = load_tokenizer(ModelConfig(name="tiny-qwen3"))  # the scorer decodes
        reward = await _run_one(client, unscored, tokenizer)
        loop = await _run_one(client, _group("broken_health_test"))
    finally:
        await client.close()
        await replica.stop()
    assert (reward.type, reward.failure_class, reward.retriable) == (
        "session_failed",
        "reward",
        False,
    )
    assert "no-such-source" in reward.error
    assert (loop.failure_class, loop.retriable) == ("loop", False)


# -- pauses --------------------------------------------------------------------------------


async def test_a_replica_paused_too_long_is_warned_about_and_counted(caplog):
    replica = await _scripted_replica()
    client = _client([replica.url], paused_warn_s=0.5, health_interval_s=0.1)
    try:
        async with httpx.AsyncClient(base_url=replica.url) as http:
            assert (await http.post("/pause", params={"mode": "keep"})).status_code == 200
        with caplog.at_level(logging.WARNING):
            await client.start()
            await _until(lambda: _sample(client, *_too_long(replica.url)))
    finally:
        await client.close()
        await replica.stop()
    assert f"replica {replica.url} has been paused for" in caplog.text
    assert "replicas.paused_warn_s = 0.5" in caplog.text
    paused_s = _sample(client, "rolloutbus_client_replica_paused_seconds", {"replica": replica.url})
    assert paused_s is not None and paused_s >= 0.5


async def test_a_paused_vllm_replica_is_timed_from_the_first_probe_that_saw_it():
    """vLLM's /health is an empty 200 and says nothing of a pause: /is_paused does."""
    calls: list[str] = []

    def vllm(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if request.url.path == "/is_paused":
            return httpx.Response(200, json={"is_paused": True})
        return httpx.Response(200)

    client = _client(["http://vllm:8000"], transport=httpx.MockTransport(vllm), paused_warn_s=0.05)
    try:
        await client.check_health()
        await asyncio.sleep(0.1)
        await client.check_health()
    finally:
        await client.close()
    assert calls == ["/health", "/is_paused"] * 2
    assert _sample(client, *_too_long("http://vllm:8000")) == 1


def _too_long(url: str) -> tuple[str, dict[str, str]]:
    return "rolloutbus_client_replica_paused_too_long_total", {"replica": url}


# -- admission of (re)started replicas -----------------------------------------------------


async def test_a_replica_is_routed_to_once_it_serves_the_current_version():
    replica = await _scripted_replica()  # labelled 0 at start
    versions = FixedVersions(current=3)
    client = _client([replica.url], versions=versions, admit_stale_s=600)
    try:
        await client.probe_replicas()
        assert not client.balancer.is_healthy(replica.url)  # held back: it serves 0, not 3
        turn = asyncio.ensure_future(client.generate("t", prompt_ids=[1], sampling_params=SAMPLING))
        await asyncio.sleep(1.5)
        assert not turn.done() and not replica.engine.calls  # it waits, nothing was sent
        replica.engine.weight_version = 3  # the weight sync caught it up
        out = await asyncio.wait_for(turn, WAIT_S)
    finally:
        await client.close()
        await replica.stop()
    assert out.extra_fields["weight_version"] == 3
    reasons = {"replica": replica.url, "reason": "current_version"}
    assert _sample(client, "rolloutbus_client_replica_admissions_total", reasons) == 1


async def test_a_replica_that_never_catches_up_is_admitted_after_admit_stale_s(caplog):
    replica = await _scripted_replica()
    client = _client([replica.url], versions=FixedVersions(current=3), admit_stale_s=1.0)
    started = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING):
            out = await client.generate("t", prompt_ids=[1], sampling_params=SAMPLING)
    finally:
        await client.close()
        await replica.stop()
    assert time.monotonic() - started >= 1.0
    assert out.extra_fields["weight_version"] == 0  # honest about its old weights
    reasons = {"replica": replica.url, "reason": "stale_timeout"}
    assert _sample(client, "rolloutbus_client_replica_admissions_total", reasons) == 1
    assert f"replica {replica.url} admitted after" in caplog.text and "stale_timeout" in caplog.text
    assert "`rolloutbus weight-sync` loads the current weights" in caplog.text  # what to do


async def test_a_replica_that_restarted_between_two_probes_is_held_back():
    """Its label goes back from 3 to 0: it restarted on its initial weights."""
    replica = await _scripted_replica()
    replica.engine.weight_version = 3
    versions = FixedVersions(current=3)
    client = _client([replica.url], versions=versions, admit_stale_s=600)
    try:
        await client.check_health()
        assert client.balancer.is_healthy(replica.url)
        replica.engine.weight_version = 0  # back on its initial weights
        await client.check_health()
        assert not client.balancer.is_healthy(replica.url)
        replica.engine.weight_version = 3
        await client.check_health()
        assert client.balancer.is_healthy(replica.url)
    finally:
        await client.close()
        await replica.stop()
    admitted = _sample(
        client,
        "rolloutbus_client_replica_admissions_total",
        {"replica": replica.url, "reason": "current_version"},
    )
    assert admitted == 2  # at first sight, and after the restart


async def test_admit_stale_s_counts_from_when_a_replica_is_back_not_from_when_it_went_down():
    port = free_port()
    client = _client(
        [f"http://127.0.0.1:{port}"], versions=FixedVersions(current=3), admit_stale_s=0.5
    )
    replica = None
    try:
        await client.check_health()  # down
        await asyncio.sleep(0.7)  # longer down than admit_stale_s
        engine = ScriptedEngine(lambda prompt: [11, 12])
        replica = await start_replica(Config(replica_server=ReplicaServerConfig(port=port)), engine)
        await client.check_health()
        held = not client.balancer.is_healthy(replica.url)
        await asyncio.sleep(0.6)
        await client.check_health()
        admitted = client.balancer.is_healthy(replica.url)
    finally:
        await client.close()
        if replica is not None:
            await replica.stop()
    assert held and admitted  # back on version 0: held its own admit_stale_s, then let in


async def test_without_a_published_version_every_replica_is_admitted_at_once():
    replica = await _scripted_replica()
    client = _client([replica.url], versions=FixedVersions(current=None))
    try:
        await client.check_health()
        healthy = client.balancer.is_healthy(replica.url)
    finally:
        await client.close()
        await replica.stop()
    assert healthy
    reasons = {"replica": replica.url, "reason": "no_version_published"}
    assert _sample(client, "rolloutbus_client_replica_admissions_total", reasons) == 1


async def _until(condition, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail("the condition never held")
        await asyncio.sleep(0.05)
