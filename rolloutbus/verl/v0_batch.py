"""Trajectory rows → what verl's V0 ``AgentLoopManager.generate_sequences`` returns.

Pure: no Kafka, no verl. ``v0_output`` turns one trajectory row per input row (already in
input order, ``rows_in_input_order``) into the three parts of verl 0.9.1's ``DataProto``,
built as verl builds them (``verl/experimental/agent_loop/agent_loop.py``):

* ``batch``: ``_agent_loop_postprocess``'s padding (prompt left-padded to
  ``prompt_length``, response right-padded to ``response_length``, ``response_mask``
  multiplied by the response attention, position ids from the attention mask) through
  ``consumers.tensors.to_padded``; ``rm_scores`` only when every row was scored, the score
  at the last real response token (``_postprocess``, lines 1093-1098);
* ``non_tensor_batch``: ``__num_turns__`` (int32), the input's non-tensor columns when no
  reward-loop workers were handed to the manager (verl merges them only then), each
  ``reward_extra_info`` key, ``multi_modal_inputs`` (``{}`` per text row) and every
  extra-field key with verl's defaults (``turn_scores``, ``tool_rewards``,
  ``min_global_steps``, ``max_global_steps``, ``extras``) and ``raw_prompt``;
* ``meta_info``: ``timing`` (``AgentLoopManager._performance_metrics``: the
  ``agent_loop/*`` min/max/mean and the slowest row's figures, numpy scalars as verl's)
  and ``reward_extra_keys`` when ``rm_scores`` is present.

tests/verl_compat/test_verl_trainer_v0.py compares this, key by key, dtype by dtype and
shape by shape, with verl's own ``_postprocess`` on the same agent-loop outputs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from rolloutbus.consumers.groups import TrajectoryGroup
from rolloutbus.consumers.tensors import to_padded
from rolloutbus.errors import RolloutBusError
from rolloutbus.schemas.trajectories import Trajectory, TrajectoryStatus, batch_to_trajectories

__all__ = ["V0Output", "rows_in_input_order", "v0_output", "v0_timing"]

# the extra-field keys every V0 batch carries, so batches of different agent loops concat
# (verl's ``_postprocess``, ``default_extra_keys``)
DEFAULT_EXTRA_KEYS = (
    "turn_scores",
    "tool_rewards",
    "min_global_steps",
    "max_global_steps",
    "extras",
)
_TIMED = ("generate_sequences", "tool_calls", "compute_score")


@dataclass
class V0Output:
    """The parts of a verl ``DataProto``: ``batch`` (its TensorDict's tensors, batch size
    the row count), ``non_tensor_batch`` and ``meta_info``."""

    batch: dict[str, torch.Tensor]
    non_tensor_batch: dict[str, np.ndarray]
    meta_info: dict[str, Any] = field(default_factory=dict)


def rows_in_input_order(
    uids: Sequence[str], groups: Mapping[str, TrajectoryGroup]
) -> pa.RecordBatch:
    """One trajectory row per input row: the k-th input row of a uid gets the group's session
    k (verl's V0 input repeats each prompt n times, interleaved, and the trainer unions row i
    of the output with row i of the repeated batch). Raises RolloutBusError for a group that
    V0 cannot return row for row: a failed session (verl's V0 step fails when a loop raises)
    or a session with several outputs."""
    by_uid: dict[str, list[Trajectory]] = {}
    for uid, group in groups.items():
        members = sorted(batch_to_trajectories(group.batch), key=lambda t: t.session_id)
        _check_v0_group(uid, members)
        by_uid[uid] = members
    seen: dict[str, int] = {}
    picked: list[pa.RecordBatch] = []
    for uid in uids:
        k = seen.get(uid, 0)
        seen[uid] = k + 1
        sessions = by_uid.get(uid, [])
        if k >= len(sessions):
            raise RolloutBusError(
                f"group {uid}: input row {k + 1} of this uid, but the group has "
                f"{len(sessions)} sessions"
            )
        keys = groups[uid].batch.column("key").to_pylist()
        picked.append(groups[uid].batch.slice(keys.index(sessions[k].key), 1))
    return pa.Table.from_batches(picked).combine_chunks().to_batches()[0]


def _check_v0_group(uid: str, members: list[Trajectory]) -> None:
    failed = [t for t in members if t.status is TrajectoryStatus.FAILED]
    if failed:
        raise RolloutBusError(
            f"group {uid}: session {failed[0].session_id} failed ({failed[0].error}); verl's V0 "
            "trainer needs every session of a step, as its own agent loop fails the step"
        )
    multi = [t for t in members if t.num_outputs != 1]
    if multi:
        raise RolloutBusError(
            f"group {uid}: session {multi[0].session_id} has {multi[0].num_outputs} outputs; "
            "verl's V0 trainer takes one output per session"
        )


def v0_output(
    rows: pa.RecordBatch,
    *,
    inputs: Mapping[str, np.ndarray],
    merge_inputs: bool,
    prompt_length: int,
    response_length: int,
    pad_token_id: int,
) -> V0Output:
    """verl's V0 output for ``rows`` (one trajectory per input row, in input order).
    ``inputs``: the input batch's non-tensor columns; ``merge_inputs``: whether verl would
    merge them (no reward-loop workers handed to the manager)."""
    trajectories = batch_to_trajectories(rows)
    padded = to_padded(
        rows,
        prompt_length=prompt_length,
        response_length=response_length,
        pad_token_id=pad_token_id,
    )
    padded.pop("rm_scores", None)  # rebuilt below as verl places it
    batch = {name: tensor.contiguous().clone() for name, tensor in padded.items()}
    scores = [t.reward_score for t in trajectories]
    if all(score is not None for score in scores):
        batch["rm_scores"] = _rm_scores(batch, scores, prompt_length)
    non_tensor, reward_extra_keys = _non_tensor_batch(trajectories, inputs, merge_inputs)
    meta_info: dict[str, Any] = {"timing": v0_timing(trajectories, batch)}
    if "rm_scores" in batch:
        meta_info["reward_extra_keys"] = reward_extra_keys
    return V0Output(batch=batch, non_tensor_batch=non_tensor, meta_info=meta_info)


def _rm_scores(
    batch: Mapping[str, torch.Tensor], scores: list[Any], prompt_length: int
) -> torch.Tensor:
    """The score at the last real response token (an empty response: the last column, as
    verl's index -1 does)."""
    response_mask = batch["response_mask"]
    last = batch["attention_mask"][:, prompt_length:].sum(dim=1) - 1
    rm_scores = torch.zeros_like(response_mask, dtype=torch.float32)
    rm_scores[torch.arange(response_mask.size(0)), last] = torch.tensor(scores, dtype=torch.float32)
    return rm_scores


def _non_tensor_batch(
    trajectories: list[Trajectory], inputs: Mapping[str, np.ndarray], merge_inputs: bool
) -> tuple[dict[str, np.ndarray], list[str]]:
    out: dict[str, np.ndarray] = {
        "__num_turns__": np.array([t.num_turns for t in trajectories], dtype=np.int32)
    }
    if merge_inputs and inputs:
        out.update(inputs)
    infos = [t.reward_extra_info or {} for t in trajectories]
    reward_extra_keys = list(infos[0].keys())
    for key in reward_extra_keys:
        out[key] = np.array([info[key] for info in infos])
    # verl's processor-less _compute_multi_modal_inputs: an empty dict per row
    out["multi_modal_inputs"] = np.array([{} for _ in trajectories], dtype=object)
    extras = [_extra_fields(t, inputs, i) for i, t in enumerate(trajectories)]
    for key in {key for extra in extras for key in extra} | set(DEFAULT_EXTRA_KEYS):
        column = np.empty(len(extras), dtype=object)
        column[:] = [extra.get(key) for extra in extras]
        out[key] = column
    return out, reward_extra_keys


def _extra_fields(t: Trajectory, inputs: Mapping[str, np.ndarray], row: int) -> dict[str, Any]:
    """A row's extra fields as verl's postprocess leaves them: the loop's own, the policy
    versions the bus recorded per token, and the input row's ``raw_prompt``."""
    extra = dict(t.extra_fields)
    if t.min_global_steps is not None:
        extra["min_global_steps"] = t.min_global_steps
    if t.max_global_steps is not None:
        extra["max_global_steps"] = t.max_global_steps
    raw_prompt = inputs.get("raw_prompt")
    extra["raw_prompt"] = raw_prompt[row] if raw_prompt is not None else t.raw_prompt
    return extra


def v0_timing(trajectories: list[Trajectory], batch: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """``AgentLoopManager._performance_metrics``: the step's ``agent_loop/*`` figures."""
    columns = {name: np.array([getattr(t.metrics, name) for t in trajectories]) for name in _TIMED}
    preempted = np.array([t.metrics.num_preempted for t in trajectories])
    timing: dict[str, Any] = {
        "agent_loop/num_preempted/min": preempted.min(),
        "agent_loop/num_preempted/max": preempted.max(),
        "agent_loop/num_preempted/mean": preempted.mean(),
    }
    for name in _TIMED:
        values = columns[name]
        timing.update(
            {
                f"agent_loop/{name}/min": values.min(),
                f"agent_loop/{name}/max": values.max(),
                f"agent_loop/{name}/mean": values.mean(),
            }
        )
    # the batch is bounded by its slowest row
    slowest = np.argmax(sum(columns[name] for name in _TIMED))
    for name in _TIMED:
        timing[f"agent_loop/slowest/{name}"] = columns[name][slowest]
    timing["agent_loop/slowest/num_preempted"] = preempted[slowest]
    prompt_length = batch["prompts"].shape[1]
    attention = batch["attention_mask"][slowest]
    timing["agent_loop/slowest/prompt_length"] = attention[:prompt_length].sum().item()
    timing["agent_loop/slowest/response_length"] = attention[prompt_length:].sum().item()
    return timing
