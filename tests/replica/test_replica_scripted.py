"""The scripted test double behind the real HTTP server: scripts, hangs and failures."""

from __future__ import annotations

import asyncio
import socket
import threading

import httpx
import pytest

from rolloutbus.config import Config, ReplicaServerConfig
from rolloutbus.errors import ReplicaError
from rolloutbus.replica.scripted import ScriptedEngine, ScriptedTurn
from rolloutbus.replica.server import replica_in_thread, start_replica


def _config() -> Config:
    return Config(replica_server=ReplicaServerConfig(port=0))


async def test_scripted_turns_are_served_in_order_and_say_they_are_scripted():
    engine = ScriptedEngine(
        [ScriptedTurn([5, 6, 7], logprobs=[-0.1, -0.2, -0.3]), [8, 9]], eos_token_ids=frozenset({9})
    )
    async with (
        await start_replica(_config(), engine) as replica,
        httpx.AsyncClient(base_url=replica.url) as client,
    ):
        models = (await client.get("/v1/models")).json()
        assert models["data"][0]["owned_by"] == "scripted-test-double"
        body = {"prompt": [1, 2], "max_tokens": 10, "logprobs": 0, "return_token_ids": True}
        first = (await client.post("/v1/completions", json=body)).json()["choices"][0]
        assert first["token_ids"] == [5, 6, 7] and first["logprobs"]["token_logprobs"] == [
            -0.1,
            -0.2,
            -0.3,
        ]
        assert first["logprobs"]["tokens"] == [
            "token_id:5",
            "token_id:6",
            "token_id:7",
        ]  # no tokenizer
        second = (
            await client.post(
                "/inference/v1/generate",
                json={"token_ids": [3], "sampling_params": {"logprobs": 0}},
            )
        ).json()
        assert (
            second["choices"][0]["token_ids"] == [8, 9]
            and second["choices"][0]["finish_reason"] == "stop"
        )
        exhausted = await client.post("/v1/completions", json=body)
        assert (
            exhausted.status_code == 500 and "no turn left" in exhausted.json()["error"]["message"]
        )
    assert [call.prompt_ids for call in engine.calls] == [[1, 2], [3], [1, 2]]


async def test_scripted_callable_honours_max_tokens_and_stop_ids():
    engine = ScriptedEngine(lambda prompt: list(range(100, 100 + len(prompt) * 3)))
    async with (
        await start_replica(_config(), engine) as replica,
        httpx.AsyncClient(base_url=replica.url) as client,
    ):
        out = (
            await client.post(
                "/generate",
                json={
                    "input_ids": [1, 2, 3],
                    "return_logprob": True,
                    "sampling_params": {"max_new_tokens": 4},
                },
            )
        ).json()
        assert out["output_ids"] == [100, 101, 102, 103]
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
        stopped = (
            await client.post(
                "/generate",
                json={"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [102]}},
            )
        ).json()
        assert stopped["output_ids"] == [100, 101, 102]
        assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": 102}


async def test_hang_then_recover():
    engine = ScriptedEngine(lambda prompt: [1, 2])
    async with (
        await start_replica(_config(), engine) as replica,
        httpx.AsyncClient(base_url=replica.url) as client,
    ):
        engine.hang()
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/v1/completions", json={"prompt": [1]}, timeout=0.3)
        assert (await client.get("/health")).status_code == 200  # hung, not dead
        engine.recover()
        ok = await client.post("/v1/completions", json={"prompt": [1], "return_token_ids": True})
        assert ok.json()["choices"][0]["token_ids"] == [1, 2]


async def test_fail_is_a_500_and_unhealthy():
    engine = ScriptedEngine(lambda prompt: [1])
    async with (
        await start_replica(_config(), engine) as replica,
        httpx.AsyncClient(base_url=replica.url) as client,
    ):
        engine.fail("replica on fire")
        response = await client.post("/v1/completions", json={"prompt": [1]})
        assert (
            response.status_code == 500 and "replica on fire" in response.json()["error"]["message"]
        )
        assert (await client.get("/health")).status_code == 503
        engine.recover()
        assert (await client.get("/health")).status_code == 200


async def test_token_delay_slows_the_reply():
    engine = ScriptedEngine(lambda prompt: [1, 2, 3, 4], token_delay_s=0.05)
    async with (
        await start_replica(_config(), engine) as replica,
        httpx.AsyncClient(base_url=replica.url) as client,
    ):
        out = (await client.post("/generate", json={"input_ids": [1]})).json()
        assert out["meta_info"]["e2e_latency"] >= 0.2


async def test_scripted_control_surface_pauses_aborts_and_records_reloads(tmp_path):
    engine = ScriptedEngine(lambda prompt: list(range(10, 30)), token_delay_s=0.05)
    body = {"prompt": [1], "max_tokens": 20, "return_token_ids": True}
    async with (
        await start_replica(_config(), engine) as replica,
        httpx.AsyncClient(base_url=replica.url) as client,
    ):
        refused = await client.post(
            "/collective_rpc",
            json={"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path)}},
        )
        assert refused.status_code == 409 and "POST /pause" in refused.json()["error"]["message"]
        running = asyncio.ensure_future(client.post("/v1/completions", json=body))
        await asyncio.sleep(0.3)  # ~6 of its 20 tokens
        assert (await client.post("/pause", params={"mode": "abort"})).status_code == 200
        aborted = (await running).json()["choices"][0]
        assert aborted["finish_reason"] == "abort" and 0 < len(aborted["token_ids"]) < 20
        reload = await client.post(
            "/collective_rpc",
            json={"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path)}},
        )
        assert reload.json() == {"results": [None]} and engine.reloads == [str(tmp_path)]
        await client.post("/update_weight_version", json={"new_version": 2})
        held = asyncio.ensure_future(client.post("/v1/completions", json=body))
        await asyncio.sleep(0.1)
        assert not held.done()  # waits for /resume
        await client.post("/resume")
        later = (await held).json()["choices"][0]
        assert later["finish_reason"] == "length" and len(later["token_ids"]) == 20


def _serving_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "rolloutbus-replica-http"]


def test_replica_in_thread_serves_from_its_own_thread_and_leaves_nothing_behind():
    engine = ScriptedEngine([[5]])
    with replica_in_thread(_config(), engine) as replica:
        assert httpx.get(f"{replica.url}/health").json()["status"] == "ok"
        assert _serving_threads() == ["rolloutbus-replica-http"]
    assert not engine.healthy  # stopped by the block's end
    assert _serving_threads() == []


def test_replica_in_thread_that_cannot_listen_raises_and_leaves_no_thread():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = Config(replica_server=ReplicaServerConfig(host="127.0.0.1", port=port))
        with pytest.raises(ReplicaError, match=f"cannot listen on 127.0.0.1:{port}"):
            with replica_in_thread(cfg, ScriptedEngine([[5]])):
                pass
    assert _serving_threads() == []
