"""``rolloutbus train``: the reference consumer of the bus, an asynchronous off-policy GRPO
trainer in torch (verl's algorithm definitions, checkpoints with the trajectory position,
policy versions published on ``rollout.control``)."""

from rolloutbus.consumers.training.algorithm import (
    agg_loss,
    grpo_outcome_advantage,
    offpolicy_metrics,
    policy_loss_vanilla,
    rollout_is_weights,
)
from rolloutbus.consumers.training.batch import TrainBatch, build_train_batch
from rolloutbus.consumers.training.checkpoint import TrainerState, latest_checkpoint
from rolloutbus.consumers.training.grpo import GRPOTrainer, TrainSummary, run_training

__all__ = [
    "GRPOTrainer",
    "TrainBatch",
    "TrainSummary",
    "TrainerState",
    "agg_loss",
    "build_train_batch",
    "grpo_outcome_advantage",
    "latest_checkpoint",
    "offpolicy_metrics",
    "policy_loss_vanilla",
    "rollout_is_weights",
    "run_training",
]
