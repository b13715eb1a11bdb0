"""The policy being trained: a Hugging Face causal LM in float32, and its token logprobs.

It starts from the weights the embedded replica serves for the same ``model`` config (the
tiny random Qwen3 from the same seed, the cached SmolLM2-135M, or a local folder), so
version 0 of the policy is what the replicas sample at first; or from a checkpoint's
``actor/huggingface`` folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rolloutbus.config import ModelConfig
from rolloutbus.errors import ConfigError


def load_policy(model: ModelConfig, folder: Path | None = None) -> Any:
    """The model to train, in train mode and float32 (AdamW on bfloat16 weights loses
    updates smaller than the weights' precision)."""
    if folder is None:
        from rolloutbus.models.causal_lm import load_causal_lm

        lm, _ = load_causal_lm(model.model_copy(update={"dtype": "float32"}))
    else:
        from transformers import AutoModelForCausalLM

        if not (folder / "config.json").is_file():
            raise ConfigError(f"checkpoint folder {folder} has no config.json: not a HF model")
        lm = AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=torch.float32, attn_implementation="sdpa"
        )
    return lm.to(torch.float32).train()


def pad_token_id(lm: Any) -> int:
    """The model's pad id (its EOS when it has none): what padding positions hold. They are
    masked out everywhere, so the id only has to exist in the vocabulary."""
    config = lm.config
    for candidate in (config.pad_token_id, config.eos_token_id, 0):
        if isinstance(candidate, list):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)
    return 0


def response_log_probs(
    lm: Any, tensors: dict[str, torch.Tensor], *, temperature: float = 1.0
) -> torch.Tensor:
    """``log π(response_t | prompt, response_<t)`` for every response slot, ``(rows, R)``.

    Only the response positions go through the LM head (``logits_to_keep``): the logits
    are ``rows x R x vocab`` instead of ``rows x (P + R) x vocab``, the largest tensor of a
    step with a 150k-token vocabulary. Logits are divided by the sampling temperature, as
    verl's actor does, so the logprobs are those of the distribution the replica sampled.
    """
    responses = tensors["responses"]
    width = responses.shape[1]
    out = lm(
        input_ids=tensors["input_ids"],
        attention_mask=tensors["attention_mask"],
        position_ids=tensors["position_ids"],
        logits_to_keep=width + 1,  # position P-1 predicts response token 0
        use_cache=False,
    )
    logits = out.logits[:, :-1, :].float()
    if temperature != 1.0:
        logits = logits / temperature
    chosen = torch.gather(logits, -1, responses.unsqueeze(-1)).squeeze(-1)
    return chosen - torch.logsumexp(logits, dim=-1)
