"""Prometheus metrics of the rollout pipeline (prefix ``rolloutbus_``, base units).

Every help text states its unit. No ``_created`` series: prometheus_client would add one
per counter, histogram and label set (a timestamp Prometheus does not need), doubling the
series a dashboard never reads; importing this module turns them off in the process
(``disable_created_metrics``). ``docs/monitoring.md`` lists every metric.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rolloutbus.config import LOOPBACK

disable_created_metrics()  # for the whole process: see the module docstring

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


def failure_class_of(record: object) -> str:
    """The failure class a failed session or trajectory names (``infrastructure``, ``loop``,
    ``reward``), or ``unknown`` for a record written before the field existed."""
    value = getattr(record, "failure_class", None)
    return str(getattr(value, "value", value)) if value else "unknown"


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


class ReplayBufferMetrics(PerRegistry):
    def _init(self, registry: CollectorRegistry) -> None:
        self._init_fold(registry)
        self._init_recovery(registry)

    def _init_fold(self, registry: CollectorRegistry) -> None:
        """What the fold of the turn log counts: events, groups, trajectories."""
        self.events = Counter(
            "rolloutbus_replay_buffer_events_total",
            "Turn events consumed, by type; events",
            ["type"],
            registry=registry,
        )
        self.trajectories = Counter(
            "rolloutbus_replay_buffer_trajectories_total",
            "Trajectories released, by status; trajectories",
            ["status"],
            registry=registry,
        )
        self.groups = Counter(
            "rolloutbus_replay_buffer_groups_released_total",
            "Prompt groups released; groups",
            registry=registry,
        )
        self.open_groups = Gauge(
            "rolloutbus_replay_buffer_open_groups",
            "Groups with sessions still running; groups",
            registry=registry,
        )
        self.duplicates = Counter(
            "rolloutbus_replay_buffer_ignored_events_total",
            "Events ignored: superseded attempts or already released groups; events",
            registry=registry,
        )
        self.dead_letters = Counter(
            "rolloutbus_replay_buffer_dead_letters_total",
            "Turn events sent to the dead-letter topic; events",
            registry=registry,
        )
        self.groups_released_early = Counter(
            "rolloutbus_replay_buffer_groups_released_early_total",
            "Groups released before all their sessions settled (unsettled ones as failed "
            "records) or rejected, by kind: deadline, too_many_open_groups, head_missing, "
            "rejected; groups",
            ["kind"],
            registry=registry,
        )
        self.oldest_open_group = Gauge(
            "rolloutbus_replay_buffer_oldest_open_group_timestamp_seconds",
            "Log timestamp of the first event of the oldest group still open (0: none open); "
            "seconds since the epoch",
            registry=registry,
        )
        self.group_deadline = Gauge(
            "rolloutbus_replay_buffer_group_deadline_seconds",
            "deadlines.group_s: log time a group may stay open before its unsettled sessions "
            "are released as failed; seconds",
            registry=registry,
        )

    def _init_recovery(self, registry: CollectorRegistry) -> None:
        """What makes a release exactly once: released uids remembered, partitions
        recovered, transactions aborted and producers replaced."""
        self.released_uids = Gauge(
            "rolloutbus_replay_buffer_released_uids",
            "Released uids remembered (read back from the released topic on assignment); uids",
            registry=registry,
        )
        self.released_uids_forgotten = Counter(
            "rolloutbus_replay_buffer_released_uids_forgotten_total",
            "Released uids dropped from memory past replay_buffer.max_released_uids; uids",
            registry=registry,
        )
        self.recoveries = Counter(
            "rolloutbus_replay_buffer_partition_recoveries_total",
            "Partitions (re)loaded from committed offsets and the released "
            "topic: on assignment and after an aborted transaction; partitions",
            registry=registry,
        )
        self.transaction_aborts = Counter(
            "rolloutbus_replay_buffer_transaction_aborts_total",
            "Transactions aborted and retried from the committed offsets, by cause: abortable "
            "(a broker error), retries_exhausted, stalled (retriable errors on one producer for "
            "replay_buffer.txn_stall_s), wedged (a client call that never returned), fatal "
            "(the producer fenced or its transaction state beyond repair); transactions",
            ["cause"],
            registry=registry,
        )
        self.consumer_replacements = Counter(
            "rolloutbus_replay_buffer_consumer_replacements_total",
            "Turn-log consumers replaced because recovering a partition failed for "
            "replay_buffer.txn_stall_s (coordinator requests stuck after a broker restart); "
            "replacement events",
            registry=registry,
        )
        self.producer_replacements = Counter(
            "rolloutbus_replay_buffer_producer_replacements_total",
            "Transactional producers replaced by a new one with the same transactional id "
            "(which fences the old and ends its transaction) after a failed transaction, by "
            "its cause (as transaction_aborts_total); replacement events",
            ["cause"],
            registry=registry,
        )


class StalenessMetrics(PerRegistry):
    """The trainer client's staleness filter (``async_training.stale_group_policy``)."""

    def _init(self, registry: CollectorRegistry) -> None:
        self.stale_groups = Counter(
            "rolloutbus_trainer_client_stale_groups_total",
            "Groups whose min policy version is older than the staleness bound allows, by "
            "action: dropped (not yielded) or down_weighted (yielded with a smaller weight); "
            "groups",
            ["action"],
            registry=registry,
        )
        self.staleness = Histogram(
            "rolloutbus_trainer_client_group_staleness_versions",
            "Current policy version minus the group's min policy version, per group received "
            "(staleness at training); versions",
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
            "initial weights: label only), failed; syncs",
            ["outcome"],
            registry=registry,
        )
        self.replica_version = Gauge(
            "rolloutbus_weight_sync_replica_policy_version",
            "Policy version each replica was last moved to; version number",
            ["replica"],
            registry=registry,
        )
        self.sync_seconds = Histogram(
            "rolloutbus_weight_sync_duration_seconds",
            "Wall time to move one replica to a version (pause to resume); seconds",
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
            registry=registry,
        )


