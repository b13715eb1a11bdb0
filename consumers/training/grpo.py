"""``rolloutbus train``: an asynchronous off-policy GRPO trainer fed by the trajectory topic.

The loop, as verl's fully-async trainer runs it:

1. gather ``ppo_mini_batch_size x require_batches`` complete prompt groups from the trainer
   client (groups older than the staleness bound are dropped or down-weighted there);
2. compute the current policy's logprobs of the sampled tokens (``old_log_prob``), the
   truncated importance weights against the rollout's own logprobs, and GRPO advantages;
3. one AdamW step per mini-batch of ``ppo_mini_batch_size`` groups on the PPO-clip loss;
4. every ``trigger_parameter_sync_step`` steps: save a checkpoint (weights, optimizer, the
   client's position), publish the policy version on ``rollout.control``, from where the
   weight sync loads it into the replicas and the dispatcher widens its bound, and commit
   the saved position.

Before the first step a new run saves a step-0 checkpoint, and every start announces the
run on ``rollout.control`` (``consumers/training/lifecycle.py``). A restarted trainer
resumes from its newest checkpoint: weights, optimizer, step, version, and the trajectory
position saved with them, so it neither skips nor re-trains a group into those weights
(``consumers/training/checkpoint.py``), from step 0 on.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean
from typing import Any

import torch

from rolloutbus.config import Config
from rolloutbus.consumers.client import TrainerClient
from rolloutbus.consumers.groups import TrajectoryGroup
from rolloutbus.consumers.position import TrainerPosition
from rolloutbus.consumers.training.algorithm import (
    grpo_outcome_advantage,
    offpolicy_metrics,
    policy_loss_vanilla,
    rollout_is_weights,
)
from rolloutbus.consumers.training.batch import TrainBatch, build_train_batch
from rolloutbus.consumers.training.checkpoint import TrainerState, load_optimizer, weights_folder
from rolloutbus.consumers.training.lifecycle import TrainerRun
from rolloutbus.consumers.training.metrics import TrainerMetrics
from rolloutbus.consumers.training.policy import load_policy, pad_token_id, response_log_probs
from rolloutbus.consumers.training.step_log import StepLog
from rolloutbus.errors import ConfigError
from rolloutbus.metrics import start_metrics_server

log = logging.getLogger(__name__)
GROUP_POLL_S = 0.5  # seconds one wait for a group lasts: how quickly a stop is noticed


@dataclass
class TrainSummary:
    """What a run did: where it started and stopped."""

    started_at_step: int
    global_step: int
    policy_version: int
    groups_trained: int  # since step 0, over every run of this checkpoint directory
    checkpoint: Path | None
    groups_this_run: int = 0  # trained by this process
    stale_dropped: int = 0  # groups this process dropped past the staleness bound

    def line(self) -> str:
        """The run in one line, as `rolloutbus train` ends."""
        steps = self.global_step - self.started_at_step
        trained = (
            f"trained {steps} step(s), {self.started_at_step + 1}..{self.global_step}, on "
            f"{self.groups_this_run} groups"
            if steps
            else f"trained no step (at step {self.global_step})"
        )
        return (
            f"{trained}; {self.stale_dropped} stale groups dropped; "
            f"{self.groups_trained} groups since step 0; policy version {self.policy_version}; "
            f"checkpoint {self.checkpoint}"
        )


class GRPOTrainer:
    """One trainer process: its model, optimizer, client and checkpoints."""

    def __init__(self, cfg: Config, *, stream: Any = None):
        if cfg.algorithm.adv_estimator != "grpo":  # a whole verl config loads with "gae"
            raise ConfigError(
                f"algorithm.adv_estimator = {cfg.algorithm.adv_estimator!r}: `rolloutbus train` "
                "implements grpo only (set algorithm.adv_estimator=grpo)"
            )
        self.cfg = cfg
        self.trainer_id = f"{socket.gethostname()}-{os.getpid()}"
        if cfg.trainer.torch_threads:
            torch.set_num_threads(cfg.trainer.torch_threads)
        torch.manual_seed(cfg.trainer.seed)
        self.durable = TrainerRun(cfg, self.trainer_id)
        resume = self.durable.checkpoint
        self.lm = load_policy(cfg.model, weights_folder(resume) if resume is not None else None)
        optim = cfg.actor.optim
        self.optimizer = torch.optim.AdamW(
            self.lm.parameters(), lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay
        )
        if resume is not None:
            load_optimizer(self.optimizer, resume, self.state)
            log.info("resuming from %s (step %d)", resume, self.state.global_step)
        self.pad_token_id = pad_token_id(self.lm)
        self.metrics = TrainerMetrics()
        self.step_log = StepLog(
            cfg.trainer.metrics_log, self.metrics, stream, console="console" in cfg.trainer.logger
        )

    @property
    def state(self) -> TrainerState:
        return self.durable.state

    @property
    def checkpoint(self) -> Path | None:
        return self.durable.checkpoint

    # -- the loop ----------------------------------------------------------------------
    def run(self, stop: threading.Event | None = None) -> TrainSummary:
        stop = stop or threading.Event()
        started_at = self.state.global_step
        groups_before = self.state.groups_trained
        self.durable.start(self.lm, self.optimizer)  # fence, step 0, announce the run
        client = TrainerClient(
            self.cfg.kafka,
            self.cfg.trainer.group_id,
            resume_from=self.state.position,
            config=self.cfg.trainer,
            async_training=self.cfg.async_training,  # the staleness bound, on the trainer's side
            commit_on_revoke=False,  # committed: only what a checkpoint holds
            # static membership: the trainer is its group's only member, and a restarted
            # one takes its place at once instead of waiting out the killed one's session
            # (45 s); a second live trainer with the same group is fenced by the broker
            consumer_overrides={"group.instance.id": f"{self.cfg.trainer.group_id}.trainer"},
        )
        client.set_policy_version(self.state.policy_version)
        unsaved = False
        try:
            while not stop.is_set() and not self._finished():
                waited = time.monotonic()
                groups = self._gather(client, stop)
                if groups is None:
                    break  # stopped or idle before a whole batch arrived: left for a restart
                position = client.position()  # every group yielded so far is in this batch
                record = self.train_step(groups, wait_s=time.monotonic() - waited)
                record["staleness/dropped_groups"] = client.stale.dropped
                record["staleness/down_weighted_groups"] = client.stale.down_weighted
                unsaved = True
                sync = self._advance(len(groups), position)
                # logged before the checkpoint: a step in the log may be lost to a crash
                # (retrained after the restart), never a checkpointed step missing from it
                self.step_log.write(
                    {
                        **record,
                        "global_step": self.state.global_step,
                        "policy_version": self.state.policy_version,
                    }
                )
                if sync:
                    self.durable.save(self.lm, self.optimizer, client, publish=True)
                    client.set_policy_version(self.state.policy_version)
                    unsaved = False
            if unsaved:
                # a stop between two syncs: keep the steps, publish no version (the
                # replicas get the next one at the next sync)
                self.durable.save(self.lm, self.optimizer, client, publish=False)
        finally:
            stale_dropped = client.stale.dropped
            client.close()
            self.step_log.close()
            self.durable.close()
        return TrainSummary(
            started_at_step=started_at,
            global_step=self.state.global_step,
            policy_version=self.state.policy_version,
            groups_trained=self.state.groups_trained,
            checkpoint=self.checkpoint,
            groups_this_run=self.state.groups_trained - groups_before,
            stale_dropped=stale_dropped,
        )

    def _advance(self, groups: int, position: TrainerPosition | None) -> bool:
        """Count a trained step; True when it is a sync step (its version is then the
        next one, published once the checkpoint is written)."""
        step = self.state.global_step + 1
        every = self.cfg.async_training.trigger_parameter_sync_step
        sync = step % every == 0
        self.durable.state = self.state.model_copy(
            update={
                "global_step": step,
                "groups_trained": self.state.groups_trained + groups,
                "position": position,
                "policy_version": step // every if sync else self.state.policy_version,
            }
        )
        return sync

    def _finished(self) -> bool:
        total = self.cfg.trainer.total_training_steps
        return total is not None and self.state.global_step >= total

    def _gather(self, client: TrainerClient, stop: threading.Event) -> list[TrajectoryGroup] | None:
        """The next train batch's groups, or None when stopped or idle past the timeout."""
        need = self.cfg.async_training.ppo_mini_batch_size * self.cfg.async_training.require_batches
        groups: list[TrajectoryGroup] = []
        idle_since = time.monotonic()
        idle_timeout = self.cfg.trainer.idle_timeout_s
        while len(groups) < need and not stop.is_set():
            for group in client.groups(max_groups=need - len(groups), timeout_s=GROUP_POLL_S):
                groups.append(group)
                idle_since = time.monotonic()
            if idle_timeout is not None and time.monotonic() - idle_since > idle_timeout:
                log.info("no new group for %.0f s: stopping", idle_timeout)
                return None
        return groups if len(groups) == need else None

    # -- one step -----------------------------------------------------------------------
    def train_step(self, groups: list[TrajectoryGroup], *, wait_s: float = 0.0) -> dict[str, Any]:
        """Advantages, importance weights and one AdamW step per mini-batch; returns the
        step's figures (verl's metric names where verl has one)."""
        started = time.monotonic()
        batch = build_train_batch(groups, pad_token_id=self.pad_token_id)
        cfg, actor = self.cfg, self.cfg.actor
        mask = batch.tensors["response_mask"].float()
        with torch.no_grad():
            old_log_prob = response_log_probs(
                self.lm, batch.tensors, temperature=cfg.rollout.temperature
            )
        advantages = grpo_outcome_advantage(
            batch.scores,
            mask,
            batch.uids,
            norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo,
        )
        # a group the client down-weighted as stale (async_training.stale_group_policy)
        advantages = advantages * batch.loss_weights[:, None]
        weights, figures = self._rollout_correction(batch, old_log_prob, mask)
        step_figures: dict[str, list[float]] = defaultdict(list)
        for rows in self._mini_batches(batch):
            index = torch.tensor(rows)
            mini = batch.select(rows)
            log_prob = response_log_probs(
                self.lm, mini.tensors, temperature=cfg.rollout.temperature
            )
            loss, pg = policy_loss_vanilla(
                old_log_prob[index],
                log_prob,
                advantages[index],
                mask[index],
                clip_ratio_low=actor.clip_ratio_low or actor.clip_ratio,
                clip_ratio_high=actor.clip_ratio_high or actor.clip_ratio,
                clip_ratio_c=actor.clip_ratio_c,
                loss_agg_mode=actor.loss_agg_mode,
                rollout_is_weights=None if weights is None else weights[index],
            )
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.lm.parameters(), actor.optim.clip_grad)
            self.optimizer.step()
            step_figures["actor/pg_loss"].append(loss.item())
            step_figures["actor/grad_norm"].append(float(grad_norm))
            for key, value in pg.items():
                step_figures[key].append(value)
        step_s = time.monotonic() - started
        figures.update({k: fmean(v) for k, v in step_figures.items()})
        figures.update(self._batch_figures(batch, mask))
        tokens = int(mask.sum().item())
        figures.update(
            {
                "groups": len(groups),
                "trajectories": batch.rows,
                "tokens": tokens,
                "timing/step_s": step_s,
                "timing/wait_s": wait_s,
                "perf/tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
                "uids": batch.group_uids,
            }
        )
        return figures

    def _rollout_correction(
        self, batch: TrainBatch, old_log_prob: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor | None, dict[str, Any]]:
        """Truncated IS weights against the rollout's logprobs (rows that have them), and the
        KL between the behaviour and the trained policy."""
        has = batch.has_rollout_log_probs
        if "rollout_log_probs" not in batch.tensors or not bool(has.any()):
            return None, {}
        rollout = torch.where(has[:, None], batch.tensors["rollout_log_probs"], old_log_prob)
        with_lp = mask * has[:, None]
        figures = {
            f"rollout_corr/{k}": v
            for k, v in offpolicy_metrics(old_log_prob, rollout, with_lp).items()
        }
        corr = self.cfg.algorithm.rollout_correction
        if corr.rollout_is is None:
            return None, figures
        weights, is_figures = rollout_is_weights(
            old_log_prob,
            rollout,
            mask,
            rollout_is=corr.rollout_is,
            rollout_is_threshold=corr.rollout_is_threshold,
        )
        figures.update({f"rollout_corr/{k}": v for k, v in is_figures.items()})
        return weights, figures

    def _mini_batches(self, batch: TrainBatch) -> list[list[int]]:
        """Rows of each mini-batch: ``ppo_mini_batch_size`` whole groups, in arrival order."""
        per = self.cfg.async_training.ppo_mini_batch_size
        out = []
        for start in range(0, len(batch.group_uids), per):
            members = set(batch.group_uids[start : start + per])
            rows = [i for i, uid in enumerate(batch.uids) if uid in members]
            if rows:
                out.append(rows)
        return out

    def _batch_figures(self, batch: TrainBatch, mask: torch.Tensor) -> dict[str, Any]:
        lengths = mask.sum(dim=-1)
        figures: dict[str, Any] = {
            "reward/mean": batch.scores.mean().item(),
            "response_length/mean": lengths.mean().item(),
            "response_length/max": lengths.max().item(),
            "dropped/failed_trajectories": batch.dropped_failed,
        }
        by_source: dict[str, list[float]] = defaultdict(list)
        for source, score in zip(batch.data_sources, batch.scores.tolist(), strict=True):
            by_source[source or "unknown"].append(score)
        figures.update({f"reward/mean/{s}": fmean(v) for s, v in sorted(by_source.items())})
        current = self.state.policy_version
        stale = [current - v for v in batch.min_versions if v is not None]
        if stale:
            figures["staleness/mean"] = fmean(stale)
            figures["staleness/max"] = max(stale)
        spans = [
            hi - lo
            for lo, hi in zip(batch.min_versions, batch.max_versions, strict=True)
            if lo is not None and hi is not None
        ]
        if spans:
            figures["staleness/version_span_max"] = max(spans)
        return figures


def run_training(cfg: Config, stop: threading.Event | None = None) -> TrainSummary:
    """``rolloutbus train``: serve metrics if configured, then train until stopped."""
    if cfg.trainer.metrics_port is not None:
        start_metrics_server(cfg.trainer.metrics_port, cfg.trainer.metrics_host)
    return GRPOTrainer(cfg).run(stop)
