"""M-RoPE in the padded conversion: a batch whose trajectories recorded their image grids
(``schemas.mrope``, written by the built-in loops from the processor) gets verl's
``(B, 4, L)`` position ids, equal to ``mrope_position_ids`` on the same padded ids (that
function is checked against transformers' Qwen2-VL in tests/producers/test_multimodal.py); a text
batch keeps its ``(B, L)`` ids."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rolloutbus.consumers.mrope import mrope_position_ids
from rolloutbus.consumers.tensors import to_padded
from rolloutbus.schemas.mrope import MROPE_INPUTS_KEY, MropeInputs
from rolloutbus.schemas.trajectories import Trajectory, trajectories_to_batch
from rolloutbus.streams.agent_loop.base import mrope_inputs
from tests.builders import make_trajectory

IMAGE, START, END, PAD = 151655, 151652, 151653, 151643
WIDTHS = {"prompt_length": 24, "response_length": 6, "pad_token_id": PAD}


def _qwen2_vl_processor() -> SimpleNamespace:
    """transformers' real Qwen2-VL image processor (no weights needed); the rest of a
    processor (tokenizer, chat template) is not needed to record the grid."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return SimpleNamespace(image_processor=Qwen2VLImageProcessorPil(), image_token_id=IMAGE)


def _traj(i: int, prompt: list[int], response: list[int], extra: dict) -> Trajectory:
    return make_trajectory(
        "u", i, group_size=3, prompts=prompt, responses=response, extra_fields=extra
    )


def _image_run(grid: tuple[int, int, int], merge: int = 2) -> list[int]:
    t, h, w = grid
    return [START] + [IMAGE] * (t * h * w // merge**2) + [END]


def test_the_loops_record_the_processors_image_grid():
    from PIL import Image

    images = [Image.new("RGB", (56, 84)), Image.new("RGB", (56, 56))]
    recorded = mrope_inputs(_qwen2_vl_processor(), images)
    inputs = MropeInputs.model_validate(recorded[MROPE_INPUTS_KEY])
    assert inputs.image_grid_thw == [(1, 6, 4), (1, 4, 4)]  # (t, h/14, w/14), in image order
    assert inputs.image_token_id == IMAGE and inputs.spatial_merge_size == 2
    assert mrope_inputs(_qwen2_vl_processor(), None) == {}  # a text output records nothing
    assert mrope_inputs(SimpleNamespace(), images) == {}  # not a Qwen2-VL-style processor


def test_a_multimodal_batch_gets_verls_mrope_position_ids():
    from PIL import Image

    images = [Image.new("RGB", (56, 84)), Image.new("RGB", (56, 56))]
    recorded = mrope_inputs(_qwen2_vl_processor(), images)
    grids = recorded[MROPE_INPUTS_KEY]["image_grid_thw"]
    prompt = [1, *_image_run(grids[0]), 2, *_image_run(grids[1]), 3]
    batch = trajectories_to_batch(  # through Arrow, as the trainer client reads them
        [
            _traj(0, prompt, [4, 5, 6], {"finish_reason": "stop", **recorded}),
            _traj(1, [7, 8], [9], {"finish_reason": "stop"}),  # a text row of the batch
        ]
    )
    out = to_padded(batch, **WIDTHS)
    positions = out["position_ids"]
    assert positions.shape == (2, 4, 30)
    mask = out["attention_mask"]
    image_row = mrope_position_ids(
        out["input_ids"][:1],
        mask[:1],
        image_token_id=IMAGE,
        image_grid_thw=torch.tensor(grids),
    )
    text_row = mrope_position_ids(out["input_ids"][1:], mask[1:], image_token_id=IMAGE)
    assert torch.equal(positions, torch.cat([image_row, text_row]))
    # the image tokens really have 3-D positions, and the text after them resumes past them
    assert not torch.equal(positions[0, 2], positions[0, 3])
    assert int(positions[0, 1].max()) < int(positions[0, 0].max())


def test_a_text_batch_keeps_its_position_ids():
    batch = trajectories_to_batch(
        [_traj(0, [1, 2], [3], {"finish_reason": "stop"}), _traj(1, [4], [5, 6], {})]
    )
    out = to_padded(batch, prompt_length=2, response_length=2, pad_token_id=PAD)
    assert out["position_ids"].tolist() == [[0, 1, 2, 2], [0, 0, 1, 2]]


def test_a_grid_that_does_not_fit_the_prompt_names_the_trajectory():
    recorded = {MROPE_INPUTS_KEY: {"image_grid_thw": [[1, 4, 4]], "image_token_id": IMAGE}}
    batch = trajectories_to_batch([_traj(3, [1, *_image_run((1, 2, 2)), 2], [3], recorded)])
    with pytest.raises(ValueError, match="trajectory u_3_0: .*does not match its grid"):
        to_padded(batch, **WIDTHS)
