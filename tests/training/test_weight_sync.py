"""Weight sync against real embedded replicas (tiny Qwen3, real HTTP) and the real broker:
a version published on rollout.control is loaded into every replica, an in-flight turn
under ``partial_rollout`` spans the old and the new version (and our vLLM client parses both
into verl's min/max_global_steps), the turns after it are sampled by the new weights with
the new version, and a replica that was down gets the current version when it is back."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from rolloutbus.config import (
    AsyncTrainingConfig,
    Config,
    ModelConfig,
    ReplicasConfig,
    ReplicaServerConfig,
)
from rolloutbus.kafka.control import publish_policy_version
from rolloutbus.replica.server import replica_in_thread
from rolloutbus.schemas.control import PolicyVersionPublished
from rolloutbus.streams.inference.weight_sync import WeightSync, sync_steps
from tests.helpers import free_port
from tests.replica_http import greedy_reference, greedy_turn

MAX_MODEL_LEN = 512
LONG = 400  # tokens; ~1-2 s of tiny-model decoding, long enough to sync in the middle
WAIT_S = 60.0  # seconds; a reload of the tiny model takes well under one


def _replica_config(port: int = 0) -> Config:
    return Config(
        model=ModelConfig(name="tiny-qwen3", seed=0),
        replica_server=ReplicaServerConfig(
            port=port, max_batch_size=4, max_model_len=MAX_MODEL_LEN, torch_threads=1
        ),
    )


@pytest.fixture(scope="module")
def replica():
    with replica_in_thread(_replica_config()) as handle:
        yield handle


async def _turn(url: str, max_tokens: int):
    async with httpx.AsyncClient(timeout=WAIT_S) as http:
        return await greedy_turn(http, max_tokens, url=url)


def test_sync_steps_follow_vllm_and_sglang_and_the_partial_rollout_switch():
    event = PolicyVersionPublished(policy_version=3, weights_path="/ckpt/3")
    keep = sync_steps("vllm_completions", event, partial_rollout=True)
    assert [(s.name, s.path) for s in keep] == [
        ("pause", "/pause"),
        ("reload", "/collective_rpc"),
        ("version", "/update_weight_version"),
        ("resume", "/resume"),
    ]
    assert keep[0].params == {"mode": "keep"}
    assert keep[1].json == {"method": "reload_weights", "kwargs": {"weights_path": "/ckpt/3"}}
    assert keep[2].json == {"new_version": "3"}  # vLLM 0.32 takes a string only
    abort = sync_steps("vllm_generate", event, partial_rollout=False)
    assert abort[0].params == {"mode": "abort"}
    sglang = sync_steps("sglang", event, partial_rollout=True)
    assert [s.path for s in sglang] == [
        "/pause_generation",
        "/update_weights_from_disk",
        "/update_weight_version",
        "/continue_generation",
    ]
    assert sglang[0].json == {"mode": "retract"} and sglang[1].json == {"model_path": "/ckpt/3"}
    initial = PolicyVersionPublished(policy_version=0)  # initial weights: the label only
    assert [s.name for s in sync_steps("vllm_completions", initial, partial_rollout=True)] == [
        "version"
    ]


async def test_a_folder_that_is_no_checkpoint_never_reaches_a_replica(replica, tmp_path):
    """vLLM's engine dies on a failed reload, so the sync refuses before the pause."""
    cfg = Config(replicas=ReplicasConfig(urls=[replica.url]))
    async with WeightSync(cfg) as sync:
        [missing] = await sync.apply(
            PolicyVersionPublished(policy_version=9, weights_path=str(tmp_path / "nope"))
        )
        [empty] = await sync.apply(
            PolicyVersionPublished(policy_version=9, weights_path=str(tmp_path))
        )
    assert (missing.outcome, empty.outcome) == ("failed", "failed")
    assert "no such folder" in missing.error and "no *.safetensors" in empty.error
    async with httpx.AsyncClient(base_url=replica.url) as http:
        assert (await http.get("/is_paused")).json() == {"is_paused": False}
    assert (await _turn(replica.url, 2)).extra_fields["max_global_steps"] == 0


