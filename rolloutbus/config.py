"""One typed configuration, from YAML, environment variables and ``key=value`` overrides.

Keys follow verl where verl has one (``rollout.n``, ``rollout.prompt_length``,
``rollout.agent.default_agent_loop``, ``rollout.multi_turn.*``, ``actor.optim.lr``,
``trainer.total_training_steps`` ...), and a whole verl trainer config loads as it is: its
keys that mean something here are read under our names (``actor_rollout_ref.rollout`` is
``rollout``, ``actor_rollout_ref.actor.optim.lr`` is ``actor.optim.lr``), the others are
listed once at start-up as ignored, each with the reason (``rolloutbus.verl_keys``). Every
model forbids unknown keys: a typo is an error that names the key and suggests the nearest.
Files are read with OmegaConf (interpolations, ``${oc.env:...}``, ``${oc.select:...}``);
``rolloutbus.config_loading`` does the reading.

Precedence: the file < ``ROLLOUTBUS__SECTION__KEY`` environment variables (``__`` between
levels, values parsed as YAML) < command-line ``key=value`` overrides
(``load_config(path, overrides=["rollout.n=8"])``).

The config is frozen once loaded; ``with_overrides(cfg, {"replica_server.port": 0})``
returns an adjusted, re-validated copy.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pydantic import (
    BaseModel,
    Field,
    ValidationError,
    model_validator,
)

from rolloutbus.config_loading import ENV_PREFIX as ENV_PREFIX
from rolloutbus.config_loading import (
    KeyTree,
    Where,
    read_sources,
    suggest,
    to_our_layout,
    where_of,
)

# The sections, re-exported: every process imports them from here
from rolloutbus.config_rollout import ACL_ROLES as ACL_ROLES
from rolloutbus.config_rollout import LOOPBACK as LOOPBACK
from rolloutbus.config_rollout import AclRole as AclRole
from rolloutbus.config_rollout import AgentConfig as AgentConfig
from rolloutbus.config_rollout import BrokerConfig as BrokerConfig
from rolloutbus.config_rollout import DeadlinesConfig as DeadlinesConfig
from rolloutbus.config_rollout import GatewayConfig as GatewayConfig
from rolloutbus.config_rollout import KafkaConfig as KafkaConfig
from rolloutbus.config_rollout import LimitsConfig as LimitsConfig
from rolloutbus.config_rollout import ModelConfig as ModelConfig
from rolloutbus.config_rollout import MonitoringConfig as MonitoringConfig
from rolloutbus.config_rollout import MultiTurnConfig as MultiTurnConfig
from rolloutbus.config_rollout import ReplayBufferConfig as ReplayBufferConfig
from rolloutbus.config_rollout import ReplicasConfig as ReplicasConfig
from rolloutbus.config_rollout import ReplicaServerConfig as ReplicaServerConfig
from rolloutbus.config_rollout import RolloutConfig as RolloutConfig
from rolloutbus.config_rollout import SessionsConfig as SessionsConfig
from rolloutbus.config_rollout import ValKwargs as ValKwargs
from rolloutbus.config_rollout import _Section
from rolloutbus.config_training import ActorConfig as ActorConfig
from rolloutbus.config_training import AlgorithmConfig as AlgorithmConfig
from rolloutbus.config_training import AsyncTrainingConfig as AsyncTrainingConfig
from rolloutbus.config_training import CustomRewardFunctionConfig as CustomRewardFunctionConfig
from rolloutbus.config_training import DataConfig as DataConfig
from rolloutbus.config_training import OptimConfig as OptimConfig
from rolloutbus.config_training import RewardConfig as RewardConfig
from rolloutbus.config_training import RewardFunctionConfig as RewardFunctionConfig
from rolloutbus.config_training import RolloutCorrectionConfig as RolloutCorrectionConfig
from rolloutbus.config_training import TrainerConfig as TrainerConfig
from rolloutbus.errors import ConfigError
from rolloutbus.verl_keys import VERL_KEYS_ACCEPTED_NOT_USED as VERL_KEYS_ACCEPTED_NOT_USED
from rolloutbus.verl_keys import VERL_KEYS_IGNORED as VERL_KEYS_IGNORED
from rolloutbus.verl_keys import VERL_KEYS_READ as VERL_KEYS_READ

logger = logging.getLogger(__name__)


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
    monitoring: MonitoringConfig = Field(default_factory=MonitoringConfig)
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    # verl's legacy top-level custom_reward_function; when any of its values is set it
    # replaces reward.custom_reward_function, as verl 0.9.1's reward loop migrates it
    custom_reward_function: CustomRewardFunctionConfig = Field(
        default_factory=CustomRewardFunctionConfig
    )
    reward: RewardConfig = Field(default_factory=RewardConfig)

    @model_validator(mode="after")
    def _derive_addresses(self) -> Config:
        # A key left unset follows the embedded service it points at, so a second stack on
        # one machine moves each port once: kafka.bootstrap_servers from broker.host/port
        # (every node's), replicas.urls from replica_server.host/port. Set directly (not
        # through the fields-set), so a copy with another port derives again.
        if "bootstrap_servers" not in self.kafka.model_fields_set and (
            self.broker.model_fields_set & {"host", "port", "nodes"}
        ):
            _set_derived(self, "kafka", "bootstrap_servers", embedded_bootstrap(self.broker))
        if "urls" not in self.replicas.model_fields_set and (
            self.replica_server.model_fields_set & {"host", "port"}
        ):
            _set_derived(self, "replicas", "urls", [embedded_replica_url(self.replica_server)])
        return self

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


def embedded_bootstrap(broker: BrokerConfig) -> str:
    """bootstrap.servers of the embedded broker: node i listens on port + 2i."""
    return ",".join(f"{_dialable(broker.host)}:{broker.port + 2 * i}" for i in range(broker.nodes))


def embedded_replica_url(server: ReplicaServerConfig) -> str:
    return f"http://{_dialable(server.host)}:{server.port}"


def _dialable(host: str) -> str:
    """A listening address a client can dial: a wildcard means this machine."""
    return LOOPBACK if host in ("0.0.0.0", "::", "") else host


def _set_derived(cfg: Config, section: str, key: str, value: Any) -> None:
    """Set a derived value on the frozen config, leaving it out of the fields-set."""
    copy = getattr(cfg, section).model_copy()
    object.__setattr__(copy, key, value)
    object.__setattr__(cfg, section, copy)


def key_tree(model: type[BaseModel] = Config) -> KeyTree:
    """Every key of the config models: a section maps to its keys, a leaf to None."""
    tree: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        kind = info.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            tree[name] = key_tree(kind)
        else:
            tree[name] = None
    return tree


_KNOWN_KEYS = key_tree()


def load_config(
    path: str | Path | Sequence[str | Path] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Sequence[str] = (),
) -> Config:
    """Read YAML files (ours, or a whole verl trainer config; several merge in order, the
    later winning key by key), apply ``ROLLOUTBUS__*`` environment variables, then
    ``key=value`` overrides (ours or verl's names), and validate once. Precedence: files <
    environment < overrides. See ``rolloutbus.config_loading``."""
    env = os.environ if env is None else env
    paths = [] if path is None else [path] if isinstance(path, str | Path) else list(path)
    tree, sources = read_sources(paths, env, overrides)
    loaded = to_our_layout(tree, _KNOWN_KEYS, sources, env)
    cfg = _validate(loaded.raw, sources, loaded.origin)
    _log_ignored(loaded.ignored)
    for sentence in loaded.unsupported:
        logger.warning("%s", sentence)
    _warn_about_unused_verl_keys(cfg)
    _warn_about_loggers(cfg)
    return cfg


def with_overrides(cfg: Config, overrides: dict[str, Any]) -> Config:
    """A validated copy of ``cfg`` with dotted keys replaced: ``{"replica_server.port": 0}``.

    The config is frozen; this is how a command-line flag or a test adjusts it.
    """
    raw = cfg.model_dump(exclude_unset=True)
    for dotted, value in overrides.items():
        _set_dotted(raw, dotted, value)
    return _validate(raw, "", {})


def _validate(raw: dict[str, Any], where: Where, origin: Mapping[str, str]) -> Config:
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_describe_validation_error(exc, where, origin)) from exc


def _log_ignored(ignored: list[tuple[str, str]]) -> None:
    """Once, at start-up: what a verl config sets that means nothing here, by reason."""
    if not ignored:
        return
    by_reason: dict[str, list[str]] = {}
    for key, reason in ignored:
        by_reason.setdefault(reason, []).append(key)
    lines = [f"  {_brace_keys(keys)}: {reason}" for reason, keys in by_reason.items()]
    logger.warning(
        "verl config keys accepted and ignored (%d; rolloutbus.verl_keys says why):\n%s",
        len(ignored),
        "\n".join(lines),
    )


def _brace_keys(keys: list[str]) -> str:
    """``a.b.x, a.b.y, c`` -> ``a.b.{x, y}, c``: siblings under their section, in order."""
    by_parent: dict[str, list[str]] = {}
    for key in keys:
        parent, _, leaf = key.rpartition(".")
        by_parent.setdefault(parent, []).append(leaf)
    parts: list[str] = []
    for parent, leaves in by_parent.items():
        prefix = f"{parent}." if parent else ""
        if len(leaves) == 1 or not parent:
            parts.extend(prefix + leaf for leaf in leaves)
        else:
            parts.append(f"{prefix}{{{', '.join(leaves)}}}")
    return ", ".join(parts)


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


def _warn_about_loggers(cfg: Config) -> None:
    others = [name for name in cfg.trainer.logger if name not in ("console", "file")]
    if others:
        logger.warning(
            "trainer.logger %s: not supported here; the trainer's figures go to its progress "
            "line ('console'), its JSONL/CSV log ('file', trainer.metrics_log) and Prometheus "
            "(trainer.metrics_port)",
            others,
        )


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"cannot set {dotted}: {part} is not a section")
    node[leaf] = value


def _describe_validation_error(
    exc: ValidationError, where: Where, origin: Mapping[str, str] | None = None
) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"])
        written = _written_name(key, origin or {})
        if err["type"] == "extra_forbidden":
            parent, _, leaf = key.rpartition(".")
            nearest = suggest(leaf, _section_keys(parent))
            hint = f": did you mean `{nearest}`?" if nearest else ""
            lines.append(f"unknown config key '{written}'{where_of(where, written)}{hint}")
        else:
            lines.append(f"config key '{written}'{where_of(where, written)}: {err['msg']}")
    return "; ".join(lines)


def _written_name(key: str, origin: Mapping[str, str]) -> str:
    """``key`` as the file wrote it (``actor_rollout_ref.actor.optim.lr`` for
    ``actor.optim.lr``); a key inside a value (a list's item) keeps its suffix."""
    parts = key.split(".")
    for i in range(len(parts), 0, -1):
        written = origin.get(".".join(parts[:i]))
        if written is not None:
            return ".".join([written, *parts[i:]])
    return key


def _section_keys(dotted: str) -> set[str]:
    node: KeyTree | None = _KNOWN_KEYS
    for part in dotted.split(".") if dotted else []:
        node = node.get(part) if node is not None else None
    return set(node) if node is not None else set()
