"""``rolloutbus train``'s Prometheus series: one update per train step."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from rolloutbus.metrics import PerRegistry

__all__ = ["TrainerMetrics"]


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
