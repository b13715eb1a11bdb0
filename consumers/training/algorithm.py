"""GRPO on the bus: verl's definitions, on padded ``(batch, response_length)`` tensors.

Each function follows the verl 0.9.1 function it names (``verl/trainer/ppo/core_algos.py``
and ``rollout_corr_helper.py``), with the same arguments, defaults and edge cases, so a
verl user reads the same numbers:

* :func:`grpo_outcome_advantage` — ``compute_grpo_outcome_advantage``: a response's score
  minus its group's mean, divided by the group's std (unbiased, as ``torch.std``) plus
  ``epsilon`` when ``norm_adv_by_std_in_grpo`` (Dr.GRPO when not); a group of one gets
  mean 0 and std 1.
* :func:`agg_loss` — ``agg_loss`` with ``dp_size`` 1: ``token-mean``, ``token-sum``,
  ``seq-mean-token-sum``, ``seq-mean-token-sum-norm``, ``seq-mean-token-mean``.
* :func:`policy_loss_vanilla` — ``compute_policy_loss_vanilla``: PPO's clipped objective with
  ``clip_ratio_low``/``clip_ratio_high``, dual-clip at ``clip_ratio_c`` for negative
  advantages, log-ratio clamped to ±20, optional rollout-correction weights multiplied in.
* :func:`rollout_is_weights` — ``compute_rollout_correction_weights``: truncated importance
  weights π_old/π_rollout per token or per sequence (TIS: clamped at the threshold; a
  ``"lower_upper"`` threshold zeroes weights outside the band, IcePop), detached.
* :func:`offpolicy_metrics` — the KL of ``compute_offpolicy_metrics`` between the behaviour
  (rollout) policy and the trained one.

Off-policy correction as verl's *decoupled* mode and AReaL's decoupled PPO: ``old_log_prob``
is the policy being trained, before this step's update (here: the current forward pass,
detached, since each batch gets one optimizer step), and the truncated weights correct for
the rollout having been sampled by an older version.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

LossAggMode = Literal[
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "seq-mean-token-mean",
]
RolloutIS = Literal["token", "sequence"]
LOG_RATIO_CLAMP = 20.0  # nats; verl clamps log(π/π_old) to ±20 before exp (PPO loss)
SAFETY_BOUND = 20.0  # nats; verl's rollout_corr_helper.SAFETY_BOUND, same reason


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """verl_F.masked_sum: NaNs outside the mask do not leak into the sum."""
    valid = torch.where(mask.bool(), values, 0.0)
    return (valid * mask).sum() if dim is None else (valid * mask).sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """verl_F.masked_mean: the mean over the mask, 1e-8 guarding an empty mask."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / (count + 1e-8)


def grpo_outcome_advantage(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[str],
    *,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> torch.Tensor:
    """Group-relative advantages, one scalar per response broadcast over its tokens.

    ``scores``: ``(batch,)`` outcome rewards (verl sums ``token_level_rewards`` over the
    response first; pass that sum). ``index``: the group (verl's ``uid``) of each row.
    """
    if len(index) != scores.shape[0]:
        raise ValueError(f"index has {len(index)} entries for {scores.shape[0]} scores")
    scores = scores.detach().to(torch.float32)
    advantages = torch.empty_like(scores)
    groups: dict[str, list[int]] = {}
    for row, uid in enumerate(index):
        groups.setdefault(uid, []).append(row)
    for rows in groups.values():
        members = scores[rows]
        if len(rows) == 1:  # verl: mean 0, std 1 for a group of one
            mean, std = torch.tensor(0.0), torch.tensor(1.0)
        else:
            mean, std = members.mean(), members.std()
        centred = members - mean
        advantages[rows] = centred / (std + epsilon) if norm_adv_by_std_in_grpo else centred
    return advantages.unsqueeze(-1) * response_mask


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: LossAggMode,
    *,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """verl's ``agg_loss`` for one data-parallel rank holding the whole batch."""
    if loss_agg_mode == "token-mean":
        return masked_sum(loss_mat, loss_mask) / loss_mask.sum()
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, loss_mask)
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()  # fully masked rows excluded
        loss = masked_sum(seq_losses, seq_mask) / seq_mask.sum()
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss = loss / (loss_scale_factor or loss_mask.shape[-1])
        return loss
    if loss_agg_mode == "seq-mean-token-mean":
        tokens = torch.sum(loss_mask, dim=-1)
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (tokens + 1e-8)
        seq_mask = (tokens > 0).float()
        return masked_sum(seq_losses, seq_mask) / seq_mask.sum()
    raise ValueError(f"invalid loss_agg_mode {loss_agg_mode!r}")


def policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: LossAggMode = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped surrogate (with dual clip) and verl's metrics ``actor/pg_clipfrac``,
    ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``."""
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 for dual-clip PPO, got {clip_ratio_c}")
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = masked_mean(
        torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), response_mask
    )
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode)
    return loss, {
        "actor/pg_clipfrac": pg_clipfrac.item(),
        "actor/ppo_kl": ppo_kl.item(),
        "actor/pg_clipfrac_lower": pg_clipfrac_lower.item(),
    }


def parse_rollout_is_threshold(threshold: str | float) -> tuple[float, float | None]:
    """``(upper, lower)``: a number (or numeric string) is TIS's upper bound; ``"lo_hi"`` is
    IcePop's band. Errors as verl's ``_parse_rollout_is_threshold``."""
    if isinstance(threshold, bool):
        raise TypeError("rollout_is_threshold must be a float or a 'lower_upper' string")
    lower: float | None = None
    if isinstance(threshold, int | float):
        upper = float(threshold)
    else:
        spec = threshold.strip()
        try:
            if "_" in spec:
                low_text, high_text = spec.split("_", 1)
                lower, upper = float(low_text), float(high_text)
            else:
                upper = float(spec)
        except ValueError as exc:
            raise ValueError(f"invalid rollout_is_threshold {threshold!r}") from exc
    if upper <= 0:
        raise ValueError(f"rollout_is_threshold upper bound must be positive, got {upper}")
    if lower is not None and not 0 < lower <= upper:
        raise ValueError(f"rollout_is_threshold lower bound must be in (0, {upper}], got {lower}")
    return upper, lower


def rollout_is_weights(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    rollout_is: RolloutIS = "token",
    rollout_is_threshold: str | float = 2.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance weights π_old / π_rollout (0 on padding, detached) and verl's
    ``rollout_is_mean/max/min`` and ``rollout_is_ratio_fraction_high/low`` metrics."""
    upper, lower = parse_rollout_is_threshold(rollout_is_threshold)
    log_ratio = (old_log_prob - rollout_log_prob).detach()
    if rollout_is == "token":
        log_ratio_for_metrics = log_ratio
        raw = torch.exp(torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    elif rollout_is == "sequence":  # one weight per sequence: the product of its tokens'
        log_ratio_for_metrics = masked_sum(log_ratio, response_mask, dim=-1).unsqueeze(-1)
        clamped = torch.clamp(log_ratio_for_metrics, -SAFETY_BOUND, SAFETY_BOUND)
        raw = torch.exp(clamped).expand_as(log_ratio)
    else:
        raise ValueError(f"invalid rollout_is {rollout_is!r}: 'token' or 'sequence'")
    raw = raw * response_mask
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    return weights, _is_metrics(
        weights, raw, log_ratio_for_metrics, response_mask, rollout_is, upper, lower
    )


def _is_metrics(
    weights: torch.Tensor,
    raw: torch.Tensor,
    log_ratio_for_metrics: torch.Tensor,
    mask: torch.Tensor,
    rollout_is: RolloutIS,
    upper: float,
    lower: float | None,
) -> dict[str, float]:
    """The core of verl's ``compute_is_metrics`` (the ESS and per-sequence spreads left out)."""
    low = 1.0 / upper if lower is None else lower
    metrics = {"rollout_is_mean": masked_mean(weights, mask).item()}
    if rollout_is == "sequence":
        metrics["rollout_is_max"] = torch.exp(
            log_ratio_for_metrics.max().clamp(max=SAFETY_BOUND)
        ).item()
        metrics["rollout_is_min"] = torch.exp(log_ratio_for_metrics.min()).item()
        metrics["rollout_is_ratio_fraction_high"] = (
            (log_ratio_for_metrics > torch.log(torch.tensor(upper))).float().mean().item()
        )
        metrics["rollout_is_ratio_fraction_low"] = (
            (log_ratio_for_metrics < torch.log(torch.tensor(low))).float().mean().item()
        )
    else:
        valid = mask.bool()
        metrics["rollout_is_max"] = weights.masked_fill(~valid, float("-inf")).max().item()
        metrics["rollout_is_min"] = weights.masked_fill(~valid, float("inf")).min().item()
        metrics["rollout_is_ratio_fraction_high"] = masked_mean((raw > upper).float(), mask).item()
        metrics["rollout_is_ratio_fraction_low"] = masked_mean((raw < low).float(), mask).item()
    return metrics


def offpolicy_metrics(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """KL(π_rollout ‖ π_train), direct (``kl``) and k3 (``k3_kl``) estimators, as verl's
    ``compute_offpolicy_metrics``: how far the behaviour policy is from the trained one."""
    log_ratio = (old_log_prob - rollout_log_prob).detach()
    return {
        "kl": masked_mean(-log_ratio, response_mask).item(),
        "k3_kl": masked_mean(torch.exp(log_ratio) - log_ratio - 1, response_mask).item(),
    }