# seconds; a CPU train step of the tiny model takes ~1 s, SmolLM2-135M tens of seconds
TRAIN_STEP_SECONDS_BUCKETS = (0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)


# The train step's figures, by verl's name (the JSONL step log's keys), each its own gauge:
# name suffix after ``rolloutbus_trainer_``, help text with the unit.
TRAINER_GAUGES: dict[str, tuple[str, str]] = {
    "reward/mean": (
        "batch_reward_mean",
        "Mean reward score of the last step's trajectories, every data source (verl: "
        "critic/score/mean); in the scorer's units",
    ),
    "response_length/mean": (
        "response_length_mean_tokens",
        "Mean response length of the last step's batch (policy-sampled tokens); tokens",
    ),
    "response_length/max": (
        "response_length_max_tokens",
        "Longest response of the last step's batch (policy-sampled tokens); tokens",
    ),
    "actor/pg_loss": (
        "pg_loss",
        "Policy-gradient loss of the last step, mean over its mini-batches (verl: "
        "actor/pg_loss); loss units (advantage-weighted ratio per token)",
    ),
    "actor/pg_clipfrac": (
        "pg_clipfrac",
        "Share of tokens whose PPO ratio was clipped (verl: actor/pg_clipfrac); ratio 0-1",
    ),
    "actor/pg_clipfrac_lower": (
        "pg_clipfrac_lower",
        "Share of tokens clipped by the dual-clip bound clip_ratio_c (verl: "
        "actor/pg_clipfrac_lower); ratio 0-1",
    ),
    "actor/ppo_kl": (
        "ppo_kl",
        "Approximate KL between the old and the updated policy (verl: actor/ppo_kl); "
        "nats per token",
    ),
    "actor/grad_norm": (
        "grad_norm",
        "Gradient L2 norm before clipping, mean over the step's mini-batches (verl: "
        "actor/grad_norm); unitless",
    ),
    "rollout_corr/rollout_is_mean": (
        "rollout_is_weight_mean",
        "Mean truncated importance weight, trained policy over rollout policy (verl: "
        "rollout_corr/rollout_is_mean); ratio",
    ),
    "rollout_corr/rollout_is_max": (
        "rollout_is_weight_max",
        "Largest importance weight of the step (verl: rollout_corr/rollout_is_max); ratio",
    ),
    "rollout_corr/rollout_is_min": (
        "rollout_is_weight_min",
        "Smallest importance weight of the step (verl: rollout_corr/rollout_is_min); ratio",
    ),
    "rollout_corr/rollout_is_ratio_fraction_high": (
        "rollout_is_ratio_fraction_high",
        "Share of tokens whose importance ratio is above rollout_is_threshold (verl: "
        "rollout_corr/rollout_is_ratio_fraction_high); ratio 0-1",
    ),
    "rollout_corr/rollout_is_ratio_fraction_low": (
        "rollout_is_ratio_fraction_low",
        "Share of tokens whose importance ratio is below the lower threshold (verl: "
        "rollout_corr/rollout_is_ratio_fraction_low); ratio 0-1",
    ),
    "rollout_corr/kl": (
        "rollout_kl",
        "KL between the rollout (behaviour) policy and the trained one, direct estimator "
        "(verl: rollout_corr/kl); nats per token",
    ),
    "rollout_corr/k3_kl": (
        "rollout_k3_kl",
        "KL between the rollout policy and the trained one, k3 estimator (verl: "
        "rollout_corr/k3_kl); nats per token",
    ),
    "staleness/mean": (
        "staleness_mean_versions",
        "Mean of current policy version minus each trajectory's oldest version, last step; "
        "versions",
    ),
    "staleness/max": (
        "staleness_max_versions",
        "Largest policy-version gap of the last step's trajectories; versions",
    ),
    "staleness/version_span_max": (
        "version_span_max_versions",
        "Largest number of versions one trajectory of the last step spans; versions",
    ),
    "perf/tokens_per_s": (
        "tokens_per_second",
        "Policy-sampled tokens trained per second of the last step (waiting excluded); "
        "tokens per second",
    ),
    "timing/wait_s": (
        "wait_seconds",
        "Seconds the last step waited for its groups (a starving trainer waits long); seconds",
    ),
}


