"""The TransferQueue layout the bus sampler writes, without verl: ``rolloutbus.verl.tq_layout``
against what ``AgentLoopWorkerTQ._agent_loop_postprocess`` builds (verl 0.9.1,
``agent_loop_tq.py:150-227``); the end-to-end check is test_verl_trainer_tq.py."""

from __future__ import annotations

import pytest
import torch

from rolloutbus.errors import RolloutBusError
from rolloutbus.schemas.mrope import MROPE_INPUTS_KEY
from rolloutbus.schemas.trajectories import Trajectory
from rolloutbus.verl.tq_layout import is_failed, output_fields, output_key, output_tag


def _trajectory(**changes) -> Trajectory:
    fields = {
        "key": "u1:1:0",
        "uid": "u1",
        "session_id": 1,
        "output_index": 0,
        "num_outputs": 1,
        "group_size": 2,
        "status": "completed",
        "prompts": [5, 6, 7],
        "responses": [8, 9],
        "response_mask": [1, 1],
        "rollout_log_probs": [-0.5, -0.25],
        "reward_score": 1.5,
        "data_source": "even_tokens",
        "global_steps": 4,
        "min_global_steps": 2,
        "max_global_steps": 3,
    }
    return Trajectory.model_validate({**fields, **changes})


def test_the_key_and_the_tensors_are_verls():
    t = _trajectory()
    fields = output_fields(t, global_steps=9)
    assert output_key(t) == "u1_1_0"
    assert torch.equal(fields["input_ids"], torch.tensor([5, 6, 7, 8, 9]))
    assert torch.equal(fields["position_ids"], torch.arange(5))
    assert fields["loss_mask"] is fields["response_mask"]
    assert fields["rm_scores"].tolist() == [0.0, 1.5]  # the score at the last response token
    assert fields["rollout_log_probs"].dtype == torch.float32
    assert fields["prompts"].dtype == fields["responses"].dtype == torch.int64
    assert fields["multi_modal_inputs"] == {}
    assert fields["extra_fields"]["min_global_steps"] == 2


def test_global_steps_come_from_transfer_queue_not_the_record():
    t = _trajectory()
    assert output_fields(t, global_steps=9)["global_steps"] == 9
    assert output_tag(t, global_steps=9) == {
        "status": "success",
        "prompt_len": 3,
        "response_len": 2,
        "seq_len": 5,
        "global_steps": 9,
        "min_global_steps": 2,
        "max_global_steps": 3,
    }


def test_an_unscored_output_has_no_rm_scores_and_a_failed_one_is_failed():
    assert "rm_scores" not in output_fields(_trajectory(reward_score=None), global_steps=1)
    assert is_failed(_trajectory(status="failed", prompts=[], responses=[], response_mask=[]))
    assert not is_failed(_trajectory(status="truncated"))


def test_an_mrope_row_is_refused():
    t = _trajectory(extra_fields={MROPE_INPUTS_KEY: {"image_grid_thw": [[1, 2, 2]]}})
    with pytest.raises(RolloutBusError, match="M-RoPE"):
        output_fields(t, global_steps=1)
