"""``multi_modal_inputs`` of V0's rows when the model has a processor, as verl 0.9.1 builds it.

verl's ``AgentLoopWorker._compute_multi_modal_inputs`` (``agent_loop.py:868-918``), per row:
collapse each run of image (or video) placeholder ids in the padded ``input_ids`` to one,
decode with ``skip_special_tokens=True``, run the processor on that text and the row's
images (``build_multimodal_processor_inputs``), drop ``input_ids`` and ``attention_mask``,
add ``images_seqlens`` from ``image_grid_thw``. ``_compute_position_ids`` then pops
``mm_token_type_ids`` for a processor with ``get_rope_index``; the dict verl returns is the
one left after that. The row's images are what verl's agent loop takes from its
``raw_prompt`` messages (``RLHFDataset._process_multi_modal_info``, which needs
``qwen_vl_utils`` for a visual row).

Without a processor verl leaves ``{}`` per row, as ``v0_batch`` does.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from rolloutbus.verl.extra import require_verl

__all__ = ["load_processor", "multi_modal_column", "multi_modal_inputs", "row_images"]

DEFAULT_PATCH_SIZE = 14  # verl's fallback when the image processor names none


def load_processor(config: Any) -> Any:
    """verl's processor for ``actor_rollout_ref.model.path`` (``hf_processor``: None for a
    text-only model), loaded only from a local folder, so nothing is fetched from a hub."""
    from omegaconf import DictConfig, OmegaConf

    tree = config if isinstance(config, DictConfig) else OmegaConf.create(dict(config or {}))
    path = OmegaConf.select(tree, "actor_rollout_ref.model.path", default=None)
    if not path or not os.path.isdir(str(path)):
        return None
    tokenizer = require_verl("verl.utils.tokenizer.tokenizer", what="a V0 VL processor")
    trust = bool(OmegaConf.select(tree, "actor_rollout_ref.model.trust_remote_code", default=False))
    return tokenizer.hf_processor(str(path), trust_remote_code=trust)


def row_images(messages: Any, processor: Any, data_config: Any = None) -> list[Any] | None:
    """The images verl's agent loop takes from a row's ``raw_prompt`` messages."""
    dataset = require_verl("verl.utils.dataset.rl_dataset", what="V0 VL rows")
    patch = getattr(getattr(processor, "image_processor", None), "patch_size", DEFAULT_PATCH_SIZE)
    images, _videos, _audios = dataset.RLHFDataset._process_multi_modal_info(
        list(messages), image_patch_size=patch, config=data_config
    )
    return images


def multi_modal_inputs(
    processor: Any,
    input_ids: torch.Tensor,
    images: Sequence[Any] | None,
    mm_processor_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, torch.Tensor]:
    """One row's ``multi_modal_inputs`` (``input_ids``: the row's padded prompt‖response)."""
    verl_tokenizer = require_verl("verl.utils.tokenizer.tokenizer", what="V0 VL rows")
    token_id = verl_tokenizer.get_processor_token_id
    collapse = {
        t for t in (token_id(processor, "image"), token_id(processor, "video")) if t is not None
    }
    collapsed: list[int] = []
    for tid in input_ids.reshape(-1).tolist():
        if not (tid in collapse and collapsed and collapsed[-1] == tid):
            collapsed.append(tid)
    text = processor.tokenizer.decode(collapsed, skip_special_tokens=True)
    out = verl_tokenizer.build_multimodal_processor_inputs(
        processor, text=[text], images=images, mm_processor_kwargs=dict(mm_processor_kwargs or {})
    )
    out.pop("input_ids", None)
    out.pop("attention_mask", None)
    inputs = dict(out.convert_to_tensors("pt"))
    grid = inputs.get("image_grid_thw")
    if grid is not None:
        inputs["images_seqlens"] = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0])
    if hasattr(processor, "get_rope_index"):
        inputs.pop("mm_token_type_ids", None)  # _compute_position_ids pops it
    return inputs


def multi_modal_column(
    processor: Any,
    input_ids: torch.Tensor,
    images: Sequence[Sequence[Any] | None],
    mm_processor_kwargs: Mapping[str, Any] | None = None,
) -> np.ndarray:
    """The ``multi_modal_inputs`` column of a V0 batch: one dict per row."""
    column = np.empty(len(images), dtype=object)
    column[:] = [
        multi_modal_inputs(processor, input_ids[i], images[i], mm_processor_kwargs)
        for i in range(len(images))
    ]
    return column
