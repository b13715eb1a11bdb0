"""The LLM client over real HTTP, against scripted replicas started inside each test.

``ScriptedReplica`` is a TEST DOUBLE: a real aiohttp server on 127.0.0.1 that speaks the
wire format of one backend (vLLM /v1/completions, vLLM /inference/v1/generate or SGLang
/generate) and answers with scripted token ids and logprobs. There is no model behind
it. It records every request body exactly as it arrived, and can be told to fail: hang,
answer 500 or 400, or stop altogether.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from typing import Any

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from rolloutbus.config import ReplicasConfig, RolloutConfig
from rolloutbus.errors import NoReplicaAvailableError
from rolloutbus.streams.inference.llm_client import LLMClient, ReplicaRequestError
from rolloutbus.streams.inference.multimodal import ImagesNotSupportedError

TOKENS = [101, 102, 103]
LOGPROBS = [-0.5, -0.25, -0.125]


class ScriptedReplica:
    """Test double of an inference replica: scripted tokens, no model (see module doc)."""

    def __init__(self, backend: str, *, tokens=TOKENS, logprobs=LOGPROBS, finish="stop"):
        self.backend = backend
        self.tokens, self.logprobs, self.finish = list(tokens), list(logprobs), finish
        self.requests: list[dict[str, Any]] = []  # bodies as the server saw them
        self.mode = "ok"  # ok | hang | error500 | error400
        self.hang_health = False
        self.delay_s = 0.0
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._unhang = asyncio.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> ScriptedReplica:
        app = web.Application()
        for path in ("/v1/completions", "/inference/v1/generate", "/generate"):
            app.router.add_post(path, self._generate)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self._unhang = asyncio.Event()
        return self

    async def stop(self) -> None:
        self._unhang.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, request: web.Request) -> web.Response:
        if self.hang_health:
            await self._unhang.wait()
        return web.Response(status=200 if self.mode == "ok" else 503)

    async def _generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append({"path": request.path, **body})
        if self.mode == "hang":
            await self._unhang.wait()
        if self.mode == "error500":
            return web.json_response({"error": {"message": "engine died"}}, status=500)
        if self.mode == "error400":
            return web.json_response(
                {"error": {"message": "prompt is too long", "code": 400}}, status=400
            )
        await asyncio.sleep(self.delay_s)
        return web.json_response(self._answer(body))

    def _answer(self, body: dict[str, Any]) -> dict[str, Any]:
        toks, lps, fin = self.tokens, self.logprobs, self.finish
        if self.backend == "vllm_completions":
            wants = body.get("logprobs") is not None
            return {
                "id": "cmpl-1",
                "object": "text_completion",
                "created": 1,
                "model": "m",
                "choices": [
                    {
                        "index": 0,
                        "text": "scripted",
                        "token_ids": toks,
                        "logprobs": {
                            "text_offset": list(range(len(toks))),
                            "token_logprobs": lps,
                            "tokens": [f"token_id:{t}" for t in toks],
                            "top_logprobs": [
                                {f"token_id:{t}": lp} for t, lp in zip(toks, lps, strict=True)
                            ],
                        }
                        if wants
                        else None,
                        "finish_reason": fin,
                        "stop_reason": None,
                    }
                ],
                "usage": {
                    "prompt_tokens": len(body["prompt"]),
                    "completion_tokens": len(toks),
                    "total_tokens": len(body["prompt"]) + len(toks),
                },
            }
        if self.backend == "vllm_generate":
            wants = body["sampling_params"].get("logprobs") is not None
            content = [
                {"token_id": t, "logprob": lp, "rank": 1, "top_logprobs": []}
                for t, lp in zip(toks, lps, strict=True)
            ]
            return {
                "request_id": body["request_id"],
                "output_mode": "tokens",
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": fin,
                        "stop_reason": None,
                        "token_ids": toks,
                        "logprobs": {"content": content} if wants else None,
                    }
                ],
            }
        meta: dict[str, Any] = {
            "id": body["rid"],
            "finish_reason": {"type": fin},
            "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": len(toks),
            "weight_version": "7",
        }
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[lp, t, None] for t, lp in zip(toks, lps, strict=True)]
        return {"text": "scripted", "output_ids": toks, "meta_info": meta}


SAMPLING = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "repetition_penalty": 1.0,
    "logprobs": True,
}


@pytest.fixture
async def make_replicas():
    started: list[ScriptedReplica] = []

    async def make(n: int = 1, backend: str = "vllm_completions", **kwargs):
        reps = [await ScriptedReplica(backend, **kwargs).start() for _ in range(n)]
        started.extend(reps)
        return reps

    yield make
    for rep in started:
        await rep.stop()


@pytest.fixture
async def make_client():
    clients: list[LLMClient] = []

    def make(replicas, *, rollout: RolloutConfig | None = None, **cfg) -> LLMClient:
        urls = [r.url for r in replicas]
        config = ReplicasConfig(urls=urls, **{"health_interval_s": 60.0, **cfg})
        client = LLMClient(
            config, rollout or RolloutConfig(), registry=CollectorRegistry(), rng=random.Random(0)
        )
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


# --------------------------------------------------------------------------------------
# one turn per backend: the request as the server saw it, the parsed output
# --------------------------------------------------------------------------------------


async def test_vllm_completions_request_and_response(make_replicas, make_client):
    (rep,) = await make_replicas(1, "vllm_completions")
    client = make_client([rep], backend="vllm_completions", model="policy")
    out = await client.generate(
        "traj",
        prompt_ids=[1, 2, 3, 4],
        sampling_params={**SAMPLING, "seed": 7, "stop_token_ids": [2]},
    )
    (req,) = rep.requests
    assert req == {
        "path": "/v1/completions",
        "model": "policy",
        "prompt": [1, 2, 3, 4],
        "max_tokens": 512,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "seed": 7,
        "stop_token_ids": [2],
        "ignore_eos": False,
        "logprobs": 0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "return_weight_versions": True,
        "request_id": req["request_id"],
        "stream": False,
    }
    assert out.token_ids == TOKENS and out.log_probs == LOGPROBS
    assert out.stop_reason == "completed" and out.num_preempted is None
    assert out.extra_fields == {
        "finish_reason": "stop",
        "replica_id": rep.url,
        "engine_request_id": req["request_id"],
    }


async def test_vllm_generate_request_and_response(make_replicas, make_client):
    (rep,) = await make_replicas(1, "vllm_generate", finish="length")
    client = make_client([rep], backend="vllm_generate")
    out = await client.generate(
        "traj", prompt_ids=[5, 6], sampling_params={**SAMPLING, "max_tokens": 3}
    )
    (req,) = rep.requests
    assert req == {
        "path": "/inference/v1/generate",
        "request_id": req["request_id"],
        "token_ids": [5, 6],
        "sampling_params": {
            "max_tokens": 3,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "ignore_eos": False,
            "logprobs": 0,
            "detokenize": False,
        },
        "output_mode": "tokens",
        "stream": False,
    }
    assert out.token_ids == TOKENS and out.log_probs == LOGPROBS
    assert out.stop_reason == "completed"
    assert out.extra_fields["finish_reason"] == "length"


async def test_sglang_request_and_response(make_replicas, make_client):
    (rep,) = await make_replicas(1, "sglang", finish="abort")
    client = make_client([rep], backend="sglang", resume_aborted=False)  # see the mapping raw
    out = await client.generate(
        "traj", prompt_ids=[9], sampling_params={**SAMPLING, "seed": 3}, priority=5
    )
    (req,) = rep.requests
    assert req == {
        "path": "/generate",
        "rid": req["rid"],
        "input_ids": [9],
        "sampling_params": {
            "max_new_tokens": 512,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "sampling_seed": 3,
            "ignore_eos": False,
        },
        "return_logprob": True,
        "logprob_start_len": -1,
        "top_logprobs_num": 0,
        "return_text_in_logprobs": False,
        "stream": False,
    }
    assert out.token_ids == TOKENS and out.log_probs == LOGPROBS
    assert out.stop_reason == "aborted"
    assert out.extra_fields["weight_version"] == "7"


async def test_no_logprobs_when_not_asked(make_replicas, make_client):
    (rep,) = await make_replicas(1, "vllm_completions")
    client = make_client([rep])
    out = await client.generate("t", prompt_ids=[1], sampling_params={"logprobs": False})
    assert "logprobs" not in rep.requests[0]
    assert out.token_ids == TOKENS and out.log_probs is None


async def test_priority_is_forwarded_to_vllm_only_when_non_zero(make_replicas, make_client):
    (rep,) = await make_replicas(1, "vllm_completions")
    client = make_client([rep])
    await client.generate("t1", prompt_ids=[1], sampling_params=SAMPLING, priority=0)
    await client.generate(
        "t2", prompt_ids=[1], sampling_params=SAMPLING, priority=-3, global_steps=12
    )
    assert "priority" not in rep.requests[0]
    assert rep.requests[1]["priority"] == -3


async def test_per_turn_budget_shrinks_as_the_trajectory_grows(make_replicas, make_client):
    (rep,) = await make_replicas(1, "vllm_completions")
    rollout = RolloutConfig(prompt_length=10, response_length=8, max_model_len=20)
    client = make_client([rep], rollout=rollout)
    for prompt_len in (4, 12, 17, 30):
        await client.generate("t", prompt_ids=list(range(prompt_len)), sampling_params=SAMPLING)
    # min(8, 18 - len) clamped to [1, 20 - len]
    assert [r["max_tokens"] for r in rep.requests] == [8, 6, 1, 1]


async def test_bad_sampling_key_and_multimodal_are_refused(make_replicas, make_client):
    (rep,) = await make_replicas(1)
    client = make_client([rep])
    with pytest.raises(ValidationError, match="temprature"):
        await client.generate("t", prompt_ids=[1], sampling_params={"temprature": 0.5})
    with pytest.raises(ImagesNotSupportedError, match="'vllm_completions' takes token ids only"):
        await client.generate("t", prompt_ids=[1], sampling_params={}, image_data=[b"x"])
    assert rep.requests == []


# --------------------------------------------------------------------------------------
# routing over HTTP
# --------------------------------------------------------------------------------------


async def test_fresh_engine_request_id_each_turn_on_the_same_sticky_replica(
    make_replicas, make_client
):
    reps = await make_replicas(3)
    client = make_client(reps)
    prompt = [1, 2]
    for _ in range(4):
        out = await client.generate("traj-A", prompt_ids=prompt, sampling_params=SAMPLING)
        prompt = prompt + out.token_ids + [7]  # the observation appended by the loop
    served = [r for r in reps if r.requests]
    assert len(served) == 1
    engine_ids = [req["request_id"] for req in served[0].requests]
    assert len(set(engine_ids)) == 4
    assert all(uuid.UUID(e) for e in engine_ids)
    assert "traj-A" not in engine_ids


async def test_full_determinism_sends_the_trajectory_id_as_engine_id(make_replicas, make_client):
    (rep,) = await make_replicas(1)
    client = make_client([rep], rollout=RolloutConfig(full_determinism=True))
    await client.generate("traj-A", prompt_ids=[1], sampling_params=SAMPLING)
    assert rep.requests[0]["request_id"] == "traj-A"


async def test_concurrent_first_turns_spread_by_least_in_flight(make_replicas, make_client):
    reps = await make_replicas(2)
    for rep in reps:
        rep.delay_s = 0.3  # keep all four in flight together
    client = make_client(reps)
    await asyncio.gather(
        *(
            client.generate(f"traj-{i}", prompt_ids=[i + 1], sampling_params=SAMPLING)
            for i in range(4)
        )
    )
    assert sorted(len(r.requests) for r in reps) == [2, 2]
    assert dict(client.balancer.in_flight) == {reps[0].url: 0, reps[1].url: 0}


# --------------------------------------------------------------------------------------
# failures: retry the same tokens elsewhere, take the replica out, bring it back
# --------------------------------------------------------------------------------------


def _who_served(reps: list[ScriptedReplica]) -> ScriptedReplica:
    (rep,) = [r for r in reps if r.requests]
    return rep


async def test_stopped_replica_mid_run_retries_on_another_and_health_brings_it_back(
    make_replicas, make_client
):
    reps = await make_replicas(2)
    client = make_client(reps)
    registry = client.metrics.registry
    await client.generate("traj", prompt_ids=[1, 2], sampling_params=SAMPLING)
    dead = _who_served(reps)
    other = next(r for r in reps if r is not dead)
    await dead.stop()  # the replica dies between turns

    prompt = [1, 2, *TOKENS, 50]
    out = await client.generate("traj", prompt_ids=prompt, sampling_params=SAMPLING)
    assert out.extra_fields["replica_id"] == other.url
    assert other.requests[0]["prompt"] == prompt  # the same tokens, on the other replica
    assert not client.balancer.is_healthy(dead.url)
    assert client.balancer.sticky_replica_of("traj") == other.url
    assert registry.get_sample_value("rolloutbus_client_retries_total") == 1
    assert (
        registry.get_sample_value(
            "rolloutbus_client_requests_total", {"replica": dead.url, "outcome": "connection_error"}
        )
        == 1
    )
    assert (
        registry.get_sample_value("rolloutbus_client_replica_healthy", {"replica": dead.url}) == 0
    )

    assert (await client.check_health())[dead.url] is False
    await dead.start()  # back on the same port
    assert (await client.check_health())[dead.url] is True
    assert client.balancer.is_healthy(dead.url)
    assert (
        registry.get_sample_value("rolloutbus_client_replica_healthy", {"replica": dead.url}) == 1
    )


async def test_hanging_replica_times_out_and_the_turn_moves(make_replicas, make_client):
    reps = await make_replicas(2)
    client = make_client(reps, request_timeout_s=0.5)
    await client.generate("traj", prompt_ids=[1], sampling_params=SAMPLING)
    stuck = _who_served(reps)
    stuck.mode, stuck.hang_health = "hang", True
    other = next(r for r in reps if r is not stuck)

    out = await client.generate("traj", prompt_ids=[1, 5], sampling_params=SAMPLING)
    assert out.extra_fields["replica_id"] == other.url
    assert stuck.requests[-1]["prompt"] == other.requests[0]["prompt"] == [1, 5]
    assert not client.balancer.is_healthy(stuck.url)
    assert (
        client.metrics.registry.get_sample_value(
            "rolloutbus_client_requests_total", {"replica": stuck.url, "outcome": "timeout"}
        )
        == 1
    )
    assert client.balancer.in_flight[stuck.url] == 0  # released in finally


async def test_server_error_is_retried_but_bad_request_is_not(make_replicas, make_client):
    reps = await make_replicas(2)
    client = make_client(reps)
    for rep in reps:
        rep.mode = "error400"
    with pytest.raises(ReplicaRequestError, match="400: prompt is too long") as info:
        await client.generate("t", prompt_ids=[1], sampling_params=SAMPLING)
    assert info.value.retriable is False and info.value.status_code == 400
    assert sum(len(r.requests) for r in reps) == 1  # no retry
    assert all(client.balancer.is_healthy(r.url) for r in reps)  # not the replica's fault

    reps[0].mode, reps[1].mode = "error500", "ok"
    client.balancer.clear_sticky_cache()
    outs = [
        await client.generate(f"u{i}", prompt_ids=[1], sampling_params=SAMPLING) for i in range(3)
    ]
    assert all(o.extra_fields["replica_id"] == reps[1].url for o in outs)


async def test_all_replicas_failing_raises_with_the_last_failure(make_replicas, make_client):
    reps = await make_replicas(2)
    client = make_client(reps, max_retries=3, unavailable_wait_s=0)
    for rep in reps:
        rep.mode = "error500"
    with pytest.raises(NoReplicaAvailableError, match="engine died") as info:
        await client.generate("t", prompt_ids=[1], sampling_params=SAMPLING)
    assert isinstance(info.value.__cause__, ReplicaRequestError)
    assert [len(r.requests) for r in reps] == [1, 1]
    assert dict(client.balancer.in_flight) == {reps[0].url: 0, reps[1].url: 0}


async def test_retries_are_capped_by_max_retries(make_replicas, make_client):
    reps = await make_replicas(3)
    client = make_client(reps, max_retries=1)
    for rep in reps:
        rep.mode = "error500"
    with pytest.raises(ReplicaRequestError, match="500: engine died"):
        await client.generate("t", prompt_ids=[1], sampling_params=SAMPLING)
    assert sum(len(r.requests) for r in reps) == 2  # first try + one retry


async def test_background_health_checker_brings_a_replica_back(make_replicas, make_client):
    reps = await make_replicas(2)
    client = make_client(reps, health_interval_s=0.05)
    await client.start()
    reps[0].mode = "error500"  # /health answers 503 too
    for _ in range(100):
        if not client.balancer.is_healthy(reps[0].url):
            break
        await asyncio.sleep(0.02)
    assert not client.balancer.is_healthy(reps[0].url)
    reps[0].mode = "ok"
    for _ in range(100):
        if client.balancer.is_healthy(reps[0].url):
            break
        await asyncio.sleep(0.02)
    assert client.balancer.is_healthy(reps[0].url)


async def test_replicas_added_and_removed_at_run_time(make_replicas, make_client):
    reps = await make_replicas(2)
    client = make_client(reps[:1])
    await client.generate("traj", prompt_ids=[1], sampling_params=SAMPLING)
    client.add_replica(reps[1].url + "/")
    assert client.replicas == (reps[0].url, reps[1].url)
    client.remove_replica(reps[0].url)
    out = await client.generate("traj", prompt_ids=[1, 2], sampling_params=SAMPLING)
    assert out.extra_fields["replica_id"] == reps[1].url
    assert (
        client.metrics.registry.get_sample_value(
            "rolloutbus_client_in_flight", {"replica": reps[0].url}
        )
        is None
    )


async def test_latency_and_outcome_metrics(make_replicas, make_client):
    (rep,) = await make_replicas(1)
    client = make_client([rep])
    await client.generate("t", prompt_ids=[1], sampling_params=SAMPLING)
    registry = client.metrics.registry
    labels = {"replica": rep.url}
    assert (
        registry.get_sample_value(
            "rolloutbus_client_requests_total", {**labels, "outcome": "completed"}
        )
        == 1
    )
    assert registry.get_sample_value("rolloutbus_client_request_latency_seconds_count", labels) == 1
    assert registry.get_sample_value("rolloutbus_client_in_flight", labels) == 0


async def test_closed_client_refuses_work(make_replicas, make_client):
    (rep,) = await make_replicas(1)
    client = make_client([rep])
    await client.close()
    await client.close()  # idempotent
    with pytest.raises(Exception, match="closed"):
        await client.generate("t", prompt_ids=[1], sampling_params=SAMPLING)


async def test_a_turn_waits_for_a_restarting_replica_instead_of_failing(make_replicas, make_client):
    [rep] = await make_replicas(1)
    client = make_client([rep], unavailable_wait_s=30)
    rep.mode = "error500"  # its /health answers 503 too: down, as while it restarts

    async def come_back() -> None:
        await asyncio.sleep(1.5)
        rep.mode = "ok"

    back = asyncio.ensure_future(come_back())
    out = await client.generate("t", prompt_ids=[1], sampling_params=SAMPLING)
    await back
    assert out.token_ids and client.balancer.is_healthy(rep.url)


async def test_a_turn_gives_up_when_no_replica_comes_back_in_time(make_replicas, make_client):
    [rep] = await make_replicas(1)
    client = make_client([rep], unavailable_wait_s=1.0)
    rep.mode = "error500"
    started = time.monotonic()
    with pytest.raises(NoReplicaAvailableError):
        await client.generate("t", prompt_ids=[1], sampling_params=SAMPLING)
    assert time.monotonic() - started >= 1.0
