"""Write the Grafana dashboards, one per question an operator asks of an RL run:
``python ops/grafana/make_dashboards.py`` (tests/monitoring/test_monitoring.py checks the JSON files
are what this writes, and tests/monitoring/test_monitoring_prometheus.py runs every query against a
real Prometheus scraping a real run).

Each panel is (title, unit, [(PromQL, legend)]); queries use fixed 1m/5m windows (the
scrape interval is 5 s) so the same text runs in Grafana and through Prometheus's API.
"""

from __future__ import annotations

import json
from pathlib import Path

DASHBOARDS = Path(__file__).resolve().parent / "dashboards"
DATASOURCE = {"type": "prometheus", "uid": "prom"}

Panel = tuple[str, str, list[tuple[str, str]]]


def q(histogram: str, quantile: float, by: str = "") -> str:
    """A quantile over 5 minutes of a histogram, optionally kept per label."""
    keep = f"le, {by}" if by else "le"
    return f"histogram_quantile({quantile}, sum by ({keep}) (rate({histogram}_bucket[5m])))"


def mean(histogram: str, by: str = "") -> str:
    group = f" by ({by})" if by else ""
    return f"sum{group} (rate({histogram}_sum[5m])) / sum{group} (rate({histogram}_count[5m]))"


FLOWING: list[Panel] = [
    (
        "Trajectories and groups released per second",
        "ops",
        [
            ("sum(rate(rolloutbus_replay_buffer_trajectories_total[1m]))", "trajectories/s"),
            ("sum(rate(rolloutbus_replay_buffer_groups_released_total[1m]))", "groups/s"),
        ],
    ),
    (
        "Tokens logged per second",
        "ops",
        [("sum by (kind) (rate(rolloutbus_sessions_tokens_total[1m]))", "{{kind}}")],
    ),
    (
        "Groups in flight and open",
        "none",
        [
            ("sum(rolloutbus_sessions_groups_in_flight)", "in flight (session workers)"),
            ("sum(rolloutbus_replay_buffer_open_groups)", "open (replay buffer)"),
        ],
    ),
    (
        "Consumer lag per stage (records)",
        "none",
        [("sum by (stage) (rolloutbus_consumer_lag_records)", "{{stage}}")],
    ),
    (
        "Oldest unconsumed record per stage",
        "s",
        [("max by (stage) (rolloutbus_consumer_lag_seconds)", "{{stage}}")],
    ),
    (
        "Turn events written per second",
        "ops",
        [("sum by (type) (rate(rolloutbus_sessions_turn_events_total[1m]))", "{{type}}")],
    ),
    (
        "Sessions per second by outcome",
        "ops",
        [("sum by (outcome) (rate(rolloutbus_sessions_total[1m]))", "{{outcome}}")],
    ),
    (
        "Dispatcher: groups started and the staleness bound",
        "none",
        [
            ("max(rolloutbus_dispatch_groups_started)", "started"),
            ("max(rolloutbus_dispatch_bound_groups)", "bound"),
            ("max(rolloutbus_dispatch_waiting)", "waiting for the trainer (1)"),
        ],
    ),
    ("Processes up", "none", [('up{job=~"rolloutbus-.*"}', "{{job}}")]),
    (
        "Consumers per group",
        "none",
        [("sum by (stage) (rolloutbus_consumer_group_members)", "{{stage}}")],
    ),
]