async def test_a_published_version_reaches_every_replica_and_the_turns_it_samples(
    replica, seed1, seed1_folder, kafka_config
):
    late_port = free_port()  # a second replica, down at first
    late_url = f"http://127.0.0.1:{late_port}"
    cfg = Config(
        kafka=kafka_config,
        replicas=ReplicasConfig(urls=[replica.url, late_url], health_interval_s=0.5),
        async_training=AsyncTrainingConfig(partial_rollout=True),
    )
    version1 = PolicyVersionPublished(
        policy_version=1, weights_path=str(seed1_folder), global_step=1
    )
    async with WeightSync(cfg) as sync:
        # 1. an in-flight turn: the sync pauses it (keep), loads, relabels, resumes
        turn = asyncio.ensure_future(_turn(replica.url, LONG))
        await _until_running(replica, turn)
        outcomes = {o.url: o.outcome for o in await sync.apply(version1)}
        spanning = await turn
        assert outcomes == {replica.url: "applied", late_url: "failed"}
        assert len(spanning.token_ids) == LONG
        assert spanning.extra_fields["min_global_steps"] == 0
        assert spanning.extra_fields["max_global_steps"] == 1

        # 2. the turns after it: the new weights, the new version
        after = await _turn(replica.url, 8)
        assert after.token_ids == greedy_reference(seed1, 8)
        assert (after.extra_fields["min_global_steps"], after.extra_fields["max_global_steps"]) == (
            1,
            1,
        )

        # 3. the process: it follows the control topic, and the replica that was down gets
        # the current version once it is up (a restarted replica starts on initial weights)
        stop = asyncio.Event()
        runner = asyncio.ensure_future(sync.run(stop))
        try:
            await asyncio.to_thread(publish_policy_version, cfg, version1)  # republished: no-op
            with replica_in_thread(_replica_config(late_port)) as late:
                await _wait_for(lambda: sync.replicas[late_url].applied == 1)
                late_turn = await _turn(late.url, 8)
                assert late_turn.token_ids == greedy_reference(seed1, 8)
                assert late_turn.extra_fields["max_global_steps"] == 1
        finally:
            stop.set()
            await asyncio.wait_for(runner, WAIT_S)
    applied = [o for o in sync.report.history if o.outcome == "applied"]
    assert [(o.url, o.policy_version) for o in applied] == [(replica.url, 1), (late_url, 1)]


async def _until_running(replica, task: asyncio.Future) -> None:
    """Return once the request is in the decode batch with a few tokens sampled."""
    for _ in range(5000):
        if replica.engine.stats.running and replica.engine.stats.generation_tokens > 0:
            return
        assert not task.done(), "the turn ended before the test could sync in its middle"
        await asyncio.sleep(0.002)
    raise AssertionError("the turn never started")


async def _wait_for(condition) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, "the weight sync did not reach the replica"
        await asyncio.sleep(0.1)


async def test_a_vllm_replica_that_restarted_between_probes_is_synced_again(tmp_path):
    """A scripted stand-in for a vLLM server (vLLM does not run in this suite): after the
    sync its /weight_info says "3"; then it restarts between two probes and says "default"
    (its initial weights), so the next probe syncs it again."""
    (tmp_path / "model.safetensors").write_bytes(b"")
    calls: list[str] = []
    served = {"weight_version": "default"}

    def vllm(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if request.url.path == "/update_weight_version":
            served["weight_version"] = json.loads(request.content)["new_version"]
        if request.url.path == "/weight_info":
            return httpx.Response(200, json=served)
        return httpx.Response(200, json={})

    cfg = Config(replicas=ReplicasConfig(urls=["http://vllm:8000"]))
    event = PolicyVersionPublished(policy_version=3, weights_path=str(tmp_path))
    async with WeightSync(cfg, transport=httpx.MockTransport(vllm)) as sync:
        await sync.apply(event)
        assert served == {"weight_version": "3"}
        calls.clear()
        assert await sync.sync_once() == []  # it serves version 3: nothing to do
        assert calls == ["/health", "/weight_info"]
        served["weight_version"] = "default"  # restarted on its initial weights
        [again] = await sync.sync_once()
    assert again.outcome == "applied" and served == {"weight_version": "3"}
