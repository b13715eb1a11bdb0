"""Run in the verl 0.9.1 side environment: ``multi_modal_inputs`` of V0 rows, the bus's
(``rolloutbus.verl.v0_vision``) against verl's own ``AgentLoopWorker._compute_multi_modal_inputs``
and ``_compute_position_ids`` (tests/verl_compat/test_verl_trainer_v0_vision.py).

The processor is transformers' real ``Qwen2VLProcessor``, built offline: its PIL image
processor with default settings, the real Qwen3 tokenizer (tiny-qwen3's, which holds Qwen's
vision tokens), ``Qwen2VLConfig()`` and ``Qwen2VLModel.get_rope_index`` bound as verl's
``hf_processor`` binds them. No Qwen-VL checkpoint is on this machine, so no model files are
read. The video processor is a stand-in (``BaseVideoProcessor`` itself, its class check
skipped: transformers' Qwen2-VL one needs torchvision, absent here); no row has a video.
Prints one JSON line.
"""

from __future__ import annotations

import json
import types
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import Qwen2VLConfig, Qwen2VLProcessor
from transformers.models.qwen2_vl import Qwen2VLModel
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.video_processing_utils import BaseVideoProcessor
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

from rolloutbus.config import ModelConfig
from rolloutbus.models.tokenizers import load_tokenizer
from rolloutbus.verl import BusAgentLoopManagerV0
from rolloutbus.verl.v0_vision import multi_modal_column, multi_modal_inputs

PROMPT_LENGTH, RESPONSE_LENGTH = 48, 8


def _processor() -> Any:
    # transformers checks video_processor against its top-level BaseVideoProcessor, a dummy
    # that raises without torchvision: skip that one check (no row has a video)
    check = Qwen2VLProcessor.check_argument_for_proper_class

    def check_but_video(self: Any, name: str, arg: Any) -> Any:
        return None if name == "video_processor" else check(self, name, arg)

    Qwen2VLProcessor.check_argument_for_proper_class = check_but_video
    tokenizer = load_tokenizer(ModelConfig(name="tiny-qwen3"))
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessorPil(),
        tokenizer=tokenizer,
        video_processor=BaseVideoProcessor(),
    )
    processor.config = Qwen2VLConfig()
    for name in ("get_rope_index", "get_vision_position_ids"):  # as hf_processor binds them
        setattr(processor, name, types.MethodType(getattr(Qwen2VLModel, name), processor))
    return processor


def _row(tok: Any, image_pads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A padded prompt‖response: the prompt holds one image's expanded placeholders."""
    vision = (
        "<|vision_start|>" + "<|image_pad|>" * image_pads + "<|vision_end|>" if image_pads else ""
    )
    prompt = tok.encode(
        f"<|im_start|>user\n{vision}What is shown?<|im_end|>\n<|im_start|>assistant\n"
    )
    response = tok.encode("A square.")
    pad = tok.pad_token_id
    ids = (
        [pad] * (PROMPT_LENGTH - len(prompt))
        + prompt
        + response
        + [pad] * (RESPONSE_LENGTH - len(response))
    )
    mask = [0] * (PROMPT_LENGTH - len(prompt)) + [1] * (len(prompt) + len(response))
    mask += [0] * (RESPONSE_LENGTH - len(response))
    return torch.tensor([ids]), torch.tensor([mask])


def _verls(processor: Any, input_ids: torch.Tensor, mask: torch.Tensor, images: Any) -> dict:
    worker = SimpleNamespace(
        processor=processor,
        tokenizer=processor.tokenizer,
        mm_processor_kwargs={},
        _get_mm_processor_kwargs=lambda audios=None: {},
    )
    output = SimpleNamespace(
        multi_modal_data={"images": images} if images else {}, mm_processor_kwargs=None
    )
    inputs = AgentLoopWorker._compute_multi_modal_inputs(worker, output, input_ids)
    AgentLoopWorker._compute_position_ids(
        worker, input_ids, mask, inputs, None
    )  # pops as verl does
    return inputs


def _differences(ours: dict, theirs: dict) -> list[str]:
    out = [f"keys: {sorted(ours)} != {sorted(theirs)}"] if sorted(ours) != sorted(theirs) else []
    for key in sorted(set(ours) & set(theirs)):
        a, b = ours[key], theirs[key]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            out.append(f"{key}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}")
    return out


def main() -> None:
    processor = _processor()
    tok = processor.tokenizer
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 255, (56, 56, 3), dtype=np.uint8))
    pads = (
        int(processor.image_processor(images=[image], return_tensors="pt")["image_grid_thw"].prod())
        // 4
    )
    vl_ids, vl_mask = _row(tok, pads)
    text_ids, text_mask = _row(tok, 0)
    ours_vl = multi_modal_inputs(processor, vl_ids[0], [image])
    ours_text = multi_modal_inputs(processor, text_ids[0], None)
    column = multi_modal_column(processor, torch.cat([vl_ids, text_ids]), [[image], None])
    manager = BusAgentLoopManagerV0.__new__(BusAgentLoopManagerV0)  # only its processor is used
    manager.config, manager.processor = None, processor
    text_rows = {"raw_prompt": np.array([[{"role": "user", "content": "hi"}]], dtype=object)}
    out = SimpleNamespace(
        non_tensor_batch={"__num_turns__": np.array([2])}, batch={"input_ids": text_ids}
    )
    by_manager = manager._multi_modal(text_rows, out)
    print(
        json.dumps(
            {
                "vl": {
                    "keys": sorted(ours_vl),
                    "differences": _differences(
                        ours_vl, _verls(processor, vl_ids, vl_mask, [image])
                    ),
                },
                "text": {
                    "keys": sorted(ours_text),
                    "differences": _differences(
                        ours_text, _verls(processor, text_ids, text_mask, None)
                    ),
                },
                "column": [sorted(row) for row in column],
                "column_equals_rows": not _differences(column[0], ours_vl)
                and not _differences(column[1], ours_text),
                "manager_text_row": {
                    "keys": sorted(by_manager[0]),
                    "differences": _differences(by_manager[0], ours_text),
                },
            }
        )
    )


if __name__ == "__main__":
    main()
