"""The engine in bfloat16 (``model.dtype: bfloat16``, the fast setting on CPUs with AMX or
AVX-512 BF16) against float32, on SmolLM2-135M: how far its logprobs are from the float32
model's on the same tokens, stated as the tolerance below.

The logprob the engine returns is always that of the (float32) distribution it sampled the
token from; bfloat16 only changes that distribution, by the amounts checked here.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from rolloutbus.config import Config, ModelConfig, ReplicaServerConfig
from rolloutbus.models.causal_lm import load_causal_lm
from rolloutbus.models.tokenizers import load_tokenizer
from rolloutbus.replica.engine import DecodeEngine
from rolloutbus.replica.generation import EngineSampling, GenerationRequest

# nats, |bf16 logprob - fp32 logprob| of a sampled token (T=1); measured on this test's
# 4 x 48 tokens (Xeon with AMX): mean 0.040, max 0.196. The bounds leave room for other
# CPUs' bf16 kernels and other draws; a broken bf16 path (wrong cache, wrong positions)
# is off by nats, not tenths.
MEAN_TOLERANCE = 0.1
MAX_TOLERANCE = 0.6
NEW_TOKENS = 48
QUESTIONS = ["What is the capital of France?", "Name a prime number.", "Why is the sky blue?"]


@pytest.fixture(scope="module")
def fp32_model():
    return load_causal_lm(ModelConfig(name="smollm2-135m", dtype="float32"))[0]


def _prompts() -> list[list[int]]:
    tokenizer = load_tokenizer(ModelConfig(name="smollm2-135m"))
    prompts = []
    for question in QUESTIONS + ["Write one sentence about rivers."]:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


async def _sample_bf16(prompts: list[list[int]]):
    cfg = Config(
        model=ModelConfig(name="smollm2-135m", dtype="bfloat16"),
        replica_server=ReplicaServerConfig(max_batch_size=4, max_model_len=256, torch_threads=1),
    )
    engine = DecodeEngine.from_config(cfg)
    assert engine.model.dtype == torch.bfloat16
    engine.start()
    try:
        requests = [
            GenerationRequest(
                request_id=str(i),
                prompt_ids=p,
                max_tokens=NEW_TOKENS,
                sampling=EngineSampling(temperature=1.0),
                seed=i,
                ignore_eos=True,
            )
            for i, p in enumerate(prompts)
        ]
        return await asyncio.gather(*[engine.submit(r) for r in requests])
    finally:
        engine.stop()


def _teacher_forced(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


@pytest.mark.slow  # the real small model, as test_replica's SmolLM2 test
async def test_bf16_logprobs_are_within_tolerance_of_fp32(fp32_model):
    prompts = _prompts()
    results = await _sample_bf16(prompts)
    diffs = []
    for prompt, result in zip(prompts, results, strict=True):
        assert len(result.token_ids) == NEW_TOKENS
        reference = _teacher_forced(fp32_model, prompt, result.token_ids)
        diffs.append((torch.tensor(result.logprobs) - reference).abs())
    diff = torch.cat(diffs)
    print(f"bf16 vs fp32 logprobs: mean {diff.mean():.4f}, max {diff.max():.4f} nats")
    assert float(diff.mean()) < MEAN_TOLERANCE, float(diff.mean())
    assert float(diff.max()) < MAX_TOLERANCE, float(diff.max())
