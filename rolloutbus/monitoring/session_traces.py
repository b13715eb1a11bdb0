"""One trace per session attempt, rebuilt from the turn log and sent to OpenTelemetry.

The turn log already holds what a trace needs, for session workers and the gateway alike:
``session_started`` (the attempt and the attempt it resumed), each ``generation`` (its
replica, policy version and latency, stamped with its log time), and the terminal event
with the spans the agent loop recorded (``rollout_trace_op``: the loop's run, each
generate, tool call and scoring). Traces built from the log need no exporter in the hot
path and cover a session whose worker died: its attempt ends with its last logged event.

One trace per session (its id derived from ``{uid}_{session_id}``): a root span
``session {key}``; a child per attempt (``attempt {id}``: ``rolloutbus.attempt``,
``.resumed_from``, ``.agent_name``, ``.status``, ``.replayed_turns``), linked to the attempt
it resumed; under each attempt the spans it recorded, each ``generate`` carrying the
``replica`` and ``policy_version`` of its logged generation (the turns an attempt replays
from the log ran in an earlier attempt, and are counted, not repeated). A killed attempt
recorded no spans: its children are its logged generations.

``rolloutbus traces`` reads the turn log and sends the traces to an OTLP/HTTP receiver
(Tempo, Jaeger, an OpenTelemetry Collector: ``monitoring.otlp_endpoint``) as OTLP JSON, or
prints that JSON.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx
from pydantic import ValidationError

from rolloutbus.config import Config
from rolloutbus.errors import RolloutBusError, SchemaError
from rolloutbus.kafka.partition_reader import read_partition
from rolloutbus.schemas.trace import SpanValue
from rolloutbus.schemas.turns import (
    Generation,
    SessionFailed,
    SessionFinished,
    SessionStarted,
    TurnEvent,
    decode_turn_event,
)
from rolloutbus.topics import Topics, partition_for

__all__ = ["AttemptTrace", "Span", "attempt_traces", "otlp_traces", "read_traces", "send_otlp"]


@dataclass(frozen=True)
class Span:
    name: str
    start_s: float
    end_s: float
    attributes: dict[str, SpanValue]
    error: str | None = None


@dataclass
class AttemptTrace:
    """One session attempt: when it ran, how it ended, and its spans."""

    uid: str
    session_id: int
    attempt: str
    resumed_from: str | None
    agent_name: str | None
    start_s: float
    end_s: float
    status: str = "unfinished"  # finished, failed, or unfinished (its worker died)
    spans: list[Span] = field(default_factory=list)
    generations: dict[tuple[Any, Any], tuple[float, Generation]] = field(default_factory=dict)
    replayed_turns: int = 0

    @property
    def key(self) -> str:
        return f"{self.uid}_{self.session_id}"

    def attributes(self) -> dict[str, SpanValue]:
        found: dict[str, SpanValue | None] = {
            "rolloutbus.uid": self.uid,
            "rolloutbus.session_id": self.session_id,
            "rolloutbus.attempt": self.attempt,
            "rolloutbus.resumed_from": self.resumed_from,
            "rolloutbus.agent_name": self.agent_name,
            "rolloutbus.status": self.status,
            "rolloutbus.replayed_turns": self.replayed_turns,
        }
        return {k: v for k, v in found.items() if v is not None}


def read_traces(cfg: Config, uid: str | None = None) -> list[AttemptTrace]:
    """Every session attempt in the turn log (``uid``'s partition and group only, if given),
    with its log times; records that are not turn events are skipped (dead letters)."""
    topic = Topics.from_config(cfg.kafka).turns
    partitions = [partition_for(uid, cfg.kafka.partitions)] if uid else range(cfg.kafka.partitions)
    records: list[tuple[float, TurnEvent]] = []
    for partition in partitions:
        for msg in read_partition(cfg.kafka, topic, partition, 0):
            try:
                event = decode_turn_event(msg.value() or b"")
            except (ValidationError, SchemaError):
                continue
            if uid is None or event.uid == uid:
                records.append((msg.timestamp()[1] / 1000, event))
    return attempt_traces(records)


def attempt_traces(records: Iterable[tuple[float, TurnEvent]]) -> list[AttemptTrace]:
    """The attempts of ``records`` (log time in seconds, turn event), in the order they
    started; events of an attempt whose ``session_started`` is not among them are skipped."""
    attempts: dict[str, AttemptTrace] = {}
    for at, event in records:
        attempt = getattr(event, "attempt", None)
        if isinstance(event, SessionStarted):
            attempts[event.attempt] = AttemptTrace(
                event.uid,
                event.session_id,
                event.attempt,
                event.resumed_from,
                event.agent_name,
                at,
                at,
            )
        elif attempt in attempts:
            _take(attempts[attempt], at, event)
    for trace in attempts.values():
        _finish(trace)
    return list(attempts.values())


def _take(trace: AttemptTrace, at: float, event: TurnEvent) -> None:
    trace.end_s = max(trace.end_s, at)
    if isinstance(event, Generation):
        trace.generations[(event.segment, event.turn)] = (at, event)
    elif isinstance(event, SessionFinished | SessionFailed):
        trace.status = "finished" if isinstance(event, SessionFinished) else "failed"
        trace.spans = [
            Span(s.name, s.start_ts, s.end_ts, dict(s.attributes), s.error) for s in event.spans
        ]


def _finish(trace: AttemptTrace) -> None:
    """Give each recorded generate span its logged generation's replica and version; a
    generation no span recorded was replayed from the log (or, for an attempt without a
    terminal event, is the only record of its turn)."""
    recorded: set[tuple[Any, Any]] = set()
    for index, span in enumerate(trace.spans):
        turn = (span.attributes.get("segment"), span.attributes.get("turn"))
        if span.name == "generate" and turn in trace.generations:
            recorded.add(turn)
            trace.spans[index] = _with_generation(span, trace.generations[turn][1])
    unrecorded = [key for key in trace.generations if key not in recorded]
    if trace.status != "unfinished":
        trace.replayed_turns = len(unrecorded)
        return
    for key in unrecorded:
        at, generation = trace.generations[key]
        start = at - (generation.latency_s or 0.0)
        attributes: dict[str, SpanValue] = {"segment": key[0], "turn": key[1], "logged_only": True}
        trace.spans.append(_with_generation(Span("generate", start, at, attributes), generation))


def _with_generation(span: Span, generation: Generation) -> Span:
    extra: dict[str, SpanValue] = {"replica": generation.replica}
    if generation.policy_version is not None:
        extra["policy_version"] = generation.policy_version
    extra["response_tokens"] = len(generation.token_ids)
    return Span(span.name, span.start_s, span.end_s, {**span.attributes, **extra}, span.error)


def otlp_traces(traces: list[AttemptTrace], service: str = "rolloutbus") -> dict[str, Any]:
    """``traces`` as an OTLP/HTTP JSON body (``POST /v1/traces``): one trace per session, its
    id derived from the session's key, so attempts exported apart land in one trace.

    The root span ``session {key}`` covers every attempt; each attempt is a child
    (``attempt {id}``, linked to the attempt it resumed); the recorded spans are children of
    their attempt."""
    spans: list[dict[str, Any]] = []
    for key, attempts in _by_session(traces).items():
        trace_id = _id(key, 16)
        root_id = _id(f"{key}/session", 8)
        first = attempts[0]
        spans.append(
            _otlp_span(
                trace_id,
                root_id,
                None,
                f"session {key}",
                min(a.start_s for a in attempts),
                max(_end(a) for a in attempts),
                {
                    "rolloutbus.uid": first.uid,
                    "rolloutbus.session_id": first.session_id,
                    "rolloutbus.attempts": len(attempts),
                },
            )
        )
        for attempt in attempts:
            spans += _attempt_spans(trace_id, root_id, attempt)
    resource = {"attributes": _attributes({"service.name": service})}
    scope = {"scope": {"name": "rolloutbus.session_traces"}, "spans": spans}
    return {"resourceSpans": [{"resource": resource, "scopeSpans": [scope]}]}


def _by_session(traces: list[AttemptTrace]) -> dict[str, list[AttemptTrace]]:
    sessions: dict[str, list[AttemptTrace]] = {}
    for attempt in sorted(traces, key=lambda a: a.start_s):
        sessions.setdefault(attempt.key, []).append(attempt)
    return sessions


def _attempt_spans(trace_id: str, root_id: str, attempt: AttemptTrace) -> list[dict[str, Any]]:
    span_id = _id(f"{attempt.key}/{attempt.attempt}", 8)
    links = []
    if attempt.resumed_from is not None:
        links = [{"traceId": trace_id, "spanId": _id(f"{attempt.key}/{attempt.resumed_from}", 8)}]
    out = [
        _otlp_span(
            trace_id,
            span_id,
            root_id,
            f"attempt {attempt.attempt}",
            attempt.start_s,
            _end(attempt),
            attempt.attributes(),
            links=links,
        )
    ]
    for index, span in enumerate(attempt.spans):
        child = _id(f"{attempt.key}/{attempt.attempt}/{index}", 8)
        attributes = {**span.attributes, "rolloutbus.attempt": attempt.attempt}
        out.append(
            _otlp_span(
                trace_id,
                child,
                span_id,
                span.name,
                span.start_s,
                span.end_s,
                attributes,
                error=span.error,
            )
        )
    return out


def _end(attempt: AttemptTrace) -> float:
    return max([attempt.end_s, *(s.end_s for s in attempt.spans)])


def _otlp_span(
    trace_id: str,
    span_id: str,
    parent: str | None,
    name: str,
    start_s: float,
    end_s: float,
    attributes: dict[str, SpanValue],
    *,
    links: list[dict[str, str]] | None = None,
    error: str | None = None,
) -> dict[str, Any]:
    span: dict[str, Any] = {
        "traceId": trace_id,
        "spanId": span_id,
        "name": name,
        "kind": 1,  # SPAN_KIND_INTERNAL
        "startTimeUnixNano": str(_ns(start_s)),
        "endTimeUnixNano": str(_ns(end_s)),
        "attributes": _attributes(attributes),
    }
    if parent is not None:
        span["parentSpanId"] = parent
    if links:
        span["links"] = links
    if error is not None:
        span["status"] = {"code": 2, "message": error}  # STATUS_CODE_ERROR
    return span


def _attributes(values: dict[str, SpanValue]) -> list[dict[str, Any]]:
    return [{"key": key, "value": _value(value)} for key, value in values.items()]


def _value(value: SpanValue) -> dict[str, Any]:
    # OTLP's JSON mapping: int64 as a string, the rest as JSON
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value}
    return {"stringValue": str(value)}


def _id(text: str, size: int) -> str:
    """A stable id of ``size`` bytes, as hex: the same session gets the same trace id in
    every export."""
    return hashlib.blake2b(text.encode(), digest_size=size).hexdigest()


def send_otlp(traces: list[AttemptTrace], endpoint: str, timeout_s: float = 10.0) -> int:
    """POST ``traces`` to an OTLP/HTTP receiver (``http://tempo:4318``; ``/v1/traces`` is
    added); the number of spans sent. An answer other than 2xx raises, with its body."""
    body = otlp_traces(traces)
    url = endpoint.rstrip("/")
    url = url if url.endswith("/v1/traces") else f"{url}/v1/traces"
    response = httpx.post(url, json=body, timeout=timeout_s)
    if response.status_code // 100 != 2:
        raise RolloutBusError(
            f"the OTLP receiver at {url} answered {response.status_code}: {response.text[:300]}"
        )
    return sum(len(s["spans"]) for r in body["resourceSpans"] for s in r["scopeSpans"])


def _ns(seconds: float) -> int:
    return int(seconds * 1_000_000_000)