LONG_TAIL: list[Panel] = [
    (
        "Group latency, first turn event to release",
        "s",
        [
            (q("rolloutbus_rollout_group_latency_seconds", 0.5), "p50"),
            (q("rolloutbus_rollout_group_latency_seconds", 0.99), "p99"),
        ],
    ),
    (
        "Group duration in the session worker",
        "s",
        [
            (q("rolloutbus_sessions_group_duration_seconds", 0.5), "p50"),
            (q("rolloutbus_sessions_group_duration_seconds", 0.99), "p99"),
        ],
    ),
    (
        "Generation time per trajectory (verl agent_loop/generate_sequences)",
        "s",
        [
            (mean("rolloutbus_agent_loop_generate_sequences_seconds"), "mean"),
            (q("rolloutbus_agent_loop_generate_sequences_seconds", 0.99), "p99"),
        ],
    ),
    (
        "Tool and scoring time per trajectory (verl agent_loop/tool_calls, compute_score)",
        "s",
        [
            (q("rolloutbus_agent_loop_tool_calls_seconds", 0.99), "tool_calls p99"),
            (q("rolloutbus_agent_loop_compute_score_seconds", 0.99), "compute_score p99"),
        ],
    ),
    (
        "Tool call duration by tool, p99",
        "s",
        [(q("rolloutbus_tool_call_duration_seconds", 0.99, "tool"), "{{tool}}")],
    ),
    (
        "Response length (tokens)",
        "none",
        [
            (mean("rolloutbus_rollout_response_length_tokens"), "mean"),
            (q("rolloutbus_rollout_response_length_tokens", 0.99), "p99"),
        ],
    ),
    (
        "Turns per trajectory",
        "none",
        [
            (mean("rolloutbus_rollout_num_turns", "agent_name"), "mean {{agent_name}}"),
            (q("rolloutbus_rollout_num_turns", 0.99, "agent_name"), "p99 {{agent_name}}"),
        ],
    ),
    (
        "generate() latency per replica, p99",
        "s",
        [(q("rolloutbus_client_request_latency_seconds", 0.99, "replica"), "{{replica}}")],
    ),
    (
        "Last turn to trainer client",
        "s",
        [
            (q("rolloutbus_trainer_client_last_turn_latency_seconds", 0.5), "p50"),
            (q("rolloutbus_trainer_client_last_turn_latency_seconds", 0.99), "p99"),
        ],
    ),
]

REPLICAS: list[Panel] = [
    (
        "Replica health (session workers' view)",
        "none",
        [("min by (replica) (rolloutbus_client_replica_healthy)", "{{replica}}")],
    ),
    (
        "generate() calls in flight per replica",
        "none",
        [("sum by (replica) (rolloutbus_client_in_flight)", "{{replica}}")],
    ),
    (
        "Embedded replica: running and waiting requests",
        "none",
        [
            ("sum by (instance) (rolloutbus_replica_requests_running)", "running {{instance}}"),
            ("sum by (instance) (rolloutbus_replica_requests_waiting)", "waiting {{instance}}"),
        ],
    ),
    (
        "Embedded replica: decode batch size",
        "none",
        [(mean("rolloutbus_replica_batch_size", "instance"), "{{instance}}")],
    ),
    (
        "Embedded replica: sampled tokens per second",
        "ops",
        [
            (
                "sum by (instance) (rate(rolloutbus_replica_generation_tokens_total[1m]))",
                "{{instance}}",
            )
        ],
    ),
    (
        "generate() latency per replica",
        "s",
        [
            (q("rolloutbus_client_request_latency_seconds", 0.5, "replica"), "p50 {{replica}}"),
            (q("rolloutbus_client_request_latency_seconds", 0.99, "replica"), "p99 {{replica}}"),
        ],
    ),
    (
        "generate() calls by outcome",
        "ops",
        [
            (
                "sum by (replica, outcome) (rate(rolloutbus_client_requests_total[1m]))",
                "{{replica}} {{outcome}}",
            )
        ],
    ),
    (
        "Policy version per replica (weight sync)",
        "none",
        [("max by (replica) (rolloutbus_weight_sync_replica_policy_version)", "{{replica}}")],
    ),
    (
        "Weight sync duration",
        "s",
        [(q("rolloutbus_weight_sync_duration_seconds", 0.99), "p99")],
    ),
]

