"""GRPO pieces against hand-computed values (verl 0.9.1's definitions; see
consumers/training/algorithm.py for the function each one follows)."""

from __future__ import annotations

import math

import pytest
import torch

from rolloutbus.consumers.training.algorithm import (
    agg_loss,
    grpo_outcome_advantage,
    offpolicy_metrics,
    parse_rollout_is_threshold,
    policy_loss_vanilla,
    rollout_is_weights,
)

EPS = 1e-6


def test_grpo_advantage_normalises_within_each_group():
    scores = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1], [1, 0, 0]]).float()
    adv = grpo_outcome_advantage(scores, mask, ["a", "a", "b", "b", "c"])
    std_a = math.sqrt(0.5)  # unbiased std of [1, 0]
    expected = [0.5 / (std_a + EPS), -0.5 / (std_a + EPS), 0.0, 0.0, 2.0 / (1.0 + EPS)]
    # one scalar per response, on its tokens only; a group of one: mean 0, std 1 (verl)
    for row, value in enumerate(expected):
        assert adv[row].tolist() == pytest.approx((mask[row] * value).tolist(), abs=1e-6)


def test_grpo_advantage_without_std_is_dr_grpo():
    scores = torch.tensor([1.0, 0.0, 3.0])
    adv = grpo_outcome_advantage(
        scores, torch.ones(3, 2), ["a", "a", "c"], norm_adv_by_std_in_grpo=False
    )
    assert adv[:, 0].tolist() == pytest.approx([0.5, -0.5, 3.0])


def test_grpo_advantage_rejects_a_short_index():
    with pytest.raises(ValueError, match="index has 1 entries for 2 scores"):
        grpo_outcome_advantage(torch.zeros(2), torch.ones(2, 1), ["a"])


LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]]).float()  # the last row fully masked


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3 tokens
        ("token-sum", 7.0),
        ("seq-mean-token-sum", 3.5),  # (3 + 4) / 2 sequences: the masked row excluded
        ("seq-mean-token-sum-norm", 3.5 / 3),  # ... / the horizon (3 columns)
        ("seq-mean-token-mean", 2.75),  # (3/2 + 4/1) / 2
    ],
)
def test_agg_loss_modes(mode, expected):
    assert agg_loss(LOSS, MASK, mode).item() == pytest.approx(expected, rel=1e-6)


def test_agg_loss_rejects_an_unknown_mode():
    with pytest.raises(ValueError, match="invalid loss_agg_mode 'mean'"):
        agg_loss(LOSS, MASK, "mean")  # type: ignore[arg-type]


def _one_token_loss(ratio: float, advantage: float, **kw):
    old = torch.zeros(1, 1)
    new = torch.full((1, 1), math.log(ratio))
    return policy_loss_vanilla(old, new, torch.full((1, 1), advantage), torch.ones(1, 1), **kw)


@pytest.mark.parametrize(
    ("ratio", "advantage", "high", "loss", "clipfrac", "clipfrac_lower"),
    [
        (1.5, 1.0, 0.2, -1.2, 1.0, 0.0),  # clipped at 1 + 0.2
        (1.5, 1.0, 0.28, -1.28, 1.0, 0.0),  # clip_ratio_high (DAPO's clip-higher)
        (1.1, 1.0, 0.2, -1.1, 0.0, 0.0),  # inside the band: the plain ratio
        (0.5, -1.0, 0.2, 0.8, 1.0, 0.0),  # negative advantage: clipped at 1 - 0.2
        (5.0, -1.0, 0.2, 3.0, 0.0, 1.0),  # dual clip: -A x clip_ratio_c caps it
    ],
)
def test_ppo_clip_loss(ratio, advantage, high, loss, clipfrac, clipfrac_lower):
    value, metrics = _one_token_loss(ratio, advantage, clip_ratio_low=0.2, clip_ratio_high=high)
    assert value.item() == pytest.approx(loss, rel=1e-5)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(clipfrac)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(clipfrac_lower)
    assert metrics["actor/ppo_kl"] == pytest.approx(-math.log(ratio), rel=1e-5)


