"""V0's vision-language rows: with a processor, ``BusAgentLoopManagerV0``'s
``multi_modal_inputs`` equals verl 0.9.1's own (``AgentLoopWorker._compute_multi_modal_inputs``
then ``_compute_position_ids``), key by key, dtype, shape and value.

Run in the verl side environment (tests/verl_compat/verl_v0_vision_program.py) on
transformers' real ``Qwen2VLProcessor`` built offline (no Qwen-VL checkpoint here; its video
processor is a stand-in, torchvision being absent). Not covered here: taking a visual row's
images from its ``raw_prompt`` (verl's ``RLHFDataset._process_multi_modal_info`` needs
``qwen_vl_utils``, not in the side environment), and M-RoPE ``position_ids``.
"""

from __future__ import annotations

import pytest

from tests.source_tree import ROOT

PROGRAM = ROOT / "tests" / "verl_compat" / "verl_v0_vision_program.py"

pytestmark = pytest.mark.verl


@pytest.fixture(scope="module")
def seen(run_in_verl) -> dict:
    return run_in_verl(str(PROGRAM))


def test_an_image_rows_inputs_equal_verls(seen):
    assert seen["vl"]["differences"] == []
    assert seen["vl"]["keys"] == ["image_grid_thw", "images_seqlens", "pixel_values"]


def test_a_text_row_with_a_processor_equals_verls(seen):
    assert seen["text"]["differences"] == [] and seen["text"]["keys"] == []


def test_the_batch_column_holds_each_rows_inputs(seen):
    assert seen["column_equals_rows"]
    assert seen["column"] == [["image_grid_thw", "images_seqlens", "pixel_values"], []]


def test_the_manager_fills_the_column_from_its_processor(seen):
    assert seen["manager_text_row"]["differences"] == []