TRAINER: list[Panel] = [
    (
        "Trajectories waiting for the trainer (lag)",
        "none",
        [('sum by (group) (rolloutbus_consumer_lag_records{stage="trainer"})', "{{group}}")],
    ),
    (
        "Oldest trajectory the trainer has not read",
        "s",
        [('max by (group) (rolloutbus_consumer_lag_seconds{stage="trainer"})', "{{group}}")],
    ),
    (
        "Trainer: waiting for data vs stepping",
        "s",
        [
            ("max(rolloutbus_trainer_wait_seconds)", "waited (last step)"),
            (mean("rolloutbus_trainer_step_duration_seconds"), "step (mean)"),
        ],
    ),
    (
        "Staleness at release and at training",
        "none",
        [
            (mean("rolloutbus_rollout_staleness_at_release_versions"), "at release (mean)"),
            (mean("rolloutbus_trainer_client_group_staleness_versions"), "at training (mean)"),
            ("max(rolloutbus_trainer_staleness_max_versions)", "last step max"),
        ],
    ),
    (
        "Stale groups dropped or down-weighted",
        "ops",
        [
            (
                "sum by (action) (rate(rolloutbus_trainer_client_stale_groups_total[5m]))",
                "{{action}}",
            )
        ],
    ),
    (
        "Trainer step and policy version",
        "none",
        [
            ("max(rolloutbus_trainer_global_step)", "step"),
            ("max(rolloutbus_trainer_policy_version)", "version"),
        ],
    ),
    (
        "Tokens trained per second",
        "ops",
        [("max(rolloutbus_trainer_tokens_per_second)", "tokens/s (last step)")],
    ),
]

FAILURES: list[Panel] = [
    (
        "Failed trajectories by failure class",
        "ops",
        [
            (
                "sum by (failure_class) (rate(rolloutbus_rollout_failed_trajectories_total[5m]))",
                "{{failure_class}}",
            )
        ],
    ),
    (
        "Failure rate of released trajectories",
        "percentunit",
        [
            (
                "sum(rate(rolloutbus_rollout_failed_trajectories_total[5m])) "
                "/ sum(rate(rolloutbus_rollout_trajectories_total[5m]))",
                "failed share",
            )
        ],
    ),
    (
        "Sessions failed by failure class (session workers)",
        "ops",
        [
            (
                "sum by (failure_class) (rate(rolloutbus_sessions_failed_total[5m]))",
                "{{failure_class}}",
            )
        ],
    ),
    (
        "Groups released early, by reason",
        "ops",
        [
            (
                "sum by (kind) (rate(rolloutbus_replay_buffer_groups_released_early_total[5m]))",
                "{{kind}}",
            )
        ],
    ),
    (
        "Dead letters",
        "ops",
        [
            ("sum(rate(rolloutbus_replay_buffer_dead_letters_total[5m]))", "replay buffer"),
            ("sum(rate(rolloutbus_dispatch_dead_letters_total[5m]))", "dispatcher"),
        ],
    ),
    (
        "generate() calls that did not complete",
        "ops",
        [
            (
                'sum by (outcome) (rate(rolloutbus_client_requests_total{outcome!="completed"}'
                "[5m]))",
                "{{outcome}}",
            ),
            ("sum(rate(rolloutbus_client_retries_total[5m]))", "retries"),
        ],
    ),
    (
        "Tool calls by outcome",
        "ops",
        [
            (
                "sum by (tool, outcome) (rate(rolloutbus_tool_calls_total[5m]))",
                "{{tool}} {{outcome}}",
            )
        ],
    ),
    (
        "Replay-buffer transactions aborted, by cause",
        "ops",
        [
            (
                "sum by (cause) (rate(rolloutbus_replay_buffer_transaction_aborts_total[5m]))",
                "{{cause}}",
            )
        ],
    ),
    (
        "Sessions resumed after a crash, and turns replayed from the log",
        "none",
        [
            ("sum by (kind) (rolloutbus_sessions_recovery_total)", "{{kind}}"),
            ("max(rolloutbus_sessions_first_resumed_turn_seconds)", "s to first resumed turn"),
        ],
    ),
    (
        "Weight syncs by outcome",
        "ops",
        [("sum by (outcome) (rate(rolloutbus_weight_sync_total[5m]))", "{{outcome}}")],
    ),
]

