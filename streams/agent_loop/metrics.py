"""verl's per-step ``agent_loop/*`` metrics, from the trajectories of one step.

verl's ``AgentLoopManager.generate_sequences`` reports, for every training step, the min,
max and mean over the step's trajectories of each per-trajectory metric the built-in loops
record (``generate_sequences`` and ``tool_calls`` seconds, ``compute_score`` seconds,
``num_preempted``), and the same metrics of the slowest trajectory with its prompt and
response lengths (``_performance_metrics``). Here a trajectory's metrics travel in its
session's ``session_finished`` event and in its trajectory row (the ``generate_sequences``,
``tool_calls``, ``compute_score`` and ``num_preempted`` columns); a trainer, the monitoring
or a report computes the step's figures with ``agent_loop_step_metrics`` from the rows it
trains on, under verl's names. Failed records (no tokens, no timings) are left out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rolloutbus.schemas.agent_loop import AgentLoopMetrics

__all__ = ["AGENT_LOOP_METRIC_NAMES", "agent_loop_step_metrics", "step_metrics_of_batch"]

_TIMED = ("num_preempted", "generate_sequences", "tool_calls", "compute_score")
AGENT_LOOP_METRIC_NAMES = (
    *(f"agent_loop/{name}/{stat}" for name in _TIMED for stat in ("min", "max", "mean")),
    *(f"agent_loop/slowest/{name}" for name in ("generate_sequences", "tool_calls")),
    "agent_loop/slowest/compute_score",
    "agent_loop/slowest/num_preempted",
    "agent_loop/slowest/prompt_length",
    "agent_loop/slowest/response_length",
)


def agent_loop_step_metrics(
    metrics: Sequence[AgentLoopMetrics | Mapping[str, Any]],
    prompt_lengths: Sequence[int] | None = None,
    response_lengths: Sequence[int] | None = None,
) -> dict[str, float]:
    """verl's ``agent_loop/*`` figures of one step's trajectories (``{}`` for none).

    ``metrics`` are the trajectories' ``AgentLoopMetrics``; the lengths (prompt and
    response tokens) give the slowest trajectory's ``prompt_length``/``response_length``,
    which verl reports only when it has them, as here.
    """
    rows = [m.model_dump() if isinstance(m, AgentLoopMetrics) else dict(m) for m in metrics]
    if not rows:
        return {}
    values = {name: np.array([row[name] for row in rows], dtype=np.float64) for name in _TIMED}
    out: dict[str, float] = {}
    for name in _TIMED:
        out[f"agent_loop/{name}/min"] = float(values[name].min())
        out[f"agent_loop/{name}/max"] = float(values[name].max())
        out[f"agent_loop/{name}/mean"] = float(values[name].mean())
    # a step is bounded by its slowest trajectory (verl's comment and rule)
    total = values["generate_sequences"] + values["tool_calls"] + values["compute_score"]
    slowest = int(np.argmax(total))
    for name in ("generate_sequences", "tool_calls", "compute_score", "num_preempted"):
        out[f"agent_loop/slowest/{name}"] = float(values[name][slowest])
    if prompt_lengths is not None and response_lengths is not None:
        out["agent_loop/slowest/prompt_length"] = float(prompt_lengths[slowest])
        out["agent_loop/slowest/response_length"] = float(response_lengths[slowest])
    return out


def step_metrics_of_batch(batch: Any) -> dict[str, float]:
    """``agent_loop_step_metrics`` of a trajectory RecordBatch (or Table), failed rows out."""
    columns = {
        name: batch.column(name).to_pylist()
        for name in (*_TIMED, "status", "prompt_len", "response_len")
    }
    kept = [i for i, status in enumerate(columns["status"]) if status != "failed"]
    metrics = [{name: columns[name][i] for name in _TIMED} for i in kept]
    return agent_loop_step_metrics(
        metrics,
        [columns["prompt_len"][i] for i in kept],
        [columns["response_len"][i] for i in kept],
    )
