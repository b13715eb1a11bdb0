"""DESIGN.md §4's per-trajectory invariants, checked by the replay buffer before release.

A trajectory that breaks one is not dropped: it is released with status ``failed`` and the
violations as its error (so its group is never silently short), and the replay buffer
writes a dead letter naming the key and the violation.
"""

from __future__ import annotations

import numpy as np

from rolloutbus.config import RolloutConfig
from rolloutbus.schemas.trajectories import Trajectory, TrajectoryStatus


def violations(t: Trajectory, rollout: RolloutConfig) -> list[str]:
    """Every invariant ``t`` breaks, as sentences that name the numbers."""
    if t.status == TrajectoryStatus.FAILED:
        return []
    found = []
    n = len(t.responses)
    if len(t.response_mask) != n:
        found.append(f"response_mask has {len(t.response_mask)} entries for {n} response tokens")
    if t.rollout_log_probs is not None and len(t.rollout_log_probs) != n:
        found.append(f"rollout_log_probs has {len(t.rollout_log_probs)} entries for {n} response tokens")
    mask = np.asarray(t.response_mask, dtype=np.int64)
    if ((mask != 0) & (mask != 1)).any():
        found.append("response_mask holds values other than 0 and 1")
    if t.rollout_log_probs is not None:
        logprobs = np.asarray(t.rollout_log_probs, dtype=np.float64)
        k = min(len(logprobs), len(mask))  # a length mismatch is reported above
        if (logprobs[:k][mask[:k] == 0] != 0.0).any():
            found.append("a mask-0 token (observation or boundary) has a non-zero logprob")
    if len(t.prompts) > rollout.prompt_length:
        found.append(f"prompt has {len(t.prompts)} tokens, over prompt_length {rollout.prompt_length}")
    if n > rollout.response_length:
        found.append(f"response has {n} tokens, over response_length {rollout.response_length}")
    return found


def as_failed(t: Trajectory, problems: list[str]) -> Trajectory:
    return t.model_copy(update={"status": TrajectoryStatus.FAILED,
                                "error": "invariant violated: " + "; ".join(problems)})
