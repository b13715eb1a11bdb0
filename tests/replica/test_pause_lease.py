"""Pauses with an owner: the embedded replica's pause lease (real HTTP, tiny Qwen3), and the
weight sync that takes it, renews it, and at start resumes a replica left paused.

A pause under a lease ends by itself when nobody renews it, on the weights the replica holds
and under a label that tells the truth; the weight sync renews it through a reload of any
length; a vLLM replica (no lease) left paused is resumed by the next weight sync.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import pytest

from rolloutbus.config import Config, ModelConfig, ReplicasConfig, ReplicaServerConfig
from rolloutbus.replica.pause_gate import PauseGate
from rolloutbus.replica.server import replica_in_thread
from rolloutbus.schemas.control import PolicyVersionPublished
from rolloutbus.streams.inference.weight_sync import WeightSync
from tests.helpers import free_port
from tests.replica_http import greedy_reference, greedy_turn, ok, reload_request

WAIT_S = 60.0  # seconds; generous deadline for what a test waits on
LEASE_S = 1.0  # seconds; short, so that a test sees it run out


@pytest.fixture(scope="module")
def replica():
    cfg = Config(
        model=ModelConfig(name="tiny-qwen3", seed=0),
        replica_server=ReplicaServerConfig(
            port=0, max_batch_size=4, max_model_len=256, torch_threads=1
        ),
    )
    with replica_in_thread(cfg) as handle:
        yield handle


@pytest.fixture
async def http(replica, seed0_folder):
    async with httpx.AsyncClient(base_url=replica.url, timeout=WAIT_S) as client:
        yield client
        # each test leaves the replica serving its first weights, labelled 0, resumed
        await ok(client.post("/pause", params={"mode": "keep"}))
        await ok(client.post("/collective_rpc", json=reload_request(seed0_folder)))
        await ok(client.post("/update_weight_version", json={"new_version": 0}))
        await ok(client.post("/resume"))


async def _until_resumed(http: httpx.AsyncClient) -> float:
    """Seconds until /is_paused says false."""
    started = time.monotonic()
    while (await ok(http.get("/is_paused")))["is_paused"]:
        assert time.monotonic() - started < WAIT_S, "the replica stayed paused"
        await asyncio.sleep(0.05)
    return time.monotonic() - started


# -- the replica's lease -------------------------------------------------------------------


async def test_a_pause_whose_lease_runs_out_resumes_on_the_same_weights(replica, http, caplog):
    before = time.time()
    answer = await ok(http.post("/pause", params={"mode": "keep", "lease_s": f"{LEASE_S}"}))
    assert answer["status"] == "paused" and answer["pause_lease_s"] == LEASE_S
    health = await ok(http.get("/health"))
    assert health["is_paused"] is True and health["pause_lease_s"] == LEASE_S
    assert before <= health["paused_since"] <= time.time()

    with caplog.at_level(logging.WARNING):
        held = asyncio.ensure_future(greedy_turn(http, 4))  # sent while paused: held, not refused
        await asyncio.sleep(0.3)
        assert not held.done()
        paused_for = 0.3 + await _until_resumed(http)
        out = await asyncio.wait_for(held, WAIT_S)
    assert paused_for >= LEASE_S - 0.1  # not before its lease ran out
    assert out.extra_fields["weight_version"] == 0  # same weights, same label: the truth
    assert (await ok(http.get("/health")))["paused_since"] is None
    assert "pause lease of 1 s ran out" in caplog.text and "still labelled 0" in caplog.text
    metrics = (await http.get("/metrics")).text
    assert "rolloutbus_replica_pause_lease_expiries_total" in metrics


async def test_renewing_the_lease_keeps_the_replica_paused(http):
    pause = {"mode": "keep", "lease_s": "0.6"}
    await ok(http.post("/pause", params=pause))
    renew_until = time.monotonic() + 2.5  # seconds: four times the lease
    while time.monotonic() < renew_until:
        await asyncio.sleep(0.2)
        assert (await ok(http.get("/is_paused")))["is_paused"] is True
        await ok(http.post("/pause", params=pause))  # same mode: a renewal
    assert await _until_resumed(http) >= 0.3  # the last renewal still held it a while


async def test_after_a_reload_whose_label_never_came_it_resumes_labelled_unknown(
    http, seed1, seed1_folder
):
    """The weight sync died between its reload and its /update_weight_version: the replica
    serves the new weights and must not stamp them with the old version."""
    await ok(http.post("/pause", params={"mode": "keep", "lease_s": f"{LEASE_S}"}))
    await ok(http.post("/collective_rpc", json=reload_request(seed1_folder)))
    await _until_resumed(http)
    label = f"unknown:{seed1_folder}"
    assert (await ok(http.get("/weight_info"))) == {"weight_version": label}
    out = await greedy_turn(http, 6)
    assert out.token_ids == greedy_reference(seed1, 6)  # the reloaded weights sample
    assert out.extra_fields["weight_version"] == label
    assert "min_global_steps" not in out.extra_fields  # no version rather than a wrong one


async def test_a_lease_that_is_no_positive_number_is_refused(http):
    for lease in ("0", "-1", "soon", "inf"):
        response = await http.post("/pause", params={"mode": "keep", "lease_s": lease})
        assert response.status_code == 400 and response.json()["error"]["param"] == "lease_s"
    assert (await ok(http.get("/is_paused")))["is_paused"] is False


def test_a_reload_under_way_holds_the_pause_past_its_lease():
    gate = PauseGate()
    gate.close("keep", lease_s=0.01)
    gate.reload_started()
    time.sleep(0.05)
    assert not gate.lease_expired  # weights must not change under running requests
    gate.reload_ended()
    assert gate.lease_expired
    gate.reload_finished("/ckpt/7")
    assert gate.label_after_lease(6) == "unknown:/ckpt/7"
    gate.labelled()
    assert gate.label_after_lease(7) == 7


def test_a_reload_whose_caller_left_before_it_ran_is_dropped_and_the_engine_lives(replica):
    """The caller of a reload (a weight sync killed mid-reload) hangs up while the work
    still waits for the decode thread: its future is cancelled, the work must not run, and
    the decode loop must not die on the cancelled future (it used to: InvalidStateError)."""
    engine, ran = replica.engine, []
    with engine._cond:  # re-entrant: the decode thread cannot take the work meanwhile
        work = engine._run_in_loop(lambda: ran.append(True))
        assert work.cancel()
    probe = engine._run_in_loop(lambda: None)  # the next control work still runs
    probe.result(timeout=WAIT_S)
    assert ran == [] and engine.healthy


# -- the weight sync that holds the lease ------------------------------------------------------


class SlowReloads(httpx.AsyncBaseTransport):
    """A FAULT INJECTOR in front of real HTTP: each reload request waits ``delay_s`` before
    it reaches the replica (a large checkpoint on a slow disk); records every path sent."""

    def __init__(self, delay_s: float):
        self.delay_s = delay_s
        self.paths: list[str] = []
        self._real = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        if request.url.path == "/collective_rpc":
            await asyncio.sleep(self.delay_s)
        return await self._real.handle_async_request(request)

    async def aclose(self) -> None:
        await self._real.aclose()


async def test_the_weight_sync_renews_its_lease_through_a_reload_longer_than_it(
    http, replica, seed1_folder
):
    """A 0.6 s lease, a reload that takes 2.5 s: without renewals the lease would run out
    and the reload would find the replica resumed (409)."""
    cfg = Config(replicas=ReplicasConfig(urls=[replica.url], pause_lease_s=0.6))
    transport = SlowReloads(delay_s=2.5)
    event = PolicyVersionPublished(policy_version=1, weights_path=str(seed1_folder))
    expiries = replica.engine.pause_gate.lease_expiries
    async with WeightSync(cfg, transport=transport) as sync:
        [outcome] = await sync.apply(event)
    assert outcome.outcome == "applied", outcome.error
    assert transport.paths.count("/pause") >= 4  # the pause and its renewals, every 0.2 s
    assert transport.paths[-1] == "/resume"  # no renewal after the resume
    assert (await ok(http.get("/weight_info"))) == {"weight_version": "1"}
    assert (await ok(http.get("/is_paused")))["is_paused"] is False
    assert replica.engine.pause_gate.lease_expiries == expiries  # the lease never ran out


async def test_a_vllm_pause_grants_no_lease_so_none_is_renewed(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    paths: list[str] = []

    async def vllm(request: httpx.Request) -> httpx.Response:
        paths.append(request.url.path)
        if request.url.path == "/collective_rpc":
            await asyncio.sleep(1.0)
        return httpx.Response(200, json={"status": "paused"} if "pause" in paths[-1] else {})

    cfg = Config(replicas=ReplicasConfig(urls=["http://vllm:8000"], pause_lease_s=0.3))
    event = PolicyVersionPublished(policy_version=2, weights_path=str(tmp_path))
    async with WeightSync(cfg, transport=httpx.MockTransport(vllm)) as sync:
        [outcome] = await sync.apply(event)
    assert outcome.outcome == "applied"
    assert paths == ["/pause", "/collective_rpc", "/update_weight_version", "/resume"]


async def test_at_start_the_weight_sync_names_a_dead_replica_and_resumes_a_paused_one(
    http, replica, caplog
):
    """A pause without a lease (vLLM's kind) left by a weight sync that died."""
    await ok(http.post("/pause", params={"mode": "keep"}))
    dead = f"http://127.0.0.1:{free_port()}"
    cfg = Config(replicas=ReplicasConfig(urls=[replica.url, dead]))
    with caplog.at_level(logging.INFO):
        async with WeightSync(cfg) as sync:
            problems = await sync.check_replicas_at_start()
            resumed = await sync.resume_left_paused()
    assert problems[replica.url] is None and problems[dead].startswith("cannot connect")
    assert f"replica {dead} is unreachable: cannot connect" in caplog.text
    assert "1 of 2 replicas reachable" in caplog.text
    assert resumed == [replica.url]
    assert (await ok(http.get("/is_paused")))["is_paused"] is False
    assert f"replica {replica.url} was paused when the weight sync started" in caplog.text
