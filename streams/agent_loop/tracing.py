"""Trace spans of a session (verl's ``rollout_trace_op``), recorded as data.

verl decorates ``AgentLoopBase.run``, the server's ``generate`` and ``BaseTool.execute``
with ``rollout_trace_op`` and sends the spans to weave or mlflow. Here the same decorator
(``from rolloutbus.streams.agent_loop.tracing import rollout_trace_op``, so a ported loop
changes only its import) records a :class:`~rolloutbus.schemas.trace.TraceSpan` into the
session that is running; the session runner collects them (``collect_spans``) and writes
them into the session's terminal event on the turn log. Outside a collecting session a
span costs one context-variable read and is dropped.

``export_to_opentelemetry`` hands spans to OpenTelemetry when the ``opentelemetry`` package
is importable (it is not a dependency): one trace per session, the spans as children of a
root span named after it.
"""

from __future__ import annotations

import functools
import importlib
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

from rolloutbus.schemas.trace import SpanValue, TraceSpan

__all__ = [
    "collect_spans",
    "export_to_opentelemetry",
    "opentelemetry_available",
    "rollout_trace_op",
    "trace_span",
]

_spans: ContextVar[list[TraceSpan] | None] = ContextVar("rolloutbus_trace_spans", default=None)
ERROR_CHARS = 300  # characters of an exception kept on a failed span

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


@contextmanager
def collect_spans() -> Iterator[list[TraceSpan]]:
    """Collect the spans recorded in this context (and the tasks it starts) into a list."""
    spans: list[TraceSpan] = []
    token = _spans.set(spans)
    try:
        yield spans
    finally:
        _spans.reset(token)


@contextmanager
def trace_span(name: str, **attributes: Any) -> Iterator[dict[str, Any]]:
    """Time the block as one span; the yielded dict takes attributes known only later."""
    sink = _spans.get()
    extra: dict[str, Any] = {}
    start = time.time()
    try:
        yield extra
    except BaseException as exc:
        if sink is not None:
            sink.append(_span(name, start, {**attributes, **extra}, exc))
        raise
    if sink is not None:
        sink.append(_span(name, start, {**attributes, **extra}, None))


def rollout_trace_op(fn: F) -> F:
    """verl's decorator: a span named after the coroutine function for each call."""

    @functools.wraps(fn)
    async def traced(*args: Any, **kwargs: Any) -> Any:
        with trace_span(fn.__qualname__):
            return await fn(*args, **kwargs)

    return traced  # type: ignore[return-value]


def _span(
    name: str, start: float, attributes: dict[str, Any], exc: BaseException | None
) -> TraceSpan:
    return TraceSpan(
        name=name,
        start_ts=start,
        end_ts=time.time(),
        attributes={k: _attribute(v) for k, v in attributes.items() if v is not None},
        status="ok" if exc is None else "error",
        error=None if exc is None else f"{type(exc).__name__}: {exc}"[:ERROR_CHARS],
    )


def _attribute(value: Any) -> SpanValue:
    """OpenTelemetry's attribute types: str, bool, int, float; anything else as text."""
    if isinstance(value, str | bool | int | float):
        return value
    return str(value)


def opentelemetry_available() -> bool:
    try:
        _otel_trace()
    except ImportError:
        return False
    return True


def _otel_trace() -> Any:
    # by name: an optional package, not a dependency (no stubs for the type checker)
    return importlib.import_module("opentelemetry.trace")


def export_to_opentelemetry(
    spans: list[TraceSpan], *, session: str, tracer_provider: Any = None
) -> int:
    """Emit ``spans`` through OpenTelemetry under a root span ``session``; the count sent.

    Needs the ``opentelemetry`` package (``opentelemetry-api``, and an SDK with an exporter
    to send anything); without it this raises ImportError naming it.
    """
    try:
        trace = _otel_trace()
    except ImportError as exc:
        raise ImportError(
            "exporting trace spans needs the opentelemetry package: "
            "pip install opentelemetry-api opentelemetry-sdk"
        ) from exc
    tracer = trace.get_tracer("rolloutbus", tracer_provider=tracer_provider)
    if not spans:
        return 0
    start = min(s.start_ts for s in spans)
    end = max(s.end_ts for s in spans)
    root = tracer.start_span(session, start_time=_ns(start))
    context = trace.set_span_in_context(root)
    for span in spans:
        child = tracer.start_span(
            span.name, context=context, start_time=_ns(span.start_ts), attributes=span.attributes
        )
        if span.status == "error":
            child.set_status(trace.Status(trace.StatusCode.ERROR, span.error))
        child.end(end_time=_ns(span.end_ts))
    root.end(end_time=_ns(end))
    return len(spans)


def _ns(seconds: float) -> int:
    return int(seconds * 1_000_000_000)
