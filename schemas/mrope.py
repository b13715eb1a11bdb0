"""What a trajectory records so that its M-RoPE position ids can be computed downstream.

verl computes a vision-language sample's ``(4, L)`` position ids in its agent-loop worker
from the processor's output (``multi_modal_inputs["image_grid_thw"]``). Here the trainer
side pads the batch (``consumers/tensors.py``) with no processor, so the agent loop records
the few numbers it needs, once per output, in ``extra_fields[MROPE_INPUTS_KEY]`` (which
reaches the trajectory's ``extra_fields`` column unchanged): each image's ``(t, h, w)``
patch grid, the image placeholder token id and the processor's spatial merge size. The
pixels stay out of it: only the grid decides positions.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["MROPE_INPUTS_KEY", "MropeInputs"]

MROPE_INPUTS_KEY = "mrope_inputs"  # the key in AgentLoopOutput/Trajectory extra_fields


class MropeInputs(BaseModel):
    """One output's M-RoPE inputs: its images' patch grids in prompt order."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    image_grid_thw: list[tuple[int, int, int]] = Field(min_length=1)  # the processor's rows
    image_token_id: int  # the placeholder token each image's run consists of
    spatial_merge_size: int = Field(default=2, ge=1)  # Qwen2-VL's image_processor.merge_size
