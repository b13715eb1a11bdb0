"""Trace spans of a session, as data on the turn log (verl's ``rollout_trace_op``).

verl traces an agent loop's ``run``, every ``generate`` and every tool call into weave or
mlflow. Here the spans are records in the session's terminal event
(``SessionFinished.spans`` / ``SessionFailed.spans``): whatever reads the turn log
(``rolloutbus inspect``, a replay, an exporter) sees them without a tracing backend.
``rolloutbus.streams.agent_loop.tracing`` records them and, when the ``opentelemetry``
package is importable, hands them to OpenTelemetry.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

SpanValue = str | int | float | bool


class TraceSpan(BaseModel):
    """One timed operation of a session: ``name``, wall-clock start and end (unix seconds),
    flat attributes (OpenTelemetry's attribute types), and whether it raised."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    start_ts: float
    end_ts: float
    attributes: dict[str, SpanValue] = Field(default_factory=dict)
    status: Literal["ok", "error"] = "ok"
    error: str | None = None

    @property
    def duration_s(self) -> float:
        return self.end_ts - self.start_ts