class TrainerClientMetrics(PerRegistry):
    """The trainer client's groups that never reach the trainer, besides stale ones."""

    def _init(self, registry: CollectorRegistry) -> None:
        self.skipped_groups = Counter(
            "rolloutbus_trainer_client_skipped_groups_total",
            "Complete groups skipped (consumed, never yielded), by reason: too_few_successful "
            "(fewer completed or truncated members than trainer.min_successful_per_group); groups",
            ["reason"],
            registry=registry,
        )


class TrainerMetrics(PerRegistry):
    """``rolloutbus train``: one update per train step (``consumers/training``)."""

    def _init(self, registry: CollectorRegistry) -> None:
        self.global_step = Gauge(
            "rolloutbus_trainer_global_step", "Optimizer steps taken; steps", registry=registry
        )
        self.policy_version = Gauge(
            "rolloutbus_trainer_policy_version",
            "Last policy version published; version number",
            registry=registry,
        )
        self.groups = Counter(
            "rolloutbus_trainer_groups_total", "Prompt groups trained on; groups", registry=registry
        )
        self.tokens = Counter(
            "rolloutbus_trainer_tokens_total",
            "Response tokens in the loss (policy-sampled); tokens",
            registry=registry,
        )
        self.step_seconds = Histogram(
            "rolloutbus_trainer_step_duration_seconds",
            "Wall time of a train step (forward, backward, optimizer), waiting excluded; seconds",
            buckets=TRAIN_STEP_SECONDS_BUCKETS,
            registry=registry,
        )
        self.reward = Gauge(
            "rolloutbus_trainer_reward_mean",
            "Mean reward score of the last step's trajectories of each data source (verl: "
            "critic/score/mean per source); in the scorer's units",
            ["data_source"],
            registry=registry,
        )
        self.failed_dropped = Counter(
            "rolloutbus_trainer_failed_trajectories_dropped_total",
            "Failed trajectories left out of train batches (verl: dropped/failed_trajectories); "
            "trajectories",
            registry=registry,
        )
        self.figures = {
            key: Gauge(f"rolloutbus_trainer_{suffix}", doc, registry=registry)
            for key, (suffix, doc) in TRAINER_GAUGES.items()
        }


# tokens; powers of two up to a 32k-token trajectory budget
LENGTH_TOKENS_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
TURNS_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)  # assistant turns per session
VERSIONS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16, 32)  # policy versions
# seconds; a generate() on CPU takes seconds, a tool call milliseconds to minutes
AGENT_LOOP_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)
PREEMPTED_BUCKETS = (0, 1, 2, 4, 8, 16)  # preemptions per trajectory
# The per-data-source window gauges (reward, response length) describe the last this many
# trajectories of each source released: about one verl train batch, so the figures read
# like verl's per-step ones while a rate() window is not needed.
RELEASE_WINDOW_TRAJECTORIES = 256


