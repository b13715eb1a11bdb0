"""The replay buffer's Prometheus series: its fold and transactions
(``ReplayBufferMetrics``), and the RL figures of what it releases (``RolloutMetrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, Histogram

from rolloutbus.metrics import (
    AGENT_LOOP_SECONDS_BUCKETS,
    GROUP_SECONDS_BUCKETS,
    PerRegistry,
    SeriesDeclarer,
)

__all__ = ["ReplayBufferMetrics", "RolloutMetrics"]


class ReplayBufferMetrics(PerRegistry):
    def _init(self, registry: CollectorRegistry) -> None:
        self._init_fold(registry)
        self._init_recovery(registry)

    def _init_fold(self, registry: CollectorRegistry) -> None:
        """What the fold of the turn log counts: events, groups, trajectories."""
        series = SeriesDeclarer(registry)
        self.events = series.counter(
            "rolloutbus_replay_buffer_events_total",
            "Turn events consumed, by type; events",
            labels=("type",),
        )
        self.trajectories = series.counter(
            "rolloutbus_replay_buffer_trajectories_total",
            "Trajectories released, by status; trajectories",
            labels=("status",),
        )
        self.groups = series.counter(
            "rolloutbus_replay_buffer_groups_released_total",
            "Prompt groups released; groups",
        )
        self.open_groups = series.gauge(
            "rolloutbus_replay_buffer_open_groups",
            "Groups with sessions still running; groups",
        )
        self.duplicates = series.counter(
            "rolloutbus_replay_buffer_ignored_events_total",
            "Events ignored: superseded attempts or already released groups; events",
        )
        self.dead_letters = series.counter(
            "rolloutbus_replay_buffer_dead_letters_total",
            "Turn events sent to the dead-letter topic; events",
        )
        self.groups_released_early = series.counter(
            "rolloutbus_replay_buffer_groups_released_early_total",
            "Groups released before all their sessions settled (unsettled ones as failed "
            "records) or rejected, by kind: deadline, too_many_open_groups, head_missing, "
            "rejected; groups",
            labels=("kind",),
        )
        self.oldest_open_group = series.gauge(
            "rolloutbus_replay_buffer_oldest_open_group_timestamp_seconds",
            "Log timestamp of the first event of the oldest group still open (0: none open); "
            "seconds since the epoch",
        )
        self.group_deadline = series.gauge(
            "rolloutbus_replay_buffer_group_deadline_seconds",
            "deadlines.group_s: log time a group may stay open before its unsettled sessions "
            "are released as failed; seconds",
        )

    def _init_recovery(self, registry: CollectorRegistry) -> None:
        """What makes a release exactly once: released uids remembered, partitions
        recovered, transactions aborted and producers replaced."""
        series = SeriesDeclarer(registry)
        self.released_uids = series.gauge(
            "rolloutbus_replay_buffer_released_uids",
            "Released uids remembered (read back from the released topic on assignment); uids",
        )
        self.released_uids_forgotten = series.counter(
            "rolloutbus_replay_buffer_released_uids_forgotten_total",
            "Released uids dropped from memory past replay_buffer.max_released_uids; uids",
        )
        self.recoveries = series.counter(
            "rolloutbus_replay_buffer_partition_recoveries_total",
            "Partitions (re)loaded from committed offsets and the released "
            "topic: on assignment and after an aborted transaction; partitions",
        )
        self.transaction_aborts = series.counter(
            "rolloutbus_replay_buffer_transaction_aborts_total",
            "Transactions aborted and retried from the committed offsets, by cause: abortable "
            "(a broker error), retries_exhausted, stalled (retriable errors on one producer for "
            "replay_buffer.txn_stall_s), wedged (a client call that never returned), fatal "
            "(the producer fenced or its transaction state beyond repair); transactions",
            labels=("cause",),
        )
        self.consumer_replacements = series.counter(
            "rolloutbus_replay_buffer_consumer_replacements_total",
            "Turn-log consumers replaced because recovering a partition failed for "
            "replay_buffer.txn_stall_s (coordinator requests stuck after a broker restart); "
            "replacement events",
        )
        self.producer_replacements = series.counter(
            "rolloutbus_replay_buffer_producer_replacements_total",
            "Transactional producers replaced by a new one with the same transactional id "
            "(which fences the old and ends its transaction) after a failed transaction, by "
            "its cause (as transaction_aborts_total); replacement events",
            labels=("cause",),
        )


# tokens; powers of two up to a 32k-token trajectory budget
LENGTH_TOKENS_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
TURNS_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)  # assistant turns per session
VERSIONS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16, 32)  # policy versions
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
        series = SeriesDeclarer(registry)

        def window(name: str, doc: str, unit: str) -> Gauge:
            return series.gauge(
                f"rolloutbus_rollout_{name}",
                f"{doc}, over the last {RELEASE_WINDOW_TRAJECTORIES} trajectories released "
                f"of each data source; {unit}",
                labels=("data_source",),
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
        series = SeriesDeclarer(registry)
        self.trajectories = series.counter(
            "rolloutbus_rollout_trajectories_total",
            "Trajectories released, by data source and status (completed, truncated, failed); "
            "trajectories",
            labels=("data_source", "status"),
        )
        self.response_length = series.histogram(
            "rolloutbus_rollout_response_length_tokens",
            "Response length of each trajectory released (prompt excluded, observations "
            "included); tokens",
            labels=("data_source",),
            buckets=LENGTH_TOKENS_BUCKETS,
        )
        self.num_turns = series.histogram(
            "rolloutbus_rollout_num_turns",
            "Turns per trajectory as the loop counts them (verl: num_turns); turns",
            labels=("agent_name",),
            buckets=TURNS_BUCKETS,
        )
        self.failed = series.counter(
            "rolloutbus_rollout_failed_trajectories_total",
            "Failed trajectory records released, by failure class (infrastructure, loop, "
            "reward; unknown when the record names none); trajectories",
            labels=("failure_class",),
        )
        self.staleness = series.histogram(
            "rolloutbus_rollout_staleness_at_release_versions",
            "Policy-version gap at release: the newest version any released trajectory "
            "carries minus this trajectory's oldest; versions",
            buckets=VERSIONS_BUCKETS,
        )
        self.group_latency = series.histogram(
            "rolloutbus_rollout_group_latency_seconds",
            "From a group's first turn event (its log timestamp) to its release; seconds",
            buckets=GROUP_SECONDS_BUCKETS,
        )

    def _init_agent_loop(self, registry: CollectorRegistry) -> None:
        """verl's agent_loop/* figures, per trajectory as the loop reports them."""
        series = SeriesDeclarer(registry)
        self.agent_loop = {
            name: series.histogram(
                f"rolloutbus_agent_loop_{name}_seconds",
                f"Per-trajectory {name} time as the agent loop reports it (verl: "
                f"agent_loop/{name}/min|max|mean over a batch); seconds",
                buckets=AGENT_LOOP_SECONDS_BUCKETS,
            )
            for name in ("generate_sequences", "tool_calls", "compute_score")
        }
        self.num_preempted = series.histogram(
            "rolloutbus_agent_loop_num_preempted",
            "Preemptions per trajectory where the engine reports them (verl: "
            "agent_loop/num_preempted/min|max|mean); preemptions",
            buckets=PREEMPTED_BUCKETS,
        )

    def agent_loop_extra(self, name: str) -> Histogram:
        """A histogram for an agent-loop metric this code does not name (a newer loop's):
        ``rolloutbus_agent_loop_<name>``, what arrives is exported."""
        if name not in self._extra:
            self._extra[name] = SeriesDeclarer(self._registry).histogram(
                f"rolloutbus_agent_loop_{name}",
                f"Per-trajectory agent-loop metric {name} (verl: agent_loop/{name}), in the "
                "loop's own units",
                buckets=AGENT_LOOP_SECONDS_BUCKETS,
            )
        return self._extra[name]
