"""Groups from the trainer client → one train batch in verl's keys.

The tensors are verl V0's (``consumers.tensors.to_padded``: ``input_ids``,
``attention_mask``, ``position_ids``, ``responses``, ``response_mask``,
``rollout_log_probs``); the per-row fields are verl's ``non_tensor_batch`` ones (``uid``
indexes GRPO's groups, ``data_source`` splits the reward metrics). Padding widths are the
batch's longest prompt and response, not ``rollout.prompt_length``/``response_length``:
the same tensors for the loss, less compute on a CPU.

Failed trajectories (no tokens) are left out: they carry no sampled token to learn from,
and a failed session is not a zero-reward answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import torch

from rolloutbus.consumers.groups import TrajectoryGroup
from rolloutbus.consumers.tensors import to_padded
from rolloutbus.errors import SchemaError
from rolloutbus.schemas.trajectories import TRAJECTORY_SCHEMA, TrajectoryStatus


@dataclass
class TrainBatch:
    """One train step's trajectories: padded tensors plus verl's non-tensor fields."""

    tensors: dict[str, torch.Tensor]
    scores: torch.Tensor  # (rows,) float32: each trajectory's reward_score
    uids: list[str]  # verl's ``uid``: the GRPO group of each row
    data_sources: list[str]
    min_versions: list[int | None]  # policy version at the trajectory's first token
    max_versions: list[int | None]  # ... and at its last
    group_uids: list[str]  # the groups of this batch, in the order received
    dropped_failed: int  # failed trajectories left out
    # (rows,) bool: the trajectory has the rollout's logprobs (rollout.calculate_log_probs);
    # rows without get no importance weight (1) and no off-policy metrics
    has_rollout_log_probs: torch.Tensor
    # (rows,) float32: the group's loss weight from the trainer client's staleness filter
    # (below 1 for a group kept but down-weighted as stale)
    loss_weights: torch.Tensor

    @property
    def rows(self) -> int:
        return len(self.uids)

    @property
    def prompt_length(self) -> int:
        return self.tensors["input_ids"].shape[1] - self.tensors["responses"].shape[1]

    def select(self, rows: list[int]) -> TrainBatch:
        """The rows ``rows`` (a mini-batch), tensors and fields alike."""
        index = torch.tensor(rows, dtype=torch.long)
        return TrainBatch(
            tensors={k: v.index_select(0, index) for k, v in self.tensors.items()},
            scores=self.scores.index_select(0, index),
            uids=[self.uids[i] for i in rows],
            data_sources=[self.data_sources[i] for i in rows],
            min_versions=[self.min_versions[i] for i in rows],
            max_versions=[self.max_versions[i] for i in rows],
            group_uids=list(dict.fromkeys(self.uids[i] for i in rows)),
            dropped_failed=0,
            has_rollout_log_probs=self.has_rollout_log_probs.index_select(0, index),
            loss_weights=self.loss_weights.index_select(0, index),
        )


def build_train_batch(groups: list[TrajectoryGroup], *, pad_token_id: int) -> TrainBatch:
    """Concatenate the groups' rows, drop failed ones, pad to the longest prompt/response."""
    if not groups:
        raise ValueError("a train batch needs at least one group")
    # every group's rows concatenated once (a group read from the trainer client still
    # holds its rows: concatenating per group first would cost pyarrow's price twice)
    rows = pa.concat_batches([part for g in groups for part in g.parts])
    table = pa.Table.from_batches([rows], TRAJECTORY_SCHEMA)
    usable = pc.and_(
        pc.not_equal(table.column("status"), TrajectoryStatus.FAILED.value),
        pc.greater(table.column("response_len"), 0),
    )
    kept = table.filter(usable)
    if kept.num_rows == 0:
        raise SchemaError(
            f"groups {[g.uid for g in groups]} hold no trajectory with response tokens"
        )
    missing_scores = kept.column("reward_score").null_count
    if missing_scores:
        raise SchemaError(
            f"{missing_scores} trajectories of groups {[g.uid for g in groups]} have no "
            "reward_score: GRPO needs one per trajectory (does the row have reward_model?)"
        )
    batch = kept.combine_chunks().to_batches()[0]
    weight_of = {g.uid: g.loss_weight for g in groups}
    prompt_width = max(1, pc.max(kept.column("prompt_len")).as_py())
    response_width = max(1, pc.max(kept.column("response_len")).as_py())
    tensors = to_padded(
        batch, prompt_length=prompt_width, response_length=response_width, pad_token_id=pad_token_id
    )
    return TrainBatch(
        tensors=tensors,
        scores=torch.tensor(kept.column("reward_score").to_pylist(), dtype=torch.float32),
        uids=kept.column("uid").to_pylist(),
        data_sources=[s or "" for s in kept.column("data_source").to_pylist()],
        min_versions=kept.column("min_global_steps").to_pylist(),
        max_versions=kept.column("max_global_steps").to_pylist(),
        group_uids=[g.uid for g in groups],
        dropped_failed=table.num_rows - kept.num_rows,
        has_rollout_log_probs=torch.tensor(
            pc.is_valid(kept.column("rollout_log_probs")).to_pylist(), dtype=torch.bool
        ),
        loss_weights=torch.tensor(
            [weight_of[uid] for uid in kept.column("uid").to_pylist()], dtype=torch.float32
        ),
    )