class RolloutMetrics(PerRegistry):
    """What the released trajectories say about the RL run, computed where every
    trajectory passes: the replay buffer, at release (``streams/assembly/release_metrics``).
    verl's names in the help texts."""

    def _init(self, registry: CollectorRegistry) -> None:
        self._init_windows(registry)
        self._init_per_trajectory(registry)
        self._init_agent_loop(registry)
        self._extra: dict[str, Histogram] = {}
        self._registry = registry

    def _init_windows(self, registry: CollectorRegistry) -> None:
        """Gauges over the last trajectories released of each data source."""

        def window(name: str, doc: str, unit: str) -> Gauge:
            return Gauge(
                f"rolloutbus_rollout_{name}",
                f"{doc}, over the last {RELEASE_WINDOW_TRAJECTORIES} trajectories released "
                f"of each data source; {unit}",
                ["data_source"],
                registry=registry,
            )

        score = "in the scorer's units"
        self.reward_mean = window(
            "reward_mean", "Mean reward score (verl: critic/score/mean)", score
        )
        self.reward_std = window("reward_std", "Standard deviation of the reward score", score)
        self.reward_min = window(
            "reward_min", "Smallest reward score (verl: critic/score/min)", score
        )
        self.reward_max = window(
            "reward_max", "Largest reward score (verl: critic/score/max)", score
        )
        self.reward_zero_ratio = window(
            "reward_zero_ratio", "Share of trajectories scored exactly 0", "ratio 0-1"
        )
        self.reward_one_ratio = window(
            "reward_one_ratio", "Share of trajectories scored exactly 1", "ratio 0-1"
        )
        self.length_mean = window(
            "response_length_mean_tokens",
            "Mean response length (verl: response_length/mean)",
            "tokens",
        )
        self.length_max = window(
            "response_length_max_tokens", "Longest response (verl: response_length/max)", "tokens"
        )
        self.clip_ratio = window(
            "response_length_clip_ratio",
            "Share of responses cut at rollout.response_length (verl: response_length/clip_ratio)",
            "ratio 0-1",
        )

    def _init_per_trajectory(self, registry: CollectorRegistry) -> None:
        """Counters and histograms every released trajectory adds to."""
        self.trajectories = Counter(
            "rolloutbus_rollout_trajectories_total",
            "Trajectories released, by data source and status (completed, truncated, failed); "
            "trajectories",
            ["data_source", "status"],
            registry=registry,
        )
        self.response_length = Histogram(
            "rolloutbus_rollout_response_length_tokens",
            "Response length of each trajectory released (prompt excluded, observations "
            "included); tokens",
            ["data_source"],
            buckets=LENGTH_TOKENS_BUCKETS,
            registry=registry,
        )
        self.num_turns = Histogram(
            "rolloutbus_rollout_num_turns",
            "Turns per trajectory as the loop counts them (verl: num_turns); turns",
            ["agent_name"],
            buckets=TURNS_BUCKETS,
            registry=registry,
        )
        self.failed = Counter(
            "rolloutbus_rollout_failed_trajectories_total",
            "Failed trajectory records released, by failure class (infrastructure, loop, "
            "reward; unknown when the record names none); trajectories",
            ["failure_class"],
            registry=registry,
        )
        self.staleness = Histogram(
            "rolloutbus_rollout_staleness_at_release_versions",
            "Policy-version gap at release: the newest version any released trajectory "
            "carries minus this trajectory's oldest; versions",
            buckets=VERSIONS_BUCKETS,
            registry=registry,
        )
        self.group_latency = Histogram(
            "rolloutbus_rollout_group_latency_seconds",
            "From a group's first turn event (its log timestamp) to its release; seconds",
            buckets=GROUP_SECONDS_BUCKETS,
            registry=registry,
        )

    def _init_agent_loop(self, registry: CollectorRegistry) -> None:
        """verl's agent_loop/* figures, per trajectory as the loop reports them."""
        self.agent_loop = {
            name: Histogram(
                f"rolloutbus_agent_loop_{name}_seconds",
                f"Per-trajectory {name} time as the agent loop reports it (verl: "
                f"agent_loop/{name}/min|max|mean over a batch); seconds",
                buckets=AGENT_LOOP_SECONDS_BUCKETS,
                registry=registry,
            )
            for name in ("generate_sequences", "tool_calls", "compute_score")
        }
        self.num_preempted = Histogram(
            "rolloutbus_agent_loop_num_preempted",
            "Preemptions per trajectory where the engine reports them (verl: "
            "agent_loop/num_preempted/min|max|mean); preemptions",
            buckets=PREEMPTED_BUCKETS,
            registry=registry,
        )

    def agent_loop_extra(self, name: str) -> Histogram:
        """A histogram for an agent-loop metric this code does not name (a newer loop's):
        ``rolloutbus_agent_loop_<name>``, what arrives is exported."""
        if name not in self._extra:
            self._extra[name] = Histogram(
                f"rolloutbus_agent_loop_{name}",
                f"Per-trajectory agent-loop metric {name} (verl: agent_loop/{name}), in the "
                "loop's own units",
                buckets=AGENT_LOOP_SECONDS_BUCKETS,
                registry=self._registry,
            )
        return self._extra[name]


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


