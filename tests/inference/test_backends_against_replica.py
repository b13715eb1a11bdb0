"""Our LLM client against the embedded replica (a real torch model over HTTP), per backend,
and the policy version flowing from the replica into the turn log."""

from __future__ import annotations

import httpx
import pytest

from rolloutbus.config import Config, with_overrides
from rolloutbus.replica.server import replica_in_thread
from rolloutbus.streams.inference.llm_client import LLMClient
from rolloutbus.streams.sessions.recorder import RecordingLLMClient

PROMPT = [151644, 872, 198, 3838, 374, 220, 17, 10, 17, 30, 151645, 198, 151644, 77091, 198]
GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "logprobs": True, "max_tokens": 8}


@pytest.fixture(scope="module")
def replica():
    cfg = Config.model_validate({"model": {"name": "tiny-qwen3"}, "replica_server": {"port": 0}})
    with replica_in_thread(cfg) as handle:
        yield cfg, handle


@pytest.mark.parametrize("backend", ["vllm_completions", "vllm_generate", "sglang"])
async def test_every_backend_gets_the_same_greedy_tokens(replica, backend):
    cfg, handle = replica
    cfg = with_overrides(cfg, {"replicas.urls": [handle.url], "replicas.backend": backend})
    async with LLMClient(cfg.replicas, cfg.rollout) as client:
        out = await client.generate("traj", prompt_ids=PROMPT, sampling_params=GREEDY)
        reference = await _completions(cfg, handle.url)
    assert out.token_ids == reference.token_ids and len(out.token_ids) == 8
    assert out.log_probs == pytest.approx(reference.log_probs, abs=1e-5)
    assert out.stop_reason == "completed"


async def _completions(cfg: Config, url: str):
    cfg = with_overrides(cfg, {"replicas.urls": [url], "replicas.backend": "vllm_completions"})
    async with LLMClient(cfg.replicas, cfg.rollout) as client:
        return await client.generate("ref", prompt_ids=PROMPT, sampling_params=GREEDY)


async def test_weight_version_is_stamped_on_each_turn(replica):
    cfg, handle = replica
    cfg = with_overrides(
        cfg, {"replicas.urls": [handle.url], "replicas.backend": "vllm_completions"}
    )
    events = []

    async def emit(event):
        events.append(event)

    async with LLMClient(cfg.replicas, cfg.rollout) as client:
        rec = RecordingLLMClient(client, emit, uid="u", session_id=0, attempt="a")
        httpx.post(
            f"{handle.url}/update_weight_version", json={"new_version": 3}
        ).raise_for_status()
        first = await rec.generate("t", prompt_ids=PROMPT, sampling_params=GREEDY)
        httpx.post(
            f"{handle.url}/update_weight_version", json={"new_version": 4}
        ).raise_for_status()
        await rec.generate("t", prompt_ids=PROMPT + first.token_ids + [198], sampling_params=GREEDY)
    versions = [e.policy_version for e in events if e.type == "generation"]
    assert versions == [3, 4]
    assert rec.segments[0].versions_until(10_000) == [3, 4]  # the fold's min/max come from these


async def test_aborted_turn_is_resumed_from_prompt_plus_tokens_so_far():
    """Partial rollout (verl's fully-async client): the scripted replica (a test double)
    aborts the first call, as an engine paused for a weight update does."""
    from rolloutbus.replica.scripted import ScriptedEngine, ScriptedTurn

    engine = ScriptedEngine(
        [
            ScriptedTurn([5, 6], [-0.1, -0.2], finish_reason="abort"),
            ScriptedTurn([7, 8, 9], [-0.3, -0.4, -0.5], finish_reason="stop"),
        ]
    )
    cfg = Config.model_validate(
        {
            "replica_server": {"port": 0},
            "rollout": {"response_length": 10},
            "replicas": {"abort_retry_delay_s": 0.0},
        }
    )
    with replica_in_thread(cfg, engine) as handle:
        cfg = with_overrides(cfg, {"replicas.urls": [handle.url]})
        async with LLMClient(cfg.replicas, cfg.rollout) as client:
            out = await client.generate(
                "t", prompt_ids=[1, 2, 3], sampling_params={"logprobs": True}
            )
    first, second = engine.calls
    assert second.prompt_ids == [1, 2, 3, 5, 6]  # prompt + the tokens sampled before the abort
    assert second.max_tokens == first.max_tokens - 2  # the remaining budget
    assert out.token_ids == [5, 6, 7, 8, 9]
    assert out.log_probs == pytest.approx([-0.1, -0.2, -0.3, -0.4, -0.5])
    assert out.stop_reason == "completed" and out.extra_fields["resumed_after_abort"] == 1


async def test_an_engine_that_keeps_aborting_is_given_up_on():
    from rolloutbus.replica.scripted import ScriptedEngine, ScriptedTurn

    engine = ScriptedEngine(lambda prompt: ScriptedTurn([], [], finish_reason="abort"))
    cfg = Config.model_validate(
        {
            "replica_server": {"port": 0},
            "replicas": {"abort_retry_delay_s": 0.0, "max_abort_resumes": 3},
        }
    )
    with replica_in_thread(cfg, engine) as handle:
        cfg = with_overrides(cfg, {"replicas.urls": [handle.url]})
        async with LLMClient(cfg.replicas, cfg.rollout) as client:
            out = await client.generate("t", prompt_ids=[1], sampling_params={})
    assert out.stop_reason == "aborted" and len(engine.calls) == 4
