"""Turn a settled group into the trajectories to release (pure, deterministic).

The live replay buffer and the offline replay (``consumers/replay.py``) both call
``finalize_group``, so replaying a range of the turn log yields byte-identical records.
"""

from __future__ import annotations

from dataclasses import dataclass

from rolloutbus.config import RolloutConfig
from rolloutbus.errors import SchemaError
from rolloutbus.schemas.trajectories import Trajectory, TrajectoryStatus
from rolloutbus.streams.fold import build_group_trajectories
from rolloutbus.streams.group_fold import ReleasedGroup
from rolloutbus.streams.invariants import as_failed, violations
from rolloutbus.topics import trajectory_key


@dataclass(frozen=True)
class Violation:
    trajectory: Trajectory  # as folded, before it was marked failed
    problems: list[str]


def finalize_group(released: ReleasedGroup, rollout: RolloutConfig
                   ) -> tuple[list[Trajectory], list[Violation]]:
    """Fold, then check DESIGN §4's invariants; a broken trajectory is released as failed."""
    try:
        trajectories = build_group_trajectories(released.group, released.sessions,
                                                rollout.response_length)
    except SchemaError as exc:
        trajectories = failed_group(released, f"turn log of the group cannot be folded: {exc}")
    found = []
    for i, t in enumerate(trajectories):
        problems = violations(t, rollout)
        if problems:
            found.append(Violation(t, problems))
            trajectories[i] = as_failed(t, problems)
    return trajectories, found


def failed_group(released: ReleasedGroup, reason: str) -> list[Trajectory]:
    group = released.group
    return [Trajectory(key=trajectory_key(group.uid, s.session_id, 0), uid=group.uid,
                       session_id=s.session_id, output_index=0, num_outputs=1,
                       group_size=len(released.sessions), status=TrajectoryStatus.FAILED,
                       error=reason, agent_name=s.agent_name, attempt=s.attempt,
                       global_steps=group.global_steps)
            for s in released.sessions]
