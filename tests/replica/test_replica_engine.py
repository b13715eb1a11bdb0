"""The decode engine without HTTP: sampling maths, batching limits, aborts, errors."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from rolloutbus.config import Config, ModelConfig, ReplicaServerConfig
from rolloutbus.replica.engine import DecodeEngine
from rolloutbus.replica.generation import (
    EngineSampling,
    GenerationRequest,
    RequestRejectedError,
    version_spans,
)
from rolloutbus.replica.sampling import sample_tokens


def _request(
    temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1, **kw
) -> GenerationRequest:
    return GenerationRequest(
        request_id=kw.pop("request_id", "r"),
        prompt_ids=kw.pop("prompt_ids", [1, 2, 3]),
        sampling=EngineSampling(temperature=temperature, top_p=top_p, top_k=top_k),
        **kw,
    )


# -- sampling (pure) ---------------------------------------------------------------------------

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])


def _draw(request: GenerationRequest, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    logits = PROBS.log().expand(n, -1).contiguous()
    tokens, logprobs, _ = sample_tokens(logits, [request] * n, [generator] * n)
    return tokens, logprobs


def test_inverse_cdf_sampling_matches_the_distribution():
    tokens, logprobs = _draw(_request(), 20_000)
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    assert torch.allclose(freq, PROBS, atol=0.015), freq
    assert torch.allclose(logprobs, PROBS.log()[tokens], atol=1e-6)


def test_top_p_keeps_the_smallest_set_reaching_p_and_renormalises():
    tokens, logprobs = _draw(_request(top_p=0.7), 5_000)
    assert set(tokens.tolist()) == {0, 1}
    expected = {0: math.log(0.5 / 0.8), 1: math.log(0.3 / 0.8)}
    assert all(
        abs(lp - expected[t]) < 1e-5
        for t, lp in zip(tokens.tolist(), logprobs.tolist(), strict=True)
    )


def test_top_k_and_temperature():
    tokens, logprobs = _draw(_request(top_k=2, temperature=0.5), 5_000)
    assert set(tokens.tolist()) == {0, 1}
    sharpened = torch.tensor([0.5**2, 0.3**2])
    expected = (sharpened / sharpened.sum()).log()
    assert torch.allclose(logprobs, expected[tokens], atol=1e-5)


def test_greedy_and_sampled_rows_in_one_batch():
    logits = PROBS.log().expand(2, -1).contiguous()
    reqs = [_request(temperature=0.0), _request(top_k=1)]
    tokens, logprobs, _ = sample_tokens(logits, reqs, [None, torch.Generator().manual_seed(0)])
    assert tokens.tolist() == [0, 0]
    assert logprobs.tolist() == pytest.approx([math.log(0.5), 0.0])


# -- the engine loop ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine():
    cfg = Config(
        model=ModelConfig(name="tiny-qwen3"),
        replica_server=ReplicaServerConfig(max_batch_size=4, max_model_len=64, torch_threads=1),
    )
    eng = DecodeEngine.from_config(cfg)
    eng.start()
    yield eng
    eng.stop()


async def test_batch_never_exceeds_max_batch_size(engine):
    engine.stats.batch_sizes.clear()
    requests = [
        _request(prompt_ids=[i + 1] * (i + 2), max_tokens=6, ignore_eos=True, seed=i)
        for i in range(10)
    ]
    results = await asyncio.gather(*[engine.submit(r) for r in requests])
    assert all(len(r.token_ids) == 6 and r.finish_reason == "length" for r in results)
    assert engine.stats.max_batch_size_seen == 4
    assert engine.stats.running == 0 and engine.stats.waiting == 0 and engine.stats.preemptions == 0


async def test_cancelled_request_is_aborted_and_the_batch_goes_on(engine):
    long = asyncio.ensure_future(
        engine.submit(_request(max_tokens=60, ignore_eos=True, prompt_ids=[5]))
    )
    await asyncio.sleep(0.05)
    long.cancel()
    short = await engine.submit(_request(max_tokens=3, ignore_eos=True))
    assert len(short.token_ids) == 3
    for _ in range(100):
        if engine.stats.running == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.stats.running == 0


async def test_a_request_cancelled_while_queued_does_not_stop_the_engine(engine):
    """A client that goes away (a SIGKILLed session worker) while its request still waits
    for a slot: the request ends with no tokens and no version span; the engine goes on."""
    running = [
        asyncio.ensure_future(engine.submit(_request(max_tokens=30, ignore_eos=True, seed=i)))
        for i in range(4)  # every slot taken
    ]
    queued = asyncio.ensure_future(engine.submit(_request(max_tokens=5, ignore_eos=True)))
    await asyncio.sleep(0.05)
    assert engine.stats.waiting >= 1
    queued.cancel()
    results = await asyncio.gather(*running)
    assert all(len(r.token_ids) == 30 for r in results)
    after = await engine.submit(_request(max_tokens=3, ignore_eos=True))
    assert len(after.token_ids) == 3 and engine.healthy


def test_no_version_span_without_tokens():
    assert version_spans([], 0) == []
    assert [s.model_dump() for s in version_spans([(0, 0), (1, 2)], 5)] == [
        {"version": 0, "start": 0, "end": 2},
        {"version": 1, "start": 2, "end": 5},
    ]


async def test_prompt_over_max_model_len_is_rejected(engine):
    with pytest.raises(RequestRejectedError, match="maximum context length is 64"):
        await engine.submit(_request(prompt_ids=[1] * 60, max_tokens=8))
    assert engine.healthy


async def test_eos_as_first_token_finishes_at_prefill(engine):
    greedy = await engine.submit(_request(temperature=0.0, max_tokens=1))
    result = await engine.submit(
        _request(temperature=0.0, max_tokens=5, stop_token_ids=[greedy.token_ids[0]])
    )
    assert result.token_ids == greedy.token_ids and result.finish_reason == "stop"


def test_same_seed_gives_identical_weights_across_loads():
    from rolloutbus.models.causal_lm import load_causal_lm

    a, _ = load_causal_lm(ModelConfig(name="tiny-qwen3", seed=3))
    b, _ = load_causal_lm(ModelConfig(name="tiny-qwen3", seed=3))
    c, _ = load_causal_lm(ModelConfig(name="tiny-qwen3", seed=4))
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_public_surface_is_complete():
    import rolloutbus.replica as replica

    for name in replica.__all__:
        assert getattr(replica, name) is not None, name
    with pytest.raises(AttributeError):
        replica.not_a_name  # noqa: B018
