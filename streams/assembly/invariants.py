"""The invariants a trajectory must hold before it is released, and the budgets it is held
to (``trajectories.py`` releases one that breaks them as ``failed``, the violations as its
error): mask and logprob lengths equal the response's, mask 0/1, logprob 0.0 on mask-0
tokens, prompt and response within the group's recorded budgets."""

from __future__ import annotations

import logging
from typing import Protocol

import numpy as np

from rolloutbus.config import RolloutConfig
from rolloutbus.schemas.trajectories import Trajectory, TrajectoryStatus
from rolloutbus.schemas.turns import GroupStarted

__all__ = ["Budgets", "as_failed", "budgets_of", "violations"]

log = logging.getLogger(__name__)


class Budgets(Protocol):
    """The token budgets a trajectory is checked against: a group's recorded
    ``GroupSettings``, or (logs written before they were recorded) a ``RolloutConfig``."""

    @property
    def prompt_length(self) -> int: ...

    @property
    def response_length(self) -> int: ...


# what has been warned about once in this process (see budgets_of)
_WARNED: set[str] = set()


def budgets_of(group: GroupStarted, fallback: RolloutConfig) -> Budgets:
    """The budgets ``group`` ran under: its recorded settings, else ``fallback`` (a log
    written before groups recorded them), with one warning per process."""
    if group.settings is not None:
        return group.settings
    if "budgets" not in _WARNED:
        _WARNED.add("budgets")
        log.warning(
            "group %s was logged before groups recorded their settings: it and every such "
            "group are folded with this process's rollout.prompt_length = %d and "
            "rollout.response_length = %d, so their trajectories depend on this config",
            group.uid,
            fallback.prompt_length,
            fallback.response_length,
        )
    return fallback


def violations(t: Trajectory, rollout: Budgets) -> list[str]:
    """Every invariant ``t`` breaks, as sentences that name the numbers (``rollout``: the
    group's budgets, see :func:`budgets_of`)."""
    if t.status == TrajectoryStatus.FAILED:
        return []
    found = []
    n = len(t.responses)
    if len(t.response_mask) != n:
        found.append(f"response_mask has {len(t.response_mask)} entries for {n} response tokens")
    if t.rollout_log_probs is not None and len(t.rollout_log_probs) != n:
        found.append(
            f"rollout_log_probs has {len(t.rollout_log_probs)} entries for {n} response tokens"
        )
    mask = np.asarray(t.response_mask, dtype=np.int64)
    if ((mask != 0) & (mask != 1)).any():
        found.append("response_mask holds values other than 0 and 1")
    if t.rollout_log_probs is not None:
        logprobs = np.asarray(t.rollout_log_probs, dtype=np.float64)
        k = min(len(logprobs), len(mask))  # a length mismatch is reported above
        if (logprobs[:k][mask[:k] == 0] != 0.0).any():
            found.append("a mask-0 token (observation or boundary) has a non-zero logprob")
    if len(t.prompts) > rollout.prompt_length:
        found.append(
            f"prompt has {len(t.prompts)} tokens, over prompt_length {rollout.prompt_length}"
        )
    if n > rollout.response_length:
        found.append(f"response has {n} tokens, over response_length {rollout.response_length}")
    return found


def as_failed(t: Trajectory, problems: list[str]) -> Trajectory:
    return t.model_copy(
        update={
            "status": TrajectoryStatus.FAILED,
            "error": "invariant violated: " + "; ".join(problems),
            "failure_class": "loop",
        }
    )
