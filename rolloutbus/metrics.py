"""Prometheus metrics of the rollout pipeline (prefix ``rolloutbus_``, base units)."""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)

from rolloutbus.config import LOOPBACK

# seconds; a prompt group on CPU takes seconds, on a busy GPU fleet up to half an hour
GROUP_SECONDS_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800)


class PerRegistry:
    """One instance per (class, registry): several workers in one process (tests,
    benchmarks) share the series instead of registering them twice."""

    _instances: dict[type, weakref.WeakKeyDictionary] = {}

    def __new__(cls, registry: CollectorRegistry | None = None):
        registry = REGISTRY if registry is None else registry
        per_class = PerRegistry._instances.setdefault(cls, weakref.WeakKeyDictionary())
        if registry not in per_class:
            instance = super().__new__(cls)
            instance._init(registry)
            per_class[registry] = instance
        return per_class[registry]

    def __init__(self, registry: CollectorRegistry | None = None):
        pass  # built once in _init

    def _init(self, registry: CollectorRegistry) -> None:
        raise NotImplementedError


class SessionMetrics(PerRegistry):
    def _init(self, registry: CollectorRegistry) -> None:
        self.groups_in_flight = Gauge(
            "rolloutbus_sessions_groups_in_flight",
            "Prompt groups being rolled out by this worker",
            registry=registry,
        )
        self.group_seconds = Histogram(
            "rolloutbus_sessions_group_duration_seconds",
            "Wall time from taking a prompt group to delivering its turns",
            buckets=GROUP_SECONDS_BUCKETS,
            registry=registry,
        )
        self.sessions = Counter(
            "rolloutbus_sessions_total", "Sessions run, by outcome", ["outcome"], registry=registry
        )
        self.turn_events = Counter(
            "rolloutbus_sessions_turn_events_total",
            "Events written to the turn log, by type",
            ["type"],
            registry=registry,
        )
        self.recovery = Counter(
            "rolloutbus_sessions_recovery_total",
            "Resuming from the turn log: resumed_sessions, "
            "replayed_generations (turns not sampled again), "
            "diverged_sessions (re-run as a new attempt)",
            ["kind"],
            registry=registry,
        )
        self.tokens = Counter(
            "rolloutbus_sessions_tokens_total",
            "Tokens logged, by kind: sampled (mask 1) or observed (mask 0)",
            ["kind"],
            registry=registry,
        )

    def count_event(self, event: object) -> None:
        kind = getattr(event, "type", "unknown")
        self.turn_events.labels(type=kind).inc()
        if kind == "generation":
            self.tokens.labels(kind="sampled").inc(len(event.token_ids))  # type: ignore[attr-defined]
        elif kind == "observation":
            self.tokens.labels(kind="observed").inc(len(event.token_ids))  # type: ignore[attr-defined]

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


class ReplayBufferMetrics(PerRegistry):
    def _init(self, registry: CollectorRegistry) -> None:
        self.events = Counter(
            "rolloutbus_replay_buffer_events_total",
            "Turn events consumed, by type",
            ["type"],
            registry=registry,
        )
        self.trajectories = Counter(
            "rolloutbus_replay_buffer_trajectories_total",
            "Trajectories released, by status",
            ["status"],
            registry=registry,
        )
        self.groups = Counter(
            "rolloutbus_replay_buffer_groups_released_total",
            "Prompt groups released",
            registry=registry,
        )
        self.open_groups = Gauge(
            "rolloutbus_replay_buffer_open_groups",
            "Groups with sessions still running",
            registry=registry,
        )
        self.duplicates = Counter(
            "rolloutbus_replay_buffer_ignored_events_total",
            "Events ignored: superseded attempts or already released groups",
            registry=registry,
        )
        self.dead_letters = Counter(
            "rolloutbus_replay_buffer_dead_letters_total",
            "Turn events sent to the dead-letter topic",
            registry=registry,
        )
        self.groups_released_early = Counter(
            "rolloutbus_replay_buffer_groups_released_early_total",
            "Groups released before all their sessions settled (unsettled ones as failed "
            "records) or rejected, by kind: deadline, too_many_open_groups, head_missing, rejected",
            ["kind"],
            registry=registry,
        )
        self.released_uids = Gauge(
            "rolloutbus_replay_buffer_released_uids",
            "Released uids remembered (read back from the released topic on assignment)",
            registry=registry,
        )
        self.released_uids_forgotten = Counter(
            "rolloutbus_replay_buffer_released_uids_forgotten_total",
            "Released uids dropped from memory past replay_buffer.max_released_uids",
            registry=registry,
        )
        self.recoveries = Counter(
            "rolloutbus_replay_buffer_partition_recoveries_total",
            "Partitions (re)loaded from committed offsets and the released "
            "topic: on assignment and after an aborted transaction",
            registry=registry,
        )
        self.transaction_aborts = Counter(
            "rolloutbus_replay_buffer_transaction_aborts_total",
            "Transactions aborted and retried from the committed offsets, by cause: abortable "
            "(a broker error), retries_exhausted, wedged (a client call that never returned)",
            ["cause"],
            registry=registry,
        )


