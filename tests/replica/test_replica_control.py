"""The replica's RL control surface over real HTTP with the tiny Qwen3 (vLLM dev mode's API):
pause (abort / wait / keep), resume, reload_weights through /collective_rpc, and the weight
version stamped on the tokens each version sampled."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import torch

from rolloutbus.config import Config, ModelConfig, ReplicaServerConfig
from rolloutbus.replica.server import replica_in_thread
from tests.replica_http import PROMPT, greedy_reference, ok, reload_request

MAX_MODEL_LEN = 512
LONG = 400  # tokens; ~1-2 s of tiny-model decoding, long enough to pause in the middle


def _config() -> Config:
    return Config(
        model=ModelConfig(name="tiny-qwen3", seed=0),
        replica_server=ReplicaServerConfig(
            port=0, max_batch_size=8, max_model_len=MAX_MODEL_LEN, torch_threads=1
        ),
    )


@pytest.fixture(scope="module")
def replica():
    with replica_in_thread(_config()) as handle:
        yield handle


@pytest.fixture
async def client(replica):
    async with httpx.AsyncClient(base_url=replica.url, timeout=60) as c:
        yield c
    # Each test leaves the replica serving, with its first weights and version 0.
    async with httpx.AsyncClient(base_url=replica.url, timeout=60) as c:
        await c.post("/resume")


async def _generate(client: httpx.AsyncClient, max_tokens: int, **fields: object) -> dict:
    body = {
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "return_weight_versions": True,
    }
    body.update(fields)
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


async def _until_running(replica, task: asyncio.Task) -> None:
    """Return once the request is in the decode batch with a few tokens sampled."""
    for _ in range(2000):
        if replica.engine.stats.running and replica.engine.stats.generation_tokens > 0:
            await asyncio.sleep(0.05)
            return
        assert not task.done(), "the request ended before the test could pause it"
        await asyncio.sleep(0.002)
    raise AssertionError("the request never started")


async def _restore(client: httpx.AsyncClient, folder: Path) -> None:
    await ok(client.post("/pause"))
    await ok(client.post("/collective_rpc", json=reload_request(folder)))
    await ok(client.post("/update_weight_version", json={"new_version": 0}))
    await ok(client.post("/resume"))


async def test_reload_weights_changes_greedy_outputs_to_the_saved_models(
    client, seed0, seed1, seed1_folder, tmp_path
):
    before = await _generate(client, 8)
    assert before["token_ids"] == greedy_reference(seed0, 8)

    assert await ok(client.get("/is_paused")) == {"is_paused": False}
    assert await ok(client.post("/pause", params={"clear_cache": "false"})) == {"status": "paused"}
    assert await ok(client.get("/is_paused")) == {"is_paused": True}
    assert await ok(client.post("/collective_rpc", json=reload_request(seed1_folder))) == {
        "results": [None]
    }
    assert await ok(client.get("/weight_info")) == {"weight_version": "0"}
    await ok(client.post("/update_weight_version", json={"new_version": "step-1"}))
    assert await ok(client.get("/weight_info")) == {"weight_version": "step-1"}  # as vLLM's
    assert await ok(client.post("/resume")) == {"status": "resumed"}

    after = await _generate(client, 8)
    assert after["token_ids"] == greedy_reference(seed1, 8) != before["token_ids"]
    assert after["weight_versions"] == [{"version": "step-1", "start": 0, "end": 8}]

    # A plain safetensors state dict (no config.json, tied lm_head left out) loads too.
    from safetensors.torch import save_file

    plain = tmp_path / "plain"
    plain.mkdir()
    state = {k: v.contiguous() for k, v in seed0.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(plain / "weights.safetensors"))
    await _restore(client, plain)
    assert (await _generate(client, 8))["token_ids"] == before["token_ids"]


async def test_keep_freezes_a_request_that_then_spans_two_weight_versions(
    replica, client, seed1_folder, seed0_folder
):
    task = asyncio.ensure_future(_generate(client, LONG))
    await _until_running(replica, task)
    await ok(client.post("/pause", params={"mode": "keep"}))
    frozen = replica.engine.stats.generation_tokens
    await ok(client.post("/collective_rpc", json=reload_request(seed1_folder)))
    await ok(client.post("/update_weight_version", json={"new_version": 1}))
    await asyncio.sleep(0.2)
    assert not task.done() and replica.engine.stats.generation_tokens == frozen  # frozen
    await ok(client.post("/resume"))
    choice = await task

    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == LONG
    old, new = choice["weight_versions"]
    assert old["version"] == 0 and new["version"] == 1
    assert old["start"] == 0 and 0 < old["end"] == new["start"] < LONG and new["end"] == LONG
    await _restore(client, seed0_folder)


async def test_abort_ends_requests_with_their_tokens_and_new_ones_wait_for_resume(replica, client):
    running = asyncio.ensure_future(_generate(client, LONG))
    await _until_running(replica, running)
    await ok(client.post("/pause"))  # mode abort is vLLM's default
    aborted = await asyncio.wait_for(running, 5)
    assert aborted["finish_reason"] == "abort"
    assert 0 < len(aborted["token_ids"]) < LONG
    assert len(aborted["logprobs"]["token_logprobs"]) == len(aborted["token_ids"])

    arriving = asyncio.ensure_future(_generate(client, 4))
    await asyncio.sleep(0.3)
    assert not arriving.done()  # queued while paused, not refused
    await ok(client.post("/resume"))
    later = await asyncio.wait_for(arriving, 10)
    assert later["finish_reason"] == "length" and len(later["token_ids"]) == 4
    # The aborted tokens are the start of what the same greedy request decodes in full.
    assert (await _generate(client, len(aborted["token_ids"])))["token_ids"] == aborted["token_ids"]


async def test_wait_returns_once_running_requests_have_finished(replica, client):
    running = asyncio.ensure_future(_generate(client, LONG // 2))
    await _until_running(replica, running)
    await ok(client.post("/pause", params={"mode": "wait"}))
    assert running.done()
    choice = running.result()
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == LONG // 2


@pytest.mark.parametrize(
    ("paused", "body", "status", "words"),
    [
        (True, {"method": "reset_weights"}, 400, "'reset_weights' is not a collective_rpc"),
        (True, {"method": "reload_weights"}, 400, "kwargs.weights_path"),
        (True, reload_request(Path("/nonexistent/step-9")), 400, "is not a folder"),
        (True, "empty", 400, "no *.safetensors"),
        (True, "wrong-shape", 400, "shape mismatch for ['model.norm.weight: (3,)"),
        (True, "missing", 400, "missing from the folder, e.g. ['model.norm.weight']"),
        (False, "seed1", 409, "not paused; POST /pause"),
    ],
)
async def test_reload_errors_name_the_problem(
    client, seed0, seed1_folder, tmp_path, paused, body, status, words
):
    if isinstance(body, str):
        body = reload_request(_bad_folder(body, tmp_path, seed0, seed1_folder))
    if paused:
        await ok(client.post("/pause"))
    response = await client.post("/collective_rpc", json=body)
    assert response.status_code == status, response.text
    assert words in response.json()["error"]["message"]
    # The served weights are untouched: greedy tokens still come from seed 0.
    await client.post("/resume")
    assert (await _generate(client, 4))["token_ids"] == greedy_reference(seed0, 4)


def _bad_folder(kind: str, tmp_path: Path, model, seed1_folder: Path) -> Path:
    from safetensors.torch import save_file

    if kind == "seed1":
        return seed1_folder
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    if kind == "wrong-shape":
        state["model.norm.weight"] = torch.ones(3)
    if kind == "missing":
        del state["model.norm.weight"]
    if kind != "empty":
        save_file(state, str(tmp_path / "model.safetensors"))
    return tmp_path


async def test_bad_pause_mode_is_400(client):
    response = await client.post("/pause", params={"mode": "sleep"})
    assert response.status_code == 400 and "abort, wait, keep" in response.text
    assert (await ok(client.get("/is_paused")))["is_paused"] is False
