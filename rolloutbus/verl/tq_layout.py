"""The TransferQueue layout of verl 0.9.1's V1 trainer, from the bus's trajectory records.

verl's ``AgentLoopWorkerTQ._agent_loop_postprocess`` (``verl/trainer/ppo/v1/agent_loop_tq.py``)
writes one key per agent-loop output, ``{uid}_{session_id}_{i}``, in partition ``train`` or
``val``; this builds the same fields and tags from a ``Trajectory``:

| field | from the record |
|---|---|
| ``prompts``, ``responses``, ``response_mask`` (= ``loss_mask``) | int64 token lists |
| ``input_ids`` | ``prompts`` then ``responses`` |
| ``position_ids`` | ``arange`` (text; M-RoPE rows are refused) |
| ``rollout_log_probs``, ``rm_scores`` | float32, when present (``reward_score`` at -1) |
| ``num_turns``, ``metrics``, ``extra_fields``, ``multi_modal_inputs`` (``{}``) | as verl |
| ``uid``, ``session_id``, ``global_steps``, ``raw_prompt``, dataset columns | the row |

The tag's and field's ``global_steps`` come from TransferQueue's prompt tag, not from the
record: verl resets it when it re-dispatches a prompt after a restart.
"""

from __future__ import annotations

from typing import Any

import torch

from rolloutbus.errors import RolloutBusError
from rolloutbus.schemas.mrope import MROPE_INPUTS_KEY
from rolloutbus.schemas.trajectories import Trajectory, TrajectoryStatus

__all__ = ["output_key", "output_fields", "output_tag", "is_failed"]


def output_key(t: Trajectory) -> str:
    """verl's key for one agent-loop output: ``{uid}_{session_id}_{index}``."""
    return f"{t.uid}_{t.session_id}_{t.output_index}"


def is_failed(t: Trajectory) -> bool:
    """A failed session: verl writes no output for it and tags its prompt ``failure``."""
    return t.status == TrajectoryStatus.FAILED


def _rm_scores(t: Trajectory) -> torch.Tensor | None:
    if t.rm_scores is not None:
        return torch.tensor(t.rm_scores, dtype=torch.float32)
    if t.reward_score is None:
        return None
    scores = torch.zeros(max(len(t.responses), 1), dtype=torch.float32)
    scores[-1] = t.reward_score  # verl puts the score at the last response token
    return scores[: len(t.responses)] if t.responses else scores


def _extra_fields(t: Trajectory) -> dict[str, Any]:
    extra = dict(t.extra_fields)
    extra["min_global_steps"] = t.min_global_steps
    extra["max_global_steps"] = t.max_global_steps
    extra["reward_extra_info"] = t.reward_extra_info or {}
    return extra


def output_fields(t: Trajectory, *, global_steps: int) -> dict[str, Any]:
    """The field dict verl's ``AgentLoopWorkerTQ`` puts for this output."""
    if t.extra_fields.get(MROPE_INPUTS_KEY) is not None:  # a VL row: M-RoPE, (3|4, L) ids
        raise RolloutBusError(f"trajectory {t.key}: M-RoPE rows are not written to TransferQueue")
    prompts = torch.tensor(t.prompts, dtype=torch.int64)
    responses = torch.tensor(t.responses, dtype=torch.int64)
    response_mask = torch.tensor(t.response_mask, dtype=torch.int64)
    input_ids = torch.cat([prompts, responses])
    fields: dict[str, Any] = {
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask,
        "loss_mask": response_mask,
        "input_ids": input_ids,
        "position_ids": torch.arange(input_ids.size(0), dtype=torch.int64),
        "num_turns": t.num_turns,
        "metrics": t.metrics.model_dump(),
        "extra_fields": _extra_fields(t),
        "multi_modal_inputs": {},
    }
    if t.rollout_log_probs is not None:
        fields["rollout_log_probs"] = torch.tensor(t.rollout_log_probs, dtype=torch.float32)
    if (scores := _rm_scores(t)) is not None:
        fields["rm_scores"] = scores
    fields.update(_prompt_columns(t, global_steps))
    return fields


def _prompt_columns(t: Trajectory, global_steps: int) -> dict[str, Any]:
    """The input row's columns verl passes on as the loop's kwargs."""
    columns: dict[str, Any] = dict(t.extra_columns)
    columns.update(
        uid=t.uid,
        session_id=t.session_id,
        global_steps=global_steps,
        raw_prompt=t.raw_prompt,
        data_source=t.data_source,
        reward_model=t.reward_model,
        extra_info=t.extra_info,
    )
    if t.agent_name is not None:
        columns["agent_name"] = t.agent_name
    return columns


def output_tag(t: Trajectory, *, global_steps: int) -> dict[str, Any]:
    """The tag verl sets on each output (``_balance_batch`` reads ``seq_len``, the staleness
    control the versions)."""
    prompt_len, response_len = len(t.prompts), len(t.responses)
    return {
        "status": "success",
        "prompt_len": prompt_len,
        "response_len": response_len,
        "seq_len": prompt_len + response_len,
        "global_steps": global_steps,
        "min_global_steps": t.min_global_steps,
        "max_global_steps": t.max_global_steps,
    }
