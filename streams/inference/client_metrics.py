"""The Prometheus series of the LLM clients of a process, prefix ``rolloutbus_client_``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from rolloutbus.metrics import PerRegistry, SeriesDeclarer

__all__ = ["ClientMetrics"]

# seconds; from a millisecond CPU test double to a 32k-token decode on a busy GPU replica.
LATENCY_BUCKETS_S = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    20,
    30,
    60,
    120,
    300,
    600,
)


class ClientMetrics(PerRegistry):
    """The request path's series (in flight, outcomes, retries, latency) and the fleet's
    (routable, admitted, paused, waiting)."""

    def _init(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._request_series(registry)
        self._fleet_series(registry)

    def _request_series(self, registry: CollectorRegistry) -> None:
        series = SeriesDeclarer(registry)
        self.in_flight = series.gauge(
            "rolloutbus_client_in_flight",
            "generate calls in flight from this process; calls",
            labels=("replica",),
        )
        self.requests = series.counter(
            "rolloutbus_client_requests",
            "generate calls by replica and outcome "
            "(completed, aborted, timeout, connection_error, server_error, bad_request, "
            "bad_response); calls",
            labels=("replica", "outcome"),
        )
        self.retries = series.counter(
            "rolloutbus_client_retries",
            "turns sent again to another replica; turns",
        )
        self.latency = series.histogram(
            "rolloutbus_client_request_latency_seconds",
            "time from sending a generate call to its parsed answer; seconds",
            labels=("replica",),
            buckets=LATENCY_BUCKETS_S,
        )

    def _fleet_series(self, registry: CollectorRegistry) -> None:
        series = SeriesDeclarer(registry)
        self.healthy = series.gauge(
            "rolloutbus_client_replica_healthy",
            "1 while a replica is routed to, else 0; boolean",
            labels=("replica",),
        )
        self.admitted = series.gauge(
            "rolloutbus_client_replica_admitted",
            "1 when the replica is routed to, 0 while a replica that (re)started waits to report "
            "the current policy version; boolean",
            labels=("replica",),
        )
        self.admissions = series.counter(
            "rolloutbus_client_replica_admissions",
            "replicas routed to again after a (re)start, by reason: current_version, "
            "stale_timeout (replicas.admit_stale_s passed first), no_version_published, "
            "no_version_reported (the replica names no weight version); replicas",
            labels=("replica", "reason"),
        )
        self.paused_seconds = series.gauge(
            "rolloutbus_client_replica_paused_seconds",
            "time a replica has been paused (0 while it is not); seconds",
            labels=("replica",),
        )
        self.paused_too_long = series.counter(
            "rolloutbus_client_replica_paused_too_long",
            "Warnings that a replica stayed paused longer than replicas.paused_warn_s; warnings",
            labels=("replica",),
        )
        self.waiting = series.gauge(
            "rolloutbus_client_turns_waiting",
            "turns waiting for a routable replica (none is healthy and admitted); turns",
        )
        self.unavailable = series.counter(
            "rolloutbus_client_unavailable",
            "turns that gave up after replicas.unavailable_wait_s with no routable replica; turns",
        )

    def forget(self, replica: str) -> None:
        """Drop a removed replica's gauges (counters keep their history)."""
        for gauge in (self.in_flight, self.healthy, self.admitted, self.paused_seconds):
            try:
                gauge.remove(replica)
            except KeyError:
                pass
