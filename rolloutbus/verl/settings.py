"""The bus's config for a plug-in that verl loads: the bus's own file, with verl's rollout
settings winning.

verl hands its plug-ins its whole trainer config. The bus config is read from the files
named by ``rolloutbus.config`` in that config (``+rolloutbus.config=bus.yaml`` on verl's
command line; a list merges in order, as ``rolloutbus -c``), else by the
``ROLLOUTBUS_CONFIG`` environment variable (paths separated by ``os.pathsep``), else
defaults plus ``ROLLOUTBUS__*`` variables. The same verl YAML may be that file: the bus reads
a verl trainer config as its own (``rolloutbus.config_loading``). Then the keys below are
taken from verl's ``actor_rollout_ref.rollout`` as verl resolved them, command-line
overrides included, so the groups the bus samples are the groups verl asked for.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rolloutbus.config import Config, load_config, with_overrides

__all__ = ["CONFIG_ENV", "ROLLOUT_KEYS", "bus_config", "config_paths", "verl_rollout_overrides"]

CONFIG_ENV = "ROLLOUTBUS_CONFIG"
# our rollout key → verl's, under actor_rollout_ref.rollout
ROLLOUT_KEYS = {
    "rollout.n": "n",
    "rollout.prompt_length": "prompt_length",
    "rollout.response_length": "response_length",
    "rollout.temperature": "temperature",
    "rollout.top_p": "top_p",
    "rollout.top_k": "top_k",
    "rollout.calculate_log_probs": "calculate_log_probs",
    "rollout.val_kwargs.n": "val_kwargs.n",
    "rollout.val_kwargs.temperature": "val_kwargs.temperature",
    "rollout.val_kwargs.top_p": "val_kwargs.top_p",
    "rollout.val_kwargs.top_k": "val_kwargs.top_k",
    "rollout.agent.default_agent_loop": "agent.default_agent_loop",
}


def _as_tree(verl_config: Any) -> DictConfig:
    if isinstance(verl_config, DictConfig):
        return verl_config
    return OmegaConf.create(dict(verl_config or {}))


def config_paths(verl_config: Any, env: Mapping[str, str] | None = None) -> list[str]:
    """The bus config files: ``rolloutbus.config`` in verl's config, else the environment's."""
    env = os.environ if env is None else env
    named = OmegaConf.select(_as_tree(verl_config), "rolloutbus.config", default=None)
    if named is None:
        return [p for p in env.get(CONFIG_ENV, "").split(os.pathsep) if p]
    if isinstance(named, str):
        return [named]
    return [str(p) for p in named]


def verl_rollout_overrides(verl_config: Any) -> dict[str, Any]:
    """Our rollout keys with the values verl's config sets (keys it lacks are left out)."""
    tree = _as_tree(verl_config)
    out = {}
    for ours, theirs in ROLLOUT_KEYS.items():
        value = OmegaConf.select(tree, f"actor_rollout_ref.rollout.{theirs}", default=None)
        if value is not None:
            out[ours] = value
    return out


def bus_config(verl_config: Any, env: Mapping[str, str] | None = None) -> Config:
    """The bus's config for a plug-in handed ``verl_config`` (see the module docstring)."""
    cfg = load_config(config_paths(verl_config, env) or None, env=env)
    return with_overrides(cfg, verl_rollout_overrides(verl_config))
