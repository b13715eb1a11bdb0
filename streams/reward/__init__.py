"""Reward as verl computes it: ``default_compute_score`` dispatching by ``data_source``
(verl 0.9.1's table), ``custom_reward_function`` plug-ins, and the naive reward manager's
scoring of a session's outputs.

verl: ``from verl.utils.reward_score import default_compute_score``
here: ``from rolloutbus.streams.reward import default_compute_score``
"""

from rolloutbus.streams.reward.default import (
    ARITHMETIC_SOURCE,
    DEFAULT_REWARD,
    ComputeScore,
    arithmetic_score,
    default_compute_score,
    get_reward_fn,
    is_verl_source,
    last_number,
    register_reward,
    unscored_reason,
)
from rolloutbus.streams.reward.manager import (
    load_custom_reward_fn,
    load_reward_fn,
    reward_call_kwargs,
    reward_extra_info_of,
    reward_fn_for,
    reward_fn_from_config,
    score_outputs,
    score_outputs_async,
    split_result,
)

__all__ = [
    "ARITHMETIC_SOURCE",
    "DEFAULT_REWARD",
    "ComputeScore",
    "arithmetic_score",
    "default_compute_score",
    "get_reward_fn",
    "is_verl_source",
    "last_number",
    "load_custom_reward_fn",
    "load_reward_fn",
    "register_reward",
    "reward_call_kwargs",
    "reward_extra_info_of",
    "reward_fn_for",
    "reward_fn_from_config",
    "score_outputs",
    "score_outputs_async",
    "split_result",
    "unscored_reason",
]