def test_ppo_loss_on_policy_gradient_is_the_policy_gradient():
    """ratio 1 (one step per batch): d loss / d logprob = -A / tokens, x the IS weight."""
    log_prob = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    advantages = torch.tensor([[1.0, 1.0], [-2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    weights = torch.tensor([[1.0, 0.5], [2.0, 0.0]])
    loss, _ = policy_loss_vanilla(
        log_prob.detach(), log_prob, advantages, mask, rollout_is_weights=weights
    )
    loss.backward()
    expected = -(advantages * weights * mask) / 3
    assert log_prob.grad is not None
    assert torch.allclose(log_prob.grad, expected)


def test_ppo_loss_rejects_clip_ratio_c_of_one():
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1.0"):
        _one_token_loss(1.0, 1.0, clip_ratio_c=1.0)


def test_token_is_weights_truncate_at_the_threshold():
    old = torch.log(torch.tensor([[3.0, 0.5, 1.0, 7.0]]))
    rollout = torch.zeros(1, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the last slot is padding
    weights, metrics = rollout_is_weights(old, rollout, mask, rollout_is_threshold=2.0)
    assert weights[0].tolist() == pytest.approx([2.0, 0.5, 1.0, 0.0])
    assert not weights.requires_grad
    assert metrics["rollout_is_mean"] == pytest.approx(3.5 / 3)
    assert metrics["rollout_is_max"] == pytest.approx(2.0)
    assert metrics["rollout_is_min"] == pytest.approx(0.5)
    assert metrics["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)  # 3 > 2
    assert metrics["rollout_is_ratio_fraction_low"] == pytest.approx(0.0)  # 0.5 is not < 1/2


def test_icepop_band_zeroes_weights_outside_it():
    old = torch.log(torch.tensor([[3.0, 0.5, 1.0]]))
    weights, _ = rollout_is_weights(
        old, torch.zeros(1, 3), torch.ones(1, 3), rollout_is_threshold="0.6_2.5"
    )
    assert weights[0].tolist() == pytest.approx([0.0, 0.0, 1.0])


def test_sequence_is_weight_is_the_product_of_the_tokens():
    old = torch.log(torch.tensor([[1.2, 1.5, 9.0], [0.5, 0.5, 1.0]]))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    weights, metrics = rollout_is_weights(
        old, torch.zeros(2, 3), mask, rollout_is="sequence", rollout_is_threshold=2.0
    )
    # row 0: 1.2 x 1.5 = 1.8 (the padded 9.0 not counted); row 1: 0.25
    assert torch.allclose(weights, torch.tensor([[1.8, 1.8, 0.0], [0.25, 0.25, 0.25]]))
    assert metrics["rollout_is_max"] == pytest.approx(1.8)
    assert metrics["rollout_is_ratio_fraction_low"] == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("spec", "parsed"), [(2.0, (2.0, None)), ("3", (3.0, None)), ("0.5_5.0", (5.0, 0.5))]
)
def test_threshold_specs(spec, parsed):
    assert parse_rollout_is_threshold(spec) == parsed


@pytest.mark.parametrize("spec", [True, "x", "5_1", -1.0, "0_2"])
def test_bad_threshold_specs_are_refused(spec):
    with pytest.raises((ValueError, TypeError)):
        parse_rollout_is_threshold(spec)


def test_offpolicy_kl():
    old = torch.log(torch.tensor([[0.5, 0.25]]))
    rollout = torch.log(torch.tensor([[0.25, 0.25]]))
    metrics = offpolicy_metrics(old, rollout, torch.ones(1, 2))
    # kl = mean(log rollout - log old) = (log 0.5 + 0) / 2; k3 = mean(r - log r - 1), r = 2, 1
    assert metrics["kl"] == pytest.approx(math.log(0.5) / 2)
    assert metrics["k3_kl"] == pytest.approx((2 - math.log(2) - 1) / 2)