class DeliveryMetrics(PerRegistry):
    """The trainer client: how long a finished rollout waits for the trainer."""

    def _init(self, registry: CollectorRegistry) -> None:
        self.last_turn_latency = Histogram(
            "rolloutbus_trainer_client_last_turn_latency_seconds",
            "From the last turn event of a group (its log timestamp) to the trainer client "
            "yielding the complete group; seconds",
            buckets=GROUP_SECONDS_BUCKETS,
            registry=registry,
        )

    def observe_record(self, timestamp: tuple[int, int]) -> None:
        """``timestamp``: the group's last trajectory record's ``Message.timestamp()``; the
        replay buffer stamps a group's records with its last turn's log time."""
        kind, ms = timestamp
        if kind != 0 and ms > 0:  # 0: TIMESTAMP_NOT_AVAILABLE
            self.last_turn_latency.observe(max(0.0, time.time() - ms / 1000))


class DispatchCollector:
    """``rolloutbus dispatch``: the dispatcher's progress, read from its report at scrape
    time (``report()`` returns a ``DispatchReport`` or None before the run starts)."""

    def __init__(self, report: Callable[[], Any], waiting: Callable[[], bool]):
        self._report = report
        self._waiting = waiting

    def collect(self) -> Iterator[Any]:
        report = self._report()
        if report is None:
            return
        yield _gauge(
            "rolloutbus_dispatch_groups_started",
            "Groups of this run on the prompt topic (found there at start plus published); groups",
            report.started,
        )
        yield CounterMetricFamily(
            "rolloutbus_dispatch_groups_published",
            "Groups this process published; groups",
            value=report.published,
        )
        yield CounterMetricFamily(
            "rolloutbus_dispatch_dead_letters",
            "Dataset rows sent to the dead-letter topic; rows",
            value=report.dead_lettered,
        )
        yield _gauge(
            "rolloutbus_dispatch_policy_version",
            "The trainer's latest policy version the dispatcher has read; version number",
            report.policy_version,
        )
        yield _gauge(
            "rolloutbus_dispatch_bound_groups",
            "Groups the staleness bound allows started at that version; groups",
            report.bound,
        )
        yield _gauge(
            "rolloutbus_dispatch_waiting",
            "1 while the staleness bound holds the dispatcher back (waiting for the trainer), "
            "else 0",
            1 if self._waiting() else 0,
        )


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def exposition(registry: CollectorRegistry = REGISTRY) -> bytes:
    """The text format of ``registry`` (no ``_created`` series: this module turned them off)."""
    return generate_latest(registry)


def serve_metrics(port: int | None, host: str = LOOPBACK, *collectors: Any) -> bool:
    """Serve ``/metrics`` when a port is configured, with ``collectors`` added to the
    process's registry; False (nothing started) for None."""
    if port is None:
        return False
    for collector in collectors:
        REGISTRY.register(collector)
    start_metrics_server(port, host)
    return True


def start_metrics_server(port: int, addr: str = LOOPBACK) -> None:
    """Serve ``/metrics`` on ``addr:port``: loopback unless the caller passes the configured
    address (``sessions.metrics_host``, ``replay_buffer.metrics_host``); prometheus_client's
    own default would be every interface."""
    start_http_server(port, addr=addr)
