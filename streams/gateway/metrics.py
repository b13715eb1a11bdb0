"""The gateway's Prometheus series (``GET /metrics`` on ``gateway.port``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from rolloutbus.metrics import PerRegistry

__all__ = ["GatewayMetrics"]


class GatewayMetrics(PerRegistry):
    """``rolloutbus gateway``: its HTTP calls and sessions (its turn events are counted by
    ``SessionMetrics``, as a session worker's are)."""

    def _init(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "rolloutbus_gateway_requests_total",
            "HTTP requests answered, by route and status code; requests",
            ["route", "status"],
            registry=registry,
        )
        self.turns = Counter(
            "rolloutbus_gateway_turns_total",
            "Completions answered, by outcome: sampled, repeated (a retried request answered "
            "from the log) or length (the response budget was spent); turns",
            ["outcome"],
            registry=registry,
        )
        self.sessions = Counter(
            "rolloutbus_gateway_sessions_total",
            "Sessions by event: opened, resumed (from the turn log), finished, aborted, "
            "idle (failed after gateway.session_idle_timeout_s); sessions",
            ["event"],
            registry=registry,
        )
        self.open_sessions = Gauge(
            "rolloutbus_gateway_open_sessions",
            "Sessions this gateway holds open; sessions",
            registry=registry,
        )