LEARNING: list[Panel] = [
    (
        "Reward by data source (released, last 256)",
        "none",
        [("max by (data_source) (rolloutbus_rollout_reward_mean)", "{{data_source}}")],
    ),
    (
        "Reward spread by data source",
        "none",
        [
            ("max by (data_source) (rolloutbus_rollout_reward_std)", "std {{data_source}}"),
            ("max by (data_source) (rolloutbus_rollout_reward_min)", "min {{data_source}}"),
            ("max by (data_source) (rolloutbus_rollout_reward_max)", "max {{data_source}}"),
        ],
    ),
    (
        "Share of 0 and 1 scores",
        "percentunit",
        [
            ("max by (data_source) (rolloutbus_rollout_reward_zero_ratio)", "0 {{data_source}}"),
            ("max by (data_source) (rolloutbus_rollout_reward_one_ratio)", "1 {{data_source}}"),
        ],
    ),
    (
        "Reward the trainer trained on",
        "none",
        [
            ("max(rolloutbus_trainer_batch_reward_mean)", "batch"),
            ("max by (data_source) (rolloutbus_trainer_reward_mean)", "{{data_source}}"),
        ],
    ),
    (
        "Response length by data source (tokens)",
        "none",
        [
            (
                "max by (data_source) (rolloutbus_rollout_response_length_mean_tokens)",
                "mean {{data_source}}",
            ),
            (
                "max by (data_source) (rolloutbus_rollout_response_length_max_tokens)",
                "max {{data_source}}",
            ),
        ],
    ),
    (
        "Clip ratio (responses cut at response_length)",
        "percentunit",
        [
            (
                "max by (data_source) (rolloutbus_rollout_response_length_clip_ratio)",
                "{{data_source}}",
            )
        ],
    ),
    (
        "Policy loss and gradient norm",
        "none",
        [
            ("max(rolloutbus_trainer_pg_loss)", "pg_loss"),
            ("max(rolloutbus_trainer_grad_norm)", "grad_norm"),
        ],
    ),
    (
        "KL and clipping",
        "none",
        [
            ("max(rolloutbus_trainer_ppo_kl)", "ppo_kl"),
            ("max(rolloutbus_trainer_rollout_kl)", "rollout KL"),
            ("max(rolloutbus_trainer_pg_clipfrac)", "pg_clipfrac"),
        ],
    ),
    (
        "Importance weights (rollout correction)",
        "none",
        [
            ("max(rolloutbus_trainer_rollout_is_weight_mean)", "mean"),
            ("max(rolloutbus_trainer_rollout_is_weight_max)", "max"),
        ],
    ),
]

# file stem -> (title, the question, panels)
ALL: dict[str, tuple[str, str, list[Panel]]] = {
    "flowing": ("Rollout Bus: is it flowing?", "throughput, lag and processes", FLOWING),
    "long-tail": ("Rollout Bus: where is the long tail?", "latency distributions", LONG_TAIL),
    "replicas": ("Rollout Bus: are the replicas healthy and saturated?", "replicas", REPLICAS),
    "trainer": ("Rollout Bus: is the trainer starving or drowning?", "lag, staleness", TRAINER),
    "failures": ("Rollout Bus: what fails, and why?", "failures by class", FAILURES),
    "learning": ("Rollout Bus: is the policy learning?", "reward and length", LEARNING),
}


def dashboard(stem: str) -> dict:
    title, description, panels = ALL[stem]
    return {
        "uid": f"rolloutbus-{stem}",
        "title": title,
        "description": description,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "tags": ["rolloutbus", "rl"],
        "panels": [_panel(i, p) for i, p in enumerate(panels)],
    }


def _panel(index: int, panel: Panel) -> dict:
    title, unit, queries = panel
    return {
        "id": index + 1,
        "type": "timeseries",
        "title": title,
        "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "expr": expr,
                "legendFormat": legend,
                "datasource": DATASOURCE,
            }
            for i, (expr, legend) in enumerate(queries)
        ],
    }


def render(stem: str) -> str:
    return json.dumps(dashboard(stem), indent=1) + "\n"


def main() -> None:
    for stem in ALL:
        (DASHBOARDS / f"{stem}.json").write_text(render(stem))


if __name__ == "__main__":
    main()
