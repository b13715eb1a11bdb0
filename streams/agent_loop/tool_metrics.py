"""Tool calls for Prometheus: count, duration and outcome of each call, by tool
(``ToolMetrics``, served by the session worker).

The tool loop turns every failure into text for the model (verl's error texts, reward
0.0), never an exception; the outcome is read back from those texts.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram

from rolloutbus.metrics import AGENT_LOOP_SECONDS_BUCKETS, PerRegistry

__all__ = ["ToolMetrics", "call_outcome", "timed_tool_call"]

T = TypeVar("T")
UNKNOWN_TOOL_LABEL = "(unknown)"  # a name the model made up: not a label of its own
# verl's error texts (tool_agent.py), most specific first
_OUTCOME_PREFIXES = (
    ("Unknown function '", "unknown_tool"),
    ("Invalid JSON in arguments for '", "invalid_arguments"),
    ("Error executing tool '", "error"),
)
_TIMEOUT_MARK = "': timed out after "


class ToolMetrics(PerRegistry):
    """Tool calls of the agent loops in a session worker, by tool."""

    def _init(self, registry: CollectorRegistry) -> None:
        self.calls = Counter(
            "rolloutbus_tool_calls_total",
            "Tool calls by tool and outcome: ok, error (the tool raised), timeout, "
            "unknown_tool, invalid_arguments; calls",
            ["tool", "outcome"],
            registry=registry,
        )
        self.seconds = Histogram(
            "rolloutbus_tool_call_duration_seconds",
            "Wall time of one tool call, by tool; seconds",
            ["tool"],
            buckets=AGENT_LOOP_SECONDS_BUCKETS,
            registry=registry,
        )


def call_outcome(text: str | None) -> str:
    """ok, unknown_tool, invalid_arguments, timeout or error, from the tool's answer."""
    text = text or ""
    for prefix, outcome in _OUTCOME_PREFIXES:
        if text.startswith(prefix):
            return "timeout" if outcome == "error" and _TIMEOUT_MARK in text else outcome
    return "ok"


async def timed_tool_call(name: str, call: Awaitable[T]) -> T:
    """Await one tool call (a ``(ToolResponse, reward, metrics)`` tuple) and count it."""
    started = time.monotonic()
    result = await call
    response: Any = result[0] if isinstance(result, tuple) and result else result
    outcome = call_outcome(getattr(response, "text", None))
    tool = UNKNOWN_TOOL_LABEL if outcome == "unknown_tool" else name
    metrics = ToolMetrics()
    metrics.calls.labels(tool=tool, outcome=outcome).inc()
    metrics.seconds.labels(tool=tool).observe(time.monotonic() - started)
    return result