class StalenessMetrics(PerRegistry):
    """The trainer client's staleness filter (``async_training.stale_group_policy``)."""

    def _init(self, registry: CollectorRegistry) -> None:
        self.stale_groups = Counter(
            "rolloutbus_trainer_client_stale_groups_total",
            "Groups whose min policy version is older than the staleness bound allows, by "
            "action: dropped (not yielded) or down_weighted (yielded with a smaller weight)",
            ["action"],
            registry=registry,
        )
        self.staleness = Histogram(
            "rolloutbus_trainer_client_group_staleness_versions",
            "Current policy version minus the group's min policy version, per group received",
            buckets=(0, 1, 2, 3, 4, 6, 8, 16, 32),
            registry=registry,
        )


class ControlMetrics(PerRegistry):
    """Readers of ``rollout.control`` (``rolloutbus.kafka.version_ledger``)."""

    def _init(self, registry: CollectorRegistry) -> None:
        self.refused = Counter(
            "rolloutbus_control_records_refused_total",
            "Control records a follower did not take, by reason: older_run (a superseded "
            "run's, ignored), backwards, no_weights, unknown_run, conflicting_run, malformed "
            "(errors: dead-lettered by the weight sync)",
            ["reason"],
            registry=registry,
        )
        self.run_epoch = Gauge(
            "rolloutbus_control_run_epoch",
            "Run epoch of the newest trainer run this process follows (0: none yet)",
            registry=registry,
        )


class WeightSyncMetrics(PerRegistry):
    """``rolloutbus weight-sync``: policy versions applied to the replicas."""

    def _init(self, registry: CollectorRegistry) -> None:
        self.syncs = Counter(
            "rolloutbus_weight_sync_total",
            "Replica syncs by outcome: applied (weights loaded), labelled (version 0, the "
            "initial weights: label only), failed",
            ["outcome"],
            registry=registry,
        )
        self.replica_version = Gauge(
            "rolloutbus_weight_sync_replica_policy_version",
            "Policy version each replica was last moved to",
            ["replica"],
            registry=registry,
        )
        self.sync_seconds = Histogram(
            "rolloutbus_weight_sync_duration_seconds",
            "Wall time to move one replica to a version (pause to resume)",
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
            registry=registry,
        )


# seconds; a CPU train step of the tiny model takes ~1 s, SmolLM2-135M tens of seconds
TRAIN_STEP_SECONDS_BUCKETS = (0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)


class TrainerClientMetrics(PerRegistry):
    """The trainer client's groups that never reach the trainer, besides stale ones."""

    def _init(self, registry: CollectorRegistry) -> None:
        self.skipped_groups = Counter(
            "rolloutbus_trainer_client_skipped_groups_total",
            "Complete groups skipped (consumed, never yielded), by reason: too_few_successful "
            "(fewer completed or truncated members than trainer.min_successful_per_group)",
            ["reason"],
            registry=registry,
        )


class TrainerMetrics(PerRegistry):
    """``rolloutbus train``: one update per train step (``consumers/training``)."""

    def _init(self, registry: CollectorRegistry) -> None:
        self.global_step = Gauge(
            "rolloutbus_trainer_global_step", "Optimizer steps taken", registry=registry
        )
        self.policy_version = Gauge(
            "rolloutbus_trainer_policy_version", "Last policy version published", registry=registry
        )
        self.groups = Counter(
            "rolloutbus_trainer_groups_total", "Prompt groups trained on", registry=registry
        )
        self.tokens = Counter(
            "rolloutbus_trainer_tokens_total",
            "Response tokens in the loss (policy-sampled)",
            registry=registry,
        )
        self.step_seconds = Histogram(
            "rolloutbus_trainer_step_duration_seconds",
            "Wall time of a train step (forward, backward, optimizer), waiting excluded",
            buckets=TRAIN_STEP_SECONDS_BUCKETS,
            registry=registry,
        )
        self.reward = Gauge(
            "rolloutbus_trainer_reward_mean",
            "Mean reward of the last step's trajectories, by data source",
            ["data_source"],
            registry=registry,
        )
        # the other per-step figures, by verl's metric name (actor/pg_clipfrac, ...)
        self.step_value = Gauge(
            "rolloutbus_trainer_step_value",
            "Last train step's figures by name: response_length/mean, actor/pg_clipfrac, "
            "actor/ppo_kl, rollout_corr/rollout_is_mean, rollout_corr/kl, staleness/max ...",
            ["name"],
            registry=registry,
        )


def start_metrics_server(port: int, addr: str = LOOPBACK) -> None:
    """Serve ``/metrics`` on ``addr:port``: loopback unless the caller passes the configured
    address (``sessions.metrics_host``, ``replay_buffer.metrics_host``); prometheus_client's
    own default would be every interface."""
    start_http_server(port, addr=addr)
