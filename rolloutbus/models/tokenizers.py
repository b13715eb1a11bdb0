"""The tokenizer and the multimodal processor of a model name (``models.catalog``).

The session workers, the gateway, the row checks, the trainer and the replica all load
them from here: they must agree on the token ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rolloutbus.config import ModelConfig
from rolloutbus.models.catalog import (
    SMOLLM2,
    TINY_QWEN2_VL,
    TINY_QWEN3,
    qwen3_tokenizer_dir,
    tiny_qwen2_vl_folder,
    unknown_model_error,
)

__all__ = ["load_processor", "load_tokenizer"]


def load_tokenizer(model: ModelConfig) -> Any:
    """The tokenizer that matches ``model``; the workers and the replica must agree on it."""
    from transformers import AutoTokenizer

    if model.name == TINY_QWEN3:
        return AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir()))
    if model.name == SMOLLM2:
        from rolloutbus.models.smollm2 import smollm2_tokenizer  # cached export of the GGUF

        return smollm2_tokenizer(model)
    if model.name == TINY_QWEN2_VL:
        return AutoTokenizer.from_pretrained(str(tiny_qwen2_vl_folder(model)))
    path = Path(model.name)
    if path.is_dir():
        return AutoTokenizer.from_pretrained(str(path))
    raise unknown_model_error(model)


def load_processor(model: ModelConfig) -> Any:
    """The multimodal processor that matches ``model`` (what verl hands an agent loop as
    ``processor``), or None for a text model: the loops then refuse images, saying so."""
    if model.name == TINY_QWEN2_VL:
        from rolloutbus.models.tiny_vl import load_tiny_qwen2_vl_processor

        return load_tiny_qwen2_vl_processor(tiny_qwen2_vl_folder(model))
    path = Path(model.name)
    if path.is_dir() and (path / "preprocessor_config.json").is_file():
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(str(path))
    return None
