"""The session worker's Prometheus series (``sessions.metrics_port``); the gateway
serves the turn-log ones for the turns it logs. docs/reference/metrics.md lists them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from rolloutbus.metrics import GROUP_SECONDS_BUCKETS, PerRegistry, failure_class_of

__all__ = ["SessionMetrics"]


class SessionMetrics(PerRegistry):
    def _init(self, registry: CollectorRegistry) -> None:
        self.groups_in_flight = Gauge(
            "rolloutbus_sessions_groups_in_flight",
            "Prompt groups being rolled out by this worker; groups",
            registry=registry,
        )
        self.group_seconds = Histogram(
            "rolloutbus_sessions_group_duration_seconds",
            "Wall time from taking a prompt group to delivering its turns; seconds",
            buckets=GROUP_SECONDS_BUCKETS,
            registry=registry,
        )
        self.sessions = Counter(
            "rolloutbus_sessions_total",
            "Sessions run, by outcome; sessions",
            ["outcome"],
            registry=registry,
        )
        self.turn_events = Counter(
            "rolloutbus_sessions_turn_events_total",
            "Events written to the turn log, by type; events",
            ["type"],
            registry=registry,
        )
        self.recovery = Counter(
            "rolloutbus_sessions_recovery_total",
            "Resuming from the turn log: resumed_sessions, "
            "replayed_generations (turns not sampled again), "
            "diverged_sessions (re-run as a new attempt); sessions or turns, as the kind says",
            ["kind"],
            registry=registry,
        )
        self.tokens = Counter(
            "rolloutbus_sessions_tokens_total",
            "Tokens logged, by kind: sampled (mask 1) or observed (mask 0); tokens",
            ["kind"],
            registry=registry,
        )
        self.stalls = Counter(
            "rolloutbus_sessions_stalls_total",
            "Sessions or groups found with no progress for sessions.stall_warn_s (each "
            "stall counted once; the log line names the key and what it waits on); stalls",
            registry=registry,
        )
        self.stalled = Gauge(
            "rolloutbus_sessions_stalled",
            "Sessions or groups stalled now (no progress for sessions.stall_warn_s); "
            "sessions or groups",
            registry=registry,
        )
        self.failed_sessions = Counter(
            "rolloutbus_sessions_failed_total",
            "Sessions that ended in session_failed, by failure class (infrastructure, loop, "
            "reward; unknown when the event names none); sessions",
            ["failure_class"],
            registry=registry,
        )
        self.first_resumed_turn = Gauge(
            "rolloutbus_sessions_first_resumed_turn_seconds",
            "Seconds from this worker's start to the first turn it logged for a resumed "
            "session (a generation replayed from the turn log); 0 until one",
            registry=registry,
        )
        self._started = time.monotonic()
        self._resumed_attempts: set[str] | None = set()  # None once the first turn is seen

    def count_event(self, event: object) -> None:
        kind = getattr(event, "type", "unknown")
        self.turn_events.labels(type=kind).inc()
        if kind == "generation":
            self.tokens.labels(kind="sampled").inc(len(event.token_ids))  # type: ignore[attr-defined]
            self._note_resumed_turn(getattr(event, "attempt", ""))
        elif kind == "observation":
            self.tokens.labels(kind="observed").inc(len(event.token_ids))  # type: ignore[attr-defined]
        elif kind == "session_started" and getattr(event, "resumed_from", None):
            if self._resumed_attempts is not None:
                self._resumed_attempts.add(event.attempt)  # type: ignore[attr-defined]
        elif kind == "session_failed":
            self.failed_sessions.labels(failure_class=failure_class_of(event)).inc()

    def _note_resumed_turn(self, attempt: str) -> None:
        if self._resumed_attempts is not None and attempt in self._resumed_attempts:
            self.first_resumed_turn.set(time.monotonic() - self._started)
            self._resumed_attempts = None  # only the first one is measured

    @contextmanager
    def track_group(self) -> Iterator[None]:
        self.groups_in_flight.inc()
        started = time.monotonic()
        try:
            yield
        finally:
            self.groups_in_flight.dec()
            self.group_seconds.observe(time.monotonic() - started)

    def count_session(self, *, failed: bool) -> None:
        self.sessions.labels(outcome="failed" if failed else "finished").inc()

    def count_recovery(self, before: dict[str, int], after: dict[str, int]) -> None:
        """Add what resuming from the log did since ``before`` (SessionStats as a dict)."""
        for kind, value in after.items():
            if value > before.get(kind, 0):
                self.recovery.labels(kind=kind).inc(value - before.get(kind, 0))
