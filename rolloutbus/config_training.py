"""The trainer's config sections, verl's names where verl has them: ``trainer``,
``async_training``, ``actor`` (``optim``), ``algorithm`` (``rollout_correction``),
``data`` and the reward function (``custom_reward_function``, ``reward``). The bus's
sections are in ``rolloutbus.config_rollout``; ``rolloutbus.config`` joins them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
)

from rolloutbus.config_loading import (
    suggest,
)
from rolloutbus.config_rollout import LOOPBACK, _Section
from rolloutbus.verl_keys import VERL_LOGGERS


class TrainerConfig(_Section):
    group_id: str = "rolloutbus-trainer"  # the consumer group of trainer clients
    # trajectory keys one client remembers to drop a record delivered twice (a group the
    # replay buffer released again); only a safety net: exactly-once comes from the
    # position. About 100 bytes per key: ~10 MB at the default.
    dedupe_window_keys: int = Field(default=100_000, ge=0)
    # groups per partition yielded while an older group there is still incomplete; their
    # uids travel in the position and in the commit metadata (the broker keeps at most
    # offset.metadata.max.bytes, 4096 bytes by default). Past this many the incomplete group
    # is given up with an error log: the replay buffer writes a group in one transaction,
    # so one still incomplete after this many later groups will never complete.
    max_interleaved_groups: int = Field(default=64, ge=1)
    # seconds a trainer may spend between two requests for groups (a train step) before
    # the broker hands its partitions to another member; librdkafka's default is 300 s
    max_poll_interval_s: float = Field(default=900.0, gt=0)
    # members of a group that must have completed or been truncated (not failed) for the
    # trainer client to yield the group; a group with fewer is skipped (consumed, counted
    # in rolloutbus_trainer_client_skipped_groups_total). 0: every complete group is yielded
    min_successful_per_group: int = Field(default=0, ge=0)
    # -- `rolloutbus train` (verl's trainer.* names where verl has one) --
    # checkpoints: {default_local_dir}/global_step_{n}/ (HF safetensors + trainer_state.json)
    default_local_dir: Path = Path("checkpoints")
    total_training_steps: int | None = Field(default=None, ge=1)  # None: until stopped
    max_checkpoints_to_keep: int = Field(default=2, ge=1)  # older step folders are deleted
    # seconds without a new group before `rolloutbus train` stops; None: wait forever
    idle_timeout_s: float | None = Field(default=None, gt=0)
    seed: int = 0  # torch seed of the trainer (dropout-free models: only the optimizer)
    torch_threads: int | None = None  # None: torch's default
    metrics_port: int | None = None  # Prometheus /metrics of the trainer
    metrics_host: str = LOOPBACK  # where metrics_port binds
    # one JSON line per train step (reward by data source, clip fraction, IS weights,
    # staleness, KL, step time); a .csv suffix writes CSV instead; None: no file
    metrics_log: Path | None = None
    # verl's tracking backends: "console" prints the progress line of every step on stderr,
    # "file" writes trainer.metrics_log (when unset: verl's file-logger path); the others
    # (wandb, mlflow ...) are accepted with a warning: the figures are on Prometheus
    logger: list[str] = Field(default_factory=lambda: ["console"])

    @field_validator("logger", mode="before")
    @classmethod
    def _one_logger_or_a_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("logger")
    @classmethod
    def _verls_loggers(cls, value: list[str]) -> list[str]:
        for name in value:
            if name not in VERL_LOGGERS:
                nearest = suggest(name, VERL_LOGGERS)
                hint = f" (did you mean `{nearest}`?)" if nearest else ""
                raise ValueError(
                    f"{name!r} is not one of verl's loggers {list(VERL_LOGGERS)}{hint}"
                )
        return value


class AsyncTrainingConfig(_Section):
    """verl's ``async_training`` (recipe fully_async_policy): the staleness bound, weight sync.

    A policy version is published every ``trigger_parameter_sync_step`` train steps, and a
    train step takes ``require_batches`` mini-batches of ``ppo_mini_batch_size`` prompt
    groups, so one version consumes ``groups_per_version`` groups. The dispatcher starts at
    most ``(version + staleness_threshold + 1) * groups_per_version`` groups in total
    (AReaL's bound), so no group is trained more than ``staleness_threshold`` versions after
    the version that was current when it started.

    ``staleness_threshold`` is an integer number of versions here. verl's is a float
    fraction S: its rollouter pauses once ``R * T * (1 + S)`` samples (R = ppo_mini_batch_size
    x require_batches, T = trigger_parameter_sync_step) were generated since the last sync,
    i.e. a version may sample S of one version's batch beyond its own. verl's integer values
    mean the same here (S = 1: one version's batch ahead); a fraction 0 < S < 1 has no
    integer equal, round it up to bound staleness at whole versions.
    """

    staleness_threshold: int = Field(default=1, ge=0)  # versions; 0: synchronous
    trigger_parameter_sync_step: int = Field(default=1, ge=1)  # train steps per version
    require_batches: int = Field(default=1, ge=1)  # mini-batches per train step
    # verl's actor_rollout_ref.actor.ppo_mini_batch_size: prompt groups per mini-batch
    ppo_mini_batch_size: int = Field(default=4, ge=1)
    # true: a weight sync pauses the replicas with mode=keep, so in-flight turns finish on
    # the new weights (their weight_versions spans say where the version changed); false:
    # mode=abort, the client resumes each aborted turn with its tokens so far
    partial_rollout: bool = True
    # what the trainer client does with a group whose min policy version is older than
    # current - staleness_threshold: drop it, or keep it with its loss weight multiplied
    # by stale_group_weight (reported either way)
    stale_group_policy: Literal["drop", "down_weight"] = "drop"
    stale_group_weight: float = Field(default=0.5, ge=0.0, le=1.0)  # see stale_group_policy

    @property
    def groups_per_version(self) -> int:
        """Prompt groups the trainer consumes per published version."""
        return self.ppo_mini_batch_size * self.require_batches * self.trigger_parameter_sync_step

    def max_groups_started(self, policy_version: int) -> int:
        """AReaL's bound: groups that may have been started while ``policy_version`` is
        the trainer's current version."""
        return (policy_version + self.staleness_threshold + 1) * self.groups_per_version


class OptimConfig(_Section):
    """verl's ``actor_rollout_ref.actor.optim``: AdamW, constant learning rate."""

    lr: float = Field(default=1e-6, gt=0)  # learning rate
    weight_decay: float = Field(default=0.01, ge=0)  # AdamW's decoupled weight decay
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW's betas
    clip_grad: float = Field(default=1.0, gt=0)  # max global grad norm before the step


class ActorConfig(_Section):
    """verl's ``actor_rollout_ref.actor`` keys that ``rolloutbus train`` reads (the
    mini-batch size is ``async_training.ppo_mini_batch_size``, next to the staleness bound
    that is computed from it)."""

    optim: OptimConfig = Field(default_factory=OptimConfig)
    clip_ratio: float = Field(default=0.2, gt=0)  # PPO's clip range, both sides
    clip_ratio_low: float | None = Field(default=None, gt=0)  # None: clip_ratio
    clip_ratio_high: float | None = Field(default=None, gt=0)  # None: clip_ratio
    clip_ratio_c: float = Field(default=3.0, gt=1.0)  # dual-clip bound for negative advantages
    # how token losses are averaged (verl's modes)
    loss_agg_mode: Literal[
        "token-mean",
        "token-sum",
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
        "seq-mean-token-mean",
    ] = "token-mean"


class RolloutCorrectionConfig(_Section):
    """verl's ``algorithm.rollout_correction`` (decoupled mode): truncated importance
    weights π_train/π_rollout against the rollout's own logprobs. verl's default is
    ``rollout_is: null`` (metrics only); here ``token``, since every batch of an
    asynchronous trainer is off-policy by up to ``async_training.staleness_threshold``."""

    # importance weights per token or per sequence; None: off
    rollout_is: Literal["token", "sequence"] | None = "token"
    # a number: TIS, weights clamped at it; "lower_upper" (e.g. "0.5_5.0"): IcePop, weights
    # outside the band zeroed
    rollout_is_threshold: str | float = 2.0


class AlgorithmConfig(_Section):
    """verl's ``algorithm`` keys that ``rolloutbus train`` reads: GRPO only."""

    # any of verl's estimators loads (a whole verl config says "gae"); `rolloutbus train`
    # implements grpo only and refuses to start with another, saying so
    adv_estimator: str = "grpo"
    norm_adv_by_std_in_grpo: bool = True  # False: Dr.GRPO (no division by the group std)
    rollout_correction: RolloutCorrectionConfig = Field(default_factory=RolloutCorrectionConfig)


class DataConfig(_Section):
    """verl's ``data`` keys that the publisher reads."""

    # datasets ``rolloutbus publish`` reads when no DATASET is given (verl accepts one path
    # or a list; so do we)
    train_files: list[str] = Field(default_factory=list)
    # the row column holding the chat messages; the publisher moves it to verl's ``prompt``
    prompt_key: str = "prompt"
    # -- more of verl's ``data`` keys (the rest are in VERL_DATA_KEYS_IGNORED) --
    val_files: list[str] = Field(default_factory=list)  # `rolloutbus publish --val`
    # rows published per file; -1: all (verl's train_max_samples / val_max_samples)
    train_max_samples: int = -1
    val_max_samples: int = -1  # as train_max_samples, for val_files
    # verl interpolates these into rollout.prompt_length / response_length; so does
    # load_config when the rollout section does not set them
    max_prompt_length: int | None = Field(default=None, ge=1)
    max_response_length: int | None = Field(default=None, ge=1)  # see max_prompt_length
    # the row column holding a multimodal row's images (verl's image_key), moved to
    # ``images``, the column verl's agent loops read
    image_key: str = "images"
    # keyword arguments of every chat-template render (verl: every apply_chat_template of
    # the Continuous Token builder), e.g. ``{enable_thinking: false}`` for Qwen3
    apply_chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    # keyword arguments of every multimodal processor call (``max_pixels`` ...): the
    # builder's renders, the loops' outputs and their generate() calls, as verl passes them
    mm_processor_kwargs: dict[str, Any] = Field(default_factory=dict)

    @field_validator("train_files", "val_files", mode="before")
    @classmethod
    def _one_path_or_a_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


class CustomRewardFunctionConfig(_Section):
    """verl's ``custom_reward_function``: the function every row is scored with, instead
    of ``default_compute_score``. ``path``: a ``.py`` file (or ``file://...``) or
    ``pkg://package.module``; ``name``: the function in it; ``reward_kwargs``: extra
    keyword arguments merged into every call."""

    path: str | None = None  # a .py file, file://... or pkg://package.module
    name: str | None = None  # the function in it
    reward_kwargs: dict[str, Any] = Field(default_factory=dict)  # merged into every call


class RewardFunctionConfig(CustomRewardFunctionConfig):
    """``reward.custom_reward_function``: as the legacy key, with verl 0.9.1's default name."""

    name: str | None = "compute_score"


class RewardConfig(_Section):
    """verl 0.9.1's ``reward`` section, the part that applies to rule-based scoring in the
    session workers (reward models and other reward managers are not supported)."""

    custom_reward_function: RewardFunctionConfig = Field(
        default_factory=lambda: RewardFunctionConfig()
    )
